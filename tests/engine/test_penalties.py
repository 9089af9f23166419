"""Presence / frequency / repetition penalties and logit bias: the math, HF transformers as the
oracle for greedy decoding, and the device-side token counts under overlap, executors and
retraction."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.forward_batch import PenaltyInfo
from engine.penalties import PenaltyState
from tests.helpers import make_random_dsv3_checkpoint


def _pairs(lists: list[list[int]]) -> torch.Tensor:
    return torch.tensor([[j for j, ids in enumerate(lists) for _ in ids], [t for ids in lists for t in ids]],
                        dtype=torch.int64).view(2, -1)


def test_penalized_logits_equal_the_definitions():
    V, rng = 50, random.Random(0)
    prompts = [[rng.randrange(V) for _ in range(rng.randrange(1, 20))] for _ in range(4)]
    outputs = [[rng.randrange(V) for _ in range(rng.randrange(0, 30))] for _ in range(4)]
    pres, freq, rep = [0.0, 0.5, -0.3, 1.2], [0.0, 0.2, 0.7, -0.4], [1.0, 1.3, 0.8, 2.0]
    state = PenaltyState(8, V, torch.device("cpu"))
    state.counts.fill_(7)  # a previous request's leftovers in the rows: rebuilt, not added to
    state.in_prompt.fill_(True)
    info = PenaltyInfo(rows=torch.tensor([5, 1, 7, 2]), presence=torch.tensor(pres), frequency=torch.tensor(freq),
                       repetition=torch.tensor(rep), init_rows=torch.arange(4),
                       init_prompt=_pairs(prompts), init_output=_pairs(outputs))
    logits = torch.randn(4, V)
    got = state.apply(logits, info)
    for b in range(4):
        for t in range(V):
            x = logits[b, t].item()
            n = outputs[b].count(t)
            x -= freq[b] * n + pres[b] * (n > 0)
            if n or t in prompts[b]:
                x = x / rep[b] if x > 0 else x * rep[b]
            assert got[b, t].item() == pytest.approx(x, abs=1e-5)
    nxt = torch.tensor([3, 3, 0, 49])
    state.observe(info, nxt)
    assert [state.counts[r, t].item() for r, t in zip([5, 1, 7, 2], [3, 3, 0, 49])] == \
        [outputs[b].count(t) + 1 for b, t in enumerate([3, 3, 0, 49])]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_random_dsv3_checkpoint(tmp_path_factory.mktemp("pen") / "m", seed=7)


def _greedy(path, prompts, **penalties) -> list[list[int]]:
    return [o.token_ids for o in _generate(path, prompts, **penalties)]


def _generate(path, prompts, **kw):
    llm = LLM(model=str(path), kv_cache_tokens=4096, page_size=4)
    try:
        return llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=32, ignore_eos=True, **kw))
    finally:
        llm.shutdown()


def test_repetition_penalty_greedy_equals_hf_generate(checkpoint):
    from transformers import DeepseekV3ForCausalLM

    prompts = [[5, 9, 200, 31, 77, 4, 18, 3, 9, 9], [100, 101, 102]]
    model = DeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    ref = []
    for p in prompts:
        out = model.generate(torch.tensor([p]), max_new_tokens=32, do_sample=False, repetition_penalty=1.8,
                             min_new_tokens=32, pad_token_id=0)
        ref.append(out[0, len(p):].tolist())
    got = _greedy(checkpoint, prompts, repetition_penalty=1.8)
    assert got == ref
    assert got != _greedy(checkpoint, prompts)  # the penalty changed what greedy picks


def test_presence_and_frequency_greedy_equal_hf_logits(checkpoint):
    """Greedy under OpenAI's penalties: at each step the argmax of HF's logits minus the
    penalties of the tokens generated so far."""
    from transformers import DeepseekV3ForCausalLM

    model = DeepseekV3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    prompts = [[5, 9, 200, 31, 77, 4, 18, 3, 9, 9], [300, 2, 300, 2]]
    pres, freq = 0.6, 0.9
    outs = _generate(checkpoint, prompts, presence_penalty=pres, frequency_penalty=freq, logprobs=True)
    got = [o.token_ids for o in outs]
    for p, o in zip(prompts, outs):
        seq, counts = list(p), torch.zeros(model.config.vocab_size)
        with torch.no_grad():
            for t, reported in zip(o.token_ids, o.logprobs):
                raw = model(torch.tensor([seq])).logits[0, -1]
                logits = raw - freq * counts - pres * (counts > 0)
                assert int(logits.argmax()) == t
                # the reported logprob is the model's own, not the penalized distribution's
                assert reported == pytest.approx(torch.log_softmax(raw, -1)[t].item(), abs=1e-4)
                counts[t] += 1
                seq.append(t)
    assert got != _greedy(checkpoint, prompts)


def test_penalties_identical_across_executors_and_retraction():
    """Rows rebuilt from the host at (re)admission and counted on the device after each step:
    outputs do not depend on the loop, the executor, or retraction (a pool too small for all)."""
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 2000) for _ in range(rng.randrange(4, 40))] for _ in range(24)]
    params = []
    for i in range(len(prompts)):
        kw = [dict(), dict(frequency_penalty=1.5), dict(presence_penalty=-1.0, repetition_penalty=1.3),
              dict(repetition_penalty=2.0, temperature=0.9, seed=i)][i % 4]
        params.append(SamplingParams(max_tokens=rng.randrange(40, 90), ignore_eos=True, **kw))
    results, retractions = {}, 0
    for name, kw in {"inline": dict(enable_overlap_schedule=False), "thread": dict(forward_executor="thread"),
                     "process": dict(forward_executor="process"),
                     "retracting": dict(kv_cache_tokens=8 * 120, page_size=8)}.items():
        llm = LLM(model="tiny-dsv3", **{"kv_cache_tokens": 16384, **kw})
        try:
            results[name] = [o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params)]
            if name == "retracting":
                retractions = llm.engine.stats().retractions
        finally:
            llm.shutdown()
    assert results["inline"] == results["thread"] == results["process"] == results["retracting"]
    assert retractions > 0


def test_logit_bias_forces_and_bans_tokens(checkpoint):
    prompts = [[5, 9, 200, 31], [100, 101, 102]]
    plain = _greedy(checkpoint, prompts)
    assert {t for toks in _greedy(checkpoint, prompts, logit_bias={77: 100.0}) for t in toks} == {77}
    banned = {toks[0]: -100.0 for toks in plain}
    got = _greedy(checkpoint, prompts, logit_bias=banned)
    assert all(t not in banned for toks in got for t in toks)
    outs = _generate(checkpoint, prompts, logit_bias={77: 100.0}, logprobs=True)
    assert all(lp < -0.5 for o in outs for lp in o.logprobs)  # the model's own logprobs of token 77
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(logit_bias={1: 101.0})
