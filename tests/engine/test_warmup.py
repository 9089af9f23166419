"""Warm-up: one short request runs through the loop while the engine starts, then leaves no
trace (prefix cache, counters, timing)."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.engine import Engine
from engine.model_runner import ModelRunner

WARMUP_PROMPT = list(range(1, 17))  # what `Engine._warm_up` sends (vocabulary > 16)


@pytest.mark.parametrize("warmup", [True, False])
def test_warm_up_runs_forwards_at_start_and_leaves_no_trace(monkeypatch, warmup):
    forwards = []
    real = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda self, fb: forwards.append(fb.forward_mode) or real(self, fb))
    llm = LLM(model="tiny-dsv3", kv_cache_tokens=4096, forward_executor="thread", warmup=warmup)
    try:
        engine: Engine = llm.engine
        started = len(forwards)
        stats = engine.stats()
        assert (stats.steps, stats.generated_tokens, stats.forward_time_s) == (0, 0, 0.0)
        assert engine.scheduler.radix.cached_pages == 0
        assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.capacity
        out = llm.generate(prompt_token_ids=[WARMUP_PROMPT + [20, 21, 22]], sampling_params=SamplingParams(max_tokens=2))[0]
        assert out.metrics.num_cached_tokens == 0  # the warm-up's first page is not in the cache
        assert engine.stats().steps >= 2
    finally:
        llm.shutdown()
    if warmup:
        assert started >= 3  # a prefill and decode steps
        assert {int(m) for m in forwards[:started]} >= {1, 2}
    else:
        assert started == 0


def test_warm_up_fits_a_tiny_pool():
    """A pool of two pages (16 tokens) still warms up, with a shorter request, and then serves."""
    llm = LLM(model="tiny-dsv3", kv_cache_tokens=16, page_size=8, forward_executor="thread")
    try:
        out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=SamplingParams(max_tokens=4))[0]
        assert len(out.token_ids) >= 1
    finally:
        llm.shutdown()
