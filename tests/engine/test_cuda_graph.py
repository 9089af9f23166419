"""Decode CUDA graphs: buckets, padding, the eager check, and the fallback.

The graph mechanics (static buffers, padding a step to its buckets, slicing the output, checking a
new graph against eager, turning graphs off on failure) are device-independent; on CPU a
`ReplayBackend` stands in for `torch.cuda.CUDAGraph`: it fixes the output buffer at capture and
replays by running the captured function again on the static buffers, which is what a graph
replay computes. Whether the decode forward can be captured at all (no host synchronization) is
checked on CPU with the op sequence the CUDA path runs.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.cuda_graph import DecodeGraphRunner, batch_buckets, seq_buckets
from engine.forward_batch import ForwardMode
from engine.model_runner import _graph_blocker


class ReplayBackend:
    def __init__(self, corrupt: bool = False, fail: bool = False) -> None:
        self.captures = 0
        self.corrupt, self.fail = corrupt, fail

    def capture(self, fn):
        if self.fail:
            raise RuntimeError("operation not permitted when stream is capturing")
        self.captures += 1
        out = fn()

        def replay():
            out.copy_(fn())
            if self.corrupt:
                out.add_(1.0)

        return replay, out


def _prompts(n: int) -> list[list[int]]:
    return [[3 + (7 * i + j) % 1900 for j in range(5 + 9 * i)] for i in range(n)]  # 5..176 tokens


def _params(n: int) -> list[SamplingParams]:
    # the longest prompts finish first: batch and KV length shrink through several buckets
    return [SamplingParams(max_tokens=2 + 3 * (n - 1 - i), ignore_eos=True, logprobs=True) for i in range(n)]


def _attach(llm: LLM, backend: ReplayBackend, max_bs: int = 32) -> DecodeGraphRunner:
    runner = llm.engine.runner
    eager = runner.model.hidden_states
    runner.graphs = DecodeGraphRunner(lambda fb: eager(fb), max_bs=max_bs, max_seq=llm.engine.max_model_len + 1,
                                      device=runner.device, backend=backend)
    return runner.graphs


def test_buckets():
    assert batch_buckets(256) == [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 160, 192, 224, 256]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(512)[-3:] == [384, 448, 512]
    assert seq_buckets(1025) == [64, 128, 256, 512, 1024, 2048]
    assert seq_buckets(100) == [64, 128]
    assert seq_buckets(10**6)[-1] == 16384  # longer KV runs eager


def test_graph_replay_matches_eager_on_real_decode_steps():
    """Every decode step of a mixed workload, replayed through its padded graph, gives the eager
    hidden states of its real rows; padding rows write only the padding page."""
    llm = LLM(model="tiny-dsv3", enable_overlap_schedule=False, kv_cache_tokens=8192, max_running_requests=24)
    try:
        runner = llm.engine.runner
        eager = runner.model.hidden_states
        backend = ReplayBackend()
        graphs = DecodeGraphRunner(lambda fb: eager(fb), max_bs=24, max_seq=llm.engine.max_model_len + 1,
                                   device=runner.device, backend=backend)
        diffs, keys = [], set()

        def checked(fb, stats=None):
            ref = eager(fb, stats)
            if fb.forward_mode == ForwardMode.DECODE:
                keys.add(graphs.buckets_for(fb))
                got = graphs.run(fb)
                diffs.append(float((got - ref).abs().max()))
            return ref

        runner.model.hidden_states = checked
        llm.generate(prompt_token_ids=_prompts(20), sampling_params=_params(20))
        assert graphs.enabled and len(diffs) == graphs.replays > 20
        assert len(keys) >= 5 and {k[1] for k in keys} >= {64, 128, 256}  # batch and KV buckets
        assert backend.captures == len(keys)
        assert max(diffs) < 1e-4
    finally:
        llm.shutdown()


def test_outputs_with_graphs_equal_eager():
    outs = {}
    for use_graphs in (False, True):
        llm = LLM(model="tiny-dsv3", enable_overlap_schedule=True, forward_executor="thread",
                  kv_cache_tokens=8192, max_running_requests=24)
        try:
            graphs = _attach(llm, ReplayBackend()) if use_graphs else None
            outs[use_graphs] = llm.generate(prompt_token_ids=_prompts(20), sampling_params=_params(20))
            if graphs is not None:
                assert graphs.enabled and graphs.replays > 20
        finally:
            llm.shutdown()
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)


@pytest.mark.parametrize("backend", [ReplayBackend(fail=True), ReplayBackend(corrupt=True)], ids=["capture-fails", "graph-differs"])
def test_a_bad_graph_turns_graphs_off_and_eager_serves(backend, caplog):
    llm = LLM(model="tiny-dsv3", enable_overlap_schedule=False, kv_cache_tokens=8192)
    try:
        ref = llm.generate(prompt_token_ids=_prompts(4), sampling_params=_params(4))
        graphs = _attach(llm, backend)
        with caplog.at_level("WARNING", logger="engine.cuda_graph"):
            outs = llm.generate(prompt_token_ids=_prompts(4), sampling_params=_params(4))
        assert not graphs.enabled and graphs.replays == 0
        assert "CUDA graphs off" in caplog.text
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    finally:
        llm.shutdown()


class _HostSyncs(TorchDispatchMode):
    SYNCS = {torch.ops.aten.item.default, torch.ops.aten._local_scalar_dense.default,
             torch.ops.aten.nonzero.default, torch.ops.aten.is_nonzero.default}

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.SYNCS:
            self.found.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("as_on_cuda", [True, False])
def test_decode_forward_has_no_host_sync_as_on_cuda(as_on_cuda, monkeypatch):
    """A graph cannot contain a device-to-host read. On CUDA the one-rank dispatcher trusts the
    router's expert ids (`all_valid`), and the decode forward then reads nothing back; on CPU it
    counts them on the host (cheap there), which this detector must see."""
    import engine.moe.none as none_mod

    if as_on_cuda:
        permute = none_mod.permute
        monkeypatch.setattr(none_mod, "permute", lambda *a, **k: permute(*a, **{**k, "all_valid": True}))
    llm = LLM(model="tiny-dsv3", enable_overlap_schedule=False, kv_cache_tokens=8192)
    try:
        model = llm.engine.runner.model
        eager, found = model.hidden_states, []

        def watched(fb, stats=None):
            if fb.forward_mode != ForwardMode.DECODE:
                return eager(fb, stats)
            with _HostSyncs() as mode:
                out = eager(fb, stats)
            found.extend(mode.found)
            return out

        model.hidden_states = watched
        llm.generate(prompt_token_ids=_prompts(3), sampling_params=SamplingParams(max_tokens=4, ignore_eos=True))
        assert (found == []) if as_on_cuda else (len(found) > 0)
    finally:
        llm.shutdown()


def test_where_graphs_cannot_run():
    assert _graph_blocker(EngineConfig(), "none", "torch") is None
    assert "all-to-all" in _graph_blocker(EngineConfig(ep_size=2), "torch", "torch")
    assert "TBO" in _graph_blocker(EngineConfig(enable_two_batch_overlap=True), "none", "torch")
    assert "host" in _graph_blocker(EngineConfig(), "none", "deep_gemm")
    assert EngineConfig().cuda_graph_max_bs == 256 and EngineConfig(cuda_graph_max_bs=0).cuda_graph_max_bs == 0


def test_steps_past_the_key_budget_run_eager():
    """A graph pads rows and KV columns to its buckets in one pass; past `max_keys` the eager
    split-KV attention runs instead."""
    import torch

    from engine.forward_batch import AttentionMetadata, ForwardBatch

    runner = DecodeGraphRunner(lambda fb: fb.input_ids.float(), max_bs=64, max_seq=4096, device=torch.device("cpu"),
                               backend=ReplayBackend(), max_keys=32 * 1024)

    def step(B: int, S: int) -> ForwardBatch:
        z = torch.zeros(B, dtype=torch.int64)
        md = AttentionMetadata(torch.zeros(B, S, dtype=torch.int64), torch.ones(B, S, dtype=torch.bool))
        return ForwardBatch(ForwardMode.DECODE, z, z, z, B, md, z, [True] * B, None, z)

    assert runner.buckets_for(step(30, 1000)) == (32, 1024)  # 32 x 1024 keys: at the budget
    assert runner.buckets_for(step(33, 1000)) is None  # 48 x 1024
    assert runner.buckets_for(step(8, 3000)) == (8, 3072)
