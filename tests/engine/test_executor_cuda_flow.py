"""The overlap executor's CUDA flow, on CPU with stand-ins for streams and events.

What is checked is the protocol, not CUDA itself (the `gpu`-marked suites run the real thing): the
worker thread only launches (forward, copy to pinned host memory, event) and moves on to the next
step without waiting; the engine's `wait` is the only place that blocks on a step's event; timing
comes from the device events.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time

import pytest
import torch

from engine import executor as ex
from engine.model_runner import ForwardOutput


class _Event:
    log: list[tuple[str, str]] = []

    def __init__(self, enable_timing: bool = False) -> None:
        self.t: float | None = None

    def record(self, stream=None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        assert self.t is not None, "waited on an event never recorded"
        _Event.log.append(("synchronize", threading.current_thread().name))

    def elapsed_time(self, other: _Event) -> float:
        return (other.t - self.t) * 1e3


class _Stream:
    def __init__(self, device=None) -> None:
        pass

    def wait_stream(self, other) -> None:
        pass


@pytest.fixture
def fake_cuda(monkeypatch):
    _Event.log = []
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, pin_memory=False, **k: empty(*a, **k))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, s: None, raising=False)
    yield


def test_worker_launches_ahead_and_only_the_engine_waits(fake_cuda):
    launched: list[int] = []

    def forward(step: int) -> ForwardOutput:
        launched.append(step)
        return ForwardOutput(torch.tensor([step, step + 1]), torch.tensor([-0.5, -1.5]), None)

    executor = ex.ThreadExecutor(forward, torch.device("cuda"), lambda: 0.0)
    try:
        futures = [executor.launch(step) for step in range(3)]
        for _ in range(200):  # the worker gets through all three without anyone waiting
            if len(launched) == 3 and all(f.done() for f in futures):
                break
            time.sleep(0.01)
        assert launched == [0, 1, 2] and all(f.done() for f in futures)
        assert _Event.log == []  # nothing has blocked on a step yet
        outs = [executor.wait(f) for f in futures]
    finally:
        executor.shutdown()
    assert [o.next_ids for o in outs] == [[0, 1], [1, 2], [2, 3]]
    assert outs[0].logprobs == [-0.5, -1.5] and outs[0].prompt_logprobs is None
    waiter = threading.current_thread().name
    assert _Event.log == [("synchronize", waiter)] * 3  # one wait per step, by the caller of wait()
    stats = executor.stats
    assert stats.steps == 3 and stats.forward_time > 0 and stats.bubble_time >= 0


def test_short_switch_interval_lasts_only_while_the_worker_runs(fake_cuda):
    before = sys.getswitchinterval()
    executor = ex.ThreadExecutor(lambda step: None, torch.device("cuda"), lambda: 0.0)
    assert sys.getswitchinterval() <= 2e-4
    executor.shutdown()
    assert sys.getswitchinterval() == before  # a normal-loop engine started next is unaffected


def test_forward_errors_surface_at_wait(fake_cuda):
    def forward(step: int) -> ForwardOutput:
        raise RuntimeError(f"step {step} failed")

    executor = ex.ThreadExecutor(forward, torch.device("cuda"), lambda: 0.0)
    try:
        fut = executor.launch(7)
        with pytest.raises(RuntimeError, match="step 7 failed"):
            executor.wait(fut)
    finally:
        executor.shutdown()
