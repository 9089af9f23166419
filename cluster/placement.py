"""Where an EP group's ranks go: one placement-group bundle per rank, packed onto few nodes.

Offline groups create the placement group themselves; under Serve the gang scheduler creates one
per gang from the same per-rank resources (`cluster.serve_rank.rank_deployment_options`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


def rank_bundle(cpus_per_rank: float, gpus_per_rank: float) -> dict[str, float]:
    """One rank's resources: `{"CPU": c}` on CPU nodes, `{"GPU": 1, "CPU": c}` on GPU nodes."""
    if cpus_per_rank < 0 or gpus_per_rank < 0:
        raise ValueError("per-rank resources must be non-negative")
    bundle = {"CPU": float(cpus_per_rank)}
    if gpus_per_rank:
        bundle["GPU"] = float(gpus_per_rank)
    return bundle


def default_gpus_per_rank(device: str) -> float:
    """One GPU per rank when the engine runs on CUDA, none on CPU."""
    return 1.0 if device == "cuda" else 0.0


def create_group_placement_group(
    ep_size: int,
    bundle: dict[str, float],
    *,
    strategy: str = "PACK",
    timeout_s: float = 120.0,
    name: str = "",
) -> PlacementGroup:
    """Reserve `ep_size` bundles at once (all or nothing) and wait until they are placed.

    PACK keeps ranks on as few nodes as possible but still spreads them when one node cannot hold
    the whole group; STRICT_PACK would instead wait forever on such a cluster.
    """
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    pg = placement_group([dict(bundle) for _ in range(ep_size)], strategy=strategy, name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise TimeoutError(
            f"could not place an EP group of {ep_size} x {bundle} ({strategy}) within "
            f"{timeout_s:.0f} s; the cluster lacks the resources"
        )
    return pg


def bundle_nodes(pg: PlacementGroup) -> list[str]:
    """Node id of each bundle, by bundle index."""
    from ray.util.placement_group import placement_group_table

    table = placement_group_table(pg)["bundles_to_node_id"]
    return [table[i] for i in range(len(table))]


def ranks_to_bundles(nodes: Sequence[str]) -> list[int]:
    """Bundle index for each rank such that ranks sharing a node are contiguous and rank 0 sits on
    the node of bundle 0.

    PACK does not promise node-contiguous bundle indices (bundles 0, 3, 5 may share a node), and
    intra-node all-to-all paths assume contiguous ranks. Stable: bundles keep their order within a
    node, nodes keep the order of their first bundle.
    """
    first_seen: dict[str, int] = {}
    for i, node in enumerate(nodes):
        first_seen.setdefault(node, i)
    return sorted(range(len(nodes)), key=lambda i: (first_seen[nodes[i]], i))


def group_rank(gang_rank: int, replica_nodes: Sequence[str]) -> int:
    """The EP rank of the Serve replica with rank `gang_rank` in its gang, given each gang
    replica's node (by gang rank). Serve places gang rank i on bundle i, and PACK does not keep a
    node's bundles contiguous, so EP ranks are the gang ranks renumbered by `ranks_to_bundles`:
    ranks sharing a node are contiguous and gang rank 0 stays EP rank 0."""
    return ranks_to_bundles(replica_nodes).index(gang_rank)
