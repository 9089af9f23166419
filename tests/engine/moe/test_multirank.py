"""ep_size 2 and 4 over gloo (spawned processes) must equal ep_size 1 (`none` backend).

One group of processes per world size runs every scenario of that size.
The `deepep` scenarios run the real adapter against `fake_deep_ep` / `fake_deep_gemm`.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp
from moe_testing import make_weights, rel_err
from mp_worker import Scenario, scenario_inputs, worker

from engine.moe.fp8 import dequantize_per_block, quantize_per_block
from engine.moe.none import NoneDispatcher
from engine.moe.runners import TorchExpertRunner

LL = dict(backend="deepep", hidden=2048, inter=128, topk=3)  # DeepEP LL kernels' hidden sizes

SCENARIOS_2 = {
    "uneven": Scenario("torch", (3, 17)),
    "idle_rank": Scenario("torch", (0, 9)),
    "all_idle": Scenario("torch", (0, 0)),
    "hot_rank1": Scenario("torch", (6, 5), hot_rank=1),
    "masked_delay": Scenario("torch", (4, 11), layout="masked", delay_s=0.01),
    "aligned_tbo": Scenario("torch", (8, 13), alignment=4, tbo=True),
    "deepep_normal_bf16": Scenario(tokens=(5, 0), **LL),
    "deepep_normal_fp8_deep_gemm": Scenario(tokens=(7, 12), normal_fp8=True, alignment=128,
                                            runner="deep_gemm", **LL),
    "deepep_ll_fp8_deep_gemm": Scenario(tokens=(0, 9), modes=("low_latency",),
                                        deepep_mode="low_latency", runner="deep_gemm", **LL),
    "deepep_ll_bf16_hot": Scenario(tokens=(6, 3), modes=("low_latency",), deepep_mode="low_latency",
                                   low_latency_fp8=False, hot_rank=1, **LL),
    "deepep_ll_signalled_combine": Scenario(tokens=(5, 11), modes=("low_latency",), deepep_mode="low_latency",
                                            runner="deep_gemm", signal=True, **LL),
    # every token to rank 1's 4 experts: ~66 rows each, so their second block of 64 rows counts too
    "deepep_ll_signalled_hot": Scenario(tokens=(48, 40), modes=("low_latency",), deepep_mode="low_latency",
                                        runner="deep_gemm", signal=True, hot_rank=1, ll_capacity=64, **LL),
    "deepep_auto_switch": Scenario(tokens=(4, 5), modes=("normal", "low_latency", "normal", "low_latency"),
                                   deepep_mode="auto", low_latency_fp8=False, **LL),
}
SCENARIOS_4 = {
    "uneven": Scenario("torch", (3, 17, 8, 1)),
    "idle_ranks": Scenario("torch", (0, 9, 0, 4)),
    "hot_rank1": Scenario("torch", (6, 5, 7, 3), hot_rank=1),
    "masked_tbo": Scenario("torch", (5, 2, 9, 6), layout="masked", tbo=True),
}


def _spawn(scenarios: dict[str, Scenario], world: int) -> dict[str, list[dict]]:
    with tempfile.TemporaryDirectory() as tmp:
        here = os.path.dirname(os.path.abspath(__file__))
        # fork: the ranks start in well under a second instead of each importing torch again
        # (~4 s apiece on 2 cores); workers set 1 intra-op thread first, as DataLoader workers do.
        method = "fork" if "fork" in mp.get_all_start_methods() else "spawn"
        mp.start_processes(worker, args=(world, os.path.join(tmp, "store"), tmp, scenarios, here),
                           nprocs=world, join=True, start_method=method)
        return {name: [torch.load(os.path.join(tmp, f"{name}.{r}.pt")) for r in range(world)]
                for name in scenarios}


@pytest.fixture(scope="module")
def results_2() -> dict[str, list[dict]]:
    return _spawn(SCENARIOS_2, 2)


@pytest.fixture(scope="module")
def results_4() -> dict[str, list[dict]]:
    return _spawn(SCENARIOS_4, 4)


def _reference(s: Scenario, step: int) -> list[torch.Tensor]:
    """Everything on one rank: all ranks' tokens through `none` + the full expert set."""
    w13, w2 = make_weights(s.num_experts, s.hidden, s.inter)
    if s.runner == "deep_gemm":  # FP8 weights: compare against what they hold, not the originals
        w13, w2 = (dequantize_per_block(*quantize_per_block(t)) for t in (w13, w2))
    parts = [scenario_inputs(s, r, step) for r in range(s.world)]
    x, ids, w = (torch.cat([p[i] for p in parts]) for i in range(3))
    d = NoneDispatcher(s.num_experts)
    d.dispatch_a(x, ids, w)
    out = d.dispatch_b()
    d.combine_a(TorchExpertRunner(w13, w2)(out), out)
    return list(d.combine_b().split(list(s.tokens)))


def _check(name: str, s: Scenario, results: list[dict]) -> None:
    fp8 = s.backend == "deepep" and (s.normal_fp8 or (s.low_latency_fp8 and "low_latency" in s.modes))
    for step in range(len(s.modes)):
        ref = _reference(s, step)
        for r in range(s.world):
            got = results[r]["outputs"][step]
            assert got.shape == ref[r].shape and got.dtype == torch.float32, name
            if s.tokens[r] == 0:
                continue
            if s.backend == "torch":
                torch.testing.assert_close(got, ref[r], atol=1e-5, rtol=1e-5, msg=name)
            else:  # DeepEP moves BF16 (or FP8) payloads
                assert rel_err(got, ref[r]) < (0.06 if fp8 or s.runner == "deep_gemm" else 0.015), name


@pytest.mark.parametrize("name", list(SCENARIOS_2))
def test_two_ranks_match_single_rank(results_2: dict, name: str) -> None:
    _check(name, SCENARIOS_2[name], results_2[name])


@pytest.mark.parametrize("name", list(SCENARIOS_4))
def test_four_ranks_match_single_rank(results_4: dict, name: str) -> None:
    _check(name, SCENARIOS_4[name], results_4[name])


def test_torch_backend_counts_bytes_sent_to_other_ranks(results_2: dict, results_4: dict) -> None:
    for results, s in ((results_2["hot_rank1"], SCENARIOS_2["hot_rank1"]),
                       (results_4["hot_rank1"], SCENARIOS_4["hot_rank1"])):
        # Rank 0 owns none of the hot experts: it sends each token once (hidden + k ids + k
        # weights, float32) plus its W counts' remote part, and gets no rows to send back.
        t0, w = s.tokens[0], s.world
        assert results[0]["bytes_sent"] == t0 * (s.hidden + 2 * s.topk) * 4 + 8 * (w - 1)
    assert results_2["all_idle"][0]["bytes_sent"] == 8  # only the counts


def test_deepep_auto_mode_cleans_low_latency_buffer_after_normal_kernels(results_2: dict) -> None:
    calls = results_2["deepep_auto_switch"][0]["calls"]
    # every switch normal -> low_latency cleans first; low_latency -> normal needs nothing
    assert calls == ["get_dispatch_layout", "dispatch", "combine", "clean_low_latency_buffer",
                     "low_latency_dispatch", "low_latency_combine",
                     "get_dispatch_layout", "dispatch", "combine", "clean_low_latency_buffer",
                     "low_latency_dispatch", "low_latency_combine"]


def test_signalled_combine_waits_on_the_down_gemm(results_2: dict) -> None:
    """SBO's finest mode: the combine took the down GEMM's tile counters (checked block by block
    by the stand-in) and the result still equals one rank's (`_check` above)."""
    for name in ("deepep_ll_signalled_combine", "deepep_ll_signalled_hot"):
        for r in results_2[name]:
            assert r["signalled"]
            assert "low_latency_combine[signal]" in r["calls"]
    plain = results_2["deepep_ll_fp8_deep_gemm"][0]["calls"]
    assert "low_latency_combine[signal]" not in plain
