"""One gang of real tiny-dsv3 ranks under Serve: streams the same greedy tokens as one rank, and
comes back as a new gang after a member is killed (RESTART_GANG)."""

from __future__ import annotations

import asyncio
import time

import pytest
from cluster_testing import LOOPBACK

from engine.config import EngineConfig

CONFIG = EngineConfig(model="tiny-dsv3", ep_size=2, device="cpu")
PROMPTS = [[3, 17, 42, 9], [5, 1, 99, 250, 7, 7], [1200, 4], [8, 8, 8, 31, 64, 2, 11, 600]]
PARAMS = {"max_tokens": 8, "temperature": 0.0, "ignore_eos": True}


def _reference() -> list[list[int]]:
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams

    llm = LLM(model="tiny-dsv3", ep_size=1, device="cpu")
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=SamplingParams(**PARAMS))
    getattr(llm, "shutdown", lambda: None)()
    return [o.token_ids for o in outs]


async def _stream_all(handle, tag: str) -> list:
    stream = handle.options(stream=True)

    async def one(i: int, prompt: list[int]):
        deltas, last = [], None
        async for out in stream.generate.remote(f"{tag}-{i}", prompt, PARAMS):
            deltas.extend(out.delta_token_ids)
            last = out
        assert deltas == last.token_ids  # deltas add up to the cumulative output
        return last

    return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))


def _gang_ids(handle, n: int = 12) -> set[str]:
    return {handle.info.remote().result(timeout_s=30)["gang_id"] for _ in range(n)}


@pytest.mark.slow
def test_real_engine_gang_serves_and_restarts_as_a_new_gang(local_ray):
    import ray
    from ray import serve

    from cluster.rank import RankOptions
    from cluster.serve_rank import build_rank_app, rank_deployment_options

    reference = _reference()
    serve.start(proxy_location="Disabled")
    opts = rank_deployment_options(
        CONFIG, num_gangs=1, autoscaling=None, cpus_per_rank=0.5, gpus_per_rank=0,
        health_check_period_s=1, health_check_timeout_s=10,
    )  # fmt: skip
    handle = serve.run(
        build_rank_app(CONFIG, rank_options=RankOptions(master_address=LOOPBACK), **opts),
        name="ep-real",
        route_prefix=None,
    )
    try:
        outs = asyncio.run(_stream_all(handle, "first"))
        assert [o.token_ids for o in outs] == reference
        assert all(o.finished and o.error is None for o in outs)
        info = handle.info.remote().result(timeout_s=30)
        assert info["world_size"] == 2 and info["max_model_len"] > 0 and info["peak_rss_bytes"] > 0
        (gang,) = _gang_ids(handle)

        ray.kill(ray.get_actor(info["replica_actor"], namespace="serve"), no_restart=True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 120:
            try:
                ids = _gang_ids(handle)
                if ids and gang not in ids:
                    break
            except Exception:
                pass  # the old gang is being torn down
            time.sleep(1)
        assert gang not in _gang_ids(handle), "the gang was not replaced"
        outs = asyncio.run(_stream_all(handle, "again"))
        assert [o.token_ids for o in outs] == reference
    finally:
        serve.delete("ep-real")
        serve.shutdown()
