"""configs/*.yaml validate (Serve schema + our args) and dsv3's resource plan is 16 GPUs over two
8-GPU nodes, checked without GPUs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serving.app import rank_options
from serving.config import ServingConfig

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def _args(name: str) -> dict[str, Any]:
    doc = yaml.safe_load((CONFIGS / name).read_text())
    ServeDeploySchema.model_validate(doc)
    (app,) = doc["applications"]
    assert app["import_path"] == "serving.app:build_app"
    return app["args"]


def test_tiny_config_fits_a_two_core_machine() -> None:
    c = ServingConfig.from_args(_args("tiny.yaml"))
    assert c.engine.model == "tiny-dsv3" and c.engine.ep_size == 2 and c.engine.device == "cpu"
    assert c.ingress.num_cpus + c.num_gangs * c.engine.ep_size * c.cpus_per_rank <= 2


def test_dsv3_config_validates() -> None:
    c = ServingConfig.from_args(_args("dsv3.yaml"))
    e = c.engine
    assert (e.ep_size, e.dtype, e.device) == (16, "bfloat16", "cuda")
    assert e.moe_a2a_backend == "deepep" and e.deepep_mode == "auto"
    assert e.moe_runner_backend == "deep_gemm"  # FP8 experts
    assert e.enable_two_batch_overlap and e.enable_single_batch_overlap
    assert c.gpus_per_rank == 1


def test_dsv3_resource_plan_is_16_gpus_over_2_nodes() -> None:
    c = ServingConfig.from_args(_args("dsv3.yaml"))
    gpus = c.num_gangs * c.engine.ep_size * c.gpus_per_rank
    assert gpus == 16 and math.ceil(gpus / 8) == 2
    opts = rank_options(c)
    gang = opts["gang_scheduling_config"]
    assert gang.gang_size == 16 and opts["num_replicas"] == 16
    assert opts["ray_actor_options"]["num_gpus"] == 1
    assert opts["request_router_config"].request_router_class.endswith("LoadPrefixRequestRouter")


def test_dsv3_gang_fits_exactly_two_simulated_8_gpu_nodes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rank deployment of configs/dsv3.yaml, as Serve would build it (options only, no
    replica and no model started), reserves its gang on a simulated cluster shaped like
    deploy/ray-cluster.yaml: a CPU head plus two nodes declaring 8 GPUs each (no real GPUs).
    The gang's placement group is built the way Serve's gang scheduler builds it (one bundle
    per replica from the replica's resources, the gang's strategy) and must take all 16 GPUs,
    8 per node, leaving the head GPU-free and room there for the ingress replicas."""
    import ray
    import ray._private.ray_constants as ray_constants
    from ray import serve
    from ray.cluster_utils import Cluster
    from ray.util.placement_group import placement_group, placement_group_table

    from cluster.serve_rank import EPRankDeployment

    c = ServingConfig.from_args(_args("dsv3.yaml"))
    ranks = serve.deployment(EPRankDeployment, name="EPRank", **rank_options(c))
    gang = ranks._deployment_config.gang_scheduling_config
    per_replica = ranks._replica_config.resource_dict
    assert ranks.num_replicas % gang.gang_size == 0
    num_gangs = ranks.num_replicas // gang.gang_size
    assert (num_gangs, gang.gang_size) == (1, 16)
    assert per_replica == {"CPU": c.cpus_per_rank, "GPU": 1.0}

    # Keep the simulated cluster on 127.0.0.1 (see tests/cluster/test_placement.py).
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 16, "num_gpus": 0, "node_ip_address": "127.0.0.1",
            "include_dashboard": False,
        },
    )  # fmt: skip
    try:
        gpu_nodes = [
            cluster.add_node(num_cpus=192, num_gpus=8, node_ip_address="127.0.0.1").node_id
            for _ in range(2)
        ]
        ray.init(address=cluster.address, logging_level="WARNING")
        cluster.wait_for_nodes()
        pg = placement_group(
            [dict(per_replica) for _ in range(gang.gang_size)],
            strategy=gang.gang_placement_strategy.value,
        )
        assert pg.wait(timeout_seconds=60), "the dsv3 gang does not fit two 8-GPU nodes"
        nodes = list(placement_group_table(pg)["bundles_to_node_id"].values())
        assert sorted(nodes.count(n) for n in gpu_nodes) == [8, 8]
        assert ray.available_resources().get("GPU", 0.0) == 0.0  # exactly 2 x 8: all taken
        # Ingress replicas (CPU only) still fit beside the gang.
        ingress = placement_group(
            [{"CPU": c.ingress.num_cpus}] * c.ingress.num_replicas, strategy="SPREAD"
        )
        assert ingress.wait(timeout_seconds=30)
    finally:
        ray.shutdown()
        cluster.shutdown()


def test_bad_args_name_the_field() -> None:
    args = _args("tiny.yaml")
    args["engine"] = {**args["engine"], "ep_size": 0}
    args["ingress"] = {**args["ingress"], "bogus": 1}
    with pytest.raises(ValueError) as e:
        ServingConfig.from_args(args)
    assert "engine.ep_size" in str(e.value) and "ingress.bogus" in str(e.value)
