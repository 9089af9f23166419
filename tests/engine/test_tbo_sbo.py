"""TBO splits, stage interleaving, and TBO/SBO equivalence on one rank (EP runs in tests/cluster)."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.forward_batch import ForwardMode
from engine.tbo import TboSplit, make_children, run_interleaved, split_decode, split_extend


# ------------------------------------------------------------------ splits
def test_decode_split_halves_odd_and_one():
    assert split_decode(8) == TboSplit(4, 0, 4)
    assert split_decode(7) == TboSplit(4, 0, 4)
    assert split_decode(2) == TboSplit(1, 0, 1)
    assert split_decode(1) == TboSplit(1, 0, 1)  # B empty: the header never allows TBO for this


def test_extend_balanced_split_at_request_boundary():
    assert split_extend([10, 10, 10, 10], 0.48) == TboSplit(2, 0, 20)
    assert split_extend([30, 10, 20], 0.48) == TboSplit(1, 0, 30)


def test_extend_two_chunk_split_below_threshold():
    # best boundary leaves 10 of 110 tokens on one side: cut the long sequence at the midpoint
    s = split_extend([100, 10], 0.48)
    assert s == TboSplit(0, 55, 55)
    # one request: always a cut
    assert split_extend([9], 0.48) == TboSplit(0, 4, 4)


@pytest.mark.parametrize("lens,threshold,expect_cut", [
    ([52, 48], 0.48, False),   # 48% exactly: balanced split kept
    ([53, 47], 0.48, True),    # 47% < 48%: two-chunk
    ([53, 47], 0.40, False),
])
def test_extend_split_around_threshold(lens, threshold, expect_cut):
    s = split_extend(lens, threshold)
    assert (s.cut != 0) == expect_cut
    assert s.token_split in range(1, sum(lens))


def test_children_cover_the_batch_with_right_positions():
    from engine.forward_batch import ForwardBatch
    from engine.sched.batch import attention_metadata

    prefix, ext = [3, 0], [7, 5]
    T = sum(ext)
    rows = torch.arange(100).view(2, 50)
    fb = ForwardBatch(ForwardMode.EXTEND, torch.arange(T), torch.tensor([3, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4]),
                      torch.arange(T) + 1000, 2,
                      attention_metadata(ForwardMode.EXTEND, torch.tensor(prefix), torch.tensor(ext), rows),
                      torch.zeros(0, dtype=torch.int64), [], None, torch.zeros(0, dtype=torch.int64),
                      prefix_lens=prefix, extend_lens=ext)
    a, b = make_children(fb, TboSplit(0, 6, 6))  # cut request 0 after 6 of its 7 tokens
    assert a.num_tokens + b.num_tokens == T
    assert a.prefix_lens == [3] and a.extend_lens == [6]
    assert b.prefix_lens == [9, 0] and b.extend_lens == [1, 5]
    assert b.positions[0].item() == 9
    # B's piece of request 0 attends to all 10 cached + own slots of request 0
    assert b.attn.kv_mask[0].sum().item() == 10
    assert torch.equal(b.attn.kv_indices[0, :10], rows[0, :10])


# ------------------------------------------------------------------ interleaving
def test_interleaved_stages_equal_sequential():
    """Stage lists with a shared 'communication' buffer per micro-batch: any delta gives the
    same per-micro-batch results as running them one after the other."""
    log = []

    def op(name):
        def f(mb):
            mb["v"] = mb["v"] * 3 + len(name)
            log.append((name, mb["id"]))
        return f

    stages = [[op(f"s{i}a"), op(f"s{i}b")] for i in range(5)]
    ref = [{"id": 0, "v": 1}, {"id": 1, "v": 2}]
    for mb in ref:
        for st in stages:
            for o in st:
                o(mb)
    for delta in (0, 1, 2, 4):
        log.clear()
        mbs = [{"id": 0, "v": 1}, {"id": 1, "v": 2}]
        run_interleaved(stages, mbs, delta)
        assert [m["v"] for m in mbs] == [m["v"] for m in ref]
        # B never runs a stage before A ran it
        order = [(n, i) for n, i in log]
        for k, (n, i) in enumerate(order):
            if i == 1:
                assert (n, 0) in order[:k]


# ------------------------------------------------------------------ end to end, one rank
def _mixed(n, seed=0):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randrange(3, 90))] for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randrange(2, 20), ignore_eos=True) for _ in range(n)]
    return prompts, params


@pytest.fixture(scope="module")
def plain_reference():
    prompts, params = _mixed(20)
    llm = LLM(model="tiny-dsv3", kv_cache_tokens=16384, chunked_prefill_size=128)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        plp = llm.generate(prompt_token_ids=prompts[:6], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=True))
    finally:
        llm.shutdown()
    return prompts, params, [o.token_ids for o in outs], [o.prompt_logprobs[1:] for o in plp]


@pytest.mark.parametrize("tbo,sbo", [(True, False), (False, True), (True, True)])
def test_tbo_sbo_equal_plain(plain_reference, tbo, sbo):
    prompts, params, ref_tokens, ref_plp = plain_reference
    llm = LLM(model="tiny-dsv3", kv_cache_tokens=16384, chunked_prefill_size=128,
              enable_two_batch_overlap=tbo, enable_single_batch_overlap=sbo)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        plp = llm.generate(prompt_token_ids=prompts[:6], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=True))
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    assert [o.token_ids for o in outs] == ref_tokens
    for a, b in zip(plp, ref_plp):
        assert max(abs(x - y) for x, y in zip(a.prompt_logprobs[1:], b)) < 1e-4
    assert (stats.tbo_steps > 0) == tbo
    assert stats.sbo == sbo
