"""Presence, frequency and repetition penalties, with their token state on the device.

OpenAI's presence / frequency penalties lower the logit of each token already in the output: by
`presence` once it appears, by `frequency` per appearance. The repetition penalty (vLLM, SGLang,
HF transformers) divides a positive logit (multiplies a negative one) of any token in the prompt or
the output. Penalties change the distribution sampled from (greedy included); the logprobs a
request asks for stay the model's own.

Under the overlap loop the scheduler builds step N+1 before it has seen step N's token, so the
counts cannot come from the host. They live here, one row per request-table slot: after each
step's sampling the sampled tokens are added to their rows, in launch order, and a row is rebuilt
from the host (`PenaltyInfo.init_*`) at the step that first samples for its request after
admission or retraction, which is launched after every step that could have touched the row
before.
"""

from __future__ import annotations

import torch

from engine.forward_batch import PenaltyInfo


class PenaltyState:
    def __init__(self, num_rows: int, vocab_size: int, device: torch.device) -> None:
        self.counts = torch.zeros(num_rows, vocab_size, dtype=torch.int32, device=device)
        self.in_prompt = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)

    def apply(self, logits: torch.Tensor, info: PenaltyInfo) -> torch.Tensor:
        """Rebuild the rows `info` names, then return `logits` [B, V] (float32) penalized."""
        if info.init_rows.numel():
            rows = info.rows[info.init_rows]
            self.counts[rows] = 0
            self.in_prompt[rows] = False
            k, tok = info.init_output
            self.counts.index_put_((rows[k], tok), torch.ones_like(tok, dtype=torch.int32), accumulate=True)
            k, tok = info.init_prompt
            self.in_prompt[rows[k], tok] = True
        counts = self.counts[info.rows]
        seen = counts > 0
        logits = logits - info.frequency[:, None] * counts - info.presence[:, None] * seen
        rep = info.repetition[:, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        return torch.where(seen | self.in_prompt[info.rows], penalized, logits)

    def observe(self, info: PenaltyInfo, next_ids: torch.Tensor) -> None:
        """Count this step's sampled tokens (rows that sampled nothing get rebuilt before use)."""
        self.counts.index_put_((info.rows, next_ids), torch.ones_like(next_ids, dtype=torch.int32), accumulate=True)
