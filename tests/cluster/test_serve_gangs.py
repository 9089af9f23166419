"""EP ranks under Serve: gangs of ep_size replicas; killing one member restarts only its gang."""

from __future__ import annotations

import asyncio
import time

import pytest
from cluster_testing import LOOPBACK

from engine.config import EngineConfig

CONFIG = EngineConfig(ep_size=2, device="cpu")


def _stub_factory(config, parallel):
    from stub_engine import StubEngine

    return StubEngine(config, parallel)


def test_rank_deployment_options_count_in_gangs():
    from cluster.serve_rank import rank_deployment_options

    opts = rank_deployment_options(CONFIG, num_gangs=3, cpus_per_rank=2, gpus_per_rank=1)
    assert opts["num_replicas"] == 6
    gang = opts["gang_scheduling_config"]
    assert (gang.gang_size, gang.gang_placement_strategy.value) == (2, "PACK")
    assert gang.runtime_failure_policy.value == "RESTART_GANG"
    assert opts["ray_actor_options"] == {"num_cpus": 2, "num_gpus": 1}
    auto = rank_deployment_options(
        CONFIG, num_gangs=None, autoscaling={"min_gangs": 0, "max_gangs": 4, "initial_gangs": 1,
                                             "target_ongoing_requests": 8},
        cpus_per_rank=1, gpus_per_rank=0,
    )  # fmt: skip
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {
        "min_replicas": 0, "max_replicas": 8, "initial_replicas": 2, "target_ongoing_requests": 8
    }  # fmt: skip


@pytest.fixture(scope="module")
def serve_app(local_ray):
    from ray import serve

    from cluster.rank import RankOptions
    from cluster.serve_rank import build_rank_app, rank_deployment_options

    serve.start(proxy_location="Disabled")
    opts = rank_deployment_options(
        CONFIG, num_gangs=2, autoscaling=None, cpus_per_rank=0.5, gpus_per_rank=0,
        health_check_period_s=1, health_check_timeout_s=5,
    )  # fmt: skip
    app = build_rank_app(
        CONFIG,
        rank_options=RankOptions(
            rendezvous_timeout_s=30, collective_timeout_s=20, master_address=LOOPBACK
        ),
        engine_factory=_stub_factory,
        **opts,
    )
    handle = serve.run(app, name="ep", route_prefix=None)
    yield handle
    serve.delete("ep")
    serve.shutdown()


def _all_infos(handle, want: int, timeout_s: float = 60) -> dict[str, dict]:
    """Info of every live replica, keyed by replica actor name (random routing: ask until all
    `want` have answered)."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout_s
    while len(seen) < want and time.monotonic() < deadline:
        try:
            for info in [r.result(timeout_s=10) for r in [handle.info.remote() for _ in range(8)]]:
                seen[info["replica_actor"]] = info
        except Exception:
            time.sleep(0.5)  # a replica going away mid-call; ask again
    return seen


def _gangs(infos: dict[str, dict]) -> dict[str, list[dict]]:
    gangs: dict[str, list[dict]] = {}
    for info in infos.values():
        gangs.setdefault(info["gang_id"], []).append(info)
    return {g: sorted(m, key=lambda i: i["rank"]) for g, m in gangs.items()}


def test_two_gangs_each_with_ranks_0_and_1(serve_app):
    infos = _all_infos(serve_app, 4)
    gangs = _gangs(infos)
    assert len(gangs) == 2
    for members in gangs.values():
        assert [m["rank"] for m in members] == [0, 1]
        # one node: the EP ranks read from the gang's placement group equal the gang ranks
        assert [m["gang_rank"] for m in members] == [0, 1]
        assert all(m["ranks_by_node"] for m in members)
        assert all(m["world_size"] == 2 and m["model"] == "tiny-dsv3" for m in members)
        assert all(m["peak_rss_bytes"] > 0 for m in members)


def test_streaming_generate_and_abort_on_cancel(serve_app):
    stream = serve_app.options(stream=True)

    async def consume() -> list:
        outs = [o async for o in stream.generate.remote("ok-1", [5, 6], {"max_tokens": 5})]
        return outs

    outs = asyncio.run(consume())
    assert outs[-1].finished and outs[-1].token_ids == [7, 8, 9, 10, 11]

    async def cancel_midway() -> None:
        gen = stream.generate.remote("cancel-1", [1], {"max_tokens": 3000})
        await gen.__anext__()
        gen.cancel()

    asyncio.run(cancel_midway())
    # The engine request was aborted: no rank keeps running it.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        loads = [serve_app.load.remote().result(timeout_s=10) for _ in range(12)]
        if all(load.num_running == 0 for load in loads):
            break
        time.sleep(0.5)
    assert all(load.num_running == 0 for load in loads)


def test_killing_one_replica_restarts_its_gang_while_the_other_keeps_serving(serve_app):
    import ray

    before = _gangs(_all_infos(serve_app, 4))
    assert len(before) == 2
    victim_gang, other_gang = sorted(before)
    pid_to_gang = {m["pid"]: g for g, ms in before.items() for m in ms}
    stream = serve_app.options(stream=True)

    async def one(i: int) -> tuple[str, str | None]:
        """Returns (gang that served it, error or None)."""
        last = None
        try:
            async for out in stream.generate.remote(f"long-{i}", [i + 1], {"max_tokens": 400}):
                last = out
        except Exception as e:  # the killed gang's survivor may be torn down under the stream
            return "?" if last is None else pid_to_gang[int(last.text[4:])], repr(e)
        return pid_to_gang[int(last.text[4:])], last.error

    async def run_all() -> list[tuple[str, str | None]]:
        tasks = [asyncio.create_task(one(i)) for i in range(8)]
        await asyncio.sleep(2.0)
        victim = before[victim_gang][1]["replica_actor"]
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        return await asyncio.wait_for(asyncio.gather(*tasks), timeout=60)

    t0 = time.monotonic()
    results = asyncio.run(run_all())
    assert time.monotonic() - t0 < 60
    # ~8 s of tokens each: streams on the untouched gang finish cleanly, the others fail (no hang).
    on_other = [err for gang, err in results if gang == other_gang]
    assert on_other and all(err is None for err in on_other), results
    assert all(err is not None for gang, err in results if gang != other_gang), results

    # The killed gang comes back as a new gang (new id, ranks 0 and 1); the other is untouched.
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        after = _gangs(_all_infos(serve_app, 4, timeout_s=20))
        if (
            len(after) == 2
            and victim_gang not in after
            and all(len(m) == 2 for m in after.values())
        ):
            break
        time.sleep(1)
    assert other_gang in after and victim_gang not in after
    assert [m["pid"] for m in after[other_gang]] == [m["pid"] for m in before[other_gang]]
    (new_gang,) = set(after) - {other_gang}
    assert [m["rank"] for m in after[new_gang]] == [0, 1]

    async def serve_again() -> list:
        return await asyncio.gather(*[_final(stream, f"again-{i}") for i in range(8)])

    finals = asyncio.run(serve_again())
    assert all(o.error is None and o.token_ids == [1, 2, 3] for o in finals)
    assert {pid_to_gang.get(int(o.text[4:]), new_gang) for o in finals} <= {other_gang, new_gang}


async def _final(stream, rid: str):
    last = None
    async for out in stream.generate.remote(rid, [0], {"max_tokens": 3}):
        last = out
    return last


def test_a_rank_whose_loop_died_fails_health_checks_and_its_gang_restarts(serve_app):
    """The process stays up; only `check_health` can tell Serve the gang is broken."""
    from stub_engine import CRASH_TOKEN

    before = _gangs(_all_infos(serve_app, 4))
    pid_to_gang = {m["pid"]: g for g, ms in before.items() for m in ms}

    async def crash():
        stream = serve_app.options(stream=True)
        return [o async for o in stream.generate.remote("crash", [CRASH_TOKEN], {"max_tokens": 5})]

    (out,) = asyncio.run(crash())
    assert out.finished and out.finish_reason == "abort" and "simulated crash" in out.error
    broken = pid_to_gang[int(out.text[4:])]
    (healthy,) = set(before) - {broken}
    deadline = time.monotonic() + 60
    after: dict[str, list[dict]] = {}
    while time.monotonic() < deadline:
        after = _gangs(_all_infos(serve_app, 4, timeout_s=20))
        if len(after) == 2 and broken not in after and all(len(m) == 2 for m in after.values()):
            break
        time.sleep(1)
    assert broken not in after and healthy in after
    assert [m["pid"] for m in after[healthy]] == [m["pid"] for m in before[healthy]]
