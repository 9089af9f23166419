"""Asyncio front of an `Engine`: one async iterator of incremental outputs per request."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

from engine.config import EngineConfig
from engine.engine import Engine, EngineLoad, EngineStats
from engine.outputs import RequestOutput
from engine.parallel import SINGLE_RANK, ParallelContext
from engine.sampling_params import SamplingParams

__all__ = ["AsyncEngine", "EngineLoad", "EngineStats"]


class AsyncEngine:
    def __init__(self, config: EngineConfig, parallel: ParallelContext = SINGLE_RANK) -> None:
        self.engine = Engine(config, parallel)
        self.config = config
        self.tokenizer = self.engine.tokenizer
        self.max_model_len = self.engine.max_model_len
        self.vocab_size = self.engine.vocab_size
        self.model = self.engine.model

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.engine.validate(prompt_token_ids, params)

    async def generate(self, prompt_token_ids: list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield the request's cumulative output after each step that changed it; the last one
        has `finished=True`. Leaving the iterator early (cancellation, aclose) aborts the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue[RequestOutput] = asyncio.Queue()
        rid = request_id or uuid.uuid4().hex
        self.engine.add_request(prompt_token_ids, params,
                                lambda out: loop.call_soon_threadsafe(q.put_nowait, out), rid)
        finished = False
        try:
            while True:
                out = await q.get()
                while not out.finished and not q.empty():  # coalesce what piled up
                    nxt = q.get_nowait()
                    nxt.delta_token_ids = out.delta_token_ids + nxt.delta_token_ids
                    nxt.delta_text = out.delta_text + nxt.delta_text
                    out = nxt
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if not finished:
                self.engine.abort(rid)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def load(self) -> EngineLoad:
        return self.engine.load()

    def stats(self) -> EngineStats:
        return self.engine.stats()

    def check_health(self) -> None:
        self.engine.check_health()

    def shutdown(self) -> None:
        self.engine.shutdown()
