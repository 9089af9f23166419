"""Offline EP group: `ep_size` Ray actors in one placement group, each running an `EPRank`.

`engine.llm.LLM(ep_size=n)` builds one of these. A batch is spread over the ranks (data-parallel
attention: each request lives on one rank; every rank joins every MoE all-to-all). The group
watches its ranks while a batch runs: a dead actor, a failed or slow health check fails the whole
group within bounded time, since the survivors' collectives cannot complete without the lost rank.
A failed group is torn down; build a new one to go on serving.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from cluster.placement import (
    bundle_nodes,
    create_group_placement_group,
    default_gpus_per_rank,
    rank_bundle,
    ranks_to_bundles,
)
from cluster.rank import EngineFactory, EPRank, ExpertShard, RankInfo, RankOptions
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.outputs import RequestOutput

logger = logging.getLogger(__name__)

Request = tuple[str, list[int], SamplingParams]


class EPGroupError(RuntimeError):
    """The EP group lost a rank (or a rank stopped making progress); it cannot serve any more."""


class _RankActor:
    """Ray actor body (async actor: health checks run while a batch is in flight)."""

    def __init__(
        self,
        engine_config: EngineConfig,
        rank: int,
        world_size: int,
        group_id: str,
        options: RankOptions,
        engine_factory: EngineFactory | None,
    ) -> None:
        self._rank = EPRank(
            engine_config,
            rank=rank,
            world_size=world_size,
            gang_id=group_id,
            options=options,
            engine_factory=engine_factory,
        )

    async def ready(self) -> int:
        return self._rank.rank

    async def validate(self, requests: list[Request]) -> None:
        for _, prompt_token_ids, params in requests:
            self._rank.engine.validate(prompt_token_ids, params)

    async def run(self, requests: list[Request]) -> list[RequestOutput]:
        async def final(request_id: str, prompt: list[int], params: SamplingParams) -> Any:
            last = None
            async for out in self._rank.generate(request_id, prompt, params):
                last = out
            return last

        return list(await asyncio.gather(*(final(*r) for r in requests)))

    async def check_health(self) -> None:
        self._rank.check_health()

    async def tokenizer(self) -> Any:
        return self._rank.engine.tokenizer

    async def info(self) -> RankInfo:
        return self._rank.info()

    async def load(self) -> Any:
        return self._rank.load()

    async def expert_shards(self) -> dict[int, ExpertShard]:
        return self._rank.expert_shards()

    async def shutdown(self) -> None:
        self._rank.shutdown()


class OfflineEPGroup:
    def __init__(
        self,
        engine_config: EngineConfig,
        *,
        options: RankOptions | None = None,
        cpus_per_rank: float = 1.0,
        gpus_per_rank: float | None = None,
        engine_factory: EngineFactory | None = None,
        placement_timeout_s: float = 120.0,
        health_check_period_s: float = 1.0,
        health_check_timeout_s: float = 10.0,
        startup_timeout_s: float | None = None,
    ) -> None:
        """`startup_timeout_s` bounds rendezvous plus model load (None: no extra bound; a rank
        that dies or misses the rendezvous still fails startup through its own timeouts)."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init()
        self.config = engine_config
        self.ep_size = engine_config.ep_size
        self.group_id = f"offline-{uuid.uuid4().hex[:12]}"
        self._options = options or RankOptions()
        self._health_period_s = health_check_period_s
        self._health_timeout_s = health_check_timeout_s
        self._failure: str | None = None
        self._actors: list[Any] = []
        self._pg: Any = None
        self._tokenizer: Any = None
        if gpus_per_rank is None:
            gpus_per_rank = default_gpus_per_rank(engine_config.resolved_device)
        bundle = rank_bundle(cpus_per_rank, gpus_per_rank)
        self._pg = create_group_placement_group(
            self.ep_size, bundle, timeout_s=placement_timeout_s, name=self.group_id
        )
        try:
            bundle_of_rank = ranks_to_bundles(bundle_nodes(self._pg))
            actor_cls = ray.remote(_RankActor)
            for rank in range(self.ep_size):
                self._actors.append(
                    actor_cls.options(
                        num_cpus=bundle["CPU"],
                        num_gpus=bundle.get("GPU", 0),
                        max_restarts=0,  # a lone restarted rank could never rejoin its group
                        scheduling_strategy=PlacementGroupSchedulingStrategy(
                            placement_group=self._pg,
                            placement_group_bundle_index=bundle_of_rank[rank],
                        ),
                    ).remote(
                        engine_config,
                        rank,
                        self.ep_size,
                        self.group_id,
                        self._options,
                        engine_factory,
                    )
                )
            self._wait_started(startup_timeout_s)
        except BaseException:
            self._teardown()
            raise

    def _wait_started(self, timeout_s: float | None) -> None:
        """Rendezvous and model load happen in the rank constructors. Fail on the first rank that
        fails (its peers would otherwise sit in rendezvous until their own timeouts)."""
        import ray

        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        pending = [a.ready.remote() for a in self._actors]
        while pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready, pending = ray.wait(pending, num_returns=1, timeout=left)
            if not ready:
                raise TimeoutError(
                    f"EP group {self.group_id}: {len(pending)} ranks not started within {timeout_s} s"
                )
            ray.get(ready)  # raises the rank's constructor error

    # -- serving ---------------------------------------------------------------------------------

    def generate(
        self, requests: Sequence[Request], placement: Sequence[int] | None = None
    ) -> list[RequestOutput]:
        """Run a batch to completion; outputs come back in request order.

        `placement[i]` is the rank request i runs on (default: round-robin). Raises `ValueError`
        for invalid requests before any runs, `EPGroupError` when the group fails meanwhile.
        """
        self._check_alive()
        if placement is None:
            placement = [i % self.ep_size for i in range(len(requests))]
        if len(placement) != len(requests):
            raise ValueError(f"{len(placement)} placements for {len(requests)} requests")
        if any(not 0 <= r < self.ep_size for r in placement):
            raise ValueError(f"placement ranks must lie in [0, {self.ep_size})")
        per_rank: dict[int, list[int]] = {}
        for i, r in enumerate(placement):
            per_rank.setdefault(r, []).append(i)

        def batch(rank: int) -> list[Request]:
            return [tuple(requests[i]) for i in per_rank[rank]]  # type: ignore[misc]

        self._await(
            {self._actors[r].validate.remote(batch(r)): r for r in per_rank}, what="validate"
        )
        results: list[Any] = [None] * len(requests)
        for rank, outs in self._await(
            {self._actors[r].run.remote(batch(r)): r for r in per_rank}, what="generate"
        ).items():
            for i, out in zip(per_rank[rank], outs, strict=True):
                results[i] = out
        if any(out.error for out in results):
            # An engine fails requests with an error when its loop dies (e.g. a peer vanished
            # mid-collective); tell that apart from a per-request failure of a healthy group.
            self._probe_health()
        return results

    def _await(self, refs: dict[Any, int], *, what: str) -> dict[int, Any]:
        """Gather per-rank results, probing every rank's health while waiting so that a dead or
        stuck rank fails the group in bounded time instead of hanging the caller."""
        import ray
        from ray.exceptions import RayError

        pending = dict(refs)
        done: dict[int, Any] = {}
        next_probe = time.monotonic() + self._health_period_s
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1, timeout=self._health_period_s)
            for ref in ready:
                rank = pending.pop(ref)
                try:
                    done[rank] = ray.get(ref)
                except RayError as e:
                    cause = e.cause if hasattr(e, "cause") else None
                    if isinstance(cause, ValueError):
                        raise cause from None  # bad request: the group itself is fine
                    self._fail(f"rank {rank} failed during {what}: {e}")
            if pending and time.monotonic() >= next_probe:
                self._probe_health()
                next_probe = time.monotonic() + self._health_period_s
        return done

    def _probe_health(self) -> None:
        import ray
        from ray.exceptions import RayError

        refs = {a.check_health.remote(): r for r, a in enumerate(self._actors)}
        ready, not_ready = ray.wait(
            list(refs), num_returns=len(refs), timeout=self._health_timeout_s
        )
        for ref in ready:
            try:
                ray.get(ref)
            except RayError as e:
                self._fail(f"rank {refs[ref]} is unhealthy: {e}")
        if not_ready:
            ranks = sorted(refs[r] for r in not_ready)
            self._fail(
                f"ranks {ranks} did not answer a health check within {self._health_timeout_s} s"
            )

    def _fail(self, reason: str) -> None:
        self._failure = f"EP group {self.group_id} failed: {reason}"
        logger.error("%s; tearing the group down", self._failure)
        self._teardown()
        raise EPGroupError(self._failure)

    def _check_alive(self) -> None:
        if self._failure is not None:
            raise EPGroupError(f"{self._failure} (create a new OfflineEPGroup)")
        if not self._actors:
            raise EPGroupError(f"EP group {self.group_id} was shut down")

    # -- introspection (tests, LLM) --------------------------------------------------------------

    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer, fetched from rank 0 (the driver may not hold the checkpoint)."""
        import ray

        if self._tokenizer is None:
            self._check_alive()
            self._tokenizer = ray.get(self._actors[0].tokenizer.remote())
        return self._tokenizer

    def info(self) -> list[RankInfo]:
        import ray

        self._check_alive()
        return ray.get([a.info.remote() for a in self._actors])

    def load(self) -> list[Any]:
        import ray

        self._check_alive()
        return ray.get([a.load.remote() for a in self._actors])

    def rank_expert_weights(self, rank: int) -> dict[int, ExpertShard]:
        """Routed-expert weights held by `rank`, by MoE layer index."""
        import ray

        self._check_alive()
        return ray.get(self._actors[rank].expert_shards.remote())

    def kill_rank(self, rank: int) -> None:
        """Kill one rank's actor outright (tests: simulates a lost process or node)."""
        import ray

        ray.kill(self._actors[rank], no_restart=True)

    # -- lifetime --------------------------------------------------------------------------------

    def shutdown(self) -> None:
        import ray

        if self._actors and self._failure is None:
            refs = [a.shutdown.remote() for a in self._actors]
            # Engines stop their loops in lockstep; a stuck one is killed below anyway.
            ray.wait(refs, num_returns=len(refs), timeout=self._health_timeout_s)
        self._teardown()

    def _teardown(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                pass
        self._actors = []
        if self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception:  # already removed
                pass
            self._pg = None

    def __enter__(self) -> OfflineEPGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
