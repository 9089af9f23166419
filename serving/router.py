"""Request routing across EP ranks: least outstanding tokens, with prefix affinity.

Every rank replica of every gang runs its own scheduler and KV cache (DP attention), so a request
may go to any rank. Two signals decide which:

* **Outstanding tokens.** Each rank reports `waiting_tokens + running_tokens` through Serve's
  routing-stats hook (`record_routing_stats`, pulled every `stats_period_s` and broadcast to every
  handle). Reports are stale by up to a period, so the router adds the tokens of requests *it*
  routed to that rank after the report was taken and that are still in flight. Request work is
  estimated as prompt tokens + max_tokens.
* **Prefix affinity.** Prompts are hashed block by block (`prefix_block_tokens`, up to
  `prefix_max_tokens`); the table remembers which rank last got each block-prefix. A prompt goes
  to the rank holding its longest known prefix unless that rank carries more than
  `affinity_slack_tokens` beyond the least-loaded one (then recomputing the prefix elsewhere is
  cheaper than queueing behind it).

`abort(request_id)` is pinned to the rank serving that request: an abort routed anywhere else
would be a silent no-op.

`RoutingPolicy` is plain Python (unit-tested without Ray); `LoadPrefixRequestRouter` adapts it to
Ray Serve 2.60's `RequestRouter` interface (`choose_replicas`, `on_request_routed`,
`on_request_completed`, `update_replicas`).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

logger = logging.getLogger("ray.serve")

# Keys of the dict a rank's `record_routing_stats` returns (see `rank_routing_stats`).
STAT_TIME = "ts"


def rank_routing_stats(
    load: Any, stats: Any = None, *, gang_rank: int | None = None
) -> dict[str, Any]:
    """The routing-stats dict a rank reports: its `EngineLoad`, plus step stats for the metrics
    (`step_<EngineStats field>` and `step_idle_fraction`). `cluster.serve_rank.EPRankDeployment`
    builds the same keys (a test holds the two together).

    `stats` is the engine's `stats()` (a dataclass or dict, optional). Values are plain numbers so
    the dict pickles cheaply through the Serve controller's broadcast.
    """
    out: dict[str, Any] = {
        STAT_TIME: time.time(),
        "running_requests": int(getattr(load, "num_running", 0)),
        "waiting_requests": int(getattr(load, "num_waiting", 0)),
        "running_tokens": int(getattr(load, "running_tokens", 0)),
        "waiting_tokens": int(getattr(load, "waiting_tokens", 0)),
        "kv_usage": float(getattr(load, "kv_usage", 0.0)),
    }
    if gang_rank is not None:
        out["gang_rank"] = gang_rank
    if stats is not None:
        items = stats if isinstance(stats, dict) else getattr(stats, "__dict__", {})
        for k, v in items.items():
            if isinstance(v, (bool, int, float)):
                out[f"step_{k}"] = v
        idle = getattr(stats, "idle_fraction", None)
        if isinstance(idle, (int, float)):
            out["step_idle_fraction"] = float(idle)
    return out


@dataclass
class _InFlight:
    replica: Hashable
    tokens: int
    routed_at: float
    request_id: str | None


class RoutingPolicy:
    """Chooses a preference order over replicas. Not thread-safe: one router event loop owns it."""

    def __init__(
        self,
        *,
        prefix_block_tokens: int = 16,
        prefix_max_tokens: int = 256,
        affinity_slack_tokens: int = 4096,
        max_prefix_entries: int = 100_000,
    ) -> None:
        self.block = prefix_block_tokens
        self.max_blocks = max(1, prefix_max_tokens // prefix_block_tokens)
        self.slack = affinity_slack_tokens
        self.max_entries = max_prefix_entries
        self._reported: dict[Hashable, tuple[int, float]] = {}  # replica -> (tokens, report time)
        self._inflight: dict[str, _InFlight] = {}  # router's request key -> what it sent where
        self._by_request_id: dict[str, Hashable] = {}  # engine request id -> replica
        self._prefix: OrderedDict[int, Hashable] = (
            OrderedDict()
        )  # LRU: block-prefix hash -> replica

    # ---- inputs -------------------------------------------------------------------------------
    def prefix_keys(self, token_ids: Sequence[int]) -> list[int]:
        """Chained hashes of the prompt's full blocks, shortest prefix first."""
        keys: list[int] = []
        h = 0
        for b in range(min(len(token_ids) // self.block, self.max_blocks)):
            h = hash((h, tuple(token_ids[b * self.block : (b + 1) * self.block])))
            keys.append(h)
        return keys

    def update_report(self, replica: Hashable, outstanding_tokens: int, reported_at: float) -> bool:
        """Record a rank's load report; False if it is the one already recorded."""
        if self._reported.get(replica, (0, None))[1] == reported_at:
            return False
        self._reported[replica] = (outstanding_tokens, reported_at)
        return True

    def forget_replicas_except(self, live: set[Hashable]) -> None:
        for r in [r for r in self._reported if r not in live]:
            del self._reported[r]
        for k in [k for k, r in self._prefix.items() if r not in live]:
            del self._prefix[k]

    # ---- decisions ----------------------------------------------------------------------------
    def outstanding(self, replica: Hashable) -> int:
        tokens, at = self._reported.get(replica, (0, 0.0))
        return tokens + sum(
            f.tokens for f in self._inflight.values() if f.replica == replica and f.routed_at > at
        )

    def preferred_for(self, keys: Sequence[int]) -> Hashable | None:
        for k in reversed(keys):
            r = self._prefix.get(k)
            if r is not None:
                return r
        return None

    def rank(self, replicas: Sequence[Hashable], prefix_keys: Sequence[int] = ()) -> list[Hashable]:
        """Replicas, most preferred first: the prefix holder (if within slack), then by load."""
        load = {r: self.outstanding(r) for r in replicas}
        order = sorted(replicas, key=lambda r: load[r])
        holder = self.preferred_for(prefix_keys)
        if holder in load and order and load[holder] <= load[order[0]] + self.slack:
            order.remove(holder)
            order.insert(0, holder)
        return order

    def replica_for_request_id(self, request_id: str) -> Hashable | None:
        return self._by_request_id.get(request_id)

    # ---- lifecycle ----------------------------------------------------------------------------
    def on_routed(
        self,
        key: str,
        replica: Hashable,
        tokens: int,
        prefix_keys: Sequence[int] = (),
        request_id: str | None = None,
        now: float | None = None,
    ) -> None:
        self._inflight[key] = _InFlight(
            replica, tokens, time.time() if now is None else now, request_id
        )
        if request_id is not None:
            self._by_request_id[request_id] = replica
        for k in prefix_keys:
            self._prefix[k] = replica
            self._prefix.move_to_end(k)
        while len(self._prefix) > self.max_entries:
            self._prefix.popitem(last=False)

    def on_completed(self, key: str) -> None:
        f = self._inflight.pop(key, None)
        if f is not None and f.request_id is not None:
            self._by_request_id.pop(f.request_id, None)


@dataclass(frozen=True)
class _GenerateCall:
    request_id: str
    prompt_token_ids: Sequence[int]
    work_tokens: int


def _parse_call(pr: PendingRequest) -> tuple[str, _GenerateCall | str | None]:
    """(method, generate call | abort's request id | None) from a rank-method call's arguments.

    Positional or keyword: `generate(request_id, prompt_token_ids, sampling_params)`,
    `abort(request_id)`.
    """
    method = pr.metadata.call_method
    args, kwargs = list(pr.args), dict(pr.kwargs)
    names = {
        "generate": ("request_id", "prompt_token_ids", "sampling_params"),
        "abort": ("request_id",),
    }
    if method not in names:
        return method, None
    vals = dict(zip(names[method], args, strict=False))
    vals.update({k: v for k, v in kwargs.items() if k in names[method]})
    rid = vals.get("request_id")
    if method == "abort":
        return method, rid if isinstance(rid, str) else None
    ids = vals.get("prompt_token_ids")
    if not isinstance(rid, str) or not isinstance(ids, (list, tuple)):
        return method, None
    params = vals.get("sampling_params") or {}
    max_tokens = (
        params.get("max_tokens", 16)
        if isinstance(params, dict)
        else getattr(params, "max_tokens", 16)
    )
    return method, _GenerateCall(rid, ids, len(ids) + int(max_tokens or 0))


class LoadPrefixRequestRouter(RequestRouter):
    """Serve request router for the EP-rank deployment (configured via `request_router_config`)."""

    def initialize_state(
        self,
        prefix_block_tokens: int = 16,
        prefix_max_tokens: int = 256,
        affinity_slack_tokens: int = 4096,
        max_prefix_entries: int = 100_000,
        **_: Any,
    ) -> None:
        self.policy = RoutingPolicy(
            prefix_block_tokens=prefix_block_tokens,
            prefix_max_tokens=prefix_max_tokens,
            affinity_slack_tokens=affinity_slack_tokens,
            max_prefix_entries=max_prefix_entries,
        )
        # Per internal request id: what `on_request_routed` needs, computed once in choose.
        self._calls: dict[str, tuple[_GenerateCall, list[int]]] = {}

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        if pending_request is not None:
            # We always consider every replica, so a failed round should back off (Serve's loop
            # spins without sleeping otherwise).
            pending_request.routing_context.should_backoff = True
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        method, call = (None, None) if pending_request is None else _parse_call(pending_request)
        if method == "abort" and isinstance(call, str):
            target = self.policy.replica_for_request_id(call)
            if target in by_id:
                return [[by_id[target]]]
        keys: list[int] = []
        if isinstance(call, _GenerateCall):
            keys = self.policy.prefix_keys(call.prompt_token_ids)
            self._calls[pending_request.metadata.internal_request_id] = (call, keys)
        order = self.policy.rank(list(by_id), keys)
        # One replica per rank: Serve tries them in order, skipping any whose queue is full.
        return [[by_id[r]] for r in order]

    def on_request_routed(
        self, pending_request: PendingRequest, replica_id: Any, result: Any
    ) -> None:
        key = pending_request.metadata.internal_request_id
        entry = self._calls.pop(key, None)
        if entry is None:
            return
        call, keys = entry
        self.policy.on_routed(key, replica_id, call.work_tokens, keys, request_id=call.request_id)
        self._publish([replica_id])

    def on_request_completed(self, replica_id: Any, internal_request_id: str) -> None:
        self._calls.pop(internal_request_id, None)
        self.policy.on_completed(internal_request_id)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        fresh = []
        for r in replicas:
            stats = r.routing_stats or {}
            if STAT_TIME in stats and self.policy.update_report(
                r.replica_id,
                int(stats.get("running_tokens", 0)) + int(stats.get("waiting_tokens", 0)),
                float(stats[STAT_TIME]),
            ):
                fresh.append(r.replica_id)
        self.policy.forget_replicas_except({r.replica_id for r in replicas})
        self._publish([r.replica_id for r in replicas], fresh)

    def _publish(self, replica_ids: Sequence[Any], fresh: Sequence[Any] = ()) -> None:
        """The router's view per rank: outstanding tokens, and how many load reports it used."""
        # Lazy import: the metrics module is only needed where a router actually routes.
        from serving.metrics import get_metrics

        m = get_metrics()
        for rid in replica_ids:
            tags = {"rank_replica": str(rid.unique_id)}
            m.router_outstanding.set(self.policy.outstanding(rid), tags=tags)
            if rid in fresh:
                m.router_reports.inc(tags=tags)
