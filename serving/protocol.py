"""OpenAI request schemas (what we accept) and the OpenAI error body.

Requests are parsed strictly: a wrong JSON type is a 400, never silently coerced ("5" is not 5),
and a field OpenAI defines but we do not implement (`tools`, `suffix`, ...) is a
400 naming it rather than an ignored knob that makes outputs differ from what the client asked.
A few non-OpenAI extras that vLLM and SGLang also accept (`top_k`, `min_p`, `repetition_penalty`,
`ignore_eos`, `stop_token_ids`) go through `extra_body` of the official client.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

MAX_N = 16  # choices per prompt; each is an engine request of its own (sharing the prompt's cache)
MAX_PROMPTS = 64  # prompts in one completions request
MAX_CHOICES = 128  # prompts x n: engine requests one HTTP request may start


class APIError(Exception):
    """An error the ingress answers with OpenAI's body `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",  # noqa: A002 - OpenAI's field name
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.retry_after_s = retry_after_s

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def validation_to_api_error(e: ValidationError) -> APIError:
    """One 400 listing every problem; `param` is the first offending field's dotted path."""
    errors = e.errors(include_url=False)
    if any(err["type"] == "json_invalid" for err in errors):
        return bad_request("request body is not valid JSON", code="invalid_json")
    unsupported = [
        ".".join(map(str, err["loc"])) for err in errors if err["type"] == "extra_forbidden"
    ]
    parts = []
    if unsupported:
        parts.append("unsupported field(s): " + ", ".join(unsupported))
    for err in errors:
        if err["type"] == "extra_forbidden":
            continue
        loc = ".".join(str(p) for p in err["loc"]) or "body"
        parts.append(f"{loc}: {err['msg']}")
    first = errors[0]["loc"] if errors else ()
    param = ".".join(str(p) for p in first) or None
    code = (
        "unsupported_parameter"
        if unsupported and len(unsupported) == len(errors)
        else "invalid_value"
    )
    return bad_request("; ".join(parts), param=param, code=code)


class _Request(BaseModel):
    # strict: JSON types must match; extra=forbid: unknown/unsupported fields are reported.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    user: str | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None  # token id (as a string, as OpenAI's) -> bias
    # Extras (not in OpenAI's schema), as in vLLM / SGLang.
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if not 1 <= v <= MAX_N:
            raise ValueError(f"n must lie in [1, {MAX_N}]")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None and any(not k.isdigit() for k in v):
            raise ValueError("keys must be token ids")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str] | None:
        if v is None:
            return None
        stops = [v] if isinstance(v, str) else v
        if len(stops) > 4:
            raise ValueError("at most 4 stop sequences")
        if any(not s for s in stops):
            raise ValueError("stop sequences must be non-empty")
        return stops or None

    @model_validator(mode="after")
    def _stream_options(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self

    @property
    def include_usage_in_stream(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    include_usage: bool = False


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 only with echo: score the prompt, generate nothing
    # OpenAI: the chosen token's logprob and the `logprobs` most likely tokens' (0..5)
    logprobs: int | None = Field(None, ge=0, le=5)
    # the prompt ahead of the completion, in the text and (with logprobs) in the logprobs
    echo: bool = False

    @model_validator(mode="after")
    def _zero_tokens_need_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: 0 is only allowed with echo=true")
        return self

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: Any) -> Any:
        # a batch of prompts (strings or token-id lists) or one; a one-element batch is one
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) > MAX_PROMPTS:
                raise ValueError(f"at most {MAX_PROMPTS} prompts per request")
            if len(v) == 1:
                v = v[0]
            elif any(len(p) == 0 for p in v):
                raise ValueError("prompts must not be empty")
        if len(v) == 0:
            raise ValueError("prompt must not be empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or a batch (choices are prompt-major, n per prompt)."""
        v = self.prompt
        return list(v) if isinstance(v, list) and v and isinstance(v[0], (str, list)) else [v]

    @model_validator(mode="after")
    def _batch_size(self) -> CompletionRequest:
        if len(self.prompts) * self.n > MAX_CHOICES:
            raise ValueError(f"prompts x n must not exceed {MAX_CHOICES}")
        return self


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs=true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )


CompletionRequest.model_rebuild()
ChatCompletionRequest.model_rebuild()
