"""`torch` dispatcher: `all_to_all_single` over the EP process group (gloo on CPU, NCCL on GPU).

Wire format (like DeepEP's normal mode): a token goes to each rank that owns at least one of its
experts once, however many of its k experts live there. With each row travel its k local expert
ids on that rank (-1 for the other slots) and their weights, packed as one float32 [rows, 2k]
tensor (ids < 2^24 are exact in float32). The receiving rank weights and sums its experts'
outputs per row, so the combine also sends one row per (token, rank).

Per step: dispatch_a exchanges per-rank row counts (a blocking all_to_all of W ints: the payload's
split sizes must be known), then launches the hidden and metadata all_to_alls async; dispatch_b
waits and regroups by local expert; combine_a weights/sums per row and launches the reverse
all_to_all async; combine_b waits and index-adds into [T, hidden]. A rank with T=0 still runs all
of it with zero rows. gloo implements all_to_all_single only with explicit (or even) split sizes,
which is what is always passed here.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
import torch.distributed as dist

from engine.moe.base import CombineSignal, Dispatcher, DispatchOutput
from engine.moe.permute import Layout, MaskedDispatchOutput, Permutation, permute, unpermute


def a2a_delay_s() -> float:
    """`MOE_A2A_DELAY_MS`: emulated one-way latency of each all-to-all, for benchmarks (default 0)."""
    v = os.environ.get("MOE_A2A_DELAY_MS", "").strip()
    return float(v) / 1000.0 if v else 0.0


class TorchA2ADispatcher(Dispatcher):
    """Expert-parallel dispatch over `torch.distributed.all_to_all_single`.

    `bytes_sent`: cumulative payload bytes this rank sent to *other* ranks (the traffic a network
    would carry; the self-chunk is a local copy), dispatch and combine together. Benchmarks diff
    it per step.
    `delay_s` (default `MOE_A2A_DELAY_MS`): each `*_b` half completes no earlier than `delay_s`
    after its `*_a` launched, so work placed between the halves (TBO/SBO) hides the emulated
    latency exactly as it would hide a real one.
    """

    def __init__(self, num_experts: int, *, ep_group: Any, rank: int, world_size: int,
                 layout: Layout = "contiguous", expert_alignment: int = 1,
                 masked_capacity: int | None = None, delay_s: float | None = None) -> None:
        if num_experts % world_size:
            raise ValueError(f"{num_experts} experts do not split over {world_size} ranks")
        self.group = ep_group
        self.rank = rank
        self.world_size = world_size
        self.num_experts = num_experts
        self.num_local_experts = num_experts // world_size
        self.layout: Layout = layout
        self.expert_alignment = expert_alignment
        self.masked_capacity = masked_capacity
        self.delay_s = a2a_delay_s() if delay_s is None else delay_s
        self.bytes_sent = 0
        self._pending: dict[str, Any] | None = None
        self._step: dict[str, Any] | None = None

    # -- helpers ---------------------------------------------------------------------------
    def _a2a(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
             in_splits: list[int]) -> Any:
        row_bytes = math.prod(inp.shape[1:]) * inp.element_size()
        self.bytes_sent += row_bytes * (sum(in_splits) - in_splits[self.rank])
        return dist.all_to_all_single(out, inp, out_splits, in_splits, group=self.group, async_op=True)

    def _wait(self, works: list[Any], launched_at: float) -> None:
        if self.delay_s > 0:
            left = self.delay_s - (time.perf_counter() - launched_at)
            if left > 0:
                time.sleep(left)
        for w in works:
            w.wait()

    # -- dispatch --------------------------------------------------------------------------
    def dispatch_a(self, hidden_states: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> None:
        x = hidden_states
        t, k = topk_ids.shape
        w_size, e_local, dev = self.world_size, self.num_local_experts, x.device
        ids = topk_ids.long()
        dest = torch.where(ids >= 0, ids // e_local, w_size)  # w_size: a dropped slot
        in_rank = torch.zeros(t, w_size + 1, dtype=torch.bool, device=dev)
        in_rank.scatter_(1, dest, True)
        in_rank = in_rank[:, :w_size]
        # One send row per (rank, token), rank-major so each rank's rows are one chunk.
        send_rank, send_token = in_rank.t().nonzero(as_tuple=True)
        send_counts = in_rank.sum(0)

        recv_counts = torch.empty_like(send_counts)
        self.bytes_sent += send_counts.element_size() * (w_size - 1)
        dist.all_to_all_single(recv_counts, send_counts, group=self.group)
        in_splits, out_splits = send_counts.tolist(), recv_counts.tolist()

        same = dest.index_select(0, send_token) == send_rank.unsqueeze(1)
        local_ids = torch.where(same, ids.index_select(0, send_token) - send_rank.unsqueeze(1) * e_local, -1)
        weights = torch.where(same, topk_weights.index_select(0, send_token).float(), 0.0)
        send_meta = torch.cat([local_ids.float(), weights], dim=1)
        send_x = x.index_select(0, send_token)

        n_recv = sum(out_splits)
        recv_x = x.new_empty(n_recv, x.shape[1])
        recv_meta = send_meta.new_empty(n_recv, 2 * k)
        launched = time.perf_counter()
        works = [self._a2a(recv_x, send_x, out_splits, in_splits),
                 self._a2a(recv_meta, send_meta, out_splits, in_splits)]
        self._pending = dict(works=works, launched=launched, recv_x=recv_x, recv_meta=recv_meta)
        self._step = dict(send_token=send_token, in_splits=in_splits, out_splits=out_splits,
                          num_tokens=t, dtype=x.dtype, hidden=x.shape[1])

    def dispatch_b(self) -> DispatchOutput:
        p, self._pending = self._pending, None
        assert p is not None and self._step is not None, "dispatch_b without dispatch_a"
        self._wait(p["works"], p["launched"])
        k = p["recv_meta"].shape[1] // 2
        recv_ids = p["recv_meta"][:, :k].long()
        recv_w = p["recv_meta"][:, k:]
        hidden, _, counts, perm = permute(
            p["recv_x"], recv_ids, self.num_local_experts, layout=self.layout,
            alignment=self.expert_alignment, capacity=self.masked_capacity)
        self._step.update(perm=perm, recv_w=recv_w)
        if self.layout == "masked":
            n = int(counts.sum())
            return MaskedDispatchOutput(hidden, counts, "masked", handle=perm,
                                        expected_m=max(1, -(-n // self.num_local_experts)))
        return DispatchOutput(hidden, counts, "contiguous", handle=perm)

    # -- combine ---------------------------------------------------------------------------
    def combine_a(self, expert_output: torch.Tensor, dispatch_output: DispatchOutput,
                  signal: CombineSignal | None = None) -> None:
        if signal is not None:
            raise ValueError(f"{type(self).__name__} has no signalled combine")
        s = self._step
        assert s is not None and "perm" in s, "combine_a before dispatch_b"
        perm: Permutation = s["perm"]
        # One weighted partial sum per received row; sent back in the dtype tokens came in.
        partial = unpermute(expert_output, perm, s["recv_w"], s["dtype"])
        back = partial.new_empty(sum(s["in_splits"]), s["hidden"])
        launched = time.perf_counter()
        work = self._a2a(back, partial, s["in_splits"], s["out_splits"])
        self._pending = dict(works=[work], launched=launched, back=back)

    def combine_b(self) -> torch.Tensor:
        p, s = self._pending, self._step
        assert p is not None and s is not None and "back" in p, "combine_b without combine_a"
        self._pending = self._step = None
        self._wait(p["works"], p["launched"])
        out = torch.zeros(s["num_tokens"], s["hidden"], dtype=torch.float32, device=p["back"].device)
        out.index_add_(0, s["send_token"], p["back"].float())
        return out.to(s["dtype"])
