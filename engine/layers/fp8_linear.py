"""Linear layers that keep a DeepSeek-V3 checkpoint's FP8 weights as stored.

The official checkpoint stores every projection as float8_e4m3fn with one float32 scale per
128x128 block (`weight_scale_inv`). Dequantized to bfloat16 on load, a rank's replicated weights
(attention, dense layers, shared experts: ~17B parameters) take ~32 GiB, twice the memory of the
checkpoint; kept FP8 they take half, which at EP16 on 80 GB GPUs is the difference between a KV
pool and none.

`Fp8Linear` runs its GEMM through DeepGEMM's dense FP8 GEMM (`fp8_gemm_nt`, or the pre-2025-07
`gemm_fp8_fp8_bf16_nt`): activations quantized per token in 1x128 blocks, BF16 out. The runner sets
`gemm`; without one, or if the GEMM fails on a shape, the weight is dequantized for each call
(correct, slower, and logged once).

`kv_b_proj` is not converted: attention uses its weight directly (absorbed into the query and the
output), so it is dequantized on load like before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.moe.fp8 import BLOCK, FP8_DTYPE, dequantize_per_block, quantize_per_token

logger = logging.getLogger(__name__)

# modules that stay in the activation dtype even when the checkpoint stores them in FP8
NOT_CONVERTED = ("kv_b_proj",)


class Fp8Linear(nn.Module):
    """y = x W^T with W float8_e4m3fn [out, in] and block scales [ceil(out/128), ceil(in/128)]."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=FP8_DTYPE), requires_grad=False)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(-(-out_features // BLOCK), -(-in_features // BLOCK), dtype=torch.float32), requires_grad=False)
        # DeepGEMM's dense GEMM: gemm((x_fp8, x_scales), (w_fp8, w_scales), out_bf16)
        self.gemm: Callable[..., Any] | None = None

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 128x128 blocks"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)
        if self.gemm is not None and x2.shape[0]:
            out = torch.empty(x2.shape[0], self.out_features, dtype=torch.bfloat16, device=x.device)
            try:
                self.gemm(quantize_per_token(x2), (self.weight, self.weight_scale_inv), out)
                return out.to(x.dtype).view(*x.shape[:-1], self.out_features)
            except Exception:  # noqa: BLE001 - a shape the kernel does not take: dequantize instead
                logger.exception("FP8 GEMM failed for [%d, %d] x [%d, %d]^T; this layer dequantizes "
                                 "its weight per call from now on", *x2.shape, self.out_features, self.in_features)
                self.gemm = None
        w = dequantize_per_block(self.weight, self.weight_scale_inv).to(x.dtype)
        return F.linear(x2, w).view(*x.shape[:-1], self.out_features)


def convert_linears(model: nn.Module, fp8_weights: set[str]) -> list[str]:
    """Replace each bias-free `nn.Linear` whose `<module>.weight` is in `fp8_weights` (checkpoint
    names) with an `Fp8Linear` of its shape, except `NOT_CONVERTED`; returns the converted module
    names. Works on a meta-device model (no storage is touched)."""
    converted = []
    for name, module in list(model.named_modules()):
        if (not isinstance(module, nn.Linear) or module.bias is not None or f"{name}.weight" not in fp8_weights
                or name.rsplit(".", 1)[-1] in NOT_CONVERTED):
            continue
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, Fp8Linear(module.in_features, module.out_features))
        converted.append(name)
    return converted


def dense_fp8_gemm() -> Callable[..., Any] | None:
    """DeepGEMM's dense FP8 GEMM under its current or pre-2025-07 name; None if unavailable."""
    try:
        import deep_gemm
    except ImportError:
        return None
    for name in ("fp8_gemm_nt", "gemm_fp8_fp8_bf16_nt"):
        fn = getattr(deep_gemm, name, None)
        if fn is not None:
            return fn
    return None
