"""The offline API: `LLM(...).generate(...)` over one rank, or over an EP group of Ray actors."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Sequence

from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class LLM:
    def __init__(self, model: str = "tiny-dsv3", **kwargs) -> None:
        self.config = EngineConfig(model=model, **kwargs)
        if self.config.ep_size > 1:
            from cluster.offline import OfflineEPGroup  # Ray lives only in the cluster layer

            self._group = OfflineEPGroup(self.config)
            self._engine = None
            self.tokenizer = self._group.tokenizer
        else:
            from engine.engine import Engine

            self._group = None
            self._engine = Engine(self.config)
            self.tokenizer = self._engine.tokenizer

    @property
    def engine(self):
        return self._engine

    def _prompts_to_ids(self, prompts, prompt_token_ids) -> list[list[int]]:
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("prompts: give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            return [self.tokenizer.encode(p) for p in prompts]
        if prompt_token_ids and isinstance(prompt_token_ids[0], int):
            prompt_token_ids = [prompt_token_ids]
        return [list(p) for p in prompt_token_ids]

    def generate(self, prompts: str | Sequence[str] | None = None,
                 prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | dict | None = None,
                 ) -> list[RequestOutput]:
        """Run the prompts to completion; outputs in prompt order. Bad input raises ValueError
        before any request is admitted."""
        ids = self._prompts_to_ids(prompts, prompt_token_ids)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, dict):
            sampling_params = SamplingParams(**sampling_params)
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(ids)
        if len(params) != len(ids):
            raise ValueError("sampling_params: need one per prompt")
        if self._group is not None:
            return self._group.generate([(uuid.uuid4().hex, p, sp) for p, sp in zip(ids, params)])
        for p, sp in zip(ids, params):
            self._engine.validate(p, sp)
        results: dict[str, RequestOutput] = {}
        done = threading.Event()
        lock = threading.Lock()
        rids = [uuid.uuid4().hex for _ in ids]

        def on_output(out: RequestOutput) -> None:
            if out.finished:
                with lock:
                    results[out.request_id] = out
                    if len(results) == len(rids):
                        done.set()

        for rid, p, sp in zip(rids, ids, params):
            self._engine.add_request(p, sp, on_output, rid)
        while not done.wait(timeout=1.0):
            if self._engine.error is not None:
                raise RuntimeError(f"engine failed: {self._engine.error!r}")
        return [results[r] for r in rids]

    def shutdown(self) -> None:
        if self._group is not None:
            self._group.shutdown()
        if self._engine is not None:
            self._engine.shutdown()
