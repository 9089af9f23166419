"""Serving metrics through `ray.util.metrics` (exported by each node's agent in Prometheus format).

Exported names get Ray's `ray_` prefix; counters also a `_total` suffix, histograms
`_bucket/_sum/_count`. E.g. `moe_serve_requests` is scraped as `ray_moe_serve_requests_total`.

Request-level metrics are recorded by the ingress. Per-rank gauges come from the ranks' routing
stats (`serving.router.rank_routing_stats`), which Serve broadcasts to every handle's router; the
router in the ingress republishes them, so a rank never has to know about serving metrics.
"""

from __future__ import annotations

import threading
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
_BATCH_BOUNDS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024]

# step stats (from the engine's `stats()`, reported as `step_<name>`) republished as rank gauges;
# the gauge is `moe_serve_rank_<name>`.
RANK_GAUGES: dict[str, str] = {
    "running_requests": "requests in the rank's running batch",
    "waiting_requests": "requests waiting in the rank's scheduler queue",
    "running_tokens": "tokens held by running requests",
    "waiting_tokens": "prompt tokens of waiting requests",
    "kv_usage": "fraction of the rank's KV pool in use",
}


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
        rank_tags = ("rank_replica", "gang_rank")
        self.rank = {
            name: rm.Gauge(PREFIX + "rank_" + name, desc, tag_keys=rank_tags)
            for name, desc in RANK_GAUGES.items()
        }
        # Whatever numeric step statistics the engine reports (forward/schedule/idle time, tokens
        # per step, batch size, overlap/TBO/SBO activity) as one gauge family keyed by `stat`, so a
        # new engine counter shows up without a serving release.
        self.rank_step = rm.Gauge(
            PREFIX + "rank_step_stat",
            "engine step statistics per rank (see the `stat` tag)",
            tag_keys=(*rank_tags, "stat"),
        )
        self.batch_size = rm.Histogram(
            PREFIX + "rank_batch_size",
            "running batch size seen at each stats report",
            boundaries=_BATCH_BOUNDS,
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


def record_rank_stats(stats_by_replica: dict[str, dict[str, Any]]) -> None:
    """Publish each rank's last routing-stats report as gauges (tag `rank_replica`)."""
    m = get_metrics()
    for replica, stats in stats_by_replica.items():
        if not stats:
            continue
        tags = {"rank_replica": replica, "gang_rank": str(stats.get("gang_rank", ""))}
        for name, gauge in m.rank.items():
            if name in stats:
                gauge.set(float(stats[name]), tags=tags)
        for key, value in stats.items():
            if key.startswith("step_") and isinstance(value, (bool, int, float)):
                m.rank_step.set(float(value), tags={**tags, "stat": key[len("step_") :]})
        if stats.get("running_requests"):
            m.batch_size.observe(float(stats["running_requests"]), tags={"rank_replica": replica})
