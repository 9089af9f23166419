"""The process forward executor: staging through shared memory, errors, and the child's lifetime."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import fields, is_dataclass

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.forward_batch import AttentionMetadata, ForwardBatch, ForwardMode
from engine.mem.pool import MLATokenPool
from engine.process_executor import _stage, _Staged, _unstage
from engine.tbo import make_children, plan_split


def _decode_batch(b: int, s: int) -> ForwardBatch:
    g = torch.Generator().manual_seed(0)
    return ForwardBatch(
        forward_mode=ForwardMode.DECODE, input_ids=torch.randint(-50, 2000, (b,), generator=g),
        positions=torch.randint(0, s, (b,), generator=g), out_cache_loc=torch.randint(16, 4096, (b,), generator=g),
        batch_size=b, attn=AttentionMetadata(torch.randint(0, 4096, (b, s), generator=g), torch.rand(b, s, generator=g) > 0.3),
        sample_index=torch.arange(b), sample_mask=[True] * b, sampling=None, future_slots=torch.arange(1, b + 1),
        prefix_lens=list(range(b)), extend_lens=[1] * b)


def _tensors(v, prefix=""):
    """Every tensor in a batch (dataclasses and tuples, recursively), by path."""
    if isinstance(v, torch.Tensor):
        return {prefix: v}
    out = {}
    if is_dataclass(v):
        for f in fields(v):
            out.update(_tensors(getattr(v, f.name), f"{prefix}.{f.name}"))
    elif isinstance(v, tuple):
        for i, x in enumerate(v):
            out.update(_tensors(x, f"{prefix}[{i}]"))
    return out


def test_staged_batch_rebuilds_every_tensor_including_tbo_children():
    fb = _decode_batch(8, 24)
    fb.tbo_children = make_children(fb, plan_split(fb, 0.48))
    slot = torch.zeros(1 << 20, dtype=torch.uint8)
    staged = _stage(fb, slot, [0])
    want = _tensors(fb)
    assert len(want) > 10 and not _tensors(staged)  # every tensor went into the slot
    got = _tensors(_unstage(staged, slot))
    assert got.keys() == want.keys()
    for k, t in want.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
        assert got[k].untyped_storage().data_ptr() == slot.untyped_storage().data_ptr()  # a view, not a copy
    assert staged.batch_size == fb.batch_size and staged.prefix_lens == fb.prefix_lens


def test_tensor_too_big_for_the_slot_travels_inline():
    fb = _decode_batch(64, 512)  # kv_indices alone are 256 KiB
    slot = torch.zeros(64 << 10, dtype=torch.uint8)
    staged = _stage(fb, slot, [0])
    assert isinstance(staged.attn.kv_indices, torch.Tensor) and isinstance(staged.input_ids, _Staged)
    rebuilt = _unstage(staged, slot)
    for k, t in _tensors(fb).items():
        assert torch.equal(_tensors(rebuilt)[k], t), k


def test_forward_executor_resolution():
    assert EngineConfig().resolved_forward_executor == "process"  # one CPU rank
    assert EngineConfig(forward_executor="thread").resolved_forward_executor == "thread"
    assert EngineConfig(enable_overlap_schedule=False).resolved_forward_executor == "inline"
    assert EngineConfig(ep_size=2).resolved_forward_executor == "thread"  # MoE groups live in the rank's process
    assert EngineConfig(device="cuda").resolved_forward_executor == "thread"
    # chosen explicitly, a single CUDA rank's forwards may run in a child too (kernel launches off the GIL)
    assert EngineConfig(device="cuda", forward_executor="process").resolved_forward_executor == "process"
    with pytest.raises(ValueError, match="forward_executor"):
        EngineConfig(forward_executor="process", ep_size=2)


def test_the_child_sizes_the_kv_pool_and_the_scheduler_follows():
    """The runner sizes its KV pool once its weights are loaded (on CUDA the default budget is a
    share of the memory then still free); in process mode that happens in the child, and the
    parent's page allocator must be exactly as large as the child's pool."""
    budget = 3 << 20
    llm = LLM(model="tiny-dsv3", kv_cache_memory_bytes=budget)
    try:
        hf = llm.engine.hf_config
        per_token = MLATokenPool.bytes_per_token(hf.num_hidden_layers, hf.kv_lora_rank, hf.qk_rope_head_dim,
                                                 torch.float32)
        pages = llm.engine.executor.num_pages
        assert pages == -(-(budget // per_token) // 16) + 1
        assert llm.engine.scheduler.allocator.capacity == pages - 1  # less the reserved padding page
        assert llm.engine.kv_capacity_tokens == (pages - 1) * 16
    finally:
        llm.shutdown()


def test_failed_step_fails_its_requests_and_the_engine_goes_on():
    llm = LLM(model="tiny-dsv3", kv_cache_tokens=4096)
    try:
        assert llm.engine.runner is None  # the model is in the child
        ex = llm.engine.executor
        bad = _decode_batch(4, 8)
        bad.out_cache_loc = torch.full((4,), 10**9)  # outside the KV pool: the child's forward raises
        with pytest.raises(IndexError):
            ex.wait(ex.launch(bad))
        sp = SamplingParams(max_tokens=8, ignore_eos=True)
        out = llm.generate(prompt_token_ids=[[5, 6, 7]], sampling_params=sp)[0]
        assert len(out.token_ids) == 8 and out.finish_reason == "length"
    finally:
        llm.shutdown()


def test_child_killed_mid_run_fails_requests_instead_of_hanging():
    llm = LLM(model="tiny-dsv3", kv_cache_tokens=4096)
    try:
        proc = llm.engine.executor._proc
        sp = SamplingParams(max_tokens=2000, ignore_eos=True)
        rid_outputs = []
        llm.engine.add_request([5, 6, 7], sp, rid_outputs.append)
        while not rid_outputs:
            time.sleep(0.01)
        proc.kill()
        deadline = time.monotonic() + 30
        while not (rid_outputs and rid_outputs[-1].finished) and time.monotonic() < deadline:
            time.sleep(0.05)
        last = rid_outputs[-1]
        assert last.finished and last.finish_reason == "abort" and "executor process died" in (last.error or "")
        with pytest.raises(RuntimeError):
            llm.engine.check_health()
    finally:
        llm.shutdown()


def test_child_exits_when_its_parent_is_killed(tmp_path):
    script = textwrap.dedent("""
        import sys, time
        from engine import LLM
        llm = LLM(model="tiny-dsv3", kv_cache_tokens=1024)   # no __main__ guard: must still work
        print(llm.engine.executor._proc.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        os.kill(child, 0)  # alive
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            try:  # reap it if it became our zombie; otherwise it belongs to init
                os.waitpid(child, os.WNOHANG)
            except ChildProcessError:
                pass
            time.sleep(0.1)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("executor process outlived its parent")
    finally:
        parent.kill()
