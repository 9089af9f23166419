"""Split-KV decode attention: the chunk plan, and the chunked online softmax against one pass."""

from __future__ import annotations

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.mem.pool import MLATokenPool
from engine.models.deepseek_v3 import MLAttention, plan_decode_chunks
from engine.sched.batch import attention_metadata


def test_plan_covers_every_key_once_with_only_the_rows_that_reach_it():
    lens = [5, 300, 40, 300, 1, 97]
    order, chunks = plan_decode_chunks(lens, width=10, budget=1000, min_chunk=16)
    assert [lens[i] for i in order] == sorted(lens, reverse=True)
    assert chunks[0][0] == 0 and chunks[-1][1] == max(lens)
    for (s, e, n), nxt in zip(chunks, chunks[1:] + [(max(lens), None, 0)]):
        assert s < e == nxt[0]
        assert n == sum(length > s for length in lens)  # exactly the rows with a key in [s, e)
        assert n * (e - s) * 10 <= 1000 or e - s == 16  # the budget, or the minimum chunk
    assert plan_decode_chunks(lens, width=10, budget=6 * 300 * 10) is None  # one pass fits


def _attention(seed: int = 0) -> MLAttention:
    from transformers import DeepseekV3Config

    from engine.layers.rotary import RotaryEmbedding

    cfg = DeepseekV3Config(hidden_size=32, num_attention_heads=4, q_lora_rank=16, kv_lora_rank=24,
                           qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    torch.manual_seed(seed)
    attn = MLAttention(cfg, 0, RotaryEmbedding(cfg, max_positions=512, interleave=True))
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return attn


def test_split_kv_equals_one_pass_for_mixed_lengths():
    attn = _attention()
    lens = [1, 200, 17, 64, 3, 130]
    B, H = len(lens), attn.num_heads
    pool = MLATokenPool(1, 64, 16, attn.kv_lora_rank, attn.rope_dim, torch.float32, "cpu")
    pool.buf.normal_()
    g = torch.Generator().manual_seed(1)
    rows = torch.stack([torch.randperm(pool.num_slots - 16, generator=g)[:max(lens)] + 16 for _ in lens])
    md = attention_metadata(ForwardMode.DECODE, torch.tensor(lens) - 1, torch.ones(B, dtype=torch.int64), rows)
    fb = ForwardBatch(ForwardMode.DECODE, torch.zeros(B, dtype=torch.int64), torch.tensor(lens) - 1,
                      torch.zeros(B, dtype=torch.int64), B, md, torch.arange(B), [True] * B, None,
                      torch.zeros(B, dtype=torch.int64))
    q_nope, q_pe = torch.randn(B, H, attn.nope_dim), torch.randn(B, H, attn.rope_dim)
    one_pass = attn.core(q_nope, q_pe, fb, pool)  # no host lengths: one padded pass

    w = attn.kv_b_proj.weight.view(H, attn.nope_dim + attn.v_dim, attn.kv_lora_rank)
    q_lat = torch.einsum("bhd,hdc->bhc", q_nope, w[:, :attn.nope_dim])
    order, chunks = plan_decode_chunks(lens, pool.buf.shape[-1], budget=1, min_chunk=16)
    assert len(chunks) == 13 and chunks[-1][2] == 1
    o_lat = attn._decode_split_kv(q_lat, q_pe, md, pool, order, chunks)
    split = attn.o_proj(torch.einsum("bhc,hvc->bhv", o_lat, w[:, attn.nope_dim:]).reshape(B, -1))
    torch.testing.assert_close(split, one_pass, rtol=1e-5, atol=1e-5)


def test_extend_groups_take_consecutive_requests_within_the_budget():
    from engine.models.deepseek_v3 import plan_extend_groups

    prefix, ext = [0, 0, 30000, 0, 0, 0], [100, 120, 8192, 50, 60, 70]
    groups = plan_extend_groups(prefix, ext, key_elems=1000, budget=600_000)
    assert groups == [(0, 2), (2, 3), (3, 6)]  # the long request alone; short ones share a group
    assert plan_extend_groups(prefix, ext, key_elems=1000, budget=10**12) == [(0, 6)]
    assert plan_extend_groups([0], [5], key_elems=1000, budget=1) == [(0, 1)]  # over budget, still one
