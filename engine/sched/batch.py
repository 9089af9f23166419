"""Turn scheduled requests into a `ForwardBatch`: host-side index tensors, built once per step."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.forward_batch import (
    AttentionMetadata,
    ForwardBatch,
    ForwardMode,
    PenaltyInfo,
    SamplingInfo,
)
from engine.mem.req_table import ReqTable
from engine.request import Req


@dataclass
class ScheduledBatch:
    """A launched step as the scheduler remembers it, to process its results later."""

    mode: ForwardMode
    reqs: list[Req]
    epochs: list[int]
    sample_mask: list[bool]
    future_ids: list[int]  # negative FutureMap ids of the sampled tokens
    prompt_logprob_lens: list[int]  # per request: prompt-logprob targets computed this step
    forward: ForwardBatch


def _penalty_info(reqs: list[Req], slots: list[int], mode: ForwardMode, sample_mask: list[bool]) -> PenaltyInfo:
    """Penalties of a batch where some request has one. Rows are rebuilt at a request's final
    prefill chunk (its first sampling step since admission or retraction); all its outputs are
    on the host then."""
    ps = [r.params for r in reqs]
    init = [i for i, s in enumerate(sample_mask) if s and mode == ForwardMode.EXTEND]

    def pairs(lists: list[list[int]]) -> torch.Tensor:
        k = [j for j, ids in enumerate(lists) for _ in ids]
        return torch.tensor([k, [t for ids in lists for t in ids]], dtype=torch.int64).view(2, -1)

    return PenaltyInfo(
        rows=torch.tensor(slots, dtype=torch.int64),
        presence=torch.tensor([p.presence_penalty for p in ps], dtype=torch.float32),
        frequency=torch.tensor([p.frequency_penalty for p in ps], dtype=torch.float32),
        repetition=torch.tensor([p.repetition_penalty for p in ps], dtype=torch.float32),
        init_rows=torch.tensor(init, dtype=torch.int64),
        init_prompt=pairs([reqs[i].prompt_ids if reqs[i].params.repetition_penalty != 1.0 else [] for i in init]),
        init_output=pairs([reqs[i].output_ids for i in init]),
    )


def _logit_bias(ps: list) -> dict:
    pairs = [(i, t, b) for i, p in enumerate(ps) if p.logit_bias for t, b in p.logit_bias.items()]
    if not pairs:
        return {}
    rows, toks, vals = zip(*pairs)
    return {"bias_index": torch.tensor([rows, toks], dtype=torch.int64),
            "bias_values": torch.tensor(vals, dtype=torch.float32)}


def _sampling_info(reqs: list[Req], vocab_size: int, slots: list[int], mode: ForwardMode,
                   sample_mask: list[bool]) -> SamplingInfo:
    ps = [r.params for r in reqs]
    temps = torch.tensor([p.temperature if not p.greedy else 0.0 for p in ps], dtype=torch.float32)
    top_ks = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in ps], dtype=torch.int64)
    return SamplingInfo(
        temperatures=temps,
        top_ps=torch.tensor([p.top_p for p in ps], dtype=torch.float32),
        top_ks=top_ks,
        min_ps=torch.tensor([p.min_p for p in ps], dtype=torch.float32),
        seeds=[p.seed for p in ps],
        output_index=[r.num_scheduled_outputs for r in reqs],
        all_greedy=bool((temps == 0).all()),
        need_top_k=any(0 < p.top_k < vocab_size and not p.greedy for p in ps),
        need_top_p=any(p.top_p < 1.0 and not p.greedy for p in ps),
        need_min_p=any(p.min_p > 0.0 and not p.greedy for p in ps),
        return_logprobs=any(p.logprobs for p in ps),
        top_logprobs=max(p.top_logprobs for p in ps),
        **_logit_bias(ps),
        penalties=_penalty_info(reqs, slots, mode, sample_mask) if any(p.has_penalties for p in ps) else None,
    )


def attention_metadata(mode: ForwardMode, prefix: torch.Tensor, ext: torch.Tensor,
                       kv_rows: torch.Tensor) -> AttentionMetadata:
    """Padded index tensors for requests with `prefix` cached and `ext` new tokens each, whose
    KV slots for positions 0.. are `kv_rows` [B, >= max(prefix + ext)]. New tokens are laid out
    request after request in the batch's token order."""
    seq = prefix + ext
    max_s = int(seq.max())
    kv_mask = torch.arange(max_s)[None, :] < seq[:, None]
    kv_indices = kv_rows[:, :max_s].masked_fill(~kv_mask, 0)
    if mode == ForwardMode.DECODE:
        return AttentionMetadata(kv_indices=kv_indices, kv_mask=kv_mask)
    return AttentionMetadata(kv_indices=kv_indices, kv_mask=kv_mask, prefix=prefix.clone())


def build_batch(mode: ForwardMode, reqs: list[Req], extend_lens: list[int], table: ReqTable,
                slots: list[int], future_slots: list[int], vocab_size: int) -> ForwardBatch:
    """Build the forward input. Each request's new tokens start at position `req.kv_len`
    (before this step) and its KV pages for them are already in the table."""
    B = len(reqs)
    prefix = torch.tensor([r.kv_len for r in reqs], dtype=torch.int64)
    ext = torch.tensor(extend_lens, dtype=torch.int64)
    seq = prefix + ext
    max_s = int(seq.max())
    slot_t = torch.tensor(slots, dtype=torch.int64)
    kv_indices = table.token_slots(slot_t, max_s)

    ids: list[int] = []
    for r, e in zip(reqs, extend_lens):
        if mode == ForwardMode.DECODE:
            ids.append(r.pending_future if r.pending_future is not None else r.fill_ids[-1])
        else:
            ids.extend(r.fill_ids[r.kv_len : r.kv_len + e])
    input_ids = torch.tensor(ids, dtype=torch.int64)
    starts = torch.cumsum(ext, 0) - ext
    row = torch.repeat_interleave(torch.arange(B), ext)
    offs = torch.arange(len(ids)) - starts[row]
    positions = prefix[row] + offs
    out_cache_loc = kv_indices[row, positions]

    if mode == ForwardMode.DECODE:
        sample_mask = [True] * B
    else:  # a prefill chunk samples only when it reaches the end of the known tokens
        sample_mask = [r.kv_len + e >= len(r.fill_ids) for r, e in zip(reqs, extend_lens)]
    attn = attention_metadata(mode, prefix, ext, kv_indices)
    plp: list[tuple[int, int, int]] = []
    for i, r in enumerate(reqs):
        if mode == ForwardMode.EXTEND and r.wants_prompt_logprobs:
            # positions p predict token p+1 while p+1 is still a prompt token
            n = min(extend_lens[i], len(r.prompt_ids) - 1 - r.kv_len)
            if n > 0:
                plp.append((int(starts[i]), int(starts[i]) + n, i))
    targets = [r.prompt_ids[r.kv_len + 1 + k] for (s, e, i) in plp for r in [reqs[i]] for k in range(e - s)]

    fb = ForwardBatch(
        forward_mode=mode,
        input_ids=input_ids,
        positions=positions,
        out_cache_loc=out_cache_loc,
        batch_size=B,
        attn=attn,
        sample_index=starts + ext - 1,
        sample_mask=sample_mask,
        sampling=_sampling_info(reqs, vocab_size, slots, mode, sample_mask),
        future_slots=torch.tensor(future_slots, dtype=torch.int64),
        prompt_logprob_ranges=plp,
        prompt_logprob_targets=torch.tensor(targets, dtype=torch.int64),
        prompt_logprob_top=max((reqs[i].params.top_logprobs for _, _, i in plp), default=0),
        prefix_lens=prefix.tolist(),
        extend_lens=list(extend_lens),
    )
    return fb


def idle_batch() -> ForwardBatch:
    """Zero tokens: run by a rank without work so it still joins every MoE collective."""
    z = torch.zeros(0, dtype=torch.int64)
    return ForwardBatch(forward_mode=ForwardMode.IDLE, input_ids=z, positions=z, out_cache_loc=z,
                        batch_size=0, attn=None, sample_index=z, sample_mask=[], sampling=None,
                        future_slots=z)
