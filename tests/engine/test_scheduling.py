"""Continuous batching, chunked prefill, prefix cache, retraction, overlap on/off, bad input."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def _workload(n: int, seed: int = 0, lo: int = 4, hi: int = 120, max_tokens=(4, 24)):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(*max_tokens), **GREEDY) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def llm():
    llm = LLM(model="tiny-dsv3", kv_cache_tokens=16384)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def alone_outputs(llm):
    prompts, params = _workload(32)
    return prompts, params, [llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].token_ids
                             for p, sp in zip(prompts, params)]


def test_batch_of_32_equals_each_alone(llm, alone_outputs):
    prompts, params, alone = alone_outputs
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.token_ids for o in outs] == alone
    assert all(o.finish_reason == "length" and len(o.token_ids) == sp.max_tokens for o, sp in zip(outs, params))


def test_chunked_prefill_equals_unchunked(alone_outputs):
    prompts, params, alone = alone_outputs
    llm = LLM(model="tiny-dsv3", kv_cache_tokens=16384, chunked_prefill_size=24, enable_prefix_caching=False)
    try:
        outs = llm.generate(prompt_token_ids=prompts[:12], sampling_params=params[:12])
        assert llm.engine.stats().prefill_steps > 12  # prompts really were split
        plp_chunked = llm.generate(prompt_token_ids=prompts[:3], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=True))
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == alone[:12]
    llm = LLM(model="tiny-dsv3", kv_cache_tokens=16384)
    try:
        plp_whole = llm.generate(prompt_token_ids=prompts[:3], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=True))
    finally:
        llm.shutdown()
    for a, b in zip(plp_chunked, plp_whole):
        assert max(abs(x - y) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])) < 1e-4


def test_prefix_cache_hit_same_output_fewer_prefill_tokens():
    llm = LLM(model="tiny-dsv3", kv_cache_tokens=8192, page_size=4)
    try:
        rng = random.Random(1)
        shared = [rng.randrange(3, 2000) for _ in range(64)]
        a = shared + [5, 6, 7]
        b = shared + [9, 10]
        sp = SamplingParams(max_tokens=8, **GREEDY)
        first = llm.generate(prompt_token_ids=[a], sampling_params=sp)[0]
        hit = llm.generate(prompt_token_ids=[b], sampling_params=sp)[0]
        again = llm.generate(prompt_token_ids=[a], sampling_params=sp)[0]
    finally:
        llm.shutdown()
    cold = LLM(model="tiny-dsv3", kv_cache_tokens=8192, page_size=4, enable_prefix_caching=False)
    try:
        ref_b = cold.generate(prompt_token_ids=[b], sampling_params=sp)[0]
    finally:
        cold.shutdown()
    assert first.metrics.num_cached_tokens == 0
    assert hit.metrics.num_cached_tokens == 64
    assert hit.metrics.num_computed_prefill_tokens == len(b) - 64
    assert hit.token_ids == ref_b.token_ids
    assert again.token_ids == first.token_ids and again.metrics.num_cached_tokens >= 64


@pytest.fixture(scope="module")
def long_decode_workload(llm):
    """64 requests with short prompts and long outputs: admission is cheap, decode growth is not."""
    prompts, params = _workload(64, seed=5, lo=4, hi=30, max_tokens=(60, 120))
    return prompts, params, [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]


@pytest.mark.parametrize("overlap", [False, True])
def test_64_requests_through_small_pool_finish_by_retraction(overlap, long_decode_workload):
    prompts, params, ref = long_decode_workload
    # room for ~8 of these requests at their full length
    llm = LLM(model="tiny-dsv3", kv_cache_tokens=8 * 150, page_size=8, enable_overlap_schedule=overlap)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == ref
    assert all(o.finish_reason == "length" for o in outs)
    assert stats.retractions > 0
    assert sum(o.metrics.num_retractions for o in outs) == stats.retractions


def test_overlap_on_off_identical_mixed_finishes(alone_outputs):
    prompts, _, _ = alone_outputs
    rng = random.Random(3)
    params = []
    for i in range(len(prompts)):
        kind = i % 4
        if kind == 0:
            params.append(SamplingParams(max_tokens=rng.randrange(1, 30), ignore_eos=True))
        elif kind == 1:
            params.append(SamplingParams(max_tokens=40, stop_token_ids=[rng.randrange(3, 2000) for _ in range(200)]))
        elif kind == 2:
            params.append(SamplingParams(max_tokens=40, stop=["e", "th"]))
        else:
            params.append(SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, top_k=50, seed=i))
    results = {}
    for executor in ("inline", "thread", "process"):  # the normal loop, then the overlap loop's two executors
        llm = LLM(model="tiny-dsv3", kv_cache_tokens=16384, enable_overlap_schedule=executor != "inline",
                  forward_executor="auto" if executor == "inline" else executor)
        try:
            results[executor] = [(o.token_ids, o.text, o.finish_reason) for o in
                                 llm.generate(prompt_token_ids=prompts, sampling_params=params)]
        finally:
            llm.shutdown()
    assert results["inline"] == results["thread"] == results["process"]
    reasons = {r for _, _, r in results["process"]}
    assert reasons == {"stop", "length"}
    for (_toks, text, reason), sp in zip(results["process"], params):
        if sp.stop and reason == "stop":
            assert not any(s in text for s in sp.stop)


def test_seeded_sampling_reproducible_regardless_of_batch(llm):
    sp = SamplingParams(max_tokens=12, temperature=1.0, top_k=100, min_p=0.01, seed=1234, ignore_eos=True)
    p = [11, 22, 33, 44]
    alone = llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].token_ids
    others, oparams = _workload(7, seed=9)
    mixed = llm.generate(prompt_token_ids=others + [p], sampling_params=oparams + [sp])[-1].token_ids
    assert alone == mixed
    other_seed = llm.generate(prompt_token_ids=[p], sampling_params=sp.model_copy(update={"seed": 99}))[0].token_ids
    assert other_seed != alone


def test_stop_string_not_in_text_and_eos_finishes(llm):
    p = [100, 200, 300]
    full = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=30, ignore_eos=True))[0]
    stop = full.text[10:13]
    assert len(stop) == 3
    out = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=30, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.index(stop)]
    eos = full.token_ids[5]
    out = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(max_tokens=30, stop_token_ids=[eos]))[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == eos and len(out.token_ids) == full.token_ids.index(eos) + 1


BAD = [
    ([], {}, "prompt"),
    ([1] * 5000, {}, "prompt"),
    ([1, 2, 10**7], {}, "prompt_token_ids"),
    ([1, 2, -1], {}, "prompt_token_ids"),
    ([1, 2], {"max_tokens": 0}, "max_tokens"),
    ([1, 2], {"temperature": -1.0}, "temperature"),
    ([1, 2], {"top_p": 0.0}, "top_p"),
    ([1, 2], {"top_p": 1.5}, "top_p"),
]


@pytest.mark.parametrize("ids,kw,field", BAD)
def test_bad_input_value_error_names_field(llm, ids, kw, field):
    with pytest.raises(ValueError, match=field):
        llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(**kw) if kw else None)


def test_bad_input_does_not_disturb_running_requests(llm):
    import threading

    res = {}
    t = threading.Thread(target=lambda: res.setdefault("o", llm.generate(
        prompt_token_ids=[[5, 6, 7]] * 4, sampling_params=SamplingParams(max_tokens=40, ignore_eos=True))))
    t.start()
    for ids, kw, _field in BAD:
        with pytest.raises(ValueError):
            llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(**kw) if kw else None)
    t.join(60)
    assert [len(o.token_ids) for o in res["o"]] == [40] * 4


def test_bad_model_names():
    with pytest.raises(ValueError, match="model"):
        LLM(model="no-such-model")
    with pytest.raises(ValueError):
        LLM(model="tiny-dsv3", page_size=0)


def test_kv_capacity_from_memory_budget():
    from engine.mem.pool import MLATokenPool

    llm = LLM(model="tiny-dsv3", kv_cache_memory_bytes=4 << 20, page_size=16)
    try:
        hf = llm.engine.hf_config
        per_token = MLATokenPool.bytes_per_token(hf.num_hidden_layers, hf.kv_lora_rank, hf.qk_rope_head_dim, torch.float32)
        expect = -(-((4 << 20) // per_token) // 16) * 16
        assert llm.engine.kv_capacity_tokens == expect
        assert llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=SamplingParams(max_tokens=4))[0].finish_reason
    finally:
        llm.shutdown()


def test_priority_policy_admits_lower_priority_value_first():
    """One request at a time (max_running_requests=1): completion order follows priority, then arrival."""
    import threading

    llm = LLM(model="tiny-dsv3", kv_cache_tokens=4096, max_running_requests=1, schedule_policy="priority")
    try:
        order, lock, done, started = [], threading.Lock(), threading.Event(), threading.Event()

        def cb(out):
            started.set()
            if out.finished:
                with lock:
                    order.append(out.request_id)
                    if len(order) == 4:
                        done.set()

        eng = llm.engine
        # the first request occupies the engine while the others queue behind it
        eng.add_request([1, 2, 3], SamplingParams(max_tokens=30, ignore_eos=True), cb, "first")
        assert started.wait(30)
        for rid, prio in [("low", 5), ("high", -1), ("mid", 0)]:
            eng.add_request([4, 5, 6], SamplingParams(max_tokens=2, ignore_eos=True, priority=prio), cb, rid)
        assert done.wait(60)
    finally:
        llm.shutdown()
    assert order == ["first", "high", "mid", "low"]
