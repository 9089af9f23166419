"""Async streaming interface, aborts mid-stream, and an arrival stress test under both loops."""

from __future__ import annotations

import asyncio
import random

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=["process", "thread", None], ids=["overlap-process", "overlap-thread", "normal"])
def aengine(request):
    executor = request.param
    eng = AsyncEngine(EngineConfig(model="tiny-dsv3", kv_cache_tokens=16384, enable_overlap_schedule=executor is not None,
                                   forward_executor=executor or "auto"))
    yield eng
    eng.shutdown()


async def _collect(eng, ids, sp, rid=None):
    deltas, last = [], None
    async for out in eng.generate(ids, sp, request_id=rid):
        deltas.append(out)
        last = out
    return deltas, last


def test_stream_deltas_add_up(aengine):
    sp = SamplingParams(max_tokens=20, ignore_eos=True)

    async def main():
        return await _collect(aengine, [10, 20, 30], sp)

    deltas, last = asyncio.run(main())
    assert last.finished and last.finish_reason == "length"
    assert sum((d.delta_token_ids for d in deltas), []) == last.token_ids
    assert "".join(d.delta_text for d in deltas) == last.text
    assert aengine.stats().overlap == aengine.engine.overlap


def test_abort_mid_stream_frees_and_others_finish(aengine):
    async def main():
        sp_long = SamplingParams(max_tokens=200, ignore_eos=True)
        survivor = asyncio.create_task(_collect(aengine, [1, 2, 3, 4], SamplingParams(max_tokens=30, ignore_eos=True)))
        gen = aengine.generate([5, 6, 7], sp_long, request_id="victim")
        seen = 0
        async for out in gen:
            seen += len(out.delta_token_ids)
            if seen >= 3:
                break
        await gen.aclose()  # leaving the iterator aborts the request
        explicit = asyncio.create_task(_collect(aengine, [8, 9], sp_long, rid="explicit"))
        await asyncio.sleep(0.05)
        aengine.abort("explicit")
        _, last_explicit = await explicit
        _, last_survivor = await survivor
        return last_explicit, last_survivor

    last_explicit, last_survivor = asyncio.run(main())
    assert last_explicit.finished and last_explicit.finish_reason == "abort"
    assert len(last_explicit.token_ids) < 200
    assert last_survivor.finish_reason == "length" and len(last_survivor.token_ids) == 30
    load = aengine.load()
    assert load.num_running == 0 and load.num_waiting == 0


def test_many_short_requests_arriving_while_others_decode(aengine):
    """No lost, duplicated or reordered tokens: every stream's deltas rebuild exactly the
    tokens the same request produces when run alone."""
    rng = random.Random(7)
    reqs = [([rng.randrange(3, 2000) for _ in range(rng.randrange(2, 40))], SamplingParams(max_tokens=rng.randrange(1, 16), ignore_eos=True))
            for _ in range(48)]

    async def main():
        tasks = []
        for ids, sp in reqs:
            tasks.append(asyncio.create_task(_collect(aengine, ids, sp)))
            await asyncio.sleep(rng.random() * 0.01)
        return await asyncio.gather(*tasks)

    results = asyncio.run(main())

    async def alone():
        return [(await _collect(aengine, ids, sp))[1].token_ids for ids, sp in reqs[:12]]

    ref = asyncio.run(alone())
    for (deltas, last), (_ids, sp) in zip(results, reqs):
        assert sum((d.delta_token_ids for d in deltas), []) == last.token_ids
        assert len(last.token_ids) == sp.max_tokens
    assert [last.token_ids for _, last in results[:12]] == ref
