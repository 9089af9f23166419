"""The two swappable pieces of a MoE layer: the dispatcher (all-to-all) and the expert runner.

Expert placement: with `ep_size` ranks and E routed experts, rank r owns the contiguous global
experts [r * E/ep, (r+1) * E/ep). Expert ids handed to a dispatcher are global; the layouts it
returns index local experts 0..E/ep-1.

A layer's MoE step is

    dispatcher.dispatch_a(x, topk_ids, topk_weights)   # launch: send tokens to their experts' ranks
    ...                                                  # free slot: shared experts, other micro-batch
    d = dispatcher.dispatch_b()                          # wait: tokens for this rank's experts
    y = runner(d)                                        # unweighted expert outputs, same layout as d
    dispatcher.combine_a(y, d)                           # launch: send outputs back (weighting inside)
    ...                                                  # free slot
    out = dispatcher.combine_b()                         # wait: [T, hidden] = sum_k w_k * expert_k(x)

Each half is called exactly once per step, in this order; a dispatcher instance holds the state of
one step between its halves, so two micro-batches (TBO) use two instances.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Literal

import torch


@dataclass
class DispatchOutput:
    """Tokens delivered to this rank's local experts.

    layout "contiguous": `hidden_states` is [N, hidden], rows grouped by local expert in order,
      `tokens_per_expert[e]` rows for expert e (an int64 tensor [E_local]; on the host, or on the
      device where the dispatcher had no need to copy it: runners copy it if they need it).
    layout "masked": `hidden_states` is [E_local, capacity, hidden]; only the first
      `tokens_per_expert[e]` rows of expert e are valid (DeepEP low-latency / DeepGEMM masked).
    `hidden_scales` is set when the payload travelled in FP8: per-token 1x128 block scales,
      [N, hidden/128] or [E_local, capacity, hidden/128].
    `handle` is the backend's own state for the combine.
    """

    hidden_states: torch.Tensor
    tokens_per_expert: torch.Tensor
    layout: Literal["contiguous", "masked"] = "contiguous"
    hidden_scales: torch.Tensor | None = None
    handle: Any = None


@dataclass
class CombineSignal:
    """SBO's finest mode: the combine starts sending a block of an expert's rows as soon as the down
    GEMM has finished it, instead of after the whole GEMM.

    `signal` int32 [E_local * ceil(m_max / 64)]: the GEMM adds 1 per finished (block_m rows x
    block_n columns) tile at `e * ceil(m_max / block_m) + block`; the combine waits for
    `threshold` (the number of column tiles) there. `ready` is a CUDA event recorded on the compute
    stream before the GEMM was queued: the combine, on its own stream, starts after it, so both run
    at once. `num_sms`: SMs the combine's sends may use.
    """

    signal: torch.Tensor
    block_m: int
    threshold: int
    num_sms: int
    ready: Any = None


class Dispatcher(ABC):
    """All-to-all of tokens to experts and back. See the module docstring for the call order."""

    @abstractmethod
    def dispatch_a(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        """Launch the dispatch of [T, hidden] tokens routed to global experts `topk_ids` [T, k]."""

    @abstractmethod
    def dispatch_b(self) -> DispatchOutput:
        """Wait for the dispatch; return the tokens for this rank's local experts."""

    @abstractmethod
    def combine_a(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput,
                  signal: CombineSignal | None = None) -> None:
        """Launch sending the expert outputs (same layout as `dispatch_output`) back to their tokens.
        With `signal` (only where `accepts_combine_signal` says so) the outputs are still being
        written by the down GEMM, and the combine sends each block once it is signalled done."""

    def accepts_combine_signal(self, dispatch_output: DispatchOutput) -> bool:
        """Whether `combine_a` of this step can take a `CombineSignal` (DeepEP LL on a build with
        the signalled combine)."""
        return False

    @abstractmethod
    def combine_b(self) -> torch.Tensor:
        """Wait for the combine; return [T, hidden]: the topk-weighted sum of expert outputs."""


class ExpertRunner(ABC):
    """Runs this rank's routed experts (SwiGLU MLPs) over a `DispatchOutput`."""

    @abstractmethod
    def __call__(self, d: DispatchOutput) -> torch.Tensor:
        """Return unweighted expert outputs in `d`'s layout (rows beyond the counts are don't-care)."""

    def signals_down_gemm(self, d: DispatchOutput) -> bool:
        """Whether `up` / `down_signalled` can run `d` (a masked layout, a GEMM that signals)."""
        return False

    def up(self, d: DispatchOutput) -> Any:
        """The gate/up GEMM and the activation: the input of `down_signalled`."""
        raise TypeError(f"{type(self).__name__} has no signalled down GEMM")

    def down_signalled(self, d: DispatchOutput, act: Any, signal: torch.Tensor,
                       num_sms: int | None = None) -> tuple[torch.Tensor, int, int]:
        """Queue the down GEMM writing into a fresh output and counting finished tiles in `signal`
        (on at most `num_sms` SMs); return (output, block_m, threshold) at once."""
        raise TypeError(f"{type(self).__name__} has no signalled down GEMM")
