"""CUDA graphs for decode steps of a single rank.

Without graphs a decode step of a small batch is several hundred kernels, each launched from
Python: the step costs host time (and, under the thread executor, the GIL the scheduler needs)
whatever the device does. Replaying a captured graph launches them all at once, so the host side
of a decode forward shrinks to filling a few input buffers, which is what lets the overlap loop
hide all of the scheduler's work behind the device.

Graphs are captured lazily, one per (batch bucket, KV-length bucket), on the first decode step that
falls in it. Every graph reads the same static input buffers, sized for the largest buckets. A
step is padded up to its buckets:
- extra rows read token 0 at position 0, write their KV to the reserved padding page (slot 0)
  and attend to slot 0 only, so they stay finite and touch no request's cache;
- extra KV columns point at slot 0 and are masked out.
Only the step's own rows of the graph's output are returned.

Each new graph is checked against an eager run of the same inputs before it is used. A capture
that fails (a host sync, an op that cannot be captured) or a graph whose output differs turns
graphs off for this runner, with a warning naming why, and the eager path runs from then on: a
graph can cost speed, never correctness.

Used where the decode forward has no host synchronization: one rank (no all-to-all with host-side
split sizes), no TBO/SBO, and expert GEMMs that keep their group sizes on the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import torch

from engine.forward_batch import AttentionMetadata, ForwardBatch, ForwardMode

logger = logging.getLogger(__name__)

# KV columns beyond this run eager: the static index buffers are [max_bs, this].
MAX_GRAPH_SEQ_LEN = 16384


def batch_buckets(max_bs: int) -> list[int]:
    """Batch sizes graphs are captured for: fine steps where padding would cost most."""
    sizes = [1, 2, 4, 8, *range(16, 65, 16), *range(96, 257, 32), *range(320, max(max_bs, 1) + 64, 64)]
    return sorted({s for s in sizes if s < max_bs} | {max_bs})


def seq_buckets(max_seq: int) -> list[int]:
    """KV lengths graphs are captured for: powers of two to 1024, then every 1024."""
    sizes = [64, 128, 256, 512, *range(1024, MAX_GRAPH_SEQ_LEN + 1, 1024)]
    limit = min(max_seq, MAX_GRAPH_SEQ_LEN)
    out = [s for s in sizes if s < limit]
    return [*out, next(s for s in sizes if s >= limit)] if limit > 0 else out


def _bucket(n: int, buckets: list[int]) -> int | None:
    for b in buckets:
        if b >= n:
            return b
    return None


class GraphBackend(Protocol):
    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        """Capture `fn` (already run once eagerly); return its replay and its output buffer."""
        ...


class CudaGraphBackend:
    """`torch.cuda.CUDAGraph` capture on a side stream; all graphs share one memory pool (they
    replay one at a time, in stream order, and each output is consumed before the next replay)."""

    def __init__(self, device: torch.device) -> None:
        self.pool = torch.cuda.graph_pool_handle()
        self.stream = torch.cuda.Stream(device)

    def capture(self, fn: Callable[[], torch.Tensor]) -> tuple[Callable[[], None], torch.Tensor]:
        graph = torch.cuda.CUDAGraph()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            fn()  # warm-up on the capture stream: per-stream library state (cuBLAS workspaces) exists before capture
        # thread_local: another thread of this process may use the CUDA runtime meanwhile
        with torch.cuda.graph(graph, pool=self.pool, stream=self.stream, capture_error_mode="thread_local"):
            out = fn()
        torch.cuda.current_stream().wait_stream(self.stream)
        return graph.replay, out


class DecodeGraphRunner:
    """Runs decode steps' hidden states through captured graphs; `run` returns None where a step
    must run eager (too large, or graphs are off)."""

    def __init__(self, hidden_states: Callable[[ForwardBatch], torch.Tensor], *, max_bs: int,
                 max_seq: int, device: torch.device, backend: GraphBackend | None = None,
                 max_keys: int | None = None,
                 check_tol: float = 2e-2) -> None:
        self._hidden_states = hidden_states
        self.batch_buckets = batch_buckets(max_bs)
        self.seq_buckets = seq_buckets(max_seq)
        self._backend = backend if backend is not None else CudaGraphBackend(device)
        self._tol = check_tol
        # bucketed rows x KV columns past this run eager (the model's split-KV decode attention
        # bounds its latent gathers; a graph pads to its buckets in one pass)
        self.max_keys = max_keys
        B, S = self.batch_buckets[-1], self.seq_buckets[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self._ids = torch.zeros(B, **i64)
        self._pos = torch.zeros(B, **i64)
        self._loc = torch.zeros(B, **i64)
        self._kv_indices = torch.zeros(B, S, **i64)
        self._kv_mask = torch.zeros(B, S, dtype=torch.bool, device=device)
        self._graphs: dict[tuple[int, int], tuple[Callable[[], None], torch.Tensor]] = {}
        self.disabled_reason: str | None = None
        self.replays = 0

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    def buckets_for(self, fb: ForwardBatch) -> tuple[int, int] | None:
        if fb.forward_mode != ForwardMode.DECODE or fb.tbo_children is not None or fb.attn is None:
            return None
        bb = _bucket(fb.batch_size, self.batch_buckets)
        sb = _bucket(fb.attn.kv_indices.shape[1], self.seq_buckets)
        if bb is None or sb is None or (self.max_keys is not None and bb * sb > self.max_keys):
            return None
        return bb, sb

    def run(self, fb: ForwardBatch) -> torch.Tensor | None:
        """Hidden states [B, hidden] of decode step `fb` (input ids resolved, on the device)."""
        if not self.enabled or fb.num_tokens != fb.batch_size:
            return None
        key = self.buckets_for(fb)
        if key is None:
            return None
        static = self._fill(fb, *key)
        graph = self._graphs.get(key)
        if graph is None:
            graph = self._capture(key, static, fb.batch_size)
            if graph is None:
                return None
        replay, out = graph
        replay()
        self.replays += 1
        return out[:fb.batch_size]

    def _fill(self, fb: ForwardBatch, bb: int, sb: int) -> ForwardBatch:
        B, S = fb.batch_size, fb.attn.kv_indices.shape[1]
        for buf, src in ((self._ids, fb.input_ids), (self._pos, fb.positions), (self._loc, fb.out_cache_loc)):
            buf[:B].copy_(src, non_blocking=True)
            buf[B:bb].zero_()
        self._kv_indices[:bb, :sb].zero_()
        self._kv_indices[:B, :S].copy_(fb.attn.kv_indices, non_blocking=True)
        self._kv_mask[:bb, :sb].zero_()
        self._kv_mask[:B, :S].copy_(fb.attn.kv_mask, non_blocking=True)
        self._kv_mask[B:bb, 0] = True  # padding rows attend to the padding slot alone
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, input_ids=self._ids[:bb], positions=self._pos[:bb],
            out_cache_loc=self._loc[:bb], batch_size=bb,
            attn=AttentionMetadata(kv_indices=self._kv_indices[:bb, :sb], kv_mask=self._kv_mask[:bb, :sb]),
            sample_index=self._ids[:0], sample_mask=[], sampling=None, future_slots=self._ids[:0])

    def _capture(self, key: tuple[int, int], static: ForwardBatch, rows: int):
        try:
            # eager first: warms up lazily initialized kernels and libraries (never in a capture),
            # and is the reference the graph must reproduce
            expected = self._hidden_states(static)[:rows].clone()
            replay, out = self._backend.capture(lambda: self._hidden_states(static))
            replay()
            got = out[:rows]
            if not bool(torch.isfinite(got).all()) or not torch.allclose(got.float(), expected.float(),
                                                                          atol=self._tol, rtol=self._tol):
                err = (got.float() - expected.float()).abs().max().item()
                raise RuntimeError(f"graph output differs from eager by up to {err:.3g}")
        except Exception as e:  # noqa: BLE001 - any failure means: eager from now on
            self.disabled_reason = f"{type(e).__name__}: {e}"
            self._graphs.clear()
            logger.warning("CUDA graphs off for decode (capturing batch %d, KV length %d failed: %s); "
                           "running eager", key[0], key[1], self.disabled_reason)
            return None
        self._graphs[key] = (replay, out)
        logger.info("captured a decode CUDA graph for batch %d, KV length %d", *key)
        return replay, out
