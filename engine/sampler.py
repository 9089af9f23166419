"""Batched sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Random draws use the exponential-race trick (argmax of p / E with E ~ Exp(1)), which samples
exactly from p. A request with a seed draws its noise from a generator seeded by
(seed, index of the token in its output), so its tokens do not depend on its batch mates, on
retraction/recompute, or on scheduling. The noise is drawn on the logits' device (generators there
too): on CUDA a host draw of [B, vocab] plus its copy would cost the forward tens of ms per step.
A seed therefore reproduces its tokens on the same kind of device.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from engine.forward_batch import SamplingInfo


class SampleOutput(NamedTuple):
    ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None = None  # [B] float32
    top_ids: torch.Tensor | None = None  # [B, K] int64, most likely first
    top_logprobs: torch.Tensor | None = None  # [B, K] float32


def _noise(vocab: int, seeds: list[int | None], output_index: list[int], device, fallback: torch.Generator) -> torch.Tensor:
    """Exp(1) noise [B, vocab] on `device`: unseeded rows in one draw from the engine generator
    (on `device`), seeded rows each from a generator keyed by (seed, output index)."""
    e = torch.empty(len(seeds), vocab, dtype=torch.float32, device=device).exponential_(generator=fallback)
    for row, (seed, idx) in enumerate(zip(seeds, output_index)):
        if seed is not None:
            g = torch.Generator(device=device)
            g.manual_seed((seed * 1_000_003 + idx) & 0x7FFF_FFFF_FFFF_FFFF)
            e[row].exponential_(generator=g)
    return e


def sample(logits: torch.Tensor, info: SamplingInfo, generator: torch.Generator,
           model_logits: torch.Tensor | None = None) -> SampleOutput:
    """logits [B, V] float32 (penalties applied) -> token ids [B] and, where asked, the log p of
    each chosen token and the `info.top_logprobs` most likely tokens under the model
    (`model_logits`, the logits before penalties; default `logits`)."""
    logprobs = (torch.log_softmax(logits if model_logits is None else model_logits, dim=-1)
                if info.return_logprobs else None)
    greedy_ids = logits.argmax(dim=-1)
    if info.all_greedy:
        ids = greedy_ids
    else:
        temps = info.temperatures.clamp(min=1e-5)[:, None]
        x = logits / temps
        if info.need_top_k:
            kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (info.top_ks.clamp(max=x.shape[-1]) - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
        probs = x.softmax(dim=-1)
        if info.need_top_p:
            sp, si = probs.sort(dim=-1, descending=True)
            cum = sp.cumsum(-1)
            drop_sorted = (cum - sp) > info.top_ps[:, None]  # keep the smallest prefix reaching top_p
            probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(1, si, drop_sorted), 0.0)
        if info.need_min_p:
            thresh = probs.max(dim=-1, keepdim=True).values * info.min_ps[:, None]
            probs = probs.masked_fill(probs < thresh, 0.0)
        e = _noise(probs.shape[-1], info.seeds, info.output_index, probs.device, generator)
        sampled = (probs / e).argmax(dim=-1)
        ids = torch.where(info.temperatures == 0, greedy_ids, sampled)
    if logprobs is None:
        return SampleOutput(ids)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1)
    if not info.top_logprobs:
        return SampleOutput(ids, chosen)
    top = logprobs.topk(min(info.top_logprobs, logprobs.shape[-1]), dim=-1)
    return SampleOutput(ids, chosen, top.indices, top.values)
