"""What one forward consumes: the typed boundary between the scheduler and the model.

The scheduler builds a `ForwardBatch` on the host (all index tensors precomputed there, so the
forward never reads scheduler state that may change while it runs under the overlap loop); the
executor moves it to the device and runs the model inside `forward_context(batch)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import IntEnum

import torch


class ForwardMode(IntEnum):
    EXTEND = 1  # prefill (possibly a chunk, possibly after a cached prefix)
    DECODE = 2  # one new token per request
    IDLE = 3  # zero tokens: this rank has no work but joins its group's collectives


@dataclass
class AttentionMetadata:
    """Padded per-request index tensors shared by every layer of one forward.

    kv_indices [B, S]: KV-pool slots of each request's tokens 0..seq_len-1 (padding -> slot 0).
    kv_mask    [B, S]: True where a slot is a real token of the request.
    prefix     [B]:    EXTEND only: tokens of each request cached before this step (its new
                       tokens are at positions prefix..prefix+ext-1, laid out request after
                       request in the batch's token order). The causal masks and query layouts
                       are built from it on the device, per group of requests, by the model.
    """

    kv_indices: torch.Tensor
    kv_mask: torch.Tensor
    prefix: torch.Tensor | None = None
    # set by the model on the device copy at its first layer, reused by every layer: its
    # attention plan (extend: request groups; decode: split-KV chunks, or None for one pass)
    layer_plan: tuple | None = None


@dataclass
class SamplingInfo:
    """Batched sampling parameters for the B rows that get logits (one per request)."""

    temperatures: torch.Tensor  # [B] float32, 0 = greedy
    top_ps: torch.Tensor  # [B]
    top_ks: torch.Tensor  # [B] int64, vocab size when disabled
    min_ps: torch.Tensor  # [B]
    seeds: list[int | None]  # per-request seed (None: engine generator)
    output_index: list[int]  # index of the token being sampled in the request's output
    all_greedy: bool
    need_top_k: bool
    need_top_p: bool
    need_min_p: bool
    return_logprobs: bool
    top_logprobs: int = 0  # most likely tokens reported per row (the batch's largest request)
    # logit_bias of the batch's requests: (row, token id) pairs [2, N] and their biases [N]
    bias_index: torch.Tensor | None = None
    bias_values: torch.Tensor | None = None
    penalties: PenaltyInfo | None = None  # None: no request of the batch has a penalty


@dataclass
class PenaltyInfo:
    """Presence / frequency / repetition penalties of a batch. The token counts they need live on
    the device, one row per request-table slot (`rows`): the runner adds each sampled token to
    its row after sampling, in launch order, so a row is current even for tokens the scheduler
    has not seen yet (overlap). A request's row is (re)built from the host at the step that
    first samples for it after admission or retraction (`init_*`): counts of its output tokens
    so far, and which tokens its prompt holds (repetition penalty)."""

    rows: torch.Tensor  # [B] int64 request-table slot of each request
    presence: torch.Tensor  # [B] float32
    frequency: torch.Tensor  # [B] float32
    repetition: torch.Tensor  # [B] float32 (1: none)
    init_rows: torch.Tensor  # [K] int64 batch rows whose state is rebuilt this step
    init_prompt: torch.Tensor  # [2, Np] int64 (index into init_rows, token id) of their prompts
    init_output: torch.Tensor  # [2, No] int64 (index into init_rows, token id) of their outputs


def _to(v, device):
    """Copy of dataclass `v` with its tensors (and nested dataclasses') on `device`."""
    moved = {}
    for g in fields(v):
        x = getattr(v, g.name)
        if isinstance(x, torch.Tensor):
            x = x.to(device, non_blocking=True)
        elif isinstance(x, PenaltyInfo):
            x = _to(x, device)
        moved[g.name] = x
    return type(v)(**moved)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64; negative entries are FutureMap placeholders
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64 KV slots this forward writes
    batch_size: int  # requests
    attn: AttentionMetadata | None
    # rows of the hidden states whose logits are sampled (last token of each request whose
    # prompt is complete); requests whose chunk is not final sample nothing (sample_mask False).
    sample_index: torch.Tensor  # [B] int64 into T
    sample_mask: list[bool]
    sampling: SamplingInfo | None
    # future slots that receive this batch's sampled tokens (one per request), see FutureMap
    future_slots: torch.Tensor  # [B] int64
    # token ranges (start, end) in T of requests that want prompt logprobs, with the request's
    # row index; logprobs of token i+1 under position i are returned for each range.
    prompt_logprob_ranges: list[tuple[int, int, int]] = field(default_factory=list)
    prompt_logprob_targets: torch.Tensor | None = None  # next prompt token of each range position
    prompt_logprob_top: int = 0  # the most likely tokens reported at prompt positions too
    # lockstep: token count of every rank in the group this step (EP); [T] for one rank
    global_num_tokens: list[int] = field(default_factory=list)
    can_run_tbo: bool = False
    # per request: tokens already in the KV cache before this step, and new tokens this step
    prefix_lens: list[int] = field(default_factory=list)
    extend_lens: list[int] = field(default_factory=list)
    # the two micro-batches of a TBO step (token ranges [0, t) and [t, T)), set after agreement
    tbo_children: tuple[ForwardBatch, ForwardBatch] | None = None
    # DeepEP `auto`: "normal" or "low_latency", agreed by the whole group for this step (None: a
    # single rank, or a mode fixed by the config)
    moe_a2a_mode: str | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str) -> ForwardBatch:
        """Copy of this batch with every tensor on `device` (non-blocking from pinned host memory)."""
        if str(device) == "cpu":
            return self
        moved = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, torch.Tensor):
                v = v.to(device, non_blocking=True)
            elif f.name == "tbo_children" and v is not None:
                v = (v[0].to(device), v[1].to(device))
            elif isinstance(v, (AttentionMetadata, SamplingInfo)):
                v = _to(v, device)
            moved[f.name] = v
        return ForwardBatch(**moved)
