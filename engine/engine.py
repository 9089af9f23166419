"""One rank's engine: a loop thread that schedules, launches forwards and processes results.

The two loops below are the policy; everything they call is mechanics.

    normal:  receive -> schedule N -> run N -> process N
    overlap: receive -> schedule N+1 -> launch N+1 -> process N (while N+1 runs)

With expert parallelism every step is also agreed with the other ranks of the group (a tiny
header all-gathered on the control group): if any rank has work, all run a forward, those without
work an idle batch of zero tokens, because every MoE layer is a collective.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.executor import ExecutorDied, ExecutorStats, HostOutput, InlineExecutor, ThreadExecutor
from engine.forward_batch import ForwardMode
from engine.lockstep import Lockstep
from engine.model_runner import ModelRunner
from engine.models.loader import load_model_config, resolve_model_path
from engine.outputs import RequestOutput
from engine.parallel import SINGLE_RANK, ParallelContext
from engine.process_executor import ProcessExecutor, RunnerSpec
from engine.request import Req
from engine.sampling_params import SamplingParams
from engine.sched.batch import ScheduledBatch, idle_batch
from engine.sched.scheduler import FutureIds, Scheduler
from engine.tbo import make_children, plan_split
from engine.tokenizer import IncrementalDetokenizer, load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class EngineLoad:
    num_running: int
    num_waiting: int
    running_tokens: int
    waiting_tokens: int
    kv_usage: float


@dataclass
class EngineStats:
    steps: int
    prefill_steps: int
    decode_steps: int
    idle_steps: int
    forward_time_s: float
    schedule_time_s: float
    bubble_time_s: float
    generated_tokens: int
    prefill_tokens: int
    cached_tokens: int
    retractions: int
    overlap: bool
    tbo_steps: int
    sbo: bool
    last_batch_size: int
    last_step_tokens: int
    a2a_wait_s: float  # time blocked in all-to-all waits (dispatch_b / combine_b)

    @property
    def idle_fraction(self) -> float:
        """Share of the executor's busy span lost to gaps between consecutive forwards."""
        span = self.forward_time_s + self.bubble_time_s
        return self.bubble_time_s / span if span else 0.0


@dataclass
class _Add:
    req: Req


@dataclass
class _Abort:
    rid: str


@dataclass
class _Reset:
    done: threading.Event


class Engine:
    def __init__(self, config: EngineConfig, parallel: ParallelContext = SINGLE_RANK) -> None:
        self.config = config
        self.parallel = parallel
        path = resolve_model_path(config.model)
        hf = load_model_config(path)
        self.hf_config = hf
        self.tokenizer = load_tokenizer(config.tokenizer or path)
        self.vocab_size = hf.vocab_size
        self.max_model_len = min(config.max_model_len or hf.max_position_embeddings, hf.max_position_embeddings)
        self.eos_ids = {hf.eos_token_id} if isinstance(hf.eos_token_id, int) else set(hf.eos_token_id or ())
        if self.tokenizer.eos_token_id is not None:
            self.eos_ids.add(self.tokenizer.eos_token_id)
        executor = config.resolved_forward_executor
        self.overlap = executor != "inline"
        self._idle_time = 0.0  # time the loop spent blocked with nothing to do

        def idle_clock() -> float:
            return self._idle_time

        # With the process executor the model lives in the child; this process only schedules.
        # The runner sizes the KV pool once its weights are loaded; the scheduler follows it.
        self.runner: ModelRunner | None = None
        future_capacity = FutureIds.capacity_for(config.max_running_requests)
        if executor == "process":
            spec = RunnerSpec(config, str(path), self.max_model_len, future_capacity)
            self.executor = ProcessExecutor(spec, idle_clock)
            num_pages = self.executor.num_pages
        else:
            self.runner = ModelRunner(config, hf, path, parallel, self.max_model_len, future_capacity)
            num_pages = self.runner.num_pages
            if executor == "thread":
                self.executor = ThreadExecutor(self.runner.forward, self.runner.device, idle_clock)
            else:
                self.executor = InlineExecutor(self.runner.forward, idle_clock)
        self.scheduler = Scheduler(config, num_pages, self.max_model_len, self.vocab_size)
        self.kv_capacity_tokens = self.scheduler.allocator.capacity * config.page_size
        self.model = self.runner.model if self.runner is not None else None
        self.lockstep = Lockstep(parallel, config)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._group_stopped = False
        self.error: BaseException | None = None
        self.last_progress = time.monotonic()
        self._counters = dict(steps=0, prefill_steps=0, decode_steps=0, idle_steps=0, schedule_time=0.0,
                              generated=0, prefill_tokens=0, cached=0, last_bs=0,
                              last_tokens=0, tbo_steps=0)
        self._thread = threading.Thread(target=self._run, name=f"engine-loop-r{parallel.rank}", daemon=True)
        self._thread.start()
        if config.warmup:
            self._warm_up()

    _WARMUP_TIMEOUT_S = 1800.0  # DeepGEMM compiles its kernels on first use: minutes, not seconds

    def _warm_up(self) -> None:
        """One short request through the loop before any other (every rank of a group does the
        same, so its steps run in lockstep like any other). It leaves no trace: its tokens leave
        the prefix cache, and step counters and timing restart at zero."""
        t0 = time.monotonic()
        finished = threading.Event()
        # 16 prompt tokens and 3 outputs where the context and the pool allow
        n = max(1, min(16, self.max_model_len - 4, self.kv_capacity_tokens - 4))
        prompt = [1 + i % (self.vocab_size - 1) for i in range(n)]
        max_tokens = max(1, min(3, self.max_model_len - n - 1, self.kv_capacity_tokens - n))
        req = Req("warmup", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0),
                  lambda out: finished.set() if out.finished else None,
                  IncrementalDetokenizer(self.tokenizer, prompt), self.eos_ids)
        self._inbox.put(_Add(req))
        if not finished.wait(self._WARMUP_TIMEOUT_S):
            raise RuntimeError(f"engine warm-up did not finish within {self._WARMUP_TIMEOUT_S:.0f}s")
        if self.error is not None:
            raise RuntimeError(f"engine warm-up failed: {self.error!r}")
        if req.error:
            raise RuntimeError(f"engine warm-up failed: {req.error}")
        reset = _Reset(threading.Event())
        self._inbox.put(reset)
        reset.done.wait(self._WARMUP_TIMEOUT_S)
        logger.info("rank %d warmed up in %.2fs", self.parallel.rank, time.monotonic() - t0)

    def _reset_after_warm_up(self) -> None:
        """(loop thread) Forget the warm-up: cached prefix pages, counters, forward timing."""
        if self.scheduler.radix is not None:
            self.scheduler.radix.evict(self.scheduler.allocator.num_pages)
        for k, v in self._counters.items():
            self._counters[k] = type(v)()
        self.executor.stats = ExecutorStats()
        if self.runner is not None:
            self.runner.comm_stats.wait_s = 0.0
        self._idle_time = 0.0

    # ------------------------------------------------------------------ API (any thread)
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if not prompt_token_ids:
            raise ValueError("prompt: must not be empty")
        bad = [t for t in prompt_token_ids if not (0 <= int(t) < self.vocab_size)]
        if bad:
            raise ValueError(f"prompt_token_ids: {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(f"prompt: {n} tokens, the model's context is {self.max_model_len}")
        if n + params.max_tokens > self.max_model_len:
            raise ValueError(f"max_tokens: prompt ({n}) + max_tokens ({params.max_tokens}) exceeds the "
                             f"model's context of {self.max_model_len} tokens")
        if n + params.max_tokens > self.kv_capacity_tokens:
            raise ValueError(f"prompt: {n} + max_tokens {params.max_tokens} tokens exceed the KV pool "
                             f"({self.kv_capacity_tokens} tokens)")
        if params.stop_token_ids and any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise ValueError("stop_token_ids: ids outside the vocabulary")
        if params.logit_bias and any(not 0 <= t < self.vocab_size for t in params.logit_bias):
            raise ValueError(f"logit_bias: token ids must lie in [0, {self.vocab_size})")

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams,
                    on_output: Callable[[RequestOutput], None], request_id: str | None = None) -> str:
        """Validate and queue a request; `on_output` is called from the loop thread per update."""
        if self.error is not None or self._stop.is_set():
            raise RuntimeError(f"engine is not running: {self.error!r}")
        prompt_token_ids = [int(t) for t in prompt_token_ids]
        self.validate(prompt_token_ids, params)
        rid = request_id or uuid.uuid4().hex
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids)
        self._inbox.put(_Add(Req(rid, prompt_token_ids, params, on_output, detok, self.eos_ids)))
        return rid

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def load(self) -> EngineLoad:
        return EngineLoad(**self.scheduler.load())

    def stats(self) -> EngineStats:
        c, s = self._counters, self.executor.stats
        return EngineStats(
            steps=c["steps"], prefill_steps=c["prefill_steps"], decode_steps=c["decode_steps"],
            idle_steps=c["idle_steps"], forward_time_s=s.forward_time, schedule_time_s=c["schedule_time"],
            bubble_time_s=s.bubble_time, generated_tokens=c["generated"],
            prefill_tokens=c["prefill_tokens"], cached_tokens=c["cached"],
            retractions=self.scheduler.num_retractions, overlap=self.overlap, tbo_steps=c["tbo_steps"],
            sbo=self.config.enable_single_batch_overlap, last_batch_size=c["last_bs"],
            last_step_tokens=c["last_tokens"],
            a2a_wait_s=self.runner.comm_stats.wait_s if self.runner is not None else self.executor.a2a_wait_s)

    def check_health(self) -> None:
        stall_timeout = self.config.stall_timeout_s
        if self.error is not None:
            raise RuntimeError(f"engine loop died: {self.error!r}")
        if not self._thread.is_alive():
            raise RuntimeError("engine loop is not running")
        if self.scheduler.has_work and time.monotonic() - self.last_progress > stall_timeout:
            raise RuntimeError(f"engine made no progress for {stall_timeout:.0f}s with work pending")

    def shutdown(self) -> None:
        self._stop.set()
        self._inbox.put(None)
        self._thread.join(timeout=10)
        self.executor.shutdown()

    # ------------------------------------------------------------------ loops (loop thread)
    def _run(self) -> None:
        torch.set_grad_enabled(False)
        if self.runner is None:
            # Forwards run in the executor process; this thread's tensor work is the scheduler's,
            # tiny, and an OpenMP team here would spin on the core the forward needs.
            torch.set_num_threads(1)
        try:
            self._overlap_loop() if self.overlap else self._normal_loop()
            for req in self.scheduler.fail_all("engine shut down"):
                req.on_output(req.make_output([]))
        except BaseException as e:  # the loop is gone: fail everything, health checks report it
            logger.exception("engine loop died")
            self.error = e
            for req in self.scheduler.fail_all(f"engine failed: {e!r}"):
                req.on_output(req.make_output([]))

    def _normal_loop(self) -> None:
        while not self._group_stopped:
            self._receive(block=not self.scheduler.has_work)
            step = self._schedule()
            if step is not None:
                self._finish(step, self._launch(step))

    def _overlap_loop(self) -> None:
        last = None
        while not self._group_stopped:
            self._receive(block=not self.scheduler.has_work and last is None)
            step = self._schedule()
            pending = self._launch(step) if step is not None else None
            if last is not None:
                self._finish(*last)
            last = (step, pending) if step is not None else None

    # ------------------------------------------------------------------ mechanics
    def _receive(self, block: bool) -> None:
        if self._stop.is_set():
            block = False
        if block and not self.lockstep.active:
            t0 = time.perf_counter()
            msg = self._inbox.get()
            self._idle_time += time.perf_counter() - t0
            self._handle(msg)
        elif block:  # other ranks may have work: poll briefly, then take part in the next step
            t0 = time.perf_counter()
            try:
                self._handle(self._inbox.get(timeout=0.002))
            except queue.Empty:
                pass
            self._idle_time += time.perf_counter() - t0
        while True:
            try:
                self._handle(self._inbox.get_nowait())
            except queue.Empty:
                return

    def _handle(self, msg) -> None:
        if isinstance(msg, _Add):
            self.scheduler.add(msg.req)
        elif isinstance(msg, _Reset):
            self._reset_after_warm_up()
            msg.done.set()
        elif isinstance(msg, _Abort):
            req = self.scheduler.abort(msg.rid)
            if req is not None:
                req.on_output(req.make_output([]))

    def _schedule(self):
        """Schedule this rank's next step and agree on it with the group; None when no rank has work."""
        t0 = time.perf_counter()
        step = self.scheduler.schedule()
        fb = step.forward if step is not None else None
        headers = self.lockstep.agree(fb, stopping=self._stop.is_set())
        self._counters["schedule_time"] += time.perf_counter() - t0
        # a group stops together: a rank leaving alone would strand the others in a collective
        self._group_stopped = self.lockstep.all_stopping(headers)
        if not self.lockstep.any_work(headers):
            return None
        if step is None:
            fb = idle_batch()
            step = ScheduledBatch(ForwardMode.IDLE, [], [], [], [], [], fb)
        fb.global_num_tokens = [h.num_tokens for h in headers]
        fb.can_run_tbo = self.lockstep.can_run_tbo(headers)
        fb.moe_a2a_mode = self.lockstep.group_a2a_mode(headers)
        if fb.can_run_tbo:
            fb.tbo_children = make_children(fb, plan_split(fb, self.config.tbo_token_distribution_threshold))
            self._counters["tbo_steps"] += 1
        return step

    def _launch(self, step: ScheduledBatch):
        c = self._counters
        c["steps"] += 1
        c["last_bs"] = len(step.reqs)
        c["last_tokens"] = step.forward.num_tokens
        if step.mode == ForwardMode.EXTEND:
            c["prefill_steps"] += 1
            c["prefill_tokens"] += step.forward.num_tokens
        elif step.mode == ForwardMode.DECODE:
            c["decode_steps"] += 1
        else:
            c["idle_steps"] += 1
        return self.executor.launch(step.forward)

    def _finish(self, step: ScheduledBatch, pending) -> None:
        try:
            out = self.executor.wait(pending)
        except Exception as e:
            if self.parallel.is_distributed or isinstance(e, ExecutorDied):
                raise  # the group's collectives are in an unknown state, or nothing runs forwards
            # one rank alone: fail the step's requests, keep serving the others
            logger.exception("forward failed; failing its %d requests", len(step.reqs))
            for req in step.reqs:
                if not req.finished:
                    req.finish("abort", error=f"internal error: {e!r}")
                    self.scheduler.abort_failed(req)
                    req.on_output(req.make_output([]))
            return
        self._process(step, out)

    def _process(self, step: ScheduledBatch, out: HostOutput) -> None:
        self.last_progress = time.monotonic()
        if step.mode == ForwardMode.IDLE:
            return
        for req, output in self.scheduler.process(step, out):
            self._counters["generated"] += 1
            if output.finished:
                self._counters["cached"] += req.metrics.num_cached_tokens
            req.on_output(output)
