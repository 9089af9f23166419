"""What the engine hands back: one `RequestOutput` per request, cumulative, with the latest delta."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FinishReason = Literal["stop", "length", "abort"]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_computed_prefill_tokens: int = 0  # prompt tokens actually run through the model
    num_retractions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all generated tokens so far
    text: str  # all text so far (stop strings excluded, held-back partial stop prefixes excluded)
    delta_token_ids: list[int] = field(default_factory=list)
    delta_text: str = ""
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None  # set when the engine failed this request (finish_reason "abort")
    logprobs: list[float] | None = None
    # per generated token, with top_logprobs: {token id: logprob} of the most likely tokens
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None
    # with prompt_logprobs and top_logprobs: the most likely tokens at each prompt position
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    metrics: RequestMetrics | None = None
