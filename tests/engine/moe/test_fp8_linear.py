"""`Fp8Linear`: FP8 weights with 128x128 block scales, run by DeepGEMM's dense GEMM (the CPU
stand-in here) or dequantized per call; which layers a checkpoint's FP8 weights convert."""

from __future__ import annotations

import fake_deep_gemm
import torch
import torch.nn.functional as F
from torch import nn

from engine.layers.fp8_linear import Fp8Linear, convert_linears
from engine.moe.fp8 import dequantize_per_block, quantize_per_block


def _layer(n: int = 200, k: int = 384, seed: int = 0) -> tuple[Fp8Linear, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    q, s = quantize_per_block(w)
    layer = Fp8Linear(k, n)
    layer.weight.data.copy_(q)
    layer.weight_scale_inv.data.copy_(s)
    return layer, dequantize_per_block(q, s)


def test_without_a_gemm_equals_the_dequantized_weight():
    layer, w = _layer()
    x = torch.randn(3, 5, 384)
    assert torch.equal(layer(x), F.linear(x, w))
    assert layer(torch.randn(0, 384)).shape == (0, 200)


def test_dense_gemm_path_quantizes_activations_per_token():
    layer, w = _layer()
    layer.gemm = fake_deep_gemm.fp8_gemm_nt
    x = torch.randn(7, 384, dtype=torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == (7, 200)
    ref = F.linear(x.float(), w)
    # e4m3 activations: a few percent per element, far below the output's scale
    assert (got.float() - ref).abs().max() < 0.05 * ref.abs().max()
    assert layer(torch.randn(0, 384, dtype=torch.bfloat16)).shape == (0, 200)


def test_a_failing_gemm_falls_back_to_dequantizing(caplog):
    layer, w = _layer()

    def broken(*args):
        raise RuntimeError("unsupported N")

    layer.gemm = broken
    x = torch.randn(4, 384)
    assert torch.equal(layer(x), F.linear(x, w))
    assert layer.gemm is None and "dequantizes" in caplog.text


def test_convert_linears_follows_the_checkpoint_and_keeps_absorbed_and_biased_layers():
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_a_proj = nn.Linear(256, 128, bias=False)
            self.kv_b_proj = nn.Linear(128, 256, bias=False)
            self.o_proj = nn.Linear(256, 256, bias=True)
            self.up_proj = nn.Linear(256, 512, bias=False)

    with torch.device("meta"):
        m = nn.Module()
        m.attn = Attn()
        done = convert_linears(m, {"attn.q_a_proj.weight", "attn.kv_b_proj.weight", "attn.o_proj.weight"})
    assert done == ["attn.q_a_proj"]
    assert isinstance(m.attn.q_a_proj, Fp8Linear) and m.attn.q_a_proj.weight.dtype == torch.float8_e4m3fn
    assert m.attn.q_a_proj.weight_scale_inv.shape == (1, 2)
    assert type(m.attn.kv_b_proj) is nn.Linear  # absorbed into attention: dequantized on load
    assert type(m.attn.o_proj) is nn.Linear  # a bias: not an FP8 GEMM here
    assert type(m.attn.up_proj) is nn.Linear  # not FP8 in the checkpoint
