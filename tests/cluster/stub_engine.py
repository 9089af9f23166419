"""A stand-in engine that follows the `AsyncEngine` contract and really runs in lockstep.

Every step, each rank all-reduces its pending work over the control group (the lockstep header)
and then joins one all-reduce over the EP group (the MoE collective), even with nothing to do (the
idle batch). So a lost peer breaks the survivors' loops exactly as it would break the real engine's,
which is what the cluster layer's health machinery has to detect. Each request emits
`prompt[-1] + k + 1` for k = 0, 1, ... (mod vocab), independent of placement.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.parallel import ParallelContext
from engine.sampling_params import SamplingParams

VOCAB = 1000
CRASH_TOKEN = 999_999  # a prompt starting with it crashes the rank's loop (a failed forward)


@dataclass
class StubLoad:
    num_running: int
    num_waiting: int
    running_tokens: int = 0
    waiting_tokens: int = 0
    kv_usage: float = 0.0


@dataclass
class _Req:
    rid: str
    prompt: list[int]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    tokens: list[int] = field(default_factory=list)


class StubEngine:
    max_model_len = 4096
    vocab_size = VOCAB
    step_s = 0.02
    stall_timeout_s = 5.0

    def __init__(
        self, config: EngineConfig, parallel: ParallelContext, *, hang_rank: int | None = None
    ) -> None:
        # `hang_rank`: that rank's loop blocks forever once it has work (a wedged kernel or a
        # stuck collective), without dying: only the stall checks can notice.
        self.hang = hang_rank == parallel.rank
        self.config = config
        self.parallel = parallel
        self.model = None
        self._lock = threading.Lock()
        self._reqs: dict[str, _Req] = {}
        self._stop = False
        self._error: BaseException | None = None
        self._last_progress = time.monotonic()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="stub-engine")
        self._thread.start()

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("empty prompt")
        if len(prompt_token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError("prompt + max_tokens exceeds max_model_len")

    async def generate(
        self, prompt_token_ids: list[int], params: SamplingParams, *, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        req = _Req(
            request_id, list(prompt_token_ids), params, asyncio.get_running_loop(), asyncio.Queue()
        )
        with self._lock:
            if self._error is not None:
                req.queue.put_nowait(self._failed(req))
            else:
                self._reqs[request_id] = req
        while True:
            out = await req.queue.get()
            yield out
            if out.finished:
                return

    def abort(self, request_id: str) -> None:
        with self._lock:
            req = self._reqs.pop(request_id, None)
        if req is not None:
            self._emit(req, finished=True, reason="abort")

    def load(self) -> StubLoad:
        with self._lock:
            return StubLoad(num_running=len(self._reqs), num_waiting=0)

    def check_health(self) -> None:
        if self._error is not None:
            raise RuntimeError(f"engine loop died: {self._error!r}")
        if not self._thread.is_alive():
            raise RuntimeError("engine loop is not running")
        stalled = time.monotonic() - self._last_progress
        if stalled > self.stall_timeout_s:
            raise RuntimeError(f"engine loop made no progress for {stalled:.1f} s")

    def shutdown(self) -> None:
        self._stop = True
        self._thread.join(timeout=5)

    # -- loop ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        try:
            while True:
                with self._lock:
                    local = list(self._reqs.values())
                if self.hang and local:
                    threading.Event().wait()
                header = torch.tensor([len(local), int(self._stop)], dtype=torch.int64)
                if self.parallel.is_distributed:
                    dist.all_reduce(header, group=self.parallel.control_group)
                    # The "MoE collective": every rank joins it, idle or not.
                    dist.all_reduce(torch.ones(4), group=self.parallel.ep_group)
                self._last_progress = time.monotonic()
                if header[1] > 0:
                    return
                for req in local:
                    if req.prompt[0] == CRASH_TOKEN:
                        raise RuntimeError("simulated crash in the forward")
                    req.tokens.append((req.prompt[-1] + len(req.tokens) + 1) % VOCAB)
                    if len(req.tokens) >= req.params.max_tokens:
                        with self._lock:
                            self._reqs.pop(req.rid, None)
                        self._emit(req, finished=True, reason="length")
                    else:
                        self._emit(req, finished=False, reason=None)
                time.sleep(self.step_s)
        except BaseException as e:  # a peer vanished: fail everything pending, like the engine
            with self._lock:
                self._error = e
                pending = list(self._reqs.values())
                self._reqs.clear()
            for req in pending:
                req.loop.call_soon_threadsafe(req.queue.put_nowait, self._failed(req))

    def _failed(self, req: _Req) -> RequestOutput:
        return RequestOutput(
            req.rid,
            req.prompt,
            list(req.tokens),
            f"pid={os.getpid()}",
            finished=True,
            finish_reason="abort",
            error=f"engine failed: {self._error!r}",
        )

    def _emit(self, req: _Req, *, finished: bool, reason: str | None) -> None:
        out = RequestOutput(
            req.rid,
            req.prompt,
            list(req.tokens),
            f"pid={os.getpid()}",  # tells tests which rank process served the request
            delta_token_ids=req.tokens[-1:],
            finished=finished,
            finish_reason=reason,  # type: ignore[arg-type]
        )
        req.loop.call_soon_threadsafe(req.queue.put_nowait, out)
