"""OpenAI response bodies and SSE chunks built from engine `RequestOutput`s."""

from __future__ import annotations

import dataclasses
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
    echo_ids: list[int] | None = None  # completions echo: the prompt goes ahead of the completion
    echo_text: str = ""  # ... as the client sent it (a token-id prompt: decoded)
    hide_output: bool = False  # max_tokens 0 (with echo): the one generated token is not reported
    created: int = field(default_factory=lambda: int(time.time()))
    _sent_tokens: int = 0  # tokens already described in streamed logprobs
    _echoed: bool = False
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
        tops = [t or {} for t in list(tops or [])[: len(lps)]] + [{}] * (len(lps) - len(tops or []))
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
        top_dicts: list[dict[str, float] | None] = []
        for t, lp, top in zip(toks, lps, tops, strict=True):
            if lp is None:  # the first prompt token (echo) has no logprob
                top_dicts.append(None)
                continue
            d = {self.tokenizer.decode([i]): v for i, v in (top or {}).items()}
            d.setdefault(t, lp)
            top_dicts.append(d)
        return {
            "tokens": toks,
            "token_logprobs": lps,
            "top_logprobs": top_dicts,
            "text_offset": offsets,
        }

    # ---- full (non-streaming) response -------------------------------------------------------------
    def _echo(self, out: Any) -> tuple[str, dict[str, Any] | None]:
        """The prompt's text and (with logprobs) its logprobs, for echo."""
        ids = self.echo_ids or []
        lp = None
        if self.logprobs:
            lp = self._logprobs(ids, out.prompt_logprobs or [None] * len(ids), out.prompt_top_logprobs)
        return self.echo_text, lp

    def _shown(self, out: Any) -> Any:
        """`out` as reported: without its generated token under max_tokens 0."""
        if not self.hide_output:
            return out
        return dataclasses.replace(out, token_ids=[], text="", delta_text="", logprobs=[],
                                   top_logprobs=[] if out.top_logprobs is not None else None,
                                   finish_reason="length" if out.finished else out.finish_reason)

    def full(self, out: Any) -> dict[str, Any]:
        out = self._shown(out)
        head_text, head_lp = self._echo(out) if self.echo_ids is not None else ("", None)
        lp = self._logprobs(list(out.token_ids), out.logprobs, out.top_logprobs)
        if head_lp is not None:
            lp = {k: head_lp[k] + lp[k] for k in lp}
        out = dataclasses.replace(out, text=head_text + out.text) if self.echo_ids is not None else out
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
        out = self._shown(out)
        head_text, head_lp = "", None
        if self.echo_ids is not None and not self._echoed:  # the first chunk carries the prompt
            self._echoed = True
            head_text, head_lp = self._echo(out)
            out = dataclasses.replace(out, delta_text=head_text + out.delta_text)
        new_ids = list(out.token_ids[self._sent_tokens :])
        lps = None
        if self.logprobs and out.logprobs is not None and new_ids:
            tops = out.top_logprobs[self._sent_tokens :] if out.top_logprobs is not None else None
            lps = self._logprobs(new_ids, list(out.logprobs[self._sent_tokens :]), tops)
        if head_lp is not None:
            lps = head_lp if lps is None else {k: head_lp[k] + lps[k] for k in lps}
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

    def usage_chunk(self, outs: list[Any], prompt_tokens: int | None = None) -> str:
        """The closing usage chunk over the last output of each choice; `prompt_tokens`: of all
        the request's prompts (default this builder's), each counted once."""
        outs = [self._shown(o) for o in outs]
        cached = outs[0].metrics.num_cached_tokens if outs[0].metrics is not None else 0
        usage = self.usage(sum(len(o.token_ids) for o in outs), cached)
        if prompt_tokens is not None:
            usage["prompt_tokens"] = prompt_tokens
            usage["total_tokens"] = prompt_tokens + usage["completion_tokens"]
        return self._chunk([], usage=usage)


def merge_full(bodies: list[dict[str, Any]], n: int = 1) -> dict[str, Any]:
    """One response from single-choice bodies in index order (n per prompt): each prompt counted
    once, completion tokens summed, as OpenAI reports them."""
    merged = dict(bodies[0])
    merged["choices"] = [c for b in bodies for c in b["choices"]]
    usage = dict(bodies[0]["usage"])
    usage["prompt_tokens"] = sum(b["usage"]["prompt_tokens"] for b in bodies[::n])
    usage["completion_tokens"] = sum(b["usage"]["completion_tokens"] for b in bodies)
    usage["total_tokens"] = usage["prompt_tokens"] + usage["completion_tokens"]
    merged["usage"] = usage
    return merged


def sse(body: dict[str, Any]) -> str:
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"
