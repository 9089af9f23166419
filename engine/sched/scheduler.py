"""One rank's scheduler: admission, chunked prefill, decode, retraction, result processing.

Policy (what `schedule()` reads as): continue the chunked prefill or admit waiting requests
under the token budget (prefill first); otherwise run one decode step over the running requests,
retracting the newest ones when the KV pool cannot hold the step. Mechanics live in the helpers.

The scheduler never waits on the device: under the overlap loop it schedules step N+1 while step
N runs, feeding N's not-yet-known tokens as FutureMap ids (`Req.pending_future`), and processes
N's results afterwards. A launched step may still read KV of a request that finishes or is
retracted meanwhile; freeing it at once is safe because the forward executor runs steps in launch
order, so a later owner of those pages writes only after the reader is done.
"""

from __future__ import annotations

import bisect
import logging
from collections import deque
from typing import TYPE_CHECKING

from engine.config import EngineConfig
from engine.forward_batch import ForwardMode
from engine.mem.pool import PageAllocator
from engine.mem.radix import RadixCache
from engine.mem.req_table import ReqTable
from engine.outputs import RequestOutput
from engine.request import Req, ReqState
from engine.sched.batch import ScheduledBatch, build_batch

if TYPE_CHECKING:
    from engine.executor import HostOutput

logger = logging.getLogger(__name__)


class FutureIds:
    """Host side of the FutureMap: hands out ring-buffer slots for sampled tokens.

    Capacity covers more than two steps of `max_running_requests` rows, so a slot is never reused
    while a launched step (at most two are unprocessed) may still resolve it.
    """

    def __init__(self, max_running: int) -> None:
        self.capacity = self.capacity_for(max_running)
        self._next = 1  # slot 0 unused: a future id is -slot, strictly negative

    @staticmethod
    def capacity_for(max_running: int) -> int:
        """Ring size (the device FutureMap is allocated with the same)."""
        return 3 * max_running + 2

    def take(self, n: int) -> list[int]:
        out = []
        for _ in range(n):
            out.append(self._next)
            self._next = self._next + 1 if self._next + 1 < self.capacity else 1
        return out


class Scheduler:
    def __init__(self, config: EngineConfig, num_pages: int, max_model_len: int, vocab_size: int) -> None:
        self.config = config
        self.page_size = config.page_size
        self.vocab_size = vocab_size
        self.allocator = PageAllocator(num_pages)
        self.radix = RadixCache(self.allocator, self.page_size) if config.enable_prefix_caching else None
        max_pages_per_req = (max_model_len + self.page_size) // self.page_size + 1
        self.table = ReqTable(config.max_running_requests + 1, max_pages_per_req, self.page_size)
        self.futures = FutureIds(config.max_running_requests)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None
        self.slots: dict[str, int] = {}  # rid -> request-table slot
        self.reqs: dict[str, Req] = {}
        self.num_retractions = 0

    # ---------------------------------------------------------------- queue
    def add(self, req: Req) -> None:
        self.reqs[req.rid] = req
        if self.config.schedule_policy == "priority":
            keys = [(r.params.priority, r.metrics.arrival_time) for r in self.waiting]
            self.waiting.insert(bisect.bisect_right(keys, (req.params.priority, req.metrics.arrival_time)), req)
        else:
            self.waiting.append(req)

    def abort(self, rid: str) -> Req | None:
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return None
        if req in self.waiting:
            self.waiting.remove(req)
        req.finish("abort")
        self._release(req)
        return req

    def abort_failed(self, req: Req) -> None:
        """Release a request its step failed on (already finished with an error)."""
        if req in self.waiting:
            self.waiting.remove(req)
        self._release(req)

    def fail_all(self, error: str) -> list[Req]:
        """Finish every request with an error (the engine cannot go on, or a step failed)."""
        failed = [r for r in self.reqs.values() if not r.finished]
        for r in failed:
            r.finish("abort", error=error)
            self._release(r)
        self.waiting.clear()
        return failed

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    # ---------------------------------------------------------------- policy
    def schedule(self) -> ScheduledBatch | None:
        batch = self._schedule_prefill()
        if batch is None:
            batch = self._schedule_decode()
        return batch

    # ---------------------------------------------------------------- prefill
    def _available_pages(self) -> int:
        return self.allocator.num_free + (self.radix.evictable_pages if self.radix else 0)

    def _take_pages(self, n: int) -> list[int]:
        if n > self.allocator.num_free and self.radix is not None:
            self.radix.evict(n - self.allocator.num_free)
        return self.allocator.alloc(n)

    def _pages_needed(self, req: Req, new_tokens: int) -> int:
        return -(-(req.kv_len + new_tokens) // self.page_size) - len(req.pages)

    def _match_prefix(self, req: Req) -> None:
        if self.radix is None or req.params.prompt_logprobs:
            return
        # leave at least one token to compute: its logits sample the next token
        pages, node = self.radix.match_prefix(req.fill_ids[:-1])
        if not pages:
            return
        self.radix.lock(node)
        req.prefix_node = node
        req.pages = list(pages)
        req.num_prefix_pages = len(pages)
        req.kv_len = len(pages) * self.page_size
        self.table.set_pages(self.slots[req.rid], 0, pages)

    def _schedule_prefill(self) -> ScheduledBatch | None:
        budget = self.config.chunked_prefill_size
        max_reqs = self.config.max_prefill_requests or self.config.max_running_requests
        reqs: list[Req] = []
        lens: list[int] = []
        queue = ([self.chunked] if self.chunked else []) + list(self.waiting)
        for req in queue:
            if budget <= 0 or len(reqs) >= max_reqs:
                break
            admitting = req.rid not in self.slots
            if admitting:
                busy = len(self.running) + len(reqs) + (self.chunked is not None and self.chunked not in reqs)
                if busy >= self.config.max_running_requests or not self.table.num_free:
                    break
                self.slots[req.rid] = self.table.alloc()
                self._match_prefix(req)
                req.metrics.num_cached_tokens = req.kv_len
            extend = len(req.fill_ids) - req.kv_len
            # keep one page of headroom per running request for its coming decode steps
            spare_pages = self._available_pages() - len(self.running) - len(reqs)
            slack = len(req.pages) * self.page_size - req.kv_len
            n = min(extend, budget, slack + max(spare_pages, 0) * self.page_size)
            if n <= 0:
                if admitting:
                    self._free_kv(req)
                    self._release_slot(req)
                break
            new_pages = self._take_pages(self._pages_needed(req, n))
            self.table.set_pages(self.slots[req.rid], len(req.pages), new_pages)
            req.pages.extend(new_pages)
            reqs.append(req)
            lens.append(n)
            budget -= n
            if req is self.chunked:
                self.chunked = None
            else:
                self.waiting.remove(req)
            if n < extend:
                self.chunked = req  # continues first in the next prefill step
                break
        if not reqs:
            return None
        return self._launchable(ForwardMode.EXTEND, reqs, lens)

    # ---------------------------------------------------------------- decode
    def _schedule_decode(self) -> ScheduledBatch | None:
        reqs = [r for r in self.running if r.num_scheduled_outputs < r.params.max_tokens]
        if not reqs:
            return None
        need = sum(1 for r in reqs if r.kv_len % self.page_size == 0)
        while need > self._available_pages() and len(reqs) > 1:
            victim = reqs.pop()  # newest admitted goes back to the queue
            if victim.kv_len % self.page_size == 0:
                need -= 1
            self._retract(victim)
        if need > self._available_pages():
            # a single request that outgrew the whole pool
            r = reqs.pop()
            r.finish("abort", error="KV cache too small for this request's length")
            r.on_output(r.make_output([]))
            self._release(r)
            return None
        for r in reqs:
            if r.kv_len % self.page_size == 0:
                page = self._take_pages(1)
                self.table.set_pages(self.slots[r.rid], len(r.pages), page)
                r.pages.extend(page)
        return self._launchable(ForwardMode.DECODE, reqs, [1] * len(reqs))

    def _retract(self, req: Req) -> None:
        logger.info("retracting request %s (%d tokens) to free KV", req.rid, req.kv_len)
        self.running.remove(req)
        self._free_kv(req)
        self._release_slot(req)
        req.state = ReqState.WAITING
        req.epoch += 1
        req.num_scheduled_outputs = len(req.output_ids)
        req.pending_future = None
        req.metrics.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    # ---------------------------------------------------------------- launch bookkeeping
    def _launchable(self, mode: ForwardMode, reqs: list[Req], lens: list[int]) -> ScheduledBatch:
        futures = self.futures.take(len(reqs))
        fb = build_batch(mode, reqs, lens, self.table, [self.slots[r.rid] for r in reqs], futures, self.vocab_size)
        plp_lens = [0] * len(reqs)
        for s, e, i in fb.prompt_logprob_ranges:
            plp_lens[i] = e - s
        if mode == ForwardMode.EXTEND:
            for r, n in zip(reqs, lens):
                r.metrics.num_computed_prefill_tokens += n
        for r, n, sample, f in zip(reqs, lens, fb.sample_mask, futures):
            r.kv_len += n
            if sample:
                r.num_scheduled_outputs += 1
                r.pending_future = -f
                if r.state != ReqState.RUNNING:
                    r.state = ReqState.RUNNING
                    self.running.append(r)
        return ScheduledBatch(mode=mode, reqs=reqs, epochs=[r.epoch for r in reqs],
                              sample_mask=fb.sample_mask, future_ids=[-f for f in futures],
                              prompt_logprob_lens=plp_lens, forward=fb)

    # ---------------------------------------------------------------- results
    def process(self, batch: ScheduledBatch, out: HostOutput) -> list[tuple[Req, RequestOutput]]:
        next_ids, logprobs, prompt_logprobs = out.next_ids, out.logprobs, out.prompt_logprobs
        outs = []
        plp_off = 0
        for i, req in enumerate(batch.reqs):
            n_plp = batch.prompt_logprob_lens[i]
            if req.epoch != batch.epochs[i] or req.finished:
                plp_off += n_plp
                continue
            if n_plp:
                req.prompt_logprob_parts.extend(prompt_logprobs[plp_off : plp_off + n_plp])
                if req.prompt_top_parts is not None and out.prompt_top_ids is not None:
                    k = req.params.top_logprobs
                    req.prompt_top_parts.extend(
                        dict(zip(ids[:k], lps[:k])) for ids, lps in
                        zip(out.prompt_top_ids[plp_off : plp_off + n_plp], out.prompt_top_logprobs[plp_off : plp_off + n_plp]))
                plp_off += n_plp
            if not batch.sample_mask[i]:
                continue
            if req.params.prompt_logprobs and req.prompt_logprobs is None:
                req.prompt_logprobs = [None] + req.prompt_logprob_parts
                if req.prompt_top_parts is not None:
                    req.prompt_top_logprobs = [None] + req.prompt_top_parts
            if req.pending_future == batch.future_ids[i]:
                req.pending_future = None
            tok = next_ids[i]
            top = None
            if out.top_ids is not None and req.params.top_logprobs:
                k = req.params.top_logprobs
                top = dict(zip(out.top_ids[i][:k], out.top_logprobs[i][:k]))
            req.append_token(tok, logprobs[i] if logprobs is not None else None, top)
            outs.append((req, req.make_output([tok])))
            if req.finished:
                self._release(req)
        return outs

    # ---------------------------------------------------------------- freeing
    def _free_kv(self, req: Req) -> None:
        own = req.pages[req.num_prefix_pages :]
        if self.radix is not None:
            n_known = min(req.kv_len, len(req.fill_ids)) // self.page_size
            if n_known:
                dup = self.radix.insert(req.fill_ids[: n_known * self.page_size], req.pages[:n_known])
                self.allocator.free(dup)
            own = req.pages[max(n_known, req.num_prefix_pages) :]
            if req.prefix_node is not None:
                self.radix.unlock(req.prefix_node)
        self.allocator.free(own)
        req.pages, req.num_prefix_pages, req.prefix_node, req.kv_len = [], 0, None, 0

    def _release_slot(self, req: Req) -> None:
        slot = self.slots.pop(req.rid, None)
        if slot is not None:
            self.table.free(slot)

    def _release(self, req: Req) -> None:
        """Give back everything a finished request holds."""
        if req in self.running:
            self.running.remove(req)
        if self.chunked is req:
            self.chunked = None
        self._free_kv(req)
        self._release_slot(req)
        self.reqs.pop(req.rid, None)

    # ---------------------------------------------------------------- load
    def load(self) -> dict:
        running_tokens = sum(r.kv_len for r in self.running)
        waiting_tokens = sum(len(r.fill_ids) for r in self.waiting)
        cap = self.allocator.capacity
        used = cap - self.allocator.num_free - (self.radix.evictable_pages if self.radix else 0)
        return dict(num_running=len(self.running) + (1 if self.chunked else 0), num_waiting=len(self.waiting),
                    running_tokens=running_tokens, waiting_tokens=waiting_tokens, kv_usage=used / cap)
