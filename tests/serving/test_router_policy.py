"""The rank-choice policy of `serving.router`, without Ray: load order, prefix affinity, slack,
staleness handling, abort pinning, and the Serve adapter's argument parsing."""

from __future__ import annotations

from types import SimpleNamespace

from serving.router import RoutingPolicy, _GenerateCall, _parse_call, rank_routing_stats


def _policy(**kw: int) -> RoutingPolicy:
    return RoutingPolicy(
        prefix_block_tokens=4, prefix_max_tokens=16, affinity_slack_tokens=100, **kw
    )


def test_least_outstanding_tokens_first() -> None:
    p = _policy()
    p.update_report("a", 500, reported_at=10.0)
    p.update_report("b", 50, reported_at=10.0)
    p.update_report("c", 200, reported_at=10.0)
    assert p.rank(["a", "b", "c"]) == ["b", "c", "a"]


def test_requests_routed_after_a_report_count_until_the_next_one() -> None:
    p = _policy()
    p.update_report("a", 0, reported_at=10.0)
    p.update_report("b", 100, reported_at=10.0)
    p.on_routed("r1", "a", tokens=300, now=11.0)  # newer than a's report: not in it yet
    assert p.outstanding("a") == 300
    assert p.rank(["a", "b"]) == ["b", "a"]
    p.update_report("a", 300, reported_at=12.0)  # the report now includes r1: no double count
    assert p.outstanding("a") == 300
    p.on_completed("r1")
    assert p.outstanding("a") == 300  # until the rank reports it finished


def test_prefix_affinity_wins_within_slack_and_yields_beyond_it() -> None:
    p = _policy()
    shared = list(range(100, 112))  # three full 4-token blocks
    p.update_report("a", 0, reported_at=1.0)
    p.update_report("b", 0, reported_at=1.0)
    keys = p.prefix_keys(shared + [1, 2, 3, 4])
    p.on_routed("r1", "b", tokens=60, prefix_keys=keys, now=2.0)
    # Another prompt with the same 12-token prefix but a different tail prefers b (60 <= 0 + 100).
    other = p.prefix_keys(shared + [9, 9, 9, 9])
    assert p.rank(["a", "b"], other)[0] == "b"
    # Once b is more than the slack above a, load wins.
    p.on_routed("r2", "b", tokens=200, now=3.0)
    assert p.rank(["a", "b"], other)[0] == "a"


def test_longest_known_prefix_decides() -> None:
    p = _policy()
    base = list(range(8))
    p.on_routed("r1", "a", 1, p.prefix_keys(base), now=1.0)  # 2 blocks -> a
    p.on_routed("r2", "b", 1, p.prefix_keys(base + [8, 9, 10, 11]), now=1.0)  # 3 blocks -> b
    assert p.preferred_for(p.prefix_keys(base + [8, 9, 10, 11, 0])) == "b"
    assert (
        p.preferred_for(p.prefix_keys(base + [7, 7, 7, 7])) == "b"
    )  # first 2 blocks re-pointed to b
    assert p.preferred_for(p.prefix_keys([5, 5, 5, 5])) is None
    assert p.prefix_keys([1, 2, 3]) == []  # shorter than one block: no affinity


def test_prefix_table_is_bounded_lru_and_forgets_dead_replicas() -> None:
    p = RoutingPolicy(
        prefix_block_tokens=1, prefix_max_tokens=1, affinity_slack_tokens=0, max_prefix_entries=2
    )
    for i, r in enumerate(["a", "b", "c"]):
        p.on_routed(f"r{i}", r, 1, p.prefix_keys([i]), now=1.0)
    assert p.preferred_for(p.prefix_keys([0])) is None  # evicted
    assert p.preferred_for(p.prefix_keys([2])) == "c"
    p.forget_replicas_except({"b"})
    assert p.preferred_for(p.prefix_keys([2])) is None
    assert p.preferred_for(p.prefix_keys([1])) == "b"


def test_abort_is_pinned_to_the_rank_serving_the_request() -> None:
    p = _policy()
    p.on_routed("internal-1", "b", 10, request_id="cmpl-1", now=1.0)
    assert p.replica_for_request_id("cmpl-1") == "b"
    p.on_completed("internal-1")
    assert p.replica_for_request_id("cmpl-1") is None


def _pending(method: str, *args: object, **kwargs: object) -> SimpleNamespace:
    return SimpleNamespace(
        args=list(args), kwargs=kwargs, metadata=SimpleNamespace(call_method=method)
    )


def test_parse_rank_calls_positional_and_keyword() -> None:
    method, call = _parse_call(_pending("generate", "rid", [1, 2, 3], {"max_tokens": 7}))
    assert method == "generate" and call == _GenerateCall("rid", [1, 2, 3], 10)
    _, call = _parse_call(
        _pending("generate", request_id="r", prompt_token_ids=[1], sampling_params={})
    )
    assert isinstance(call, _GenerateCall) and call.work_tokens == 1 + 16
    assert _parse_call(_pending("abort", "rid")) == ("abort", "rid")
    assert _parse_call(_pending("load")) == ("load", None)


def test_rank_routing_stats_flattens_load_and_step_stats() -> None:
    load = SimpleNamespace(
        num_running=3, num_waiting=2, running_tokens=40, waiting_tokens=9, kv_usage=0.25
    )
    s = rank_routing_stats(load, {"tbo_steps": 4, "name": "x", "overlap": True}, gang_rank=1)
    assert s["running_tokens"] == 40 and s["waiting_requests"] == 2 and s["kv_usage"] == 0.25
    assert s["step_tbo_steps"] == 4 and s["step_overlap"] is True and "step_name" not in s
    assert s["gang_rank"] == 1 and s["ts"] > 0
