"""The overlap loop's forward executor in a process of its own (one rank: the default on CPU).

On CPU the forward is itself CPU work. In a thread it shares the GIL with the scheduler: each of
its several hundred tensor ops must take the GIL back when it returns, and waits while the
scheduler runs Python, so the scheduling the overlap loop means to hide is serialized with the
forward instead (measured: the forward slows by about what the loop saves). A child process has
its own interpreter, so scheduling and the forward really do run at once on two cores.

The child owns everything on the device side: model weights, KV pool, FutureMap and sampling
generator (`ModelRunner`). The scheduler stays in the parent, which is why a step's input ids may
be FutureMap placeholders exactly as with the thread executor.

Per step the parent copies the batch's tensors into a staging slot of a shared-memory arena (the
CPU counterpart of pinned host memory) and sends a small header through a socket; the child runs
the step on views of that slot and answers with the host results and the step's timing. Steps run
and answer in launch order. A slot is reused only after its step's answer has been received, so
the child never reads a slot the parent is refilling. A tensor that does not fit goes through the
socket instead (slower, still correct).

On CUDA (chosen with `forward_executor="process"`) the same holds for the forward's kernel launches:
without CUDA graphs a decode step of a small model is hundreds of Python-launched kernels, which in
a thread hold the GIL the scheduler needs. The child pins the arena (`cudaHostRegister`), so its
copies to the device are asynchronous, and answers once the step's results are on the host.

The child sizes the KV pool once its weights are loaded and reports the page count; the parent's
scheduler is built from it.

Not used with expert parallelism: a rank's MoE process groups live in its own process, where the
thread executor runs its forwards.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, fields, is_dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from engine.config import EngineConfig
from engine.executor import ExecutorDied, ExecutorStats, HostOutput, to_host
from engine.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

_ALIGN = 64
SLOT_BYTES = 8 << 20  # a 256-request decode batch stages ~0.2 MB; long prefills' masks go by socket
NUM_SLOTS = 3  # the overlap loop has at most two steps launched and unprocessed


@dataclass(frozen=True)
class RunnerSpec:
    """What the child needs to build the rank's `ModelRunner` (single rank)."""

    config: EngineConfig
    model_path: str
    max_model_len: int
    future_capacity: int


@dataclass(frozen=True)
class _Staged:
    """A tensor that travels in the arena: `nbytes` at `offset` of the step's slot."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _stage(value, slot: torch.Tensor, cursor: list[int]):
    """`value` with each tensor (in dataclasses and tuples, recursively) copied into `slot`."""
    if isinstance(value, torch.Tensor):
        nbytes = value.numel() * value.element_size()
        offset = -(-cursor[0] // _ALIGN) * _ALIGN
        if offset + nbytes > slot.numel():
            return value
        cursor[0] = offset + nbytes
        slot[offset:offset + nbytes].view(value.dtype).view(value.shape).copy_(value)
        return _Staged(offset, nbytes, value.dtype, tuple(value.shape))
    if is_dataclass(value) and not isinstance(value, type):
        return type(value)(**{f.name: _stage(getattr(value, f.name), slot, cursor) for f in fields(value)})
    if isinstance(value, tuple):
        return tuple(_stage(v, slot, cursor) for v in value)
    return value


def _unstage(value, slot: torch.Tensor):
    if isinstance(value, _Staged):
        return slot[value.offset:value.offset + value.nbytes].view(value.dtype).view(value.shape)
    if is_dataclass(value) and not isinstance(value, type):
        return type(value)(**{f.name: _unstage(getattr(value, f.name), slot) for f in fields(value)})
    if isinstance(value, tuple):
        return tuple(_unstage(v, slot) for v in value)
    return value


@dataclass(frozen=True)
class _Launch:
    seq: int
    slot: int | None  # None: every tensor is in `batch` itself
    batch: ForwardBatch


@dataclass(frozen=True)
class _Result:
    seq: int
    output: HostOutput | None
    error: BaseException | None
    start: float  # perf_counter (CLOCK_MONOTONIC: one clock for both processes)
    end: float
    a2a_wait_s: float


def _portable(e: BaseException) -> BaseException:
    """`e` if it survives pickling, else a RuntimeError carrying its text and traceback."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        text = "".join(traceback.format_exception(e))
        return RuntimeError(f"forward failed in the executor process: {e!r}\n{text}")


def _pin(arena: torch.Tensor) -> None:
    """Page-lock the arena for the device (it is the child's pinned host memory), so each step's
    host-to-device copies run asynchronously; unpinned, they are merely synchronous."""
    err = torch.cuda.cudart().cudaHostRegister(arena.data_ptr(), arena.numel(), 0)
    if int(err) != 0:
        logger.warning("could not pin the staging arena (cudaError %d); batches copy synchronously", int(err))


def _child_main(fd: int) -> None:
    """The executor process: build the runner, then run launched steps in order until told to stop
    or until the parent goes away (the socket reports EOF)."""
    from engine.model_runner import ModelRunner
    from engine.models.loader import load_model_config
    from engine.parallel import SINGLE_RANK

    torch.set_grad_enabled(False)
    conn = Connection(fd)
    try:
        arena_path, spec = conn.recv()
        arena = torch.from_file(arena_path, shared=True, size=NUM_SLOTS * SLOT_BYTES, dtype=torch.uint8)
        runner = ModelRunner(spec.config, load_model_config(spec.model_path), spec.model_path, SINGLE_RANK,
                             spec.max_model_len, spec.future_capacity)
        if runner.device.type == "cuda":
            _pin(arena)
    except BaseException as e:
        conn.send(_portable(e))
        return
    conn.send(runner.num_pages)  # ready; the parent's scheduler sizes its page table from it
    slots = arena.view(NUM_SLOTS, SLOT_BYTES)
    while True:
        try:
            msg: _Launch | None = conn.recv()
        except (EOFError, OSError):  # the parent is gone
            return
        if msg is None:
            return
        start = time.perf_counter()
        try:
            fb = _unstage(msg.batch, slots[msg.slot]) if msg.slot is not None else msg.batch
            host = to_host(runner.forward(fb))
            result = _Result(msg.seq, host, None, start, time.perf_counter(), runner.comm_stats.wait_s)
        except BaseException as e:
            result = _Result(msg.seq, None, _portable(e), start, time.perf_counter(), runner.comm_stats.wait_s)
        try:
            conn.send(result)
        except OSError:  # the parent is gone
            return


class _Pending:
    __slots__ = ("seq", "slot", "idle_at_launch")

    def __init__(self, seq: int, slot: int | None, idle_at_launch: float) -> None:
        self.seq, self.slot, self.idle_at_launch = seq, slot, idle_at_launch


class ProcessExecutor:
    """Runs launched steps in order in a child process; same contract as the thread executor:
    `launch` returns at once, `wait` (called in launch order) returns the step's host results or
    raises its error."""

    def __init__(self, spec: RunnerSpec, idle_clock: Callable[[], float], start_timeout_s: float = 300.0) -> None:
        self.stats = ExecutorStats()
        self.a2a_wait_s = 0.0
        self._idle_clock = idle_clock
        self._seq = 0
        self._next_result = 0
        # The arena is a file in shared memory mapped by both processes; it is unlinked once the
        # child has mapped it, so nothing outlives the two processes.
        shm_dir = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, arena_path = tempfile.mkstemp(prefix="moe-forward-", dir=shm_dir)
        os.close(fd)
        try:
            self._arena = torch.from_file(arena_path, shared=True, size=NUM_SLOTS * SLOT_BYTES, dtype=torch.uint8)
            self._slots = self._arena.view(NUM_SLOTS, SLOT_BYTES)
            self._free = list(range(NUM_SLOTS))
            self._proc = self._start_child(spec, arena_path, start_timeout_s)
        finally:
            os.unlink(arena_path)

    def _start_child(self, spec: RunnerSpec, arena_path: str, timeout_s: float) -> subprocess.Popen:
        # A fresh interpreter, not multiprocessing's spawn: spawn re-runs the parent's main script,
        # which breaks every caller without an `if __name__ == "__main__"` guard (and Ray workers).
        # Not fork either: the parent has threads and an OpenMP pool.
        parent_sock, child_sock = socket.socketpair()
        env = dict(os.environ)
        src = str(Path(__file__).resolve().parents[1])  # this `engine` package, whatever sys.path says
        env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-c", f"from engine.process_executor import _child_main; _child_main({child_sock.fileno()})"],
            pass_fds=(child_sock.fileno(),), env=env)
        child_sock.close()  # the child holds the only other end: its death reads as EOF here
        self._conn = Connection(parent_sock.detach())
        self._conn.send((arena_path, spec))
        if not self._conn.poll(timeout_s):
            proc.kill()
            proc.wait()
            raise RuntimeError(f"forward executor process did not start within {timeout_s:.0f}s")
        try:
            ready = self._conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"forward executor process exited at start (exit code {proc.wait()})") from None
        if isinstance(ready, BaseException):
            proc.wait()
            raise ready
        self.num_pages: int = ready
        return proc

    def launch(self, fb: ForwardBatch) -> _Pending:
        slot = self._free.pop() if self._free else None
        batch = _stage(fb, self._slots[slot], [0]) if slot is not None else fb
        pending = _Pending(self._seq, slot, self._idle_clock())
        try:
            self._conn.send(_Launch(self._seq, slot, batch))
        except OSError as e:  # BrokenPipeError, ConnectionResetError
            raise ExecutorDied(f"forward executor process died (exit code {self._exit_code()})") from e
        self._seq += 1
        return pending

    def wait(self, pending: _Pending) -> HostOutput:
        if pending.seq != self._next_result:
            raise RuntimeError(f"steps are waited on in launch order: expected {self._next_result}, got {pending.seq}")
        try:
            res: _Result = self._conn.recv()
        except (EOFError, OSError):
            raise ExecutorDied(f"forward executor process died (exit code {self._exit_code()})") from None
        self._next_result += 1
        if pending.slot is not None:
            self._free.append(pending.slot)
        self.a2a_wait_s = res.a2a_wait_s
        self.stats.record(res.start, res.end, pending.idle_at_launch)
        if res.error is not None:
            raise res.error
        return res.output

    def _exit_code(self) -> int | None:
        try:
            return self._proc.wait(timeout=5)
        except subprocess.TimeoutExpired:  # its socket closed but it has not exited yet
            return None

    def shutdown(self) -> None:
        with contextlib.suppress(OSError):  # a child that is already gone needs no stop message
            self._conn.send(None)
        try:
            self._proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()
        self._conn.close()
