"""The EP-rank Serve deployment: one replica per rank, one gang per EP group.

Serve's gang scheduler places the `ep_size` replicas of a gang in one placement group (PACK) and,
under RESTART_GANG, replaces the whole gang when any member fails (a dead actor at once, a failing
`check_health` after Serve's consecutive-failure threshold): collectives cannot survive a lost
member, so a partial gang is useless. Every incarnation gets a fresh gang id, hence a fresh
rendezvous key. Other gangs keep serving meanwhile.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

from cluster.rank import EngineFactory, EPRank, RankOptions
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

logger = logging.getLogger("ray.serve")

DEFAULT_HEALTH_CHECK_PERIOD_S = 5.0
DEFAULT_HEALTH_CHECK_TIMEOUT_S = 10.0

# Called in the rank's process with every routing-stats report and the rank's identity tags
# (`gang`, `gang_rank`, `rank_replica`): how the serving layer records per-rank metrics without
# this module importing it. Must be picklable (a module-level function) and cheap.
RankReportHook = Callable[[Mapping[str, Any], Mapping[str, str]], None]


def _ep_rank(gang: Any) -> tuple[int, bool]:
    """This replica's EP rank: its gang rank renumbered so that the ranks on one node are
    contiguous (`cluster.placement.group_rank`), from the nodes of the gang's placement group.
    Every member reads the same table, so the group agrees on the numbering. Second: whether the
    table could be read (if not, EP ranks are the gang ranks)."""
    from ray.util import get_placement_group

    from cluster.placement import bundle_nodes, group_rank

    try:
        nodes = bundle_nodes(get_placement_group(gang.pg_name)) if gang.pg_name else []
    except ValueError:
        nodes = []
    per_replica, rest = divmod(len(nodes), gang.world_size)
    if not nodes or rest:
        logger.warning("gang %s: placement group %r not readable as %d replicas' bundles; EP ranks "
                       "follow gang ranks", gang.gang_id, gang.pg_name, gang.world_size)
        return gang.rank, False
    return group_rank(gang.rank, nodes[::per_replica]), True


class EPRankDeployment:
    """One rank of one gang. Decorated with `serve.deployment` by `build_rank_app`, so the same
    class can be deployed with any options (and tests can inject an engine stand-in)."""

    async def __init__(
        self,
        engine_config: EngineConfig | dict[str, Any],
        rank_options: RankOptions | None = None,
        engine_factory: EngineFactory | None = None,
        report_hook: RankReportHook | None = None,
    ) -> None:
        from ray import serve

        config = (
            engine_config
            if isinstance(engine_config, EngineConfig)
            else EngineConfig(**engine_config)
        )
        ctx = serve.get_replica_context()
        gang = ctx.gang_context
        self._ranks_by_node = False
        if gang is not None:
            (rank, self._ranks_by_node), world_size, gang_id = _ep_rank(gang), gang.world_size, gang.gang_id
        elif config.ep_size == 1:
            rank, world_size, gang_id = 0, 1, ctx.replica_id.unique_id
        else:
            raise RuntimeError(
                f"ep_size {config.ep_size} needs gang scheduling; deploy with "
                "cluster.serve_rank.rank_deployment_options"
            )
        self._replica_actor = ctx.replica_id.to_full_id_str()
        self._report_hook = report_hook
        self._report_tags = {
            "gang": str(gang_id),
            "gang_rank": str(rank),
            "rank_replica": ctx.replica_id.unique_id,
        }
        logger.info("EP rank %d/%d of gang %s starting (gang rank %s)", rank, world_size, gang_id,
                    gang.rank if gang is not None else 0)
        self._gang_rank = gang.rank if gang is not None else 0
        # Rendezvous and model load block for long: keep the replica's event loop free meanwhile.
        self._rank = await asyncio.to_thread(
            EPRank,
            config,
            rank=rank,
            world_size=world_size,
            gang_id=gang_id,
            options=rank_options,
            engine_factory=engine_factory,
        )

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: dict[str, Any] | SamplingParams,
    ) -> AsyncIterator[RequestOutput]:
        """Stream cumulative outputs. A cancelled stream (client disconnect → CancelledError at the
        next await) or a closed one aborts the engine request (`EPRank.generate`)."""
        params = (
            sampling_params
            if isinstance(sampling_params, SamplingParams)
            else SamplingParams(**sampling_params)
        )
        async for out in self._rank.generate(request_id, prompt_token_ids, params):
            yield out

    async def abort(self, request_id: str) -> None:
        self._rank.abort(request_id)

    async def load(self) -> Any:
        return self._rank.load()

    async def info(self) -> dict[str, Any]:
        """`RankInfo` fields, plus for operators the replica's actor name (namespace "serve"), its gang
        rank, and whether its EP rank was renumbered from the gang's placement group."""
        return {**dataclasses.asdict(self._rank.info()), "replica_actor": self._replica_actor,
                "gang_rank": self._gang_rank, "ranks_by_node": self._ranks_by_node}

    def check_health(self) -> None:
        # Runs on the replica's event loop: the engine's check is a few attribute reads.
        self._rank.check_health()

    def record_routing_stats(self) -> dict[str, Any]:
        """Load report for the request router, pulled by the Serve controller every
        `request_routing_stats_period_s` and broadcast to every handle's router. Keys follow
        `serving.router.rank_routing_stats` (cluster must not import serving): the `EngineLoad`
        fields, plus every numeric `EngineStats` field (and `idle_fraction`) as `step_<name>`.
        The same report goes to the report hook (per-rank metrics)."""
        load = self._rank.load()
        out: dict[str, Any] = {
            "ts": time.time(),
            "running_requests": int(load.num_running),
            "waiting_requests": int(load.num_waiting),
            "running_tokens": int(load.running_tokens),
            "waiting_tokens": int(load.waiting_tokens),
            "kv_usage": float(load.kv_usage),
            "gang_rank": self._rank.rank,
        }
        stats_fn = getattr(self._rank.engine, "stats", None)
        if stats_fn is not None:
            stats = stats_fn()
            for k, v in dataclasses.asdict(stats).items():
                if isinstance(v, (bool, int, float)):
                    out[f"step_{k}"] = v
            idle = getattr(stats, "idle_fraction", None)
            if isinstance(idle, (int, float)):
                out["step_idle_fraction"] = float(idle)
        if self._report_hook is not None:
            try:
                self._report_hook(out, self._report_tags)
            except Exception:  # metrics must never cost the router its load report
                logger.exception("rank report hook failed")
        return out

    def __del__(self) -> None:
        # Graceful stop (scale-down, redeploy). A forced gang restart kills the process instead.
        rank = getattr(self, "_rank", None)
        if rank is not None:
            rank.shutdown()


def rank_deployment_options(
    engine_config: EngineConfig,
    *,
    num_gangs: int | None = None,
    autoscaling: dict[str, Any] | None = None,
    cpus_per_rank: float = 1.0,
    gpus_per_rank: float = 0.0,
    health_check_period_s: float = DEFAULT_HEALTH_CHECK_PERIOD_S,
    health_check_timeout_s: float = DEFAULT_HEALTH_CHECK_TIMEOUT_S,
) -> dict[str, Any]:
    """Serve options for the rank deployment, counted in gangs.

    `num_gangs` gangs of `ep_size` replicas, or, with `autoscaling`, bounds in gangs
    (`min_gangs`/`max_gangs`/`initial_gangs`, or the same with `_replicas`, still meaning gangs)
    multiplied into replica counts; Serve's gang policy then scales in whole gangs.
    """
    from ray.serve.config import (
        GangPlacementStrategy,
        GangRuntimeFailurePolicy,
        GangSchedulingConfig,
    )

    ep = engine_config.ep_size
    opts: dict[str, Any] = {
        "gang_scheduling_config": GangSchedulingConfig(
            gang_size=ep,
            gang_placement_strategy=GangPlacementStrategy.PACK,
            runtime_failure_policy=GangRuntimeFailurePolicy.RESTART_GANG,
        ),
        # The gang's placement group gets one bundle per rank from these resources.
        "ray_actor_options": {"num_cpus": cpus_per_rank, "num_gpus": gpus_per_rank},
        "health_check_period_s": health_check_period_s,
        "health_check_timeout_s": health_check_timeout_s,
    }
    if autoscaling is not None:
        cfg = dict(autoscaling)
        for bound in ("min", "max", "initial"):
            gangs = cfg.pop(f"{bound}_gangs", None)
            gangs = cfg.pop(f"{bound}_replicas", gangs)
            if gangs is not None:
                cfg[f"{bound}_replicas"] = int(gangs) * ep
        cfg.setdefault("min_replicas", ep)
        cfg.setdefault("max_replicas", max(ep, cfg["min_replicas"]))
        opts["autoscaling_config"] = cfg
    else:
        if num_gangs is not None and num_gangs < 1:
            raise ValueError("num_gangs must be >= 1 (use autoscaling to scale to zero)")
        opts["num_replicas"] = (num_gangs or 1) * ep
    return opts


def build_rank_app(
    engine_config: EngineConfig,
    *,
    rank_options: RankOptions | None = None,
    engine_factory: EngineFactory | None = None,
    report_hook: RankReportHook | None = None,
    name: str = "EPRank",
    **serve_options: Any,
) -> Any:
    """The bound rank deployment. `serve_options` are Serve deployment options, normally
    `rank_deployment_options(...)` plus the serving layer's router/admission settings; without
    them the deployment is one gang. `report_hook` sees every load report in the rank's process
    (the serving layer records per-rank metrics with it)."""
    from ray import serve

    if not serve_options:
        serve_options = rank_deployment_options(engine_config)
    deployment = serve.deployment(EPRankDeployment, name=name, **serve_options)
    return deployment.bind(engine_config, rank_options, engine_factory, report_hook)
