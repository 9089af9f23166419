"""A CPU stand-in for `deep_gemm`'s grouped FP8 GEMMs, holding callers to the documented contract.

`make_module(legacy=False)` builds a module object: the current names
(`m_grouped_fp8_gemm_nt_contiguous`, `m_grouped_fp8_gemm_nt_masked`, `fp8_gemm_nt`,
`get_mk_alignment_for_contiguous_layout`) or, with `legacy=True`, only the pre-2025-07 ones
(`m_grouped_gemm_fp8_fp8_bf16_nt_contiguous/_masked`, `gemm_fp8_fp8_bf16_nt`,
`get_m_alignment_for_contiguous_layout`).
Semantics (SM90 recipe (1,128,128)): `a = (fp8 [m, k], fp32 [m, k/128])` per-token scales,
`b = (fp8 [G, n, k], fp32 [G, n/128, k/128])`, `d` BF16 written in place with `a @ b[g].T`;
contiguous: `grouped_layout` int32 [m] (group per row, -1 padding rows left untouched), each
group's rows start on a multiple of the M alignment; masked: `a` [G, m_max, k], only the first
`masked_m[g]` rows of group g are computed, `expected_m` a positive int.
"""

from __future__ import annotations

import types

import torch

ALIGNMENT = 128


def _deq_lhs(a: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, s = a
    assert x.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (*x.shape[:-1], (x.shape[-1] + 127) // 128), "LHS scales must be per-token 1x128"
    return x.float() * s.repeat_interleave(128, dim=-1)[..., : x.shape[-1]]


def _deq_rhs(b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    w, s = b
    g, n, k = w.shape
    assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert s.shape == (g, (n + 127) // 128, (k + 127) // 128), "RHS scales must be 128x128 blocks"
    full = s.repeat_interleave(128, dim=1).repeat_interleave(128, dim=2)[:, :n, :k]
    return w.float() * full


def m_grouped_fp8_gemm_nt_contiguous(a: tuple, b: tuple, d: torch.Tensor, grouped_layout: torch.Tensor,
                                     *args: object, **kwargs: object) -> None:
    m = a[0].shape[0]
    assert d.dtype == torch.bfloat16 and d.shape == (m, b[0].shape[1])
    assert grouped_layout.dtype == torch.int32 and grouped_layout.shape == (m,)
    if m == 0:
        return
    assert m % ALIGNMENT == 0, "contiguous layout must be padded to the M alignment"
    blocks = grouped_layout.view(-1, ALIGNMENT)
    # Every aligned block belongs to one group (or is padding): segments start on block bounds.
    head = blocks[:, :1]
    assert ((blocks == head) | (blocks == -1)).all(), "a group segment does not start on the alignment"
    x, w = _deq_lhs(a), _deq_rhs(b)
    for g in grouped_layout.unique().tolist():
        if g < 0:
            continue
        rows = (grouped_layout == g).nonzero().flatten()
        d[rows] = (x[rows] @ w[g].T).to(torch.bfloat16)


def m_grouped_fp8_gemm_nt_masked(a: tuple, b: tuple, d: torch.Tensor, masked_m: torch.Tensor,
                                 expected_m: int, *args: object, **kwargs: object) -> None:
    g, m_max, _ = a[0].shape
    assert d.dtype == torch.bfloat16 and d.shape == (g, m_max, b[0].shape[1])
    assert masked_m.dtype == torch.int32 and masked_m.shape == (g,)
    assert isinstance(expected_m, int) and expected_m > 0
    x, w = _deq_lhs(a), _deq_rhs(b)
    for e, n in enumerate(masked_m.tolist()):
        assert n <= m_max
        d[e, :n] = (x[e, :n] @ w[e].T).to(torch.bfloat16)


SBO_BLOCK_M, SBO_BLOCK_N = 64, 128


def m_grouped_fp8_gemm_nt_masked_signal(a: tuple, b: tuple, d: torch.Tensor, masked_m: torch.Tensor,
                                        expected_m: int, recipe: object = None, compiled_dims: str = "nk",
                                        disable_ue8m0_cast: bool = False, max_block_n: int = 256,
                                        enable_overlap: bool = False,
                                        signal: torch.Tensor | None = None) -> tuple[int, int] | None:
    """SGLang's fork (SM90): with `enable_overlap`, each finished (block_m x block_n) tile of
    group g, row block i adds 1 at `signal[g * ceil(m_max / block_m) + i]`; returns
    (block_m, threshold = ceil(n / block_n)), the count a finished row block reaches."""
    m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m)
    if not enable_overlap:
        return None
    assert signal is not None and signal.dtype == torch.int32 and signal.is_contiguous()
    g, m_max, n = d.shape
    blocks = -(-m_max // SBO_BLOCK_M)
    threshold = -(-n // SBO_BLOCK_N)
    assert signal.numel() >= g * blocks
    for e, rows in enumerate(masked_m.tolist()):
        for i in range(-(-rows // SBO_BLOCK_M)):
            signal[e * blocks + i] += threshold  # one per column tile of this row block
    return SBO_BLOCK_M, threshold


def fp8_gemm_nt(a: tuple, b: tuple, d: torch.Tensor, c: torch.Tensor | None = None,
                *args: object, **kwargs: object) -> None:
    """Dense: `a = (fp8 [m, k], fp32 [m, k/128])`, `b = (fp8 [n, k], fp32 [n/128, k/128])`, `d`
    BF16 [m, n] written with `a @ b.T` (+ `c`)."""
    m, n = a[0].shape[0], b[0].shape[0]
    assert a[0].dim() == 2 and b[0].dim() == 2 and a[0].shape[1] == b[0].shape[1]
    assert d.dtype == torch.bfloat16 and d.shape == (m, n)
    out = _deq_lhs(a) @ _deq_rhs((b[0][None], b[1][None]))[0].T
    d.copy_((out if c is None else out + c.float()).to(torch.bfloat16))


def get_mk_alignment_for_contiguous_layout() -> int:
    return ALIGNMENT


def make_module(legacy: bool = False, signal: bool = False) -> types.ModuleType:
    """`signal`: the masked GEMM is the SGLang fork's, which can signal finished tiles."""
    mod = types.ModuleType("deep_gemm")
    num_sms = [132]
    mod.get_num_sms = lambda: num_sms[0]
    mod.set_num_sms = lambda n: num_sms.__setitem__(0, int(n))
    if legacy:
        mod.m_grouped_gemm_fp8_fp8_bf16_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
        mod.m_grouped_gemm_fp8_fp8_bf16_nt_masked = m_grouped_fp8_gemm_nt_masked
        mod.get_m_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout
        mod.gemm_fp8_fp8_bf16_nt = fp8_gemm_nt
    else:
        mod.m_grouped_fp8_gemm_nt_contiguous = m_grouped_fp8_gemm_nt_contiguous
        mod.m_grouped_fp8_gemm_nt_masked = (m_grouped_fp8_gemm_nt_masked_signal if signal
                                            else m_grouped_fp8_gemm_nt_masked)
        mod.get_mk_alignment_for_contiguous_layout = get_mk_alignment_for_contiguous_layout
        mod.fp8_gemm_nt = fp8_gemm_nt
    return mod
