"""CUDA runs of the MoE backends (marked gpu; skipped cleanly without CUDA / the libraries).

Run with `pytest -m gpu tests/engine/moe`. The real-DeepEP test needs >= 2 GPUs (DeepEP has no
single-rank configuration); the others need one.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import tempfile
from collections.abc import Iterator

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from moe_testing import make_inputs, make_weights, moe_step, rel_err

from engine.moe.fp8 import quantize_per_block
from engine.moe.none import NoneDispatcher
from engine.moe.runners import TorchExpertRunner

pytestmark = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@needs_cuda
@pytest.mark.parametrize("layout,alignment", [("contiguous", 1), ("contiguous", 128), ("masked", 1)])
def test_none_and_torch_runner_on_cuda_match_cpu(layout: str, alignment: int) -> None:
    e, h, inter = 8, 256, 128
    w13, w2 = make_weights(e, h, inter)
    (q13, s13), (q2, s2) = quantize_per_block(w13), quantize_per_block(w2)
    x, ids, w = make_inputs(300, h, e, 4, seed=0)
    cpu = moe_step(NoneDispatcher(e, layout=layout, expert_alignment=alignment),
                   TorchExpertRunner(q13, q2, w13_scale=s13, w2_scale=s2, compute_dtype=torch.float32),
                   x, ids, w)
    dev = torch.device("cuda")
    gpu = moe_step(NoneDispatcher(e, layout=layout, expert_alignment=alignment),
                   TorchExpertRunner(q13.to(dev), q2.to(dev), w13_scale=s13.to(dev), w2_scale=s2.to(dev),
                                     compute_dtype=torch.float32),
                   x.to(dev), ids.to(dev), w.to(dev))
    assert gpu.device.type == "cuda"
    assert rel_err(gpu.cpu(), cpu) < 1e-3  # TF32 and reduction order differ


@contextlib.contextmanager
def _nccl_rank(rank: int, world: int, store: str) -> Iterator[torch.device]:
    """This process as rank `rank` of an NCCL group on GPU `rank`."""
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        yield torch.device("cuda", rank)
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()


def _nccl_worker(rank: int, world: int, store: str, backend: str) -> None:
    from engine.moe.factory import make_dispatcher

    with _nccl_rank(rank, world, store) as dev:
        e, h, inter, k = 16, 2048, 256, 4
        w13, w2 = make_weights(e, h, inter)
        el = e // world
        runner = TorchExpertRunner(w13[rank * el:(rank + 1) * el].to(dev), w2[rank * el:(rank + 1) * el].to(dev))
        full = TorchExpertRunner(w13.to(dev), w2.to(dev))
        for mode, tokens in (("normal", (37, 0)), ("low_latency", (0, 11)), ("normal", (5, 64))):
            inputs = [make_inputs(tokens[r % len(tokens)], h, e, k, seed=r) for r in range(world)]
            x, ids, w = (t.to(dev) for t in inputs[rank])
            x = x.bfloat16()
            d = make_dispatcher(backend, num_experts=e, hidden_size=h, ep_group=dist.group.WORLD, rank=rank,
                                world_size=world, deepep_mode="auto", params_dtype=torch.bfloat16,
                                low_latency_fp8=False)
            if backend == "deepep":
                d.set_mode(mode)
            got = moe_step(d, runner, x, ids, w)
            ref = moe_step(NoneDispatcher(e), full, x, ids, w)
            if x.shape[0]:
                assert rel_err(got.float(), ref.float()) < 0.02, (backend, mode, rank)


def _run_nccl(world: int, backend: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_nccl_worker, args=(world, os.path.join(tmp, "store"), backend), nprocs=world, join=True)


@needs_cuda
def test_torch_backend_over_nccl_matches_none() -> None:
    _run_nccl(min(torch.cuda.device_count(), 2), "torch")


@pytest.mark.skipif(torch.cuda.device_count() < 2 or importlib.util.find_spec("deep_ep") is None,
                    reason="needs >= 2 GPUs and deep_ep")
def test_real_deepep_normal_and_low_latency_match_none() -> None:
    _run_nccl(2, "deepep")


def _signalled_combine_supported() -> bool:
    if torch.cuda.device_count() < 2:
        return False
    from engine.sbo import _signal_support

    return _signal_support(torch.device("cuda"), "deepep", "deep_gemm")[0]


def _signalled_worker(rank: int, world: int, store: str) -> None:
    from engine.moe.factory import make_dispatcher, make_expert_runner
    from engine.sbo import combine_overlapping_down_gemm

    with _nccl_rank(rank, world, store) as dev:
        e, h, inter, k = 16, 2048, 512, 4
        w13, w2 = make_weights(e, h, inter)
        el = e // world
        (q13, s13), (q2, s2) = (quantize_per_block(t[rank * el:(rank + 1) * el]) for t in (w13, w2))
        runner = make_expert_runner("deep_gemm", q13.to(dev), q2.to(dev), w13_scale=s13.to(dev), w2_scale=s2.to(dev))
        full = TorchExpertRunner(w13.to(dev), w2.to(dev))
        x, ids, w = (t.to(dev) for t in make_inputs(96, h, e, k, seed=rank))
        x = x.bfloat16()
        d = make_dispatcher("deepep", num_experts=e, hidden_size=h, ep_group=dist.group.WORLD, rank=rank,
                            world_size=world, deepep_mode="low_latency", params_dtype=torch.bfloat16,
                            num_max_dispatch_tokens_per_rank=128)
        d.dispatch_a(x, ids, w)
        out = d.dispatch_b()
        assert d.accepts_combine_signal(out) and runner.signals_down_gemm(out)
        combine_overlapping_down_gemm(d, runner, out, comm_num_sms=3, gemm_num_sms=None)
        got = d.combine_b()
        ref = moe_step(NoneDispatcher(e), full, x, ids, w)
        assert rel_err(got.float(), ref.float()) < 0.06, rank  # FP8 weights and payload


@pytest.mark.skipif(not _signalled_combine_supported(),
                    reason="needs >= 2 SM90 GPUs, DeepEP antgroup-opt and SGLang's DeepGEMM fork")
def test_real_signalled_combine_matches_none() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_signalled_worker, args=(2, os.path.join(tmp, "store")), nprocs=2, join=True)


@pytest.mark.skipif(not torch.cuda.is_available() or importlib.util.find_spec("deep_gemm") is None,
                    reason="needs CUDA and DeepGEMM")
def test_fp8_linear_real_dense_gemm_matches_dequantized() -> None:
    """DeepSeek-V3's o_proj and q_b_proj shapes through the real dense FP8 GEMM."""
    from engine.layers.fp8_linear import Fp8Linear, dense_fp8_gemm

    gemm = dense_fp8_gemm()
    assert gemm is not None
    dev = torch.device("cuda")
    for n, k in ((7168, 16384), (24576, 1536), (576, 7168)):
        w = torch.randn(n, k, device=dev) * 0.02
        q, s = quantize_per_block(w)
        layer = Fp8Linear(k, n).to(dev)
        layer.weight.data.copy_(q)
        layer.weight_scale_inv.data.copy_(s)
        x = torch.randn(37, k, device=dev, dtype=torch.bfloat16)
        ref = layer(x).float()  # no gemm: dequantized weight
        layer.gemm = gemm
        got = layer(x).float()
        assert layer.gemm is not None  # the real kernel ran, no fallback
        assert rel_err(got, ref) < 0.05
