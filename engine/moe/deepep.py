"""`deepep` dispatcher: DeepEP's `deep_ep.Buffer` (V1 API), normal and low-latency modes.

- normal (prefill): `get_dispatch_layout` + `dispatch` deliver one row per token per rank with the
  token's top-k table made local (-1 = expert elsewhere); we regroup those rows per expert into
  the contiguous layout, and for the combine fold the top-k weights in ourselves (DeepEP's normal
  `combine` only sums what each rank sends back).
- low_latency (decode): `low_latency_dispatch` delivers DeepEP's packed per-expert layout, which
  is exactly DeepGEMM's masked layout (`recv_count` = valid rows per expert); the weighted
  reduction happens inside `low_latency_combine`. FP8 payload by default (scales come back too).

Mode: `deepep_mode` "normal" | "low_latency" fixes it; "auto" starts in normal and the model calls
`set_mode("normal")` for extend/prefill steps and `set_mode("low_latency")` for decode steps
before `dispatch_a`. Switching to low-latency after normal kernels cleans the low-latency buffer,
as DeepEP requires.

`deep_ep` is imported lazily: nothing here runs unless this backend is selected.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine.moe.base import CombineSignal, Dispatcher, DispatchOutput
from engine.moe.fp8 import quantize_per_token
from engine.moe.permute import MaskedDispatchOutput, Permutation, permute, unpermute

logger = logging.getLogger(__name__)

Mode = Literal["normal", "low_latency"]


@dataclass
class _SharedBuffer:
    """One `deep_ep.Buffer` per EP group, shared by every dispatcher on it (TBO has two)."""

    buffer: Any
    low_latency_enabled: bool
    num_max_dispatch_tokens_per_rank: int
    hidden: int
    num_experts: int
    last_mode: Mode | None = None


# Keyed by id(group); the entry keeps no reference to the group, the caller's group outlives it.
_BUFFERS: dict[int, _SharedBuffer] = {}


def _deep_ep() -> Any:
    import deep_ep  # lazy: GPU-only library

    return deep_ep


def get_buffer(group: Any, *, hidden: int, params_dtype: torch.dtype, deepep_mode: str,
               num_max_dispatch_tokens_per_rank: int, num_experts: int) -> _SharedBuffer:
    """The group's Buffer, created on first use and sized for the modes `deepep_mode` allows."""
    key = id(group)
    entry = _BUFFERS.get(key)
    want_ll = deepep_mode in ("low_latency", "auto")
    if entry is not None:
        if (want_ll and not entry.low_latency_enabled) or hidden > entry.hidden or (
                want_ll and num_max_dispatch_tokens_per_rank > entry.num_max_dispatch_tokens_per_rank):
            raise ValueError("the group's DeepEP buffer was created for a smaller or normal-only use")
        return entry
    Buffer = _deep_ep().Buffer
    world = group.size()
    # Recipe from DeepEP's docs: the largest size hint over the normal dispatch/combine configs,
    # hidden bytes counted at >= 2 bytes per element (BF16 payload even for FP8 models).
    hidden_bytes = hidden * max(torch.empty((), dtype=params_dtype).element_size(), 2)
    num_nvl = num_rdma = 0
    for cfg in (Buffer.get_dispatch_config(world), Buffer.get_combine_config(world)):
        num_nvl = max(num_nvl, cfg.get_nvl_buffer_size_hint(hidden_bytes, world))
        num_rdma = max(num_rdma, cfg.get_rdma_buffer_size_hint(hidden_bytes, world))
    num_local = num_experts // world
    if want_ll:
        num_rdma = max(num_rdma, Buffer.get_low_latency_rdma_size_hint(
            num_max_dispatch_tokens_per_rank, hidden, world, num_experts))
    # Low-latency mode needs exactly one QP per local expert (DeepEP docs); normal kernels are
    # served by one per SM they run on.
    qps = {"normal": Buffer.num_sms, "low_latency": num_local}.get(deepep_mode, max(Buffer.num_sms, num_local))
    logger.info("DeepEP buffer: %d ranks, nvl %d B, rdma %d B, low_latency=%s, qps/rank %d",
                world, num_nvl, num_rdma, want_ll, qps)
    buf = Buffer(group, num_nvl, num_rdma, low_latency_mode=want_ll, num_qps_per_rank=qps)
    entry = _SharedBuffer(buf, want_ll, num_max_dispatch_tokens_per_rank, hidden, num_experts)
    _BUFFERS[key] = entry
    return entry


def combine_takes_signal(buffer: Any) -> bool:
    """Whether this DeepEP build's `low_latency_combine` takes a down-GEMM completion signal
    (`comp_signal`/`block_m`/`threshold`, the antgroup-opt "LL-SBO" API; main has none)."""
    try:
        params = inspect.signature(type(buffer).low_latency_combine).parameters
    except (TypeError, ValueError):
        return False
    return all(p in params for p in ("overlap", "packed_recv_count", "comp_signal", "block_m", "threshold"))


def clear_buffers() -> None:
    """Drop the cached Buffers (tests; process-group teardown)."""
    _BUFFERS.clear()


class DeepEPDispatcher(Dispatcher):
    """Dispatcher over DeepEP. See the module docstring for modes; options:

    - `expert_alignment`: contiguous segments padded to this (128 for DeepGEMM's contiguous GEMM);
      also passed to DeepEP so its per-expert counts come back padded the same way.
    - `normal_fp8`: quantize the normal-mode payload per token (1x128) before sending; halves the
      bytes, and the runner gets `hidden_scales`.
    - `low_latency_fp8`: `use_fp8` of `low_latency_dispatch` (default True).
    - `num_max_dispatch_tokens_per_rank`: low-latency capacity per rank (<= 511 with DeepEP's
      default QP depth); masked layouts hold `world_size * this` rows per expert.
    - `return_recv_hook`: low-latency halves split at the receive (the hook), taking no SMs while
      other work runs; otherwise `async_finish` events.
    """

    def __init__(self, *, num_experts: int, hidden_size: int, ep_group: Any, rank: int, world_size: int,
                 deepep_mode: str = "auto", params_dtype: torch.dtype = torch.bfloat16,
                 expert_alignment: int = 1, normal_fp8: bool = False, low_latency_fp8: bool = True,
                 num_max_dispatch_tokens_per_rank: int = 128, return_recv_hook: bool = True,
                 async_finish: bool = True) -> None:
        if deepep_mode not in ("auto", "normal", "low_latency"):
            raise ValueError(f"deepep_mode must be auto|normal|low_latency, not {deepep_mode!r}")
        self.num_experts = num_experts
        self.num_local_experts = num_experts // world_size
        self.hidden = hidden_size
        self.rank, self.world_size = rank, world_size
        self.deepep_mode = deepep_mode
        self.expert_alignment = expert_alignment
        self.normal_fp8 = normal_fp8
        self.low_latency_fp8 = low_latency_fp8
        self.num_max_dispatch_tokens_per_rank = num_max_dispatch_tokens_per_rank
        self.return_recv_hook = return_recv_hook
        self.async_finish = async_finish
        self._shared = get_buffer(ep_group, hidden=hidden_size, params_dtype=params_dtype,
                                  deepep_mode=deepep_mode, num_experts=num_experts,
                                  num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank)
        self.mode: Mode = "low_latency" if deepep_mode == "low_latency" else "normal"
        self._s: dict[str, Any] = {}

    @property
    def buffer(self) -> Any:
        return self._shared.buffer

    def set_mode(self, mode: Mode) -> None:
        """Pick the kernels for the next step: "normal" (extend/prefill) or "low_latency" (decode)."""
        if self.deepep_mode != "auto" and mode != self.deepep_mode:
            raise ValueError(f"dispatcher built with deepep_mode={self.deepep_mode!r} cannot run {mode!r}")
        self.mode = mode

    # -- dispatch --------------------------------------------------------------------------
    def dispatch_a(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        deep_ep = _deep_ep()
        topk_idx = topk_ids.to(getattr(deep_ep, "topk_idx_t", torch.int64))
        s: dict[str, Any] = dict(mode=self.mode, dtype=hidden_states.dtype, topk_idx=topk_idx,
                                 topk_weights=topk_weights.float())
        x = hidden_states.to(torch.bfloat16)  # DeepEP moves BF16 (or FP8 + scales)
        if self.mode == "low_latency":
            self._enter_low_latency()
            t = x.shape[0]
            if t > self.num_max_dispatch_tokens_per_rank:
                raise ValueError(f"{t} tokens > num_max_dispatch_tokens_per_rank "
                                 f"{self.num_max_dispatch_tokens_per_rank}")
            recv_x, recv_count, handle, event, hook = self.buffer.low_latency_dispatch(
                x, topk_idx, self.num_max_dispatch_tokens_per_rank, self.num_experts,
                use_fp8=self.low_latency_fp8, async_finish=not self.return_recv_hook,
                return_recv_hook=self.return_recv_hook)
            k = topk_idx.shape[1]
            # DeepGEMM's hint: the mean rows per local expert if every rank sends as many tokens.
            expected_m = max(1, (t * self.world_size * k + self.num_experts) // self.num_experts)
            s.update(recv_x=recv_x, recv_count=recv_count, handle=handle, event=event, hook=hook,
                     expected_m=expected_m)
        else:
            self._shared.last_mode = "normal"
            # Dispatch itself runs in dispatch_b: it blocks the CPU until the receive counts
            # arrive, so issuing it late lets the other micro-batch's kernels get queued first;
            # the captured event orders it after this stream's producers of x.
            payload: Any = quantize_per_token(x) if self.normal_fp8 else x
            s.update(payload=payload,
                     previous_event=deep_ep.Buffer.capture() if self.async_finish else None)
        self._s = s

    def _enter_low_latency(self) -> None:
        sh = self._shared
        if sh.last_mode == "normal":
            # Normal kernels reuse the buffer memory the low-latency kernels expect zeroed.
            sh.buffer.clean_low_latency_buffer(sh.num_max_dispatch_tokens_per_rank, sh.hidden, sh.num_experts)
        sh.last_mode = "low_latency"

    def dispatch_b(self) -> DispatchOutput:
        s = self._s
        assert "topk_idx" in s and "perm" not in s, "dispatch_b without dispatch_a"
        if s["mode"] == "low_latency":
            self._wait(s.pop("hook"), s.pop("event"))
            recv_x = s["recv_x"]
            x, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
            s["perm"] = None
            return MaskedDispatchOutput(x, s["recv_count"], "masked", hidden_scales=scales,
                                        handle=s["handle"], expected_m=s["expected_m"])
        buf = self.buffer
        prev = s.pop("previous_event")
        on_comm = prev is not None
        n_tok_rank, n_tok_rdma, n_tok_expert, in_rank, event = buf.get_dispatch_layout(
            s["topk_idx"], self.num_experts, previous_event=prev, async_finish=self.async_finish,
            allocate_on_comm_stream=on_comm)
        recv_x, recv_topk_idx, recv_topk_weights, _, handle, event = buf.dispatch(
            s.pop("payload"), topk_idx=s["topk_idx"], topk_weights=s["topk_weights"],
            num_tokens_per_rank=n_tok_rank, num_tokens_per_rdma_rank=n_tok_rdma,
            is_token_in_rank=in_rank, num_tokens_per_expert=n_tok_expert,
            expert_alignment=self.expert_alignment,
            previous_event=event if self.async_finish else None, async_finish=self.async_finish,
            allocate_on_comm_stream=on_comm)
        self._wait(None, event)
        x, scales = recv_x if isinstance(recv_x, tuple) else (recv_x, None)
        hidden, hidden_scales, counts, perm = permute(
            x, recv_topk_idx, self.num_local_experts, alignment=self.expert_alignment, scales=scales)
        s.update(handle=handle, perm=perm, recv_topk_weights=recv_topk_weights)
        return DispatchOutput(hidden, counts, "contiguous", hidden_scales=hidden_scales, handle=handle)

    def _wait(self, hook: Any, event: Any) -> None:
        if hook is not None:
            hook()  # low-latency: wait for the receive (posted sends took no SMs meanwhile)
        elif event is not None and self.async_finish:
            event.current_stream_wait()

    # -- combine ---------------------------------------------------------------------------
    def accepts_combine_signal(self, dispatch_output: DispatchOutput) -> bool:
        return (self._s.get("mode") == "low_latency" and dispatch_output.layout == "masked"
                and combine_takes_signal(self.buffer))

    def _comm_stream(self) -> Any:
        if getattr(self, "_comm", None) is None:
            self._comm = torch.cuda.Stream()
        return self._comm

    def combine_a(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput,
                  signal: CombineSignal | None = None) -> None:
        s = self._s
        assert "perm" in s, "combine_a before dispatch_b"
        buf = self.buffer
        if signal is not None:
            if not self.accepts_combine_signal(dispatch_output):
                raise ValueError("this step's combine cannot take a down-GEMM signal")
            # the GEMM is still writing this very tensor: no conversion copy may stand between
            if expert_output.dtype != torch.bfloat16:
                raise ValueError("a signalled combine needs the down GEMM's BF16 output itself")
        y = expert_output.to(torch.bfloat16)
        if s["mode"] == "low_latency":
            kw: dict[str, Any] = {}
            on_comm: Any = contextlib.nullcontext()
            if signal is not None:
                kw = dict(overlap=True, packed_recv_count=s["recv_count"], comp_signal=signal.signal,
                          block_m=signal.block_m, threshold=signal.threshold, num_sms=signal.num_sms)
                if y.is_cuda:  # the combine runs beside the GEMM, on its own stream
                    comm = self._comm_stream()
                    comm.wait_event(signal.ready)
                    y.record_stream(comm)
                    signal.signal.record_stream(comm)
                    on_comm = torch.cuda.stream(comm)
                    s["comm_stream"] = comm
            with on_comm:
                combined, event, hook = buf.low_latency_combine(
                    y, s["topk_idx"], s["topk_weights"], s["handle"],
                    async_finish=not self.return_recv_hook, return_recv_hook=self.return_recv_hook, **kw)
        else:
            perm: Permutation = s["perm"]
            # Normal combine sums rank contributions unweighted: weight per received row here.
            partial = unpermute(y, perm, s["recv_topk_weights"], torch.bfloat16)
            prev = _deep_ep().Buffer.capture() if self.async_finish else None
            combined, _, event = buf.combine(
                partial, s["handle"], previous_event=prev, async_finish=self.async_finish,
                allocate_on_comm_stream=prev is not None)
            hook = None
        s.update(combined=combined, event=event, hook=hook)

    def combine_b(self) -> torch.Tensor:
        s, self._s = self._s, {}
        assert "combined" in s, "combine_b without combine_a"
        if "comm_stream" in s:  # signalled combine: its stream joins the compute stream here
            main = torch.cuda.current_stream()
            main.wait_stream(s["comm_stream"])
            s["combined"].record_stream(main)
        self._wait(s["hook"], s["event"])
        return s["combined"].to(s["dtype"])
