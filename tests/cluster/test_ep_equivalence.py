"""ep_size 2 and 4 equal ep_size 1: prompt_logprobs within 1e-4 and identical greedy tokens, on
tiny-dsv3 and a random HF checkpoint, over prefill, decode and mixed steps (chunked prefill on
one rank while another decodes), with requests spread, all on one rank, and a rank left idle."""

from __future__ import annotations

import random
import uuid

import pytest

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from tests.helpers import make_random_dsv3_checkpoint

pytestmark = pytest.mark.usefixtures("local_ray")


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    # lengths straddle the chunk budget so some ranks prefill in chunks while others decode
    return [[rng.randrange(3, 500) for _ in range(rng.choice([3, 17, 70, 130]))] for _ in range(n)]


def _reference(model: str, prompts, sp, plp):
    llm = LLM(model=model, kv_cache_tokens=8192, chunked_prefill_size=96)
    try:
        return ([o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp)],
                [o.prompt_logprobs[1:] for o in llm.generate(prompt_token_ids=prompts, sampling_params=plp)])
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def random_ckpt(tmp_path_factory):
    return str(make_random_dsv3_checkpoint(tmp_path_factory.mktemp("ep") / "ckpt", seed=3, n_routed_experts=8,
                                           num_experts_per_tok=3, n_group=2, topk_group=1))


@pytest.mark.parametrize("ep", [2, 4])
@pytest.mark.parametrize("which", ["tiny-dsv3", "random"])
def test_ep_equals_ep1(ep, which, random_ckpt):
    from cluster.offline import OfflineEPGroup

    model = "tiny-dsv3" if which == "tiny-dsv3" else random_ckpt
    prompts = _prompts(8, seed=ep)
    sp = SamplingParams(max_tokens=10, ignore_eos=True)
    plp = SamplingParams(max_tokens=1, prompt_logprobs=True)
    ref_tokens, ref_plp = _reference(model, prompts, sp, plp)
    placements = {
        "spread": [i % ep for i in range(len(prompts))],
        "all-on-last": [ep - 1] * len(prompts),
        "rank0-idle": [1 + i % (ep - 1) for i in range(len(prompts))],
    }
    group = OfflineEPGroup(EngineConfig(model=model, ep_size=ep, kv_cache_tokens=8192, chunked_prefill_size=96,
                                        moe_a2a_backend="torch"), cpus_per_rank=0.5)
    try:
        for name, placement in placements.items():
            outs = group.generate([(uuid.uuid4().hex, p, sp) for p in prompts], placement=placement)
            assert [o.token_ids for o in outs] == ref_tokens, name
            lp = group.generate([(uuid.uuid4().hex, p, plp) for p in prompts], placement=placement)
            for a, b in zip(lp, ref_plp):
                assert max(abs(x - y) for x, y in zip(a.prompt_logprobs[1:], b)) < 1e-4, name
    finally:
        group.shutdown()
