"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class SamplingParams(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # OpenAI's: subtracted from a token's logit once it appears in the output (presence) or per
    # appearance (frequency). vLLM/SGLang's repetition penalty: logits of tokens in the prompt or
    # output divided by it when positive, multiplied when negative (HF transformers' semantics).
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    # OpenAI's: added to these tokens' logits before sampling (-100 bans a token, 100 forces it)
    logit_bias: dict[int, float] | None = None
    logprobs: bool = False
    top_logprobs: int = Field(0, ge=0, le=20, description=(
        "with logprobs / prompt_logprobs: also the logprobs of this many most likely tokens at "
        "each generated / prompt position"))
    prompt_logprobs: bool = False
    priority: int = 0  # lower runs first under schedule_policy="priority"

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop(cls, v: object) -> object:
        if isinstance(v, str):
            v = [v]
        if v is not None and any(not s for s in v):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[int, float] | None) -> dict[int, float] | None:
        if v is None:
            return None
        if len(v) > 300:
            raise ValueError("logit_bias: at most 300 tokens")
        if any(not -100.0 <= b <= 100.0 for b in v.values()):
            raise ValueError("logit_bias: values must lie in [-100, 100]")
        if any(t < 0 for t in v):
            raise ValueError("logit_bias: token ids must be non-negative")
        return v or None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> SamplingParams:
        if self.top_logprobs and not (self.logprobs or self.prompt_logprobs):
            raise ValueError("top_logprobs requires logprobs=True or prompt_logprobs=True")
        return self

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
