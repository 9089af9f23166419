"""Serving metrics through `ray.util.metrics` (exported by each node's agent in Prometheus format).

Exported names get Ray's `ray_` prefix; counters also a `_total` suffix, histograms
`_bucket/_sum/_count`. E.g. `moe_serve_requests` is scraped as `ray_moe_serve_requests_total`.

Request-level metrics are recorded by the ingress (`ServingMetrics`). Per-rank metrics are
recorded in each rank's own process (`RankMetrics`), from the same report it gives the request
router (`record_routing_stats`, pulled by the Serve controller every `router.stats_period_s`):
the rank deployment calls `publish_rank_report` with it. Publishing there, not in the routers,
means one series per rank however many ingress replicas (routers) there are, and counters that
count each engine step once. Per-rank series carry the tags `gang` (gang id), `gang_rank` and
`rank_replica` (Serve replica id).

The engine's `EngineStats` are cumulative since the engine started; counters advance by the
difference between consecutive reports. Every `EngineStats` field maps to exactly one named
metric below (`RANK_STEP_COUNTERS` / `RANK_STEP_GAUGES`; a test keeps them in step with the
engine).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from ray.util import metrics as rm

PREFIX = "moe_serve_"

# Latency buckets in seconds: sub-ms ITL on GPUs up to multi-minute e2e under load.
_LATENCY_BOUNDS = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
]


class ServingMetrics:
    """The process-wide metric objects; create through `get_metrics()` (one set per process)."""

    def __init__(self) -> None:
        m = ("model",)
        self.requests = rm.Counter(
            PREFIX + "requests",
            "finished HTTP requests by endpoint and status",
            tag_keys=("model", "endpoint", "status"),
        )
        self.ttft = rm.Histogram(
            PREFIX + "ttft_seconds", "time to first token", boundaries=_LATENCY_BOUNDS, tag_keys=m
        )
        self.itl = rm.Histogram(
            PREFIX + "inter_token_latency_seconds",
            "time between streamed tokens",
            boundaries=_LATENCY_BOUNDS,
            tag_keys=m,
        )
        self.e2e = rm.Histogram(
            PREFIX + "e2e_latency_seconds",
            "request latency, arrival to last token",
            boundaries=_LATENCY_BOUNDS,
            tag_keys=m,
        )
        self.prompt_tokens = rm.Counter(
            PREFIX + "prompt_tokens", "prompt tokens of finished requests", tag_keys=m
        )
        self.generation_tokens = rm.Counter(
            PREFIX + "generation_tokens", "generated tokens", tag_keys=m
        )
        self.cached_tokens = rm.Counter(
            PREFIX + "cached_tokens", "prompt tokens served from the prefix cache", tag_keys=m
        )
        self.running = rm.Gauge(
            PREFIX + "ingress_running_requests", "requests in flight in this ingress", tag_keys=m
        )
        # The router's view of each rank: last report + what it routed there since.
        self.router_outstanding = rm.Gauge(
            PREFIX + "router_outstanding_tokens",
            "outstanding tokens the request router attributes to each rank",
            tag_keys=("rank_replica",),
        )
        self.router_reports = rm.Counter(
            PREFIX + "router_rank_reports",
            "fresh rank load reports the request router took into account",
            tag_keys=("rank_replica",),
        )


_lock = threading.Lock()
_metrics: ServingMetrics | None = None


def get_metrics() -> ServingMetrics:
    global _metrics
    with _lock:
        if _metrics is None:
            _metrics = ServingMetrics()
        return _metrics


# ---- per rank (recorded in the rank's process) ----------------------------------------------------
RANK_TAGS = ("gang", "gang_rank", "rank_replica")

# Load report key -> (metric name after `moe_serve_rank_`, description); gauges.
RANK_LOAD_GAUGES: dict[str, tuple[str, str]] = {
    "running_requests": ("running_requests", "requests in the rank's running batch"),
    "waiting_requests": ("waiting_requests", "requests waiting in the rank's scheduler queue"),
    "running_tokens": ("running_tokens", "tokens held by running requests"),
    "waiting_tokens": ("waiting_tokens", "prompt tokens of waiting requests"),
    "kv_usage": ("kv_usage", "fraction of the rank's KV pool in use"),
}

# Cumulative `EngineStats` field -> (counter name after `moe_serve_rank_`, description).
RANK_STEP_COUNTERS: dict[str, tuple[str, str]] = {
    "steps": ("steps", "engine steps (every rank steps in lockstep, idle or not)"),
    "prefill_steps": ("prefill_steps", "steps that ran a prefill (extend) batch"),
    "decode_steps": ("decode_steps", "steps that ran a decode batch"),
    "idle_steps": ("idle_steps", "zero-token steps run only to join the group's collectives"),
    "tbo_steps": ("tbo_steps", "steps run as two overlapped micro-batches (TBO)"),
    "forward_time_s": ("forward_seconds", "time spent in model forwards"),
    "schedule_time_s": ("schedule_seconds", "time spent scheduling"),
    "bubble_time_s": ("bubble_seconds", "executor idle gaps between consecutive forwards"),
    "a2a_wait_s": ("a2a_wait_seconds", "time blocked waiting on MoE all-to-all"),
    "generated_tokens": ("generated_tokens", "tokens sampled"),
    "prefill_tokens": ("prefill_tokens", "prompt tokens prefilled (computed, not cached)"),
    "cached_tokens": ("cached_tokens", "prompt tokens served from the prefix cache"),
    "retractions": ("retractions", "requests preempted for lack of KV cache"),
}

# Instantaneous `EngineStats` field or property -> (gauge name after `moe_serve_rank_`, description).
RANK_STEP_GAUGES: dict[str, tuple[str, str]] = {
    "overlap": ("overlap_enabled", "1 if the overlap scheduler is on"),
    "sbo": ("sbo_enabled", "1 if single-batch overlap is on"),
    "last_batch_size": ("batch_size", "requests in the last step's batch"),
    "last_step_tokens": ("step_tokens", "tokens in the last step's batch"),
    "idle_fraction": (
        "idle_fraction",
        "bubble share of the executor's busy span since start (EngineStats.idle_fraction)",
    ),
}

# Derived per report interval (no EngineStats field of its own).
TBO_STEP_FRACTION = ("tbo_step_fraction", "share of the last report interval's steps run with TBO")


class RankMetrics:
    """The named metrics of one rank process; `publish` turns one report into metric updates."""

    def __init__(self) -> None:
        name = PREFIX + "rank_"
        self.load = {
            key: rm.Gauge(name + metric, desc, tag_keys=RANK_TAGS)
            for key, (metric, desc) in RANK_LOAD_GAUGES.items()
        }
        self.counters = {
            key: rm.Counter(name + metric, desc, tag_keys=RANK_TAGS)
            for key, (metric, desc) in RANK_STEP_COUNTERS.items()
        }
        self.gauges = {
            key: rm.Gauge(name + metric, desc, tag_keys=RANK_TAGS)
            for key, (metric, desc) in RANK_STEP_GAUGES.items()
        }
        self.tbo_fraction = rm.Gauge(
            name + TBO_STEP_FRACTION[0], TBO_STEP_FRACTION[1], tag_keys=RANK_TAGS
        )
        self._last: dict[str, float] = {}  # cumulative field -> value at the previous report
        self._lock = threading.Lock()

    def publish(self, report: Mapping[str, Any], tags: Mapping[str, str]) -> None:
        """`report`: a rank's routing-stats dict (load keys, `step_<EngineStats field>`)."""
        tags = {k: str(tags.get(k, "")) for k in RANK_TAGS}
        with self._lock:
            for key, gauge in self.load.items():
                if key in report:
                    gauge.set(float(report[key]), tags=tags)
            deltas: dict[str, float] = {}
            for key, counter in self.counters.items():
                value = report.get("step_" + key)
                if value is None:
                    continue
                value = float(value)
                prev = self._last.get(key, 0.0)
                # A smaller value means the counters restarted (a new engine): count from zero.
                deltas[key] = value - prev if value >= prev else value
                self._last[key] = value
                if deltas[key] > 0:
                    counter.inc(deltas[key], tags=tags)
            for key, gauge in self.gauges.items():
                value = report.get("step_" + key)
                if value is not None:
                    gauge.set(float(value), tags=tags)
            if "steps" in deltas:
                steps = deltas["steps"]
                self.tbo_fraction.set(
                    deltas.get("tbo_steps", 0.0) / steps if steps > 0 else 0.0, tags=tags
                )


_rank_metrics: RankMetrics | None = None


def publish_rank_report(report: Mapping[str, Any], tags: Mapping[str, str]) -> None:
    """The rank deployment's report hook (`cluster.serve_rank.build_rank_app(report_hook=...)`):
    runs in the rank's process at every routing-stats report."""
    global _rank_metrics
    with _lock:
        if _rank_metrics is None:
            _rank_metrics = RankMetrics()
    _rank_metrics.publish(report, tags)
