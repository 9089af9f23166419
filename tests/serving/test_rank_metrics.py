"""Per-rank metrics without Ray: every `EngineStats` field has one named metric, the rank
deployment's load report has the router's keys and reaches the report hook, and `RankMetrics`
turns cumulative engine stats into counter increments (deltas) and gauges."""

from __future__ import annotations

import dataclasses
import json
import re
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import serving.metrics as sm
from cluster.serve_rank import EPRankDeployment
from engine.engine import EngineLoad, EngineStats
from serving.router import RoutingPolicy, rank_routing_stats


def _stats(**kw: Any) -> EngineStats:
    base = dict(
        steps=10, prefill_steps=2, decode_steps=6, idle_steps=2, forward_time_s=1.5,
        schedule_time_s=0.1, bubble_time_s=0.5, generated_tokens=40, prefill_tokens=64,
        cached_tokens=16, retractions=0, overlap=True, tbo_steps=4, sbo=False,
        last_batch_size=3, last_step_tokens=3, a2a_wait_s=0.2,
    )  # fmt: skip
    return EngineStats(**{**base, **kw})


REPO = Path(__file__).resolve().parents[2]
LOAD = EngineLoad(num_running=3, num_waiting=1, running_tokens=50, waiting_tokens=7, kv_usage=0.5)


def test_every_engine_stat_maps_to_exactly_one_named_metric() -> None:
    fields = {f.name for f in dataclasses.fields(EngineStats)} | {"idle_fraction"}
    counters, gauges = set(sm.RANK_STEP_COUNTERS), set(sm.RANK_STEP_GAUGES)
    assert not counters & gauges
    assert counters | gauges == fields
    names = [m for m, _ in [*sm.RANK_STEP_COUNTERS.values(), *sm.RANK_STEP_GAUGES.values()]]
    names += [m for m, _ in sm.RANK_LOAD_GAUGES.values()] + [sm.TBO_STEP_FRACTION[0]]
    assert len(names) == len(set(names))


def test_rank_deployment_report_has_the_router_keys_and_reaches_the_hook() -> None:
    seen: list[tuple[dict[str, Any], dict[str, str]]] = []
    dep = object.__new__(EPRankDeployment)  # no Serve replica: only the report path
    dep._rank = SimpleNamespace(
        load=lambda: LOAD, rank=1, engine=SimpleNamespace(stats=_stats), shutdown=lambda: None
    )
    dep._report_hook = lambda report, tags: seen.append((dict(report), dict(tags)))
    dep._report_tags = {"gang": "g0", "gang_rank": "1", "rank_replica": "abc"}
    report = dep.record_routing_stats()
    expected = rank_routing_stats(LOAD, _stats(), gang_rank=1)
    assert set(report) == set(expected)
    assert {k: v for k, v in report.items() if k != "ts"} == {
        k: v for k, v in expected.items() if k != "ts"
    }
    assert report["step_idle_fraction"] == pytest.approx(0.25)
    assert seen == [(report, dep._report_tags)]


class _FakeMetric:
    def __init__(self, name: str, description: str = "", tag_keys: tuple[str, ...] = ()) -> None:
        self.name, self.tag_keys = name, tag_keys
        self.values: dict[tuple[str, ...], float] = defaultdict(float)

    def _key(self, tags: dict[str, str]) -> tuple[str, ...]:
        assert set(tags) == set(self.tag_keys)
        return tuple(tags[k] for k in self.tag_keys)

    def inc(self, value: float = 1.0, tags: dict[str, str] | None = None) -> None:
        assert value > 0  # ray.util.metrics.Counter refuses anything else
        self.values[self._key(tags or {})] += value

    def set(self, value: float, tags: dict[str, str] | None = None) -> None:
        self.values[self._key(tags or {})] = value


def test_counters_advance_by_deltas_and_gauges_follow_the_last_report(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sm, "rm", SimpleNamespace(Counter=_FakeMetric, Gauge=_FakeMetric))
    m = sm.RankMetrics()
    tags = {"gang": "g", "gang_rank": "0", "rank_replica": "r"}
    key = ("g", "0", "r")
    m.publish(rank_routing_stats(LOAD, _stats()), tags)
    m.publish(rank_routing_stats(LOAD, _stats(steps=20, tbo_steps=9, generated_tokens=70)), tags)
    assert m.counters["steps"].values[key] == 20
    assert m.counters["generated_tokens"].values[key] == 70
    assert m.counters["forward_time_s"].values[key] == pytest.approx(1.5)  # no change: no inc
    assert m.tbo_fraction.values[key] == pytest.approx(5 / 10)  # last interval: 5 TBO of 10
    assert m.gauges["overlap"].values[key] == 1.0 and m.gauges["sbo"].values[key] == 0.0
    assert m.gauges["last_batch_size"].values[key] == 3
    assert m.load["kv_usage"].values[key] == 0.5 and m.load["waiting_requests"].values[key] == 1
    # A restarted engine reports smaller totals: they count from zero, never backwards.
    m.publish(rank_routing_stats(LOAD, _stats(steps=4)), tags)
    assert m.counters["steps"].values[key] == 24


def test_router_takes_each_report_once() -> None:
    p = RoutingPolicy()
    assert p.update_report("a", 10, reported_at=1.0)
    assert not p.update_report("a", 10, reported_at=1.0)  # the same report, broadcast again
    assert p.update_report("a", 0, reported_at=2.0) and p.outstanding("a") == 0


def test_grafana_dashboard_uses_only_exported_metric_names(monkeypatch: pytest.MonkeyPatch) -> None:
    created: dict[str, str] = {}

    def factory(kind: str) -> Any:
        def make(name: str, description: str = "", **kw: Any) -> _FakeMetric:
            created[name] = kind
            return _FakeMetric(name, description, kw.get("tag_keys", ()))

        return make

    monkeypatch.setattr(
        sm,
        "rm",
        SimpleNamespace(
            Counter=factory("counter"), Gauge=factory("gauge"), Histogram=factory("histogram")
        ),
    )
    sm.ServingMetrics()
    sm.RankMetrics()
    suffixes = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count")}
    exported = {"ray_" + n + s for n, kind in created.items() for s in suffixes[kind]}
    dashboard = json.loads((REPO / "deploy" / "grafana_dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {n for e in exprs for n in re.findall(r"ray_moe_serve_\w+", e)}
    assert used <= exported, used - exported
    # Every per-rank metric has a panel.
    rank_names = {n for n in exported if n.startswith("ray_moe_serve_rank_")}
    assert rank_names <= used, rank_names - used
