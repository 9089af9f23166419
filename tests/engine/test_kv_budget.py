"""How the KV pool is sized: explicit tokens, an explicit byte budget, or (CUDA) a share of the
device memory still free when the runner has loaded its weights."""

from types import SimpleNamespace

import pytest
import torch

from engine.config import EngineConfig
from engine.mem.pool import MLATokenPool
from engine.model_runner import kv_cache_pages

HF = SimpleNamespace(num_hidden_layers=4, kv_lora_rank=64, qk_rope_head_dim=16)
PER_TOKEN = MLATokenPool.bytes_per_token(4, 64, 16, torch.bfloat16)  # 640 bytes


def test_explicit_tokens_round_up_to_pages_plus_the_padding_page():
    assert kv_cache_pages(EngineConfig(kv_cache_tokens=100), HF, 1024, torch.device("cpu"), torch.bfloat16) == 7 + 1


def test_byte_budget():
    cfg = EngineConfig(kv_cache_memory_bytes=PER_TOKEN * 1600)
    assert kv_cache_pages(cfg, HF, 1024, torch.device("cpu"), torch.bfloat16) == 100 + 1


def test_cuda_budget_is_a_share_of_the_memory_free_at_call_time(monkeypatch):
    free = [PER_TOKEN * 16_000]
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free[0], 10 * free[0]))
    cfg = EngineConfig(kv_cache_memory_fraction=0.5)
    assert kv_cache_pages(cfg, HF, 1024, torch.device("cuda"), torch.bfloat16) == 500 + 1
    free[0] //= 2  # weights loaded since: the pool shrinks with what is left
    assert kv_cache_pages(cfg, HF, 1024, torch.device("cuda"), torch.bfloat16) == 250 + 1
    # never more than every running request at the full context needs
    cfg = EngineConfig(kv_cache_memory_fraction=0.5, max_running_requests=2)
    assert kv_cache_pages(cfg, HF, 1024, torch.device("cuda"), torch.bfloat16) == 128 + 1


def test_a_budget_below_one_page_is_a_clear_error():
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        kv_cache_pages(EngineConfig(kv_cache_memory_bytes=PER_TOKEN * 3), HF, 1024, torch.device("cpu"), torch.bfloat16)
