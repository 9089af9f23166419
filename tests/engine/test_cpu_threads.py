"""The CPU forward's intra-op thread count: one thread for small expert GEMMs, else the process's."""

from types import SimpleNamespace

import torch

from engine.config import EngineConfig
from engine.model_runner import _cpu_threads


def _hf(hidden: int, inter: int) -> SimpleNamespace:
    return SimpleNamespace(hidden_size=hidden, moe_intermediate_size=inter)


def test_small_experts_run_on_one_thread():
    assert _cpu_threads(EngineConfig(), _hf(256, 128), torch.float32) == 1  # tiny-dsv3's shapes


def test_large_experts_use_the_process_threads():
    assert _cpu_threads(EngineConfig(), _hf(1024, 512), torch.float32) == torch.get_num_threads()
    # the bound is in bytes: the same shapes in bfloat16 are half as large
    assert _cpu_threads(EngineConfig(), _hf(512, 256), torch.bfloat16) == 1


def test_explicit_setting_wins():
    assert _cpu_threads(EngineConfig(cpu_threads=3), _hf(256, 128), torch.float32) == 3
