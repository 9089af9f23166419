"""Logits oracle: prompt_logprobs equal HF transformers' DeepseekV3ForCausalLM log-softmax."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from tests.helpers import make_random_dsv3_checkpoint

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 512,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

CASES = {
    "q_lora_grouped_bias": {},
    "no_q_lora": {"q_lora_rank": None},
    "yarn": {"rope_parameters": YARN},
    "single_group_no_interleave": {"n_group": 1, "topk_group": 1, "rope_interleave": False},
    "dense_then_moe_no_norm_topk": {"first_k_dense_replace": 2, "norm_topk_prob": False},
}


def hf_prompt_logprobs(path, prompts: list[list[int]]) -> list[list[float]]:
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            logits = model(torch.tensor([p])).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            out.append([lp[i, p[i + 1]].item() for i in range(len(p) - 1)])
    return out


def ours(path, prompts, **engine_kw) -> list[list[float]]:
    llm = LLM(model=str(path), kv_cache_tokens=8192, page_size=4, **engine_kw)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=True))
    finally:
        llm.shutdown()
    for o in outs:
        assert o.prompt_logprobs[0] is None
    return [o.prompt_logprobs[1:] for o in outs]


def _prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


@pytest.mark.parametrize("case", list(CASES))
def test_prompt_logprobs_match_hf(tmp_path, case):
    path = make_random_dsv3_checkpoint(tmp_path / case, seed=list(CASES).index(case), **CASES[case])
    prompts = _prompts(500, [37, 5, 64, 2])
    ref = hf_prompt_logprobs(path, prompts)
    got = ours(path, prompts, chunked_prefill_size=48)  # forces a chunk boundary inside a prompt
    for r, g in zip(ref, got):
        assert len(r) == len(g)
        assert max(abs(a - b) for a, b in zip(r, g)) < 1e-4


def test_tiny_dsv3_prompt_logprobs_match_hf():
    from engine.models.tiny import ensure_tiny_dsv3

    path = ensure_tiny_dsv3()
    prompts = _prompts(2000, [90, 17])
    ref = hf_prompt_logprobs(path, prompts)
    got = ours(path, prompts)
    for r, g in zip(ref, got):
        assert max(abs(a - b) for a, b in zip(r, g)) < 1e-4


def test_decode_logprobs_match_hf(tmp_path):
    """Absorbed-form decode over the paged cache: each generated token's logprob equals HF's
    log-softmax at that position of prompt + generated tokens."""
    path = make_random_dsv3_checkpoint(tmp_path / "dec", rope_parameters=YARN)
    prompts = _prompts(500, [11, 30])
    llm = LLM(model=str(path), kv_cache_tokens=4096, page_size=4)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
            max_tokens=12, logprobs=True, top_logprobs=4, ignore_eos=True))
    finally:
        llm.shutdown()
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, o in zip(prompts, outs):
        full = p + o.token_ids
        ref = hf_prompt_logprobs(path, [full])[0][len(p) - 1 :]
        assert max(abs(a - b) for a, b in zip(ref, o.logprobs)) < 1e-4
        # the 4 most likely tokens at each step, with their logprobs, most likely first
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([full])).logits[0].float(), dim=-1)[len(p) - 1 : -1]
        assert len(o.top_logprobs) == len(o.token_ids)
        for step, top in zip(lp, o.top_logprobs):
            want = step.topk(4)
            assert list(top) == want.indices.tolist()
            assert max(abs(a - b) for a, b in zip(top.values(), want.values.tolist())) < 1e-4


def test_prompt_logprobs_in_row_chunks_match_hf(tmp_path, monkeypatch):
    """Long prompts' logprobs are computed a chunk of rows at a time; chunk edges change nothing."""
    import engine.model_runner as model_runner

    monkeypatch.setattr(model_runner, "_LOGPROB_ROWS", 7)  # the runner is in this process (thread executor)
    path = make_random_dsv3_checkpoint(tmp_path / "chunks", seed=11)
    prompts = _prompts(500, [37, 5, 64, 2])
    ref = hf_prompt_logprobs(path, prompts)
    got = ours(path, prompts, forward_executor="thread")
    for r, g in zip(ref, got):
        assert len(r) == len(g)
        assert max(abs(a - b) for a, b in zip(r, g)) < 1e-4


def test_split_kv_decode_logprobs_match_hf(tmp_path, monkeypatch):
    """Decode attention in key chunks with an online softmax (forced here with a tiny gather
    budget: rows of four lengths, several chunks each) equals HF, as the one-pass form does."""
    from engine.models import deepseek_v3

    monkeypatch.setattr(deepseek_v3, "DECODE_GATHER_ELEMS", {"cpu": 1, "cuda": 1})
    monkeypatch.setattr(deepseek_v3, "_DECODE_MIN_CHUNK", 8)
    calls = []
    split = deepseek_v3.MLAttention._decode_split_kv

    def spy(self, *args):
        calls.append(len(args[-1]))  # chunks
        return split(self, *args)

    monkeypatch.setattr(deepseek_v3.MLAttention, "_decode_split_kv", spy)
    path = make_random_dsv3_checkpoint(tmp_path / "split", rope_parameters=YARN, seed=3)
    prompts = _prompts(500, [11, 30, 3, 57])
    llm = LLM(model=str(path), kv_cache_tokens=4096, page_size=4, forward_executor="thread")
    try:
        outs = llm.generate(prompt_token_ids=prompts,
                            sampling_params=SamplingParams(max_tokens=12, logprobs=True, ignore_eos=True))
    finally:
        llm.shutdown()
    assert calls and max(calls) >= 8  # 57 + 11 keys in chunks of 8
    for p, o in zip(prompts, outs):
        ref = hf_prompt_logprobs(path, [p + o.token_ids])[0][len(p) - 1 :]
        assert max(abs(a - b) for a, b in zip(ref, o.logprobs)) < 1e-4


def test_extend_in_request_groups_matches_hf(tmp_path, monkeypatch):
    """Extend attention one group of requests at a time (forced here: every request alone, and
    prefixes from chunked prefill) equals HF, as one padded group does."""
    from engine.models import deepseek_v3

    monkeypatch.setattr(deepseek_v3, "EXTEND_GROUP_ELEMS", {"cpu": 1, "cuda": 1})
    sizes = []
    plan = deepseek_v3.plan_extend_groups

    def spy(*args):
        groups = plan(*args)
        sizes.append(len(groups))
        return groups

    monkeypatch.setattr(deepseek_v3, "plan_extend_groups", spy)
    path = make_random_dsv3_checkpoint(tmp_path / "groups", seed=4)
    prompts = _prompts(500, [37, 5, 64, 2, 20])
    ref = hf_prompt_logprobs(path, prompts)
    got = ours(path, prompts, chunked_prefill_size=48, forward_executor="thread")
    assert max(sizes) >= 3  # several requests in one step, each its own group
    for r, g in zip(ref, got):
        assert len(r) == len(g)
        assert max(abs(a - b) for a, b in zip(r, g)) < 1e-4


def test_prompt_top_logprobs_match_hf(tmp_path):
    """With prompt_logprobs and top_logprobs, every prompt position also reports the most likely
    tokens: HF's top-k of its log-softmax there (across a prefill chunk boundary)."""
    from transformers import DeepseekV3ForCausalLM

    path = make_random_dsv3_checkpoint(tmp_path / "ptop", seed=9)
    prompts = _prompts(500, [37, 5])
    llm = LLM(model=str(path), kv_cache_tokens=4096, page_size=4, chunked_prefill_size=24)
    try:
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
            max_tokens=1, prompt_logprobs=True, top_logprobs=3))
    finally:
        llm.shutdown()
    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for p, o in zip(prompts, outs):
        assert o.prompt_top_logprobs[0] is None and len(o.prompt_top_logprobs) == len(p)
        assert o.top_logprobs is None  # generated tokens' tops need logprobs=True
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1)[:-1]
        for step, top in zip(lp, o.prompt_top_logprobs[1:]):
            want = step.topk(3)
            assert list(top) == want.indices.tolist()
            assert max(abs(a - b) for a, b in zip(top.values(), want.values.tolist())) < 1e-4
