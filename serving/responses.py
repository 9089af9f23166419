"""OpenAI response bodies and SSE chunks built from engine `RequestOutput`s."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, Literal

Kind = Literal["completion", "chat"]


@dataclass
class ResponseBuilder:
    """Everything one response needs; keeps the logprob cursor across stream chunks."""

    kind: Kind
    request_id: str
    model: str
    prompt_tokens: int
    logprobs: bool
    tokenizer: Any
    index: int = 0  # the choice this builder describes (n > 1: one builder per choice)
    created: int = field(default_factory=lambda: int(time.time()))
    _sent_tokens: int = 0  # tokens already described in streamed logprobs
    _text_offset: int = 0

    # ---- pieces -----------------------------------------------------------------------------------
    def usage(self, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens},
        }

    def _logprobs(
        self, token_ids: list[int], logprobs: list[float] | None,
        tops: list[dict[int, float]] | None = None,
    ) -> dict[str, Any] | None:
        """OpenAI logprobs for `token_ids`: each chosen token's, and where the request asked for
        them the most likely tokens' (`tops`, most likely first)."""
        if not self.logprobs:
            return None
        lps = list(logprobs or [])[: len(token_ids)]
        ids = token_ids[: len(lps)]
        toks = [self.tokenizer.decode([t]) for t in ids]
        tops = list(tops or [])[: len(lps)] + [{}] * (len(lps) - len(tops or []))
        if self.kind == "chat":
            def entry(text: str, lp: float) -> dict[str, Any]:
                return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

            return {
                "content": [
                    {**entry(t, lp),
                     "top_logprobs": [entry(self.tokenizer.decode([i]), v) for i, v in top.items()]}
                    for t, lp, top in zip(toks, lps, tops, strict=True)
                ]
            }
        offsets = []
        for t in toks:
            offsets.append(self._text_offset)
            self._text_offset += len(t)
        # legacy completions: {token text: logprob} of the top tokens, the chosen one included
        top_dicts = []
        for t, lp, top in zip(toks, lps, tops, strict=True):
            d = {self.tokenizer.decode([i]): v for i, v in top.items()}
            d.setdefault(t, lp)
            top_dicts.append(d)
        return {
            "tokens": toks,
            "token_logprobs": lps,
            "top_logprobs": top_dicts,
            "text_offset": offsets,
        }

    # ---- full (non-streaming) response -------------------------------------------------------------
    def full(self, out: Any) -> dict[str, Any]:
        lp = self._logprobs(list(out.token_ids), out.logprobs, out.top_logprobs)
        cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
        if self.kind == "chat":
            choice = {
                "index": self.index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": lp,
                "finish_reason": out.finish_reason,
            }
            obj = "chat.completion"
        else:
            choice = {
                "index": self.index,
                "text": out.text,
                "logprobs": lp,
                "finish_reason": out.finish_reason,
            }
            obj = "text_completion"
        return {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": [choice],
            "usage": self.usage(len(out.token_ids), cached),
        }

    # ---- streaming ------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body = {
            "id": self.request_id,
            "object": "chat.completion.chunk" if self.kind == "chat" else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if usage is not None:
            body["usage"] = usage
        return sse(body)

    def first_chunk(self) -> str | None:
        """Chat streams open with the assistant role, as OpenAI's do."""
        if self.kind != "chat":
            return None
        return self._chunk(
            [
                {
                    "index": self.index,
                    "delta": {"role": "assistant", "content": ""},
                    "logprobs": None,
                    "finish_reason": None,
                }
            ]
        )

    def delta_chunk(self, out: Any) -> str | None:
        """A chunk for the tokens/text new in `out`, or None when there is nothing to send."""
        new_ids = list(out.token_ids[self._sent_tokens :])
        lps = None
        if self.logprobs and out.logprobs is not None and new_ids:
            tops = out.top_logprobs[self._sent_tokens :] if out.top_logprobs is not None else None
            lps = self._logprobs(new_ids, list(out.logprobs[self._sent_tokens :]), tops)
        self._sent_tokens = len(out.token_ids)
        if not out.delta_text and not out.finished and lps is None:
            return None
        if self.kind == "chat":
            delta = {"content": out.delta_text} if out.delta_text or not out.finished else {}
            choice = {
                "index": self.index,
                "delta": delta,
                "logprobs": lps,
                "finish_reason": out.finish_reason if out.finished else None,
            }
        else:
            choice = {
                "index": self.index,
                "text": out.delta_text,
                "logprobs": lps,
                "finish_reason": out.finish_reason if out.finished else None,
            }
        return self._chunk([choice])

    def usage_chunk(self, outs: list[Any]) -> str:
        """The closing usage chunk over the last output of each choice (prompt counted once)."""
        cached = outs[0].metrics.num_cached_tokens if outs[0].metrics is not None else 0
        return self._chunk([], usage=self.usage(sum(len(o.token_ids) for o in outs), cached))


def merge_full(bodies: list[dict[str, Any]]) -> dict[str, Any]:
    """One response of n choices from the n single-choice bodies (index order): the prompt counted
    once, completion tokens summed, as OpenAI reports them."""
    merged = dict(bodies[0])
    merged["choices"] = [c for b in bodies for c in b["choices"]]
    usage = dict(bodies[0]["usage"])
    usage["completion_tokens"] = sum(b["usage"]["completion_tokens"] for b in bodies)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    merged["usage"] = usage
    return merged


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
