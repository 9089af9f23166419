"""OfflineEPGroup over the real engine (tiny-dsv3, ep_size 2, gloo): same greedy tokens as one
rank wherever requests run, each rank holds exactly its experts, a lost rank fails the batch."""

from __future__ import annotations

import threading
import time

import pytest
from cluster_testing import LOOPBACK

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [[3, 17, 42, 9], [5, 1, 99, 250, 7, 7], [1200, 4], [8, 8, 8, 31, 64, 2, 11, 600]]
PLACEMENTS = {
    "spread": [0, 1, 0, 1],
    "all_on_rank0": [0, 0, 0, 0],  # rank 1 idle: runs zero-token batches in every collective
    "all_on_rank1": [1, 1, 1, 1],
}


def _group():
    from cluster.offline import OfflineEPGroup
    from cluster.rank import RankOptions

    return OfflineEPGroup(
        EngineConfig(model="tiny-dsv3", ep_size=2, device="cpu"),
        options=RankOptions(
            rendezvous_timeout_s=60, collective_timeout_s=60, master_address=LOOPBACK
        ),
        health_check_period_s=0.5,
        health_check_timeout_s=10,
    )


def _requests(tag: str, params: SamplingParams = GREEDY):
    return [(f"{tag}-{i}", p, params) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def reference_tokens(local_ray) -> list[list[int]]:
    from engine.llm import LLM

    llm = LLM(model="tiny-dsv3", ep_size=1, device="cpu")
    try:
        return [o.token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]
    finally:
        shutdown = getattr(llm, "shutdown", None)
        if shutdown is not None:
            shutdown()


@pytest.fixture(scope="module")
def group(local_ray):
    g = _group()
    yield g
    g.shutdown()


@pytest.mark.parametrize("placement", list(PLACEMENTS), ids=list(PLACEMENTS))
def test_ep2_greedy_tokens_equal_ep1_wherever_requests_run(group, reference_tokens, placement):
    outs = group.generate(_requests(placement), placement=PLACEMENTS[placement])
    assert [o.error for o in outs] == [None] * len(PROMPTS)
    assert [o.token_ids for o in outs] == reference_tokens


def test_each_rank_holds_exactly_its_experts_weights(group):
    import torch
    from safetensors import safe_open

    from engine.models.loader import load_model_config, resolve_model_path

    path = resolve_model_path("tiny-dsv3")
    n_experts = load_model_config(path).n_routed_experts
    shards = [group.rank_expert_weights(r) for r in range(2)]
    assert shards[0].keys() == shards[1].keys() and shards[0]
    with safe_open(str(path / "model.safetensors"), "pt") as ckpt:
        for layer in shards[0]:
            ranges = [(s[layer].start, s[layer].end) for s in shards]
            assert ranges == [(0, n_experts // 2), (n_experts // 2, n_experts)]
            for shard in (s[layer] for s in shards):
                assert shard.w13.shape[0] == shard.w2.shape[0] == shard.end - shard.start
                for local, expert in enumerate(range(shard.start, shard.end)):
                    pre = f"model.layers.{layer}.mlp.experts.{expert}."
                    gate, up, down = (
                        ckpt.get_tensor(pre + f"{p}.weight")
                        for p in ("gate_proj", "up_proj", "down_proj")
                    )
                    torch.testing.assert_close(shard.w13[local], torch.cat([gate, up]).float())
                    torch.testing.assert_close(shard.w2[local], down.float())


def test_info_reports_ranks_and_peak_memory(group):
    infos = group.info()
    assert [(i.rank, i.world_size) for i in infos] == [(0, 2), (1, 2)]
    assert all(i.model == "tiny-dsv3" and i.max_model_len > 0 for i in infos)
    assert all(i.peak_rss_bytes > 50 * 2**20 and i.peak_device_bytes is None for i in infos)
    assert group.tokenizer.encode("hello")


def test_killing_a_rank_mid_generation_fails_the_batch_then_a_new_group_serves(
    local_ray, reference_tokens
):
    from cluster.offline import EPGroupError

    doomed = _group()
    long = SamplingParams(max_tokens=3000, temperature=0.0, ignore_eos=True)
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["outs"] = doomed.generate(_requests("long", long), placement=[0, 0, 1, 1])
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    time.sleep(3.0)
    killed_at = time.monotonic()
    doomed.kill_rank(1)
    t.join(timeout=60)
    assert not t.is_alive(), "generate hung after a rank was killed"
    assert time.monotonic() - killed_at < 30
    assert isinstance(result.get("error"), EPGroupError), result
    doomed.shutdown()

    fresh = _group()
    try:
        outs = fresh.generate(_requests("again"))
        assert [o.token_ids for o in outs] == reference_tokens
    finally:
        fresh.shutdown()
