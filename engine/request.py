"""A request's whole life inside one rank's engine."""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

from engine.outputs import FinishReason, RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams


class ReqState(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Req:
    """Scheduler-side state of one request.

    KV bookkeeping: `pages` hold the KV of token positions 0..kv_len-1 of `fill_ids`
    (prompt + known outputs); `prefix_pages` of them came from the radix cache (locked through
    `prefix_node`). Under the overlap loop, tokens sampled by launched but unprocessed batches are
    not in `output_ids` yet: `num_scheduled_outputs` counts them, and `pending_future` is the
    FutureMap id of the newest one, fed as the next decode input.
    """

    def __init__(self, rid: str, prompt_ids: list[int], params: SamplingParams,
                 on_output: Callable[[RequestOutput], None], detokenizer, eos_ids: set[int]) -> None:
        self.rid = rid
        self.prompt_ids = prompt_ids
        self.params = params
        self.on_output = on_output
        self.detok = detokenizer
        self.stop_ids = set(params.stop_token_ids or ()) | (set() if params.ignore_eos else eos_ids)
        self.output_ids: list[int] = []
        self.state = ReqState.WAITING
        self.finish_reason: FinishReason | None = None
        self.error: str | None = None
        self.metrics = RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(prompt_ids))
        # KV
        self.pages: list[int] = []
        self.num_prefix_pages = 0
        self.prefix_node = None
        self.kv_len = 0
        # overlap bookkeeping
        self.num_scheduled_outputs = 0
        self.pending_future: int | None = None
        self.epoch = 0  # bumped on retraction: results of batches launched before are dropped
        # text
        self.text = ""  # all finalized text (stop strings removed)
        self.emitted_len = 0  # chars of `text` already sent
        self.logprobs: list[float] | None = [] if params.logprobs else None
        self.top_logprobs: list[dict[int, float]] | None = [] if params.top_logprobs and params.logprobs else None
        self.prompt_logprobs: list[float | None] | None = None
        self.prompt_logprob_parts: list[float] = []  # accumulated over prefill chunks
        want_prompt_top = params.prompt_logprobs and params.top_logprobs > 0
        self.prompt_top_parts: list[dict[int, float]] | None = [] if want_prompt_top else None
        self.prompt_top_logprobs: list[dict[int, float] | None] | None = None

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.state == ReqState.FINISHED

    @property
    def wants_prompt_logprobs(self) -> bool:
        return self.params.prompt_logprobs and self.prompt_logprobs is None

    def append_token(self, token: int, logprob: float | None, top: dict[int, float] | None = None) -> None:
        """Record one sampled token (with its logprob, and the most likely tokens' where asked);
        decide whether it finishes the request."""
        self.output_ids.append(token)
        if self.logprobs is not None:
            self.logprobs.append(float(logprob))
        if self.top_logprobs is not None:
            self.top_logprobs.append(top or {})
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = time.time()
        skip_text = token in self.stop_ids
        if not skip_text:
            self.text += self.detok.append([token])
        if token in self.stop_ids:
            self.finish("stop")
        elif self._check_stop_strings():
            self.finish("stop")
        elif len(self.output_ids) >= self.params.max_tokens:
            self.finish("length")

    def _check_stop_strings(self) -> bool:
        stops = self.params.stop
        if not stops:
            return False
        # only the tail can hold a new match: the last delta plus the longest stop minus one
        start = max(0, self.emitted_len - max(len(s) for s in stops))
        best = -1
        for s in stops:
            i = self.text.find(s, start)
            if i != -1 and (best == -1 or i < best):
                best = i
        if best == -1:
            return False
        self.text = self.text[:best]
        return True

    def finish(self, reason: FinishReason, error: str | None = None) -> None:
        if self.state == ReqState.FINISHED:
            return
        if reason == "length":
            self.text += self.detok.flush()
        self.state = ReqState.FINISHED
        self.finish_reason = reason
        self.error = error
        self.metrics.finished_time = time.time()

    def make_output(self, new_token_ids: list[int]) -> RequestOutput:
        """The cumulative output with the delta since the last one; holds back text that could
        still turn out to be the start of a stop string."""
        if self.finished or not self.params.stop:
            visible = len(self.text)
        else:
            visible = max(self.emitted_len, len(self.text) - (max(len(s) for s in self.params.stop) - 1))
        delta = self.text[self.emitted_len:visible]
        self.emitted_len = visible
        return RequestOutput(
            request_id=self.rid,
            prompt_token_ids=self.prompt_ids,
            token_ids=list(self.output_ids),
            text=self.text[:visible],
            delta_token_ids=new_token_ids,
            delta_text=delta,
            finished=self.finished,
            finish_reason=self.finish_reason,
            error=self.error,
            logprobs=list(self.logprobs) if self.logprobs is not None else None,
            top_logprobs=list(self.top_logprobs) if self.top_logprobs is not None else None,
            prompt_logprobs=self.prompt_logprobs,
            prompt_top_logprobs=self.prompt_top_logprobs,
            metrics=self.metrics,
        )
