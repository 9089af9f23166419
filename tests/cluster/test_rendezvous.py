from __future__ import annotations

import time

import pytest


class _Member:
    """A bare rank: rendezvous, then one all-reduce on each of the two groups."""

    def __init__(
        self,
        rank: int,
        world_size: int,
        group_id: str,
        rendezvous_timeout_s: float,
        master_address: str | None = "127.0.0.1",
    ):
        from cluster.rendezvous import init_ep_process_groups

        self.ctx = init_ep_process_groups(
            rank,
            world_size,
            group_id,
            device="cpu",
            rendezvous_timeout_s=rendezvous_timeout_s,
            collective_timeout_s=30,
            master_address=master_address,
        )

    def master_address(self) -> str:
        import torch.distributed as dist

        store = dist.distributed_c10d._get_default_store()
        while hasattr(store, "underlying_store"):  # PrefixStore wrappers around the TCPStore
            store = store.underlying_store
        return store.host

    def all_reduce(self) -> tuple[float, float]:
        import torch
        import torch.distributed as dist

        a = torch.tensor([float(self.ctx.rank + 1)])
        dist.all_reduce(a, group=self.ctx.ep_group)
        b = torch.tensor([float(10 * (self.ctx.rank + 1))])
        dist.all_reduce(b, group=self.ctx.control_group)
        return a.item(), b.item()


@pytest.mark.parametrize("world_size", [2, 4])
def test_rendezvous_forms_working_gloo_groups_in_placement_group(local_ray, world_size):
    import ray
    from ray.experimental import internal_kv
    from ray.util.placement_group import remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from cluster.placement import create_group_placement_group
    from cluster.rendezvous import KV_NAMESPACE

    pg = create_group_placement_group(world_size, {"CPU": 1}, timeout_s=30)
    group_id = f"test-rdv-{world_size}"
    cls = ray.remote(_Member)
    members = [
        cls.options(
            num_cpus=1,
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                pg, placement_group_bundle_index=r
            ),
        ).remote(r, world_size, group_id, 30)
        for r in range(world_size)
    ]
    try:
        results = ray.get([m.all_reduce.remote() for m in members], timeout=60)
        n = world_size * (world_size + 1) / 2
        assert results == [(n, 10 * n)] * world_size
        assert ray.get(members[1].master_address.remote()) == "127.0.0.1"  # loopback only
        # Rank 0 withdraws the address once everyone joined: no key leaks per incarnation.
        assert not internal_kv._internal_kv_list("ep_master/" + group_id, namespace=KV_NAMESPACE)
    finally:
        for m in members:
            ray.kill(m)
        remove_placement_group(pg)


def test_rendezvous_times_out_clearly_when_rank0_never_publishes(local_ray):
    import ray

    from cluster.rendezvous import RendezvousTimeoutError

    lonely = ray.remote(_Member).options(num_cpus=0).remote(1, 2, "test-rdv-no-rank0", 1.0)
    t0 = time.monotonic()
    with pytest.raises(ray.exceptions.RayActorError) as info:
        ray.get(lonely.all_reduce.remote(), timeout=60)
    assert time.monotonic() - t0 < 30
    text = str(info.value)
    assert RendezvousTimeoutError.__name__ in text
    assert "rank 0 did not publish" in text and "test-rdv-no-rank0" in text
