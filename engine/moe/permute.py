"""Layout helpers shared by the dispatchers: token rows + a top-k table <-> per-expert layouts.

Every backend ends up with the same picture on the receiving rank: R token rows, each with a
[R, k] table of *local* expert ids (-1 where that slot's expert lives elsewhere or is absent) and
the matching weights. `permute` turns that into the per-expert layout the runners consume;
`unpermute` takes the expert outputs back to one weighted row per token row. All vectorized (one
stable sort), no per-token Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from engine.moe.base import DispatchOutput

Layout = Literal["contiguous", "masked"]


@dataclass
class MaskedDispatchOutput(DispatchOutput):
    """A masked-layout `DispatchOutput` plus DeepGEMM's `expected_m` hint (a CPU int > 0).

    A subclass, so code written against `DispatchOutput` keeps working. For masked layouts that
    come straight from DeepEP low-latency, `tokens_per_expert` is DeepEP's device int32
    `recv_count`: copying it to the host every layer would serialize the decode step.
    """

    expected_m: int = 1


@dataclass
class Permutation:
    """Where each valid (row, slot) pair of a [num_rows, topk] table sits in an expert layout."""

    pair_index: torch.Tensor  # [N] int64: flat index row*topk + slot, in layout order
    dest_row: torch.Tensor  # [N] int64: row in the layout flattened to [rows, hidden]
    num_rows: int
    topk: int

    @property
    def token_index(self) -> torch.Tensor:
        return self.pair_index // self.topk


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    # Gathers/scatters on float8 are not implemented for every device/op; the bytes are the same.
    return t.view(torch.uint8) if t.element_size() == 1 and t.is_floating_point() else t


def _scatter_rows(src: torch.Tensor, index: torch.Tensor | None, dest: torch.Tensor | None,
                  num_out: int) -> torch.Tensor:
    """out[dest] = src[index] with out zero elsewhere (dest None: out = src[index])."""
    b = _bytes_view(src)
    rows = b if index is None else b.index_select(0, index)
    if dest is None:
        out = rows
    else:
        out = b.new_zeros((num_out, *src.shape[1:]))
        out[dest] = rows
    return out.view(src.dtype) if b is not src else out


def permute(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    num_experts: int,
    *,
    layout: Layout = "contiguous",
    alignment: int = 1,
    capacity: int | None = None,
    scales: torch.Tensor | None = None,
    all_valid: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, Permutation]:
    """Group the rows of `x` [R, hidden] by expert: one layout row per valid (row, slot) pair.

    `topk_ids` [R, k] holds expert ids in [0, num_experts) or -1 (skipped). The sort is stable,
    so within an expert rows keep their order.
    - contiguous: [M, hidden], expert e's segment padded with zero rows to a multiple of
      `alignment` (DeepGEMM's contiguous GEMM wants 128); `tokens_per_expert` holds the padded
      segment sizes, so it always describes the rows exactly.
    - masked: [num_experts, cap, hidden], cap = `capacity` or the largest count; `tokens_per_expert`
      holds the true counts.
    `scales` ([R, hidden/128], FP8 payloads) follow their rows. Returns (hidden, scales,
    tokens_per_expert as an int64 tensor, permutation); `tokens_per_expert` is on the host, except
    with `all_valid` (the caller vouches that no id is -1, as a router's never are) and the
    unaligned contiguous layout: then nothing needs the counts on the host and nothing copies them
    there, so a GPU forward does not stall on them.
    """
    num_rows, topk = topk_ids.shape
    flat = topk_ids.reshape(-1).long()
    key = torch.where(flat >= 0, flat, num_experts)  # invalid pairs sort last and are cut off
    order = torch.sort(key, stable=True).indices
    counts = torch.bincount(key, minlength=num_experts + 1)[:num_experts]
    if all_valid and layout == "contiguous" and alignment == 1:
        counts_cpu, n = None, num_rows * topk
    else:
        counts_cpu = counts.cpu()
        n = int(counts_cpu.sum())
    pair_index = order[:n]
    expert = key[pair_index]
    start = torch.cumsum(counts, 0) - counts
    pos = torch.arange(n, device=flat.device) - start[expert]
    token = pair_index // topk

    if layout == "contiguous":
        if alignment == 1:
            dest, num_out, dest_arg = torch.arange(n, device=flat.device), n, None
            tokens_per_expert = counts if counts_cpu is None else counts_cpu
        else:
            seg_cpu = (counts_cpu + alignment - 1) // alignment * alignment
            seg = seg_cpu.to(flat.device)
            dest = (torch.cumsum(seg, 0) - seg)[expert] + pos
            num_out, dest_arg = int(seg_cpu.sum()), dest
            tokens_per_expert = seg_cpu
    elif layout == "masked":
        cap = int(counts_cpu.max()) if capacity is None and num_experts else (capacity or 0)
        if n and int(counts_cpu.max()) > cap:
            raise ValueError(f"masked capacity {cap} < {int(counts_cpu.max())} tokens for one expert")
        dest = expert * cap + pos
        num_out, dest_arg = num_experts * cap, dest
        tokens_per_expert = counts_cpu
    else:
        raise ValueError(f"unknown layout {layout!r}")

    hidden = _scatter_rows(x, token, dest_arg, num_out)
    out_scales = None if scales is None else _scatter_rows(scales, token, dest_arg, num_out)
    if layout == "masked":
        hidden = hidden.view(num_experts, -1, x.shape[-1])
        if out_scales is not None:
            out_scales = out_scales.view(num_experts, -1, scales.shape[-1])
    perm = Permutation(pair_index=pair_index, dest_row=dest, num_rows=num_rows, topk=topk)
    return hidden, out_scales, tokens_per_expert.long(), perm


def unpermute(
    expert_output: torch.Tensor,
    perm: Permutation,
    topk_weights: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """[num_rows, hidden]: row r = sum over its valid slots j of w[r, j] * output of pair (r, j).

    Rows of the layout that no pair points at (padding, masked tail) are never read. Accumulates
    in float32 so the result does not depend on the order of the k additions' rounding.
    """
    hidden = expert_output.shape[-1]
    y = expert_output.reshape(-1, hidden).index_select(0, perm.dest_row).float()
    w = topk_weights.reshape(-1).index_select(0, perm.pair_index).float()
    out = torch.zeros(perm.num_rows, hidden, dtype=torch.float32, device=expert_output.device)
    out.index_add_(0, perm.token_index, y * w.unsqueeze(1))
    return out.to(out_dtype)
