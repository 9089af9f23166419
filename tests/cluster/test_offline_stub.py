"""OfflineEPGroup's placement, lockstep and failure handling, with a lockstep stand-in engine."""

from __future__ import annotations

import threading
import time

import pytest
from cluster_testing import LOOPBACK

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams


def _stub_factory(config, parallel):
    from stub_engine import StubEngine

    return StubEngine(config, parallel)


def _hanging_rank1_factory(config, parallel):
    from stub_engine import StubEngine

    return StubEngine(config, parallel, hang_rank=1)


def _group(**kw):
    from cluster.offline import OfflineEPGroup
    from cluster.rank import RankOptions

    kw.setdefault("engine_factory", _stub_factory)
    return OfflineEPGroup(
        EngineConfig(ep_size=2, device="cpu"),
        options=RankOptions(
            rendezvous_timeout_s=30, collective_timeout_s=30, master_address=LOOPBACK
        ),
        health_check_period_s=0.5,
        health_check_timeout_s=5,
        **kw,
    )


def _requests(n: int, max_tokens: int = 4):
    return [(f"r{i}", [i + 1, 100 + i], SamplingParams(max_tokens=max_tokens)) for i in range(n)]


def _expected(req):
    _, prompt, params = req
    return [(prompt[-1] + k + 1) % 1000 for k in range(params.max_tokens)]


@pytest.mark.parametrize("placement", [None, [0, 0, 0, 0], [1, 1, 1, 1], [0, 1, 1, 0]])
def test_offline_group_spreads_requests_and_returns_in_order(local_ray, placement):
    with _group() as group:
        reqs = _requests(4)
        outs = group.generate(reqs, placement=placement)
        assert [o.request_id for o in outs] == [r[0] for r in reqs]
        assert [o.token_ids for o in outs] == [_expected(r) for r in reqs]
        assert all(o.finished and o.finish_reason == "length" and o.error is None for o in outs)
        infos = group.info()
        assert [i.rank for i in infos] == [0, 1]
        assert {i.gang_id for i in infos} == {group.group_id}
        assert all(i.peak_rss_bytes > 10 * 2**20 and i.peak_device_bytes is None for i in infos)


def test_offline_group_rejects_bad_placement_and_invalid_requests(local_ray):
    with _group() as group:
        with pytest.raises(ValueError, match="placement ranks"):
            group.generate(_requests(2), placement=[0, 2])
        with pytest.raises(ValueError, match="empty prompt"):
            group.generate([("bad", [], SamplingParams())])
        # A rejected request leaves the group serving.
        assert group.generate(_requests(1))[0].token_ids == _expected(_requests(1)[0])


@pytest.mark.parametrize("victim", [0, 1])
def test_killing_a_rank_mid_generation_fails_pending_requests_then_new_group_serves(
    local_ray, victim
):
    from cluster.offline import EPGroupError

    group = _group()
    long_reqs = _requests(4, max_tokens=2000)  # ~40 s of steps: must be cut short by the kill
    result: dict[str, object] = {}

    def run() -> None:
        try:
            result["outs"] = group.generate(long_reqs, placement=[0, 0, 0, 0])
        except BaseException as e:
            result["error"] = e

    t = threading.Thread(target=run)
    t.start()
    time.sleep(2.0)
    killed_at = time.monotonic()
    group.kill_rank(victim)  # victim 1 is idle: only the health probes can notice it
    t.join(timeout=30)
    assert not t.is_alive(), "generate hung after a rank was killed"
    assert time.monotonic() - killed_at < 15
    assert isinstance(result.get("error"), EPGroupError), result
    assert "rank" in str(result["error"])
    with pytest.raises(EPGroupError, match="create a new OfflineEPGroup"):
        group.generate(_requests(1))
    group.shutdown()

    with _group() as fresh:
        reqs = _requests(2)
        assert [o.token_ids for o in fresh.generate(reqs)] == [_expected(r) for r in reqs]


def test_a_hung_rank_fails_the_group_by_stall_detection(local_ray):
    """No process dies: rank 1 wedges, rank 0 blocks in its collective. Health checks report the
    stall (stub stall timeout 5 s) and the batch fails instead of hanging."""
    from cluster.offline import EPGroupError

    with _group(engine_factory=_hanging_rank1_factory) as group:
        t0 = time.monotonic()
        with pytest.raises(EPGroupError, match="no progress"):
            group.generate(_requests(2, max_tokens=50), placement=[0, 1])
        assert time.monotonic() - t0 < 20


def _failing_rank1_factory(config, parallel):
    from stub_engine import StubEngine

    if parallel.rank == 1:
        raise RuntimeError("rank 1 could not load its experts")
    return StubEngine(config, parallel)


def test_a_rank_failing_at_startup_fails_the_group_promptly(local_ray):
    """Rank 0 sits in the collective startup with its peer gone; the group must not wait for it."""
    t0 = time.monotonic()
    with pytest.raises(Exception, match="could not load its experts"):
        _group(engine_factory=_failing_rank1_factory)
    assert time.monotonic() - t0 < 20
