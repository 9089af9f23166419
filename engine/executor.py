"""Forward executors: where a launched step runs while the scheduler goes on.

`InlineExecutor` runs the step at launch (the normal loop). `ThreadExecutor` plays the role of a
CUDA stream for the overlap loop: launched steps run in launch order on one worker thread while
the scheduler goes on (on CPU the two share the GIL, and each tensor op of the forward waits for it
when it returns). On CUDA the worker only launches:
the forward on its own stream, then the copy of the results to pinned host memory on a copy
stream with an event, and goes on to the next step (its input ids come from the FutureMap on the
device, so it needs nothing from the host); `wait()`, called where the engine processes the step,
is the only place that blocks on that event.

For one CPU rank the overlap loop uses `ProcessExecutor` instead (`engine/process_executor.py`):
same contract, but the forward runs in a child process with a GIL of its own (a single CUDA rank
may choose it too, to take the forward's kernel launches off the scheduler's GIL).

All record per-step timing: forward time, and the idle gap between consecutive steps while the
engine had work (the "bubble" the overlap loop exists to remove). On CUDA both come from timing
events on the forward stream, i.e. the device's own busy and idle time.
"""

from __future__ import annotations

import queue
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from engine.forward_batch import ForwardBatch
from engine.model_runner import ForwardOutput


class ExecutorDied(RuntimeError):
    """The executor itself is gone (not one step's error): the engine loop cannot go on."""


@dataclass
class HostOutput:
    next_ids: list[int] | None
    logprobs: list[float] | None
    prompt_logprobs: list[float] | None
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    prompt_top_ids: list[list[int]] | None = None
    prompt_top_logprobs: list[list[float]] | None = None


@dataclass
class ExecutorStats:
    steps: int = 0
    forward_time: float = 0.0
    bubble_time: float = 0.0  # worker idle between steps while work was pending
    _last_end: float | None = None
    _idle_mark: float = 0.0

    def record(self, start: float, end: float, engine_idle_total: float) -> None:
        """One step ran from `start` to `end`; `engine_idle_total` is the engine's running total
        of time blocked with nothing to do, which does not count as a bubble."""
        if self._last_end is not None:
            self.bubble_time += max(0.0, start - self._last_end - (engine_idle_total - self._idle_mark))
        self._last_end, self._idle_mark = end, engine_idle_total
        self.steps += 1
        self.forward_time += end - start


class _DeviceStep:
    """A launched CUDA step: results on their way to pinned host memory, and its timing events."""

    __slots__ = ("host", "done", "start", "end", "idle_at_launch")

    def __init__(self, host: list, done, start, end, idle_at_launch: float) -> None:
        self.host, self.done, self.start, self.end = host, done, start, end
        self.idle_at_launch = idle_at_launch

    def wait(self) -> HostOutput:
        self.done.synchronize()
        return HostOutput(*[h.tolist() if h is not None else None for h in self.host])


class _CudaCopier:
    """Forward stream + copy stream + events for one worker (CUDA only)."""

    def __init__(self, device) -> None:
        self.forward_stream = torch.cuda.Stream(device)
        self.copy_stream = torch.cuda.Stream(device)
        self.origin = torch.cuda.Event(enable_timing=True)  # device times are measured from here
        self.origin.record(self.forward_stream)

    def seconds(self, event) -> float:
        return self.origin.elapsed_time(event) / 1e3

    def launch(self, fn: Callable[[], ForwardOutput], idle_total: float) -> _DeviceStep:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.forward_stream):
            start.record()
            out = fn()
            end.record()
        done = torch.cuda.Event()
        self.copy_stream.wait_stream(self.forward_stream)
        with torch.cuda.stream(self.copy_stream):
            host = []
            for t in out.host_tensors():
                if t is not None:
                    h = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                    h.copy_(t, non_blocking=True)
                    t.record_stream(self.copy_stream)
                    t = h
                host.append(t)
            done.record(self.copy_stream)
        return _DeviceStep(host, done, start, end, idle_total)  # nobody waits here


def to_host(out: ForwardOutput) -> HostOutput:
    return HostOutput(*[t.tolist() if t is not None else None for t in out.host_tensors()])


class _Executor:
    """Runs a step, timing it, and settles its future; subclasses decide where it runs."""

    def __init__(self, forward: Callable[[ForwardBatch], ForwardOutput], idle_clock: Callable[[], float],
                 cuda: _CudaCopier | None = None) -> None:
        self._forward = forward
        self._idle_clock = idle_clock
        self._cuda = cuda
        self.stats = ExecutorStats()

    def _run(self, fb: ForwardBatch, fut: Future) -> None:
        start = time.perf_counter()
        try:
            if self._cuda is not None:
                out = self._cuda.launch(lambda: self._forward(fb), self._idle_clock())
            else:
                out = to_host(self._forward(fb))
                self.stats.record(start, time.perf_counter(), self._idle_clock())
        except BaseException as e:  # surfaced to the loop through the future
            fut.set_exception(e)
            return
        fut.set_result(out)

    def wait(self, fut: Future) -> HostOutput:
        """The step's host results (the engine calls this for each launched step, in launch order)."""
        out = fut.result()
        if isinstance(out, _DeviceStep):
            host = out.wait()
            self.stats.record(self._cuda.seconds(out.start), self._cuda.seconds(out.end), out.idle_at_launch)
            return host
        return out

    def shutdown(self) -> None:
        pass


class InlineExecutor(_Executor):
    """Runs each step synchronously at launch (the normal loop)."""

    def launch(self, fb: ForwardBatch) -> Future:
        fut: Future = Future()
        self._run(fb, fut)
        return fut


class ThreadExecutor(_Executor):
    """Runs launched steps in order on a worker thread (own CUDA stream when on GPU)."""

    def __init__(self, forward: Callable[[ForwardBatch], ForwardOutput], device: torch.device,
                 idle_clock: Callable[[], float]) -> None:
        super().__init__(forward, idle_clock, _CudaCopier(device) if device.type == "cuda" else None)
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        # The worker gives up the GIL at every host sync inside a forward; with the default 5 ms
        # switch interval the scheduler thread may then hold it that long while the device idles.
        # A short interval bounds that stall (the scheduler thread's work is what overlaps).
        self._switch_interval = sys.getswitchinterval()  # restored at shutdown
        if self._cuda is not None:  # on CPU the forward's own tensor work releases the GIL anyway
            sys.setswitchinterval(min(self._switch_interval, 2e-4))
        self._thread = threading.Thread(target=self._work, name="forward-executor", daemon=True)
        self._thread.start()

    def launch(self, fb: ForwardBatch) -> Future:
        fut: Future = Future()
        self._queue.put((fb, fut))
        return fut

    def _work(self) -> None:
        torch.set_grad_enabled(False)
        while (item := self._queue.get()) is not None:
            self._run(*item)

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)
        sys.setswitchinterval(self._switch_interval)
