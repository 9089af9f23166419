"""Two-batch overlap: split a step into two micro-batches and interleave their layer stages.

While micro-batch A waits for its all-to-all (dispatch or combine), B computes, and the
reverse. B lags A by `delta` stages: 2 for decode (so A's dispatch launch is followed by B's
attention before A waits), 0 for extend (A's and B's stages alternate).

Splits (host side, after all ranks agreed that TBO runs this step):
  decode: by halves of the requests (A gets the extra one of an odd count);
  extend: at the request boundary that best balances tokens; if that leaves a side with less
    than `threshold` of the tokens, a two-chunk split cuts one sequence at the token midpoint:
    its first part ends micro-batch A, its second part (prefix grown by the first part's length,
    positions continuing) starts micro-batch B.
Micro-batches are contiguous token ranges [0, t) and [t, T) of the step, so merging their outputs
back into the original order is a concatenation. Dense layers run unsplit on the whole batch; the
split starts at the first MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.sched.batch import attention_metadata

DELTA_STAGES = {ForwardMode.DECODE: 2, ForwardMode.EXTEND: 0}


@dataclass(frozen=True)
class TboSplit:
    """Micro-batch A holds requests [0, req_split) and `cut` tokens of request req_split (0: none);
    B holds the rest. `token_split` is the first token index of B."""

    req_split: int
    cut: int
    token_split: int


def split_decode(batch_size: int) -> TboSplit:
    a = (batch_size + 1) // 2
    return TboSplit(a, 0, a)


def split_extend(extend_lens: list[int], threshold: float) -> TboSplit:
    total = sum(extend_lens)
    best, best_i, acc = None, 0, 0
    for i in range(1, len(extend_lens)):
        acc += extend_lens[i - 1]
        gap = abs(total - 2 * acc)
        if best is None or gap < best:
            best, best_i = gap, i
    if best is not None:
        left = sum(extend_lens[:best_i])
        if min(left, total - left) >= threshold * total:
            return TboSplit(best_i, 0, left)
    # two-chunk split: cut the sequence holding the token midpoint
    mid = total // 2
    acc = 0
    for i, e in enumerate(extend_lens):
        if acc + e > mid:
            cut = mid - acc
            return TboSplit(i, cut, mid) if cut else TboSplit(i, 0, acc)
        acc += e
    raise ValueError("cannot split an empty batch")


def plan_split(fb: ForwardBatch, threshold: float) -> TboSplit:
    if fb.forward_mode == ForwardMode.DECODE:
        return split_decode(fb.batch_size)
    return split_extend(fb.extend_lens, threshold)


def make_children(fb: ForwardBatch, split: TboSplit) -> tuple[ForwardBatch, ForwardBatch]:
    """Host-side micro-batches of `fb` (its tensors still on the host)."""
    r, cut, t = split.req_split, split.cut, split.token_split
    prefix, ext = list(fb.prefix_lens), list(fb.extend_lens)
    rows = fb.attn.kv_indices
    if cut:
        a_pre, a_ext, a_rows = prefix[: r + 1], ext[:r] + [cut], rows[: r + 1]
        b_pre, b_ext, b_rows = [prefix[r] + cut] + prefix[r + 1 :], [ext[r] - cut] + ext[r + 1 :], rows[r:]
    else:
        a_pre, a_ext, a_rows = prefix[:r], ext[:r], rows[:r]
        b_pre, b_ext, b_rows = prefix[r:], ext[r:], rows[r:]
    children = []
    for pre, ex, kv_rows, sl in ((a_pre, a_ext, a_rows, slice(0, t)), (b_pre, b_ext, b_rows, slice(t, None))):
        p, e = torch.tensor(pre, dtype=torch.int64), torch.tensor(ex, dtype=torch.int64)
        children.append(ForwardBatch(
            forward_mode=fb.forward_mode, input_ids=fb.input_ids[sl], positions=fb.positions[sl],
            out_cache_loc=fb.out_cache_loc[sl], batch_size=len(pre),
            attn=attention_metadata(fb.forward_mode, p, e, kv_rows),
            sample_index=torch.zeros(0, dtype=torch.int64), sample_mask=[], sampling=None,
            future_slots=torch.zeros(0, dtype=torch.int64), prefix_lens=pre, extend_lens=ex))
    return children[0], children[1]


def run_interleaved(stages: list[list], micro_batches: list, delta: int) -> None:
    """Run the same stage list over two micro-batches, B lagging A by `delta` stages.

    Any interleaving gives the same result as running A's stages then B's: the stages of one
    micro-batch run in order, and the two share nothing but the KV pool, where each writes only
    its own tokens' slots before reading (B's second part of a cut sequence reads A's first part,
    which A wrote at least one stage earlier in the same layer: delta >= 0, and within a stage
    index A runs first)."""
    a, b = micro_batches
    n = len(stages)
    for t in range(n + delta):
        if t < n:
            for op in stages[t]:
                op(a)
        if 0 <= t - delta < n:
            for op in stages[t - delta]:
                op(b)
