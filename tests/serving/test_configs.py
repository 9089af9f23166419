"""configs/*.yaml validate (Serve schema + our args) and dsv3's resource plan is 16 GPUs over two
8-GPU nodes, checked without GPUs."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

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
    try:
        from serving.app import rank_options

        opts = rank_options(c)
    except ImportError:
        pytest.skip("cluster.serve_rank not available yet")
    gang = opts["gang_scheduling_config"]
    assert gang.gang_size == 16
    per_rank_gpus = opts.get("ray_actor_options", {}).get("num_gpus", 0) or sum(
        b.get("GPU", 0) for b in opts.get("placement_group_bundles", [])
    )
    assert opts["num_replicas"] * per_rank_gpus == 16
    assert opts["request_router_config"].request_router_class.endswith("LoadPrefixRequestRouter")


def test_bad_args_name_the_field() -> None:
    args = _args("tiny.yaml")
    args["engine"] = {**args["engine"], "ep_size": 0}
    args["ingress"] = {**args["ingress"], "bogus": 1}
    with pytest.raises(ValueError) as e:
        ServingConfig.from_args(args)
    assert "engine.ep_size" in str(e.value) and "ingress.bogus" in str(e.value)
