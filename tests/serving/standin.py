"""A stand-in rank deployment for ingress tests while `cluster.serve_rank` / `AsyncEngine` are not
available: same methods (generate/abort/load/info/check_health/record_routing_stats), a
deterministic fake engine behind them. Only used when the real modules cannot be imported."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

from ray import serve

from engine.config import EngineConfig
from engine.outputs import RequestMetrics, RequestOutput
from engine.sampling_params import SamplingParams
from serving.router import rank_routing_stats
from serving.tokenizer import load_tokenizer, model_limits


class FakeEngine:
    """Next token = f(previous), text by full decode; honours max_tokens, stop strings, abort."""

    def __init__(self, config: EngineConfig) -> None:
        self.tokenizer = load_tokenizer(config)
        self.vocab_size = model_limits(config).vocab_size
        self.running: dict[str, int] = {}
        self.aborted: set[str] = set()

    async def generate(
        self, ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        metrics = RequestMetrics(arrival_time=time.time(), num_prompt_tokens=len(ids))
        self.running[request_id] = len(ids)
        toks: list[int] = []
        text = ""
        try:
            prev = ids[-1]
            for _ in range(params.max_tokens):
                await asyncio.sleep(0.005)
                if request_id in self.aborted:
                    return
                prev = (prev * 31 + 7) % (self.vocab_size - 16) + 16
                toks.append(prev)
                full = self.tokenizer.decode(toks)
                finish = "length" if len(toks) == params.max_tokens else None
                for s in params.stop or []:
                    if s in full:
                        full, finish = full[: full.index(s)], "stop"
                delta, text = full[len(text) :], full
                yield RequestOutput(
                    request_id=request_id,
                    prompt_token_ids=ids,
                    token_ids=list(toks),
                    text=text,
                    delta_token_ids=[prev],
                    delta_text=delta,
                    finished=finish is not None,
                    finish_reason=finish,
                    logprobs=[-1.0] * len(toks) if params.logprobs else None,
                    metrics=metrics,
                )
                if finish:
                    return
        finally:
            self.running.pop(request_id, None)

    def load(self) -> SimpleNamespace:
        n = len(self.running)
        return SimpleNamespace(
            num_running=n,
            num_waiting=0,
            running_tokens=sum(self.running.values()),
            waiting_tokens=0,
            kv_usage=0.0,
        )


@serve.deployment(name="EPRank")
class StandInRank:
    def __init__(self, config: EngineConfig) -> None:
        self.engine = FakeEngine(config)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: dict[str, Any]
    ) -> AsyncIterator[RequestOutput]:
        params = SamplingParams(**sampling_params)
        async for out in self.engine.generate(prompt_token_ids, params, request_id):
            yield out

    def abort(self, request_id: str) -> None:
        self.engine.aborted.add(request_id)

    def load(self) -> Any:
        return self.engine.load()

    def check_health(self) -> None:
        pass

    def record_routing_stats(self) -> dict[str, Any]:
        return rank_routing_stats(self.engine.load(), {"forward_steps": 1}, gang_rank=0)
