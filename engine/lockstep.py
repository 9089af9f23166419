"""Per-step agreement between the ranks of an expert-parallel group.

Every MoE layer is a collective, so all ranks must run a forward at the same steps. Before each
step the ranks all-gather a three-number header (tokens, forward mode, TBO possible) on the gloo
control group, which is separate from the MoE group so it never interleaves with the collectives
of a forward still running under the overlap loop.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.parallel import ParallelContext

_NO_BATCH = 0


@dataclass(frozen=True)
class StepHeader:
    num_tokens: int
    mode: int  # ForwardMode value, or 0 for "no batch"
    tbo_ok: bool
    stopping: bool = False  # this rank is shutting down; the group stops when all are


def local_header(fb: ForwardBatch | None, config: EngineConfig) -> StepHeader:
    if fb is None:
        return StepHeader(0, _NO_BATCH, True)
    tbo_ok = fb.num_tokens >= config.tbo_min_tokens
    if fb.forward_mode == ForwardMode.DECODE:
        tbo_ok = tbo_ok and fb.batch_size >= 2
    return StepHeader(fb.num_tokens, int(fb.forward_mode), tbo_ok)


class Lockstep:
    def __init__(self, parallel: ParallelContext, config: EngineConfig) -> None:
        self.parallel = parallel
        self.config = config
        self.active = parallel.is_distributed

    def agree(self, fb: ForwardBatch | None, stopping: bool = False) -> list[StepHeader]:
        """Headers of all ranks for this step (every rank calls this once per loop iteration)."""
        mine = local_header(fb, self.config)
        if not self.active:
            return [StepHeader(mine.num_tokens, mine.mode, mine.tbo_ok, stopping)]
        import torch.distributed as dist

        t = torch.tensor([mine.num_tokens, mine.mode, int(mine.tbo_ok), int(stopping)], dtype=torch.int64)
        out = [torch.empty_like(t) for _ in range(self.parallel.world_size)]
        dist.all_gather(out, t, group=self.parallel.control_group)
        return [StepHeader(int(h[0]), int(h[1]), bool(h[2]), bool(h[3])) for h in out]

    @staticmethod
    def any_work(headers: list[StepHeader]) -> bool:
        return any(h.mode != _NO_BATCH for h in headers)

    @staticmethod
    def all_stopping(headers: list[StepHeader]) -> bool:
        return all(h.stopping for h in headers)

    def group_a2a_mode(self, headers: list[StepHeader]) -> str | None:
        """DeepEP `auto`: the kernels every rank runs this step. All ranks decide it from the same
        headers, never each from its own batch: a prefilling rank (normal kernels) and a decoding
        or idle one (low-latency kernels) would never meet in the collective. Low-latency only when
        no rank extends and every rank's tokens fit the low-latency buffers."""
        if self.config.deepep_mode != "auto":
            return None
        if any(h.mode == int(ForwardMode.EXTEND) for h in headers):
            return "normal"
        if max(h.num_tokens for h in headers) > self.config.resolved_deepep_ll_max_tokens:
            return "normal"
        return "low_latency"

    def can_run_tbo(self, headers: list[StepHeader]) -> bool:
        """TBO only when every rank can split its batch the same way: same mode, enough tokens,
        and not an extend step with low-latency DeepEP (whose buffers hold one decode batch)."""
        if not self.config.enable_two_batch_overlap:
            return False
        modes = {h.mode for h in headers}
        if len(modes) != 1 or _NO_BATCH in modes or int(ForwardMode.IDLE) in modes:
            return False
        if modes == {int(ForwardMode.EXTEND)} and self.config.deepep_mode == "low_latency":
            return False
        return all(h.tbo_ok for h in headers)
