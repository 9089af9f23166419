"""Expert runners: this rank's routed SwiGLU experts over a `DispatchOutput`.

Weights (local experts only): `w13` [E_local, 2*I, hidden] (gate rows, then up rows), `w2`
[E_local, hidden, I]; expert e computes `(silu(x @ w13[e,:I].T) * (x @ w13[e,I:].T)) @ w2[e].T`.
Either may be FP8 with 128x128 block scales (`w13_scale` [E, 2I/128, hidden/128], `w2_scale`
[E, hidden/128, I/128]), as DeepSeek-V3 checkpoints ship them.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from engine.moe.base import DispatchOutput, ExpertRunner
from engine.moe.fp8 import (
    FP8_DTYPE,
    dequantize_per_block,
    dequantize_per_token,
    quantize_per_block,
    quantize_per_token,
)

logger = logging.getLogger(__name__)


def _silu_mul(h: torch.Tensor) -> torch.Tensor:
    i = h.shape[-1] // 2
    return F.silu(h[..., :i]) * h[..., i:]


_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


def _grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `torch._grouped_mm` (a private op: present in recent torch, on CPU for float32 and
    bfloat16, on CUDA for bfloat16 on Hopper+) runs here and matches per-expert matmuls; probed
    once per device type and dtype, with the per-expert loop as the fallback."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_OK:
        ok = False
        fn = getattr(torch, "_grouped_mm", None)
        if fn is not None:
            try:
                g = torch.Generator().manual_seed(0)
                x = torch.randn(24, 64, generator=g).to(device, dtype)
                w = torch.randn(3, 32, 64, generator=g).to(device, dtype)
                counts = torch.tensor([8, 0, 16], device=device)
                got = fn(x, w.transpose(1, 2), offs=torch.cumsum(counts, 0).to(torch.int32))
                ref = torch.cat([x[:8] @ w[0].T, x[8:] @ w[2].T])
                tol = 1e-5 if dtype == torch.float32 else 2e-2  # float32 must stay float32-exact
                ok = bool(torch.allclose(got.float(), ref.float(), rtol=tol, atol=tol))
            except Exception as e:  # any failure of a private op means: do not use it
                logger.info("torch._grouped_mm unusable on %s/%s (%s); per-expert matmuls", device.type, dtype, e)
        _GROUPED_MM_OK[key] = ok
    return _GROUPED_MM_OK[key]


class TorchExpertRunner(ExpertRunner):
    """Plain torch matmuls; the reference runner and the CPU path.

    contiguous: two grouped GEMMs (`torch._grouped_mm`) where this torch has them, else one pair
    of GEMMs per local expert that received rows (experts with none cost nothing). masked: two `bmm`s over [E, cap, hidden], a fixed-shape computation (CUDA-graph
    friendly); rows past the counts are computed and left as don't-care.
    FP8 weights are dequantized once here; FP8 activations (FP8 dispatch) with their scales.
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
                 w2_scale: torch.Tensor | None = None, compute_dtype: torch.dtype | None = None) -> None:
        if compute_dtype is None:
            compute_dtype = torch.bfloat16 if w13.dtype == FP8_DTYPE else w13.dtype
        self.w13 = self._weight(w13, w13_scale, compute_dtype)
        self.w2 = self._weight(w2, w2_scale, compute_dtype)
        self.dtype = compute_dtype

    @staticmethod
    def _weight(w: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        if w.dtype == FP8_DTYPE:
            if scale is None:
                raise ValueError("FP8 expert weights need their 128x128 block scales")
            return dequantize_per_block(w, scale).to(dtype)
        return w.to(dtype)

    def _input(self, d: DispatchOutput) -> torch.Tensor:
        x = d.hidden_states
        if x.dtype == FP8_DTYPE:
            if d.hidden_scales is None:
                raise ValueError("FP8 dispatch output without hidden_scales")
            return dequantize_per_token(x, d.hidden_scales).to(self.dtype)
        return x.to(self.dtype)

    def __call__(self, d: DispatchOutput) -> torch.Tensor:
        x = self._input(d)
        if d.layout == "masked":
            h = torch.bmm(x, self.w13.transpose(1, 2))
            return torch.bmm(_silu_mul(h), self.w2.transpose(1, 2))
        if _grouped_mm_works(x.device, self.dtype):
            # one grouped GEMM per weight over all experts: no per-expert Python, and the group
            # offsets stay on the device (no host copy of the counts)
            offs = torch.cumsum(d.tokens_per_expert.to(x.device), 0).to(torch.int32)
            try:
                h = torch._grouped_mm(x, self.w13.transpose(1, 2), offs=offs)
                return torch._grouped_mm(_silu_mul(h), self.w2.transpose(1, 2), offs=offs)
            except Exception as e:  # a shape the probe did not cover: per-expert from now on
                logger.warning("torch._grouped_mm failed on %s (%s); per-expert matmuls from now on",
                               tuple(x.shape), e)
                _GROUPED_MM_OK[(x.device.type, self.dtype)] = False
        out = torch.empty(x.shape[0], self.w2.shape[1], dtype=self.dtype, device=x.device)
        start = 0
        for e, n in enumerate(d.tokens_per_expert.tolist()):
            if n:
                xe = x[start:start + n]
                out[start:start + n] = _silu_mul(xe @ self.w13[e].T) @ self.w2[e].T
            start += n
        return out


def _first_attr(mod: Any, names: tuple[str, ...]) -> tuple[str, Callable[..., Any]]:
    for name in names:
        fn = getattr(mod, name, None)
        if fn is not None:
            return name, fn
    raise ImportError(f"deep_gemm has none of {names}")


def _accepts(fn: Callable[..., Any], *names: str) -> bool:
    """Whether `fn` takes these keyword arguments: from its signature, or for a compiled function
    without one from the signature line pybind11 writes at the top of its docstring."""
    try:
        params = inspect.signature(fn).parameters
        if not any(p.kind == p.VAR_KEYWORD for p in params.values()):
            return all(n in params for n in names)
    except (TypeError, ValueError):
        pass
    head = (getattr(fn, "__doc__", None) or "").split("\n", 1)[0]
    return all(f"{n}:" in head or f"{n}=" in head for n in names)


@contextlib.contextmanager
def _deep_gemm_num_sms(num_sms: int | None) -> Iterator[None]:
    """DeepGEMM kernels launched inside use at most `num_sms` SMs (a global setting, restored)."""
    import deep_gemm

    if num_sms is None or not hasattr(deep_gemm, "set_num_sms"):
        yield
        return
    before = deep_gemm.get_num_sms()
    deep_gemm.set_num_sms(num_sms)
    try:
        yield
    finally:
        deep_gemm.set_num_sms(before)


class DeepGemmExpertRunner(ExpertRunner):
    """DeepGEMM grouped FP8 GEMMs (Hopper/Blackwell): contiguous for normal dispatch, masked for LL.

    Activations are quantized per token in 1x128 blocks (or arrive so from an FP8 dispatch), the
    weights are FP8 with 128x128 block scales (quantized here if given in BF16). Scales are passed
    as float32 in the natural layout; DeepGEMM converts them to its TMA-aligned MN-major (SM90) or
    packed UE8M0 (SM100) layout itself. Outputs are BF16.
    Both the current names (`m_grouped_fp8_gemm_nt_*`) and the pre-2025-07 ones
    (`m_grouped_gemm_fp8_fp8_bf16_nt_*`) are supported; which one is used is logged once.
    """

    def __init__(self, w13: torch.Tensor, w2: torch.Tensor, *, w13_scale: torch.Tensor | None = None,
                 w2_scale: torch.Tensor | None = None) -> None:
        import deep_gemm  # lazy: GPU-only library

        self.w13 = self._weight(w13, w13_scale)
        self.w2 = self._weight(w2, w2_scale)
        name_c, self._gemm_contiguous = _first_attr(
            deep_gemm, ("m_grouped_fp8_gemm_nt_contiguous", "m_grouped_gemm_fp8_fp8_bf16_nt_contiguous"))
        name_m, self._gemm_masked = _first_attr(
            deep_gemm, ("m_grouped_fp8_gemm_nt_masked", "fp8_m_grouped_gemm_nt_masked",
                        "m_grouped_gemm_fp8_fp8_bf16_nt_masked"))
        try:
            _, align_fn = _first_attr(deep_gemm, ("get_mk_alignment_for_contiguous_layout",
                                                 "get_m_alignment_for_contiguous_layout"))
            self.alignment = int(align_fn())
        except ImportError:
            self.alignment = 128  # the documented legacy value
        # SGLang's DeepGEMM fork: the masked GEMM can count finished tiles into a signal tensor
        self.masked_signal = _accepts(self._gemm_masked, "enable_overlap", "signal")
        logger.info("deep_gemm runner: %s / %s, M alignment %d%s", name_c, name_m, self.alignment,
                    ", masked GEMM signals finished tiles" if self.masked_signal else "")

    @staticmethod
    def _weight(w: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if w.dtype == FP8_DTYPE:
            if scale is None:
                raise ValueError("FP8 expert weights need their 128x128 block scales")
            return w.contiguous(), scale.float().contiguous()
        return quantize_per_block(w)

    @staticmethod
    def _fp8_input(d: DispatchOutput) -> tuple[torch.Tensor, torch.Tensor]:
        if d.hidden_states.dtype == FP8_DTYPE:
            assert d.hidden_scales is not None, "FP8 dispatch output without hidden_scales"
            return d.hidden_states, d.hidden_scales
        return quantize_per_token(d.hidden_states)

    def __call__(self, d: DispatchOutput) -> torch.Tensor:
        if d.layout == "masked":
            return self._masked(d)
        return self._contiguous(d)

    def _masked(self, d: DispatchOutput) -> torch.Tensor:
        a, as_, masked_m, expected_m = self.up(d)
        out = torch.empty(*a.shape[:2], self.w2[0].shape[1], dtype=torch.bfloat16, device=a.device)
        self._gemm_masked((a, as_), self.w2, out, masked_m, expected_m)
        return out

    def signals_down_gemm(self, d: DispatchOutput) -> bool:
        return d.layout == "masked" and self.masked_signal

    def up(self, d: DispatchOutput) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Masked gate/up GEMM + SwiGLU, quantized for the down GEMM."""
        x, xs = self._fp8_input(d)
        g, m_max, _ = x.shape
        masked_m = d.tokens_per_expert.to(device=x.device, dtype=torch.int32)
        expected_m = getattr(d, "expected_m", None) or max(1, m_max // 2)
        h = torch.empty(g, m_max, self.w13[0].shape[1], dtype=torch.bfloat16, device=x.device)
        self._gemm_masked((x, xs), self.w13, h, masked_m, expected_m)
        a, as_ = quantize_per_token(_silu_mul(h))
        return a, as_, masked_m, expected_m

    def down_signalled(self, d: DispatchOutput, act: Any, signal: torch.Tensor,
                       num_sms: int | None = None) -> tuple[torch.Tensor, int, int]:
        if not self.signals_down_gemm(d):
            raise ValueError("this deep_gemm build or layout has no signalled masked GEMM")
        a, as_, masked_m, expected_m = act
        out = torch.empty(*a.shape[:2], self.w2[0].shape[1], dtype=torch.bfloat16, device=a.device)
        with _deep_gemm_num_sms(num_sms):
            block_m, threshold = self._gemm_masked((a, as_), self.w2, out, masked_m, expected_m,
                                                   enable_overlap=True, signal=signal)
        return out, int(block_m), int(threshold)

    def _contiguous(self, d: DispatchOutput) -> torch.Tensor:
        x, xs = self._fp8_input(d)
        counts = d.tokens_per_expert.tolist()
        m = x.shape[0]
        n13, n2 = self.w13[0].shape[1], self.w2[0].shape[1]
        if m == 0:
            return torch.empty(0, n2, dtype=torch.bfloat16, device=x.device)
        # DeepGEMM needs every expert's segment to start on an `alignment` boundary; dispatchers
        # built with expert_alignment=alignment already deliver that, others get padded here.
        a = self.alignment
        cnt = torch.tensor(counts, dtype=torch.int64)
        padded = (cnt + a - 1) // a * a
        expert_of_row = torch.repeat_interleave(torch.arange(len(counts)), cnt)
        row_in_expert = torch.arange(m) - (torch.cumsum(cnt, 0) - cnt)[expert_of_row]
        dest = (torch.cumsum(padded, 0) - padded)[expert_of_row] + row_in_expert
        m_pad = int(padded.sum())
        layout = torch.full((m_pad,), -1, dtype=torch.int32)  # -1: padding row, DeepGEMM skips it
        layout[dest] = expert_of_row.int()
        layout = layout.to(x.device)
        index = None if m_pad == m else dest.to(x.device)
        if index is not None:
            xp = torch.zeros(m_pad, x.shape[1], dtype=torch.uint8, device=x.device)
            xp[index] = x.view(torch.uint8)
            sp = torch.zeros(m_pad, xs.shape[1], dtype=xs.dtype, device=x.device)
            sp[index] = xs
            x, xs = xp.view(FP8_DTYPE), sp
        h = torch.empty(x.shape[0], n13, dtype=torch.bfloat16, device=x.device)
        self._gemm_contiguous((x, xs), self.w13, h, layout)
        act, act_s = quantize_per_token(_silu_mul(h))
        out = torch.empty(x.shape[0], n2, dtype=torch.bfloat16, device=x.device)
        self._gemm_contiguous((act, act_s), self.w2, out, layout)
        return out if index is None else out.index_select(0, index)
