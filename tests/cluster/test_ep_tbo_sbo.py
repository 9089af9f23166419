"""TBO, SBO and both over a real 2-rank EP group (gloo all-to-all): outputs equal plain EP.

Covers prefill (chunked, with two-chunk TBO splits), decode, steps where one rank prefills while
the other decodes (TBO then falls back for that step), and uneven placement (all requests on
rank 0: rank 1 runs idle batches that still join every collective).
"""

from __future__ import annotations

import random
import uuid

import pytest

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

pytestmark = pytest.mark.usefixtures("local_ray")


def _requests(n: int, seed: int):
    rng = random.Random(seed)
    reqs = []
    for _ in range(n):
        ids = [rng.randrange(3, 2000) for _ in range(rng.randrange(3, 80))]
        reqs.append(
            (
                uuid.uuid4().hex,
                ids,
                SamplingParams(max_tokens=rng.randrange(2, 14), ignore_eos=True),
            )
        )
    return reqs


def _plp_requests(reqs):
    return [
        (uuid.uuid4().hex, ids, SamplingParams(max_tokens=1, prompt_logprobs=True))
        for _, ids, _ in reqs
    ]


def _run(reqs, placements, **kw):
    from cluster.offline import OfflineEPGroup

    group = OfflineEPGroup(
        EngineConfig(
            model="tiny-dsv3",
            ep_size=2,
            kv_cache_tokens=8192,
            chunked_prefill_size=64,
            moe_a2a_backend="torch",
            **kw,
        )
    )
    try:
        outs = []
        for placement in placements:
            gen = group.generate(reqs, placement=placement)
            plp = group.generate(_plp_requests(reqs), placement=placement)
            outs.append(([o.token_ids for o in gen], [o.prompt_logprobs[1:] for o in plp]))
        return outs
    finally:
        group.shutdown()


REQS = _requests(10, seed=11)
PLACEMENTS = [
    [i % 2 for i in range(len(REQS))],  # spread evenly
    [0] * len(REQS),  # all on rank 0, rank 1 idle
    [0, 0, 0, 0, 0, 0, 0, 1, 1, 0],  # uneven
]


@pytest.fixture(scope="module")
def plain_ep():
    return _run(REQS, PLACEMENTS)


@pytest.mark.parametrize(
    "tbo,sbo", [(True, False), (False, True), (True, True)], ids=["tbo", "sbo", "tbo+sbo"]
)
def test_ep2_overlap_modes_equal_plain_ep(plain_ep, tbo, sbo):
    got = _run(REQS, PLACEMENTS, enable_two_batch_overlap=tbo, enable_single_batch_overlap=sbo)
    for (ref_tokens, ref_plp), (tokens, plp) in zip(plain_ep, got):
        assert tokens == ref_tokens
        for a, b in zip(ref_plp, plp):
            assert max(abs(x - y) for x, y in zip(a, b)) < 1e-4
