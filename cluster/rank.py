"""One rank of an EP group: joins the group's process groups and runs the engine.

The Serve deployment (`cluster.serve_rank`) and the offline actor (`cluster.offline`) both wrap this
class, so a rank behaves the same whichever way it was started.
"""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from cluster.rendezvous import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    DEFAULT_RENDEZVOUS_TIMEOUT_S,
    destroy_ep_process_groups,
    init_ep_process_groups,
)
from engine.config import EngineConfig
from engine.parallel import ParallelContext
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.outputs import RequestOutput

EngineFactory = Callable[[EngineConfig, ParallelContext], Any]
"""Builds a rank's engine. The default is `engine.async_engine.AsyncEngine`; tests inject stand-ins
that follow the same contract (generate/abort/load/check_health/shutdown)."""


@dataclass(frozen=True)
class RankOptions:
    """Cluster-level knobs of a rank, beside the engine's own `EngineConfig`."""

    rendezvous_timeout_s: float = DEFAULT_RENDEZVOUS_TIMEOUT_S
    # Bound on any one collective: a peer that died mid-step makes the survivors' collectives fail
    # after at most this long (gloo usually notices a closed socket much sooner).
    collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    # Address rank 0 publishes for the group; None = its Ray node IP. "127.0.0.1" keeps a
    # single-machine group (tests, a laptop) on loopback.
    master_address: str | None = None


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    gang_id: str
    node_id: str
    pid: int
    model: str
    max_model_len: int
    device: str
    peak_rss_bytes: int
    peak_device_bytes: int | None  # torch.cuda.max_memory_allocated; None on CPU


class ExpertShard(NamedTuple):
    """The routed experts one rank holds for one MoE layer: global ids [start, end)."""

    start: int
    end: int
    w13: torch.Tensor  # [end - start, 2 * intermediate, hidden]: gate and up projections stacked
    w2: torch.Tensor  # [end - start, hidden, intermediate]: down projection


def default_engine_factory(config: EngineConfig, parallel: ParallelContext) -> Any:
    from engine.async_engine import AsyncEngine

    return AsyncEngine(config, parallel=parallel)


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def peak_device_bytes(device: str) -> int | None:
    if device != "cuda":
        return None
    import torch

    return int(torch.cuda.max_memory_allocated())


def _node_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_node_id()
    except Exception:  # outside Ray (unit use of a single rank): there is no node to name
        return ""


class EPRank:
    def __init__(
        self,
        engine_config: EngineConfig,
        *,
        rank: int,
        world_size: int,
        gang_id: str,
        options: RankOptions | None = None,
        engine_factory: EngineFactory | None = None,
    ) -> None:
        if world_size != engine_config.ep_size:
            raise ValueError(
                f"gang world_size {world_size} does not match engine ep_size {engine_config.ep_size}"
            )
        options = options or RankOptions()
        self.config = engine_config
        self.rank = rank
        self.world_size = world_size
        self.gang_id = gang_id
        self.device = engine_config.resolved_device
        self.parallel = init_ep_process_groups(
            rank,
            world_size,
            gang_id,
            device=self.device,
            rendezvous_timeout_s=options.rendezvous_timeout_s,
            collective_timeout_s=options.collective_timeout_s,
            master_address=options.master_address,
        )
        try:
            self.engine = (engine_factory or default_engine_factory)(engine_config, self.parallel)
        except BaseException:
            destroy_ep_process_groups()
            raise

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs; aborts the engine request if the consumer goes away
        (cancellation at an await, or the generator closed at a yield) before it finished."""
        self.engine.validate(prompt_token_ids, params)
        finished = False
        try:
            async for out in self.engine.generate(prompt_token_ids, params, request_id=request_id):
                finished = out.finished
                yield out
        finally:
            if not finished:
                self.engine.abort(request_id)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def load(self) -> Any:
        return self.engine.load()

    def check_health(self) -> None:
        """Raises when the engine loop died or stalled with work pending."""
        self.engine.check_health()

    def info(self) -> RankInfo:
        return RankInfo(
            rank=self.rank,
            world_size=self.world_size,
            gang_id=self.gang_id,
            node_id=_node_id(),
            pid=os.getpid(),
            model=self.config.model,
            max_model_len=int(self.engine.max_model_len),
            device=self.device,
            peak_rss_bytes=peak_rss_bytes(),
            peak_device_bytes=peak_device_bytes(self.device),
        )

    def expert_shards(self) -> dict[int, ExpertShard]:
        """Routed-expert weights this rank holds, by MoE layer index (copied to CPU)."""
        shards: dict[int, ExpertShard] = {}
        for i, layer in enumerate(self.engine.model.model.layers):
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if experts is None or not hasattr(experts, "expert_range"):
                continue  # dense layer
            start, end = experts.expert_range
            shards[i] = ExpertShard(
                int(start), int(end), experts.w13.detach().cpu(), experts.w2.detach().cpu()
            )
        return shards

    def shutdown(self) -> None:
        try:
            self.engine.shutdown()
        finally:
            destroy_ep_process_groups()
