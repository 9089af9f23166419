"""FP8 (e4m3) block quantization in the layouts DeepEP and DeepGEMM use on Hopper.

- activations: per token, 1x128 blocks along hidden: `x[..., K]` -> fp8 `[..., K]` + float32 scales
  `[..., ceil(K/128)]` (DeepEP's FP8 dispatch payload and DeepGEMM's LHS).
- weights: 128x128 blocks: `w[..., N, K]` -> fp8 `[..., N, K]` + float32 scales
  `[..., ceil(N/128), ceil(K/128)]` (DeepGEMM's RHS, DeepSeek-V3 checkpoints' `weight_scale_inv`).

`x ~= q.float() * scale` per block. Pure torch, so the same code runs on CPU (tests) and GPU.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
BLOCK = 128
# Floor on the amax so an all-zero block gets a finite scale (and quantizes to exact zeros).
_EPS = 1e-10


def _ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


def quantize_per_token(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize along the last dim in 1 x `block` groups: returns (fp8 same shape, fp32 scales)."""
    k = x.shape[-1]
    nb = _ceil_div(k, block)
    pad = nb * block - k
    xf = x.float()
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    xb = xf.reshape(*x.shape[:-1], nb, block)
    scale = xb.abs().amax(dim=-1).clamp_min(_EPS) / FP8_MAX
    q = (xb / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*x.shape[:-1], nb * block)[..., :k]
    return q.contiguous(), scale


def dequantize_per_token(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Inverse of `quantize_per_token` (float32 out). `scale` may be non-contiguous (MN-major)."""
    k = q.shape[-1]
    s = scale.float().repeat_interleave(block, dim=-1)[..., :k]
    return q.float() * s


def quantize_per_block(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize the last two dims in `block` x `block` tiles: (fp8 same shape, fp32 [.., N/b, K/b])."""
    n, k = w.shape[-2:]
    nbn, nbk = _ceil_div(n, block), _ceil_div(k, block)
    wf = w.float()
    wf = torch.nn.functional.pad(wf, (0, nbk * block - k, 0, nbn * block - n))
    wb = wf.reshape(*w.shape[:-2], nbn, block, nbk, block)
    scale = wb.abs().amax(dim=(-3, -1)).clamp_min(_EPS) / FP8_MAX  # [..., nbn, nbk]
    q = (wb / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*w.shape[:-2], nbn * block, nbk * block)[..., :n, :k]
    return q.contiguous(), scale


def dequantize_per_block(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """Inverse of `quantize_per_block` (float32 out)."""
    n, k = q.shape[-2:]
    s = scale.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return q.float() * s[..., :n, :k]
