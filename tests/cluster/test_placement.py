from __future__ import annotations

import pytest

from cluster.placement import group_rank, rank_bundle, ranks_to_bundles


def test_rank_bundle_shapes():
    assert rank_bundle(2, 0) == {"CPU": 2.0}
    assert rank_bundle(8, 1) == {"CPU": 8.0, "GPU": 1.0}
    with pytest.raises(ValueError):
        rank_bundle(-1, 0)


def test_ranks_to_bundles_keeps_ranks_of_a_node_contiguous():
    # PACK may interleave nodes across bundle indices; ranks must not.
    assert ranks_to_bundles(["a", "b", "a", "b"]) == [0, 2, 1, 3]
    assert ranks_to_bundles(["b", "a", "a", "b"]) == [0, 3, 1, 2]
    assert ranks_to_bundles(["a", "a"]) == [0, 1]


def test_group_rank_renumbers_gang_ranks_node_contiguously():
    # Serve's PACK placed gang ranks 0..3 on nodes a, b, a, b: EP ranks 0, 1 must share node a.
    nodes = ["a", "b", "a", "b"]
    ep = [group_rank(g, nodes) for g in range(4)]
    assert ep == [0, 2, 1, 3]
    assert [nodes[ep.index(r)] for r in range(4)] == ["a", "a", "b", "b"]
    assert group_rank(0, ["b", "a", "a", "b"]) == 0  # gang rank 0 (the rendezvous master) stays 0
    assert sorted(group_rank(g, ["x"] * 8) for g in range(8)) == list(range(8))


def test_two_rank_gang_spreads_over_two_one_cpu_nodes_and_forms_a_group(monkeypatch):
    import ray
    import ray._private.ray_constants as ray_constants
    from cluster_testing import ray_runtime_env
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    from test_rendezvous import _Member

    from cluster.placement import bundle_nodes, create_group_placement_group

    # ray.init(address=...) rewrites a loopback address to the host's outward IP unless Ray thinks
    # it runs single-machine; keep the whole simulated cluster on 127.0.0.1.
    monkeypatch.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    try:
        cluster.add_node(num_cpus=1, node_ip_address="127.0.0.1")
        ray.init(address=cluster.address, runtime_env=ray_runtime_env(), logging_level="WARNING")
        cluster.wait_for_nodes()
        # Neither node can hold both ranks: PACK must fall back to one rank per node.
        pg = create_group_placement_group(2, rank_bundle(1, 0), timeout_s=30)
        nodes = bundle_nodes(pg)
        assert len(set(nodes)) == 2
        members = [
            ray.remote(_Member)
            .options(
                num_cpus=1,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    pg, placement_group_bundle_index=r
                ),
            )
            .remote(r, 2, "test-two-nodes", 30)
            for r in range(2)
        ]
        assert ray.get([m.all_reduce.remote() for m in members], timeout=60) == [(3.0, 30.0)] * 2
        actor_nodes = ray.get(
            [
                m.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id())
                for m in members
            ]
        )
        assert actor_nodes == nodes
    finally:
        ray.shutdown()
        cluster.shutdown()
