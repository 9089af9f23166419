"""`none` dispatcher: one rank owns every expert, so dispatch is a local regrouping."""

from __future__ import annotations

import torch

from engine.moe.base import CombineSignal, Dispatcher, DispatchOutput
from engine.moe.permute import Layout, MaskedDispatchOutput, Permutation, permute, unpermute


class NoneDispatcher(Dispatcher):
    """Groups (token, expert) pairs by expert (stable) and index-adds the weighted outputs back.

    `layout="masked"` gives [E, cap, hidden] (cap = `masked_capacity` or the largest count), the
    shape a masked expert runner or a CUDA graph wants; the default is contiguous.
    """

    def __init__(self, num_experts: int, *, layout: Layout = "contiguous", expert_alignment: int = 1,
                 masked_capacity: int | None = None) -> None:
        self.num_experts = num_experts
        self.layout: Layout = layout
        self.expert_alignment = expert_alignment
        self.masked_capacity = masked_capacity
        self._state: tuple[Permutation, torch.Tensor, torch.dtype] | None = None
        self._out: DispatchOutput | None = None
        self._combined: torch.Tensor | None = None

    def dispatch_a(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        # On the GPU the ids come from the router, which never drops a slot: no host copy of the
        # counts then (on the CPU checking costs nothing, so the general path runs)
        hidden, _, counts, perm = permute(
            hidden_states, topk_ids, self.num_experts, layout=self.layout,
            alignment=self.expert_alignment, capacity=self.masked_capacity, all_valid=topk_ids.is_cuda)
        self._state = (perm, topk_weights, hidden_states.dtype)
        if self.layout == "masked":
            n_valid = int(counts.sum())
            self._out = MaskedDispatchOutput(
                hidden, counts, "masked", handle=perm,
                expected_m=max(1, -(-n_valid // max(self.num_experts, 1))))
        else:
            self._out = DispatchOutput(hidden, counts, "contiguous", handle=perm)

    def dispatch_b(self) -> DispatchOutput:
        out, self._out = self._out, None
        assert out is not None, "dispatch_b without dispatch_a"
        return out

    def combine_a(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput,
                  signal: CombineSignal | None = None) -> None:
        if signal is not None:
            raise ValueError(f"{type(self).__name__} has no signalled combine")
        assert self._state is not None, "combine_a without dispatch"
        perm, weights, dtype = self._state
        self._state = None
        self._combined = unpermute(expert_output, perm, weights, dtype)

    def combine_b(self) -> torch.Tensor:
        out, self._combined = self._combined, None
        assert out is not None, "combine_b without combine_a"
        return out
