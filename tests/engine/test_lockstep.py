"""What the ranks of an EP group agree on per step from their headers: the DeepEP kernels."""

from types import SimpleNamespace

import pytest

from engine.config import EngineConfig
from engine.forward_batch import ForwardMode
from engine.lockstep import Lockstep, StepHeader
from engine.model_runner import ModelRunner
from engine.parallel import SINGLE_RANK
from engine.sched.batch import idle_batch

DECODE, EXTEND, IDLE, NONE = int(ForwardMode.DECODE), int(ForwardMode.EXTEND), int(ForwardMode.IDLE), 0


def _mode(headers, **cfg):
    return Lockstep(SINGLE_RANK, EngineConfig(**cfg)).group_a2a_mode([StepHeader(n, m, True) for n, m in headers])


def test_one_extending_rank_puts_the_whole_group_on_normal_kernels():
    assert _mode([(64, DECODE), (64, DECODE)]) == "low_latency"
    assert _mode([(64, DECODE), (900, EXTEND)]) == "normal"  # the decoding rank must follow
    assert _mode([(0, NONE), (900, EXTEND)]) == "normal"  # and so must a rank with nothing to do


def test_an_idle_rank_joins_the_decoding_ranks():
    assert _mode([(0, NONE), (12, DECODE)]) == "low_latency"


def test_a_decode_step_over_the_low_latency_capacity_runs_normal_kernels():
    assert _mode([(200, DECODE), (10, DECODE)], max_running_requests=256, deepep_ll_max_tokens=128) == "normal"
    assert _mode([(128, DECODE), (10, DECODE)], max_running_requests=256, deepep_ll_max_tokens=128) == "low_latency"
    # default capacity: a rank's largest decode batch
    assert EngineConfig(max_running_requests=96).resolved_deepep_ll_max_tokens == 96


@pytest.mark.parametrize("fixed", ["normal", "low_latency"])
def test_a_fixed_mode_is_left_alone(fixed):
    assert _mode([(64, DECODE), (900, EXTEND)], deepep_mode=fixed) is None


class _Recorder:
    def __init__(self):
        self.modes = []

    def set_mode(self, mode):
        self.modes.append(mode)


def _runner(deepep_mode="auto"):
    d = _Recorder()
    fake = SimpleNamespace(a2a_backend="deepep", config=EngineConfig(deepep_mode=deepep_mode),
                           model=SimpleNamespace(moe_layers=[SimpleNamespace(dispatchers=[d])]))
    return fake, d


def test_runner_applies_the_group_mode_on_an_idle_rank():
    fake, d = _runner()
    fb = idle_batch()
    fb.moe_a2a_mode = "normal"  # another rank prefills
    ModelRunner._set_deepep_mode(fake, fb)
    fb.moe_a2a_mode = "low_latency"
    ModelRunner._set_deepep_mode(fake, fb)
    assert d.modes == ["normal", "low_latency"]


def test_runner_without_a_group_mode_follows_its_batch():
    fake, d = _runner()
    ModelRunner._set_deepep_mode(fake, idle_batch())  # nothing to follow: unchanged
    assert d.modes == []
    fake2, d2 = _runner(deepep_mode="normal")
    fb = idle_batch()
    fb.moe_a2a_mode = "low_latency"
    ModelRunner._set_deepep_mode(fake2, fb)  # a fixed mode is never switched
    assert d2.modes == []
