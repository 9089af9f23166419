"""Attention without padding to the longest request, in one run, on DeepSeek-V3's MLA shapes
(kv_lora 512, rope 64, nope 128, v 128; `--heads` of the 128, since a rank's attention is not
split by head).

Decode: split-KV (key chunks, online softmax, rows longest first) vs one pass padded to the
longest request. Workloads: `mixed` (one long request among short ones: the padded pass costs
every row the long one's length), `uniform` (equal lengths: no padding to save, so any cost of
chunking shows) and `long_tail`. Reports median time per layer call, the ratio one-pass / split
(> 1: split is faster), and the largest latent gather of each (elements of kv_lora + rope).

Extend: request groups within a budget vs one group padded to the longest request, on a chunked
prefill step of one long request (a cached prefix plus a chunk) among new short prompts.

    python benchmarks/attention.py [--heads 16] [--repeats 5] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engine.forward_batch import ForwardBatch, ForwardMode
from engine.layers.rotary import RotaryEmbedding
from engine.mem.pool import MLATokenPool
from engine.models import deepseek_v3
from engine.models.deepseek_v3 import MLAttention
from engine.sched.batch import attention_metadata

WORKLOADS = {
    "mixed": [8192] + [256] * 63,
    "uniform": [1024] * 64,
    "long_tail": [4096, 2048] + [128] * 126,
}


def _batch(lens: list[int], pool: MLATokenPool, device: str, host_lens: bool) -> ForwardBatch:
    B, page = len(lens), pool.page_size
    rows, next_page = [], 1
    for n in lens:  # each request its own pages, as the allocator would hand them out
        pages = -(-n // page)
        slots = (torch.arange(next_page, next_page + pages)[:, None] * page + torch.arange(page)).flatten()
        rows.append(torch.nn.functional.pad(slots[:n], (0, max(lens) - n)))
        next_page += pages
    md = attention_metadata(ForwardMode.DECODE, torch.tensor(lens) - 1, torch.ones(B, dtype=torch.int64), torch.stack(rows))
    fb = ForwardBatch(ForwardMode.DECODE, torch.zeros(B, dtype=torch.int64), torch.tensor(lens) - 1,
                      torch.zeros(B, dtype=torch.int64), B, md, torch.arange(B), [True] * B, None,
                      torch.zeros(B, dtype=torch.int64))
    if host_lens:
        fb.prefix_lens, fb.extend_lens = [n - 1 for n in lens], [1] * B
    return fb.to(device)


def _pool(lens: list[int], cfg, dtype: torch.dtype, device: str) -> MLATokenPool:
    """A one-layer pool with room for `lens`, filled with random latents."""
    pool = MLATokenPool(1, sum(-(-n // 16) for n in lens) + 1, 16, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                        dtype, device)
    pool.buf.normal_()
    return pool


def _timed_core(attn: MLAttention, q_nope: torch.Tensor, q_pe: torch.Tensor, fb: ForwardBatch,
                pool: MLATokenPool) -> tuple[torch.Tensor, float]:
    """One attention call and its wall time (device-synchronized on CUDA)."""
    cuda = q_nope.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = attn.core(q_nope, q_pe, fb, pool)
    if cuda:
        torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def _extend(attn: MLAttention, cfg, args) -> dict:
    prefix, ext = [6000] + [0] * 15, [512] + [256] * 15
    lens = [p + e for p, e in zip(prefix, ext)]
    dtype = attn.kv_b_proj.weight.dtype
    pool = _pool(lens, cfg, dtype, args.device)
    T = sum(ext)
    q_nope = torch.randn(T, args.heads, cfg.qk_nope_head_dim, device=args.device, dtype=dtype)
    q_pe = torch.randn(T, args.heads, cfg.qk_rope_head_dim, device=args.device, dtype=dtype)
    base = _batch(lens, pool, args.device, True)

    def step() -> ForwardBatch:
        md = attention_metadata(ForwardMode.EXTEND, torch.tensor(prefix), torch.tensor(ext), base.attn.kv_indices.cpu())
        fb = ForwardBatch(ForwardMode.EXTEND, torch.zeros(T, dtype=torch.int64), torch.zeros(T, dtype=torch.int64),
                          torch.zeros(T, dtype=torch.int64), len(lens), md, torch.zeros(0, dtype=torch.int64),
                          [], None, torch.zeros(0, dtype=torch.int64), prefix_lens=prefix, extend_lens=ext)
        return fb.to(args.device)

    default = dict(deepseek_v3.EXTEND_GROUP_ELEMS)
    one_group = {k: 1 << 62 for k in default}
    times: dict[str, list[float]] = {"one_group": [], "groups": []}
    outs = {}
    with torch.inference_mode():
        for _ in range(args.repeats + 1):
            for k, budget in (("one_group", one_group), ("groups", default)):
                deepseek_v3.EXTEND_GROUP_ELEMS = budget
                fb = step()
                outs[k], dt = _timed_core(attn, q_nope, q_pe, fb, pool)
                times[k].append(dt)
                outs[k + "_groups"] = len(fb.attn.layer_plan[0])
    deepseek_v3.EXTEND_GROUP_ELEMS = default
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    r = {"one_group_ms": med["one_group"] * 1e3, "groups_ms": med["groups"] * 1e3,
         "ratio": med["one_group"] / med["groups"], "groups": outs["groups_groups"],
         "max_abs_diff": (outs["groups"].float() - outs["one_group"].float()).abs().max().item()}
    print(f"extend     one group {r['one_group_ms']:8.2f} ms  {r['groups']} groups {r['groups_ms']:8.2f} ms  "
          f"ratio {r['ratio']:5.2f}  max|diff| {r['max_abs_diff']:.2e}")
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="attention.json")
    args = ap.parse_args()
    from transformers import DeepseekV3Config

    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    cfg = DeepseekV3Config(num_attention_heads=args.heads)
    attn = MLAttention(cfg, 0, RotaryEmbedding(cfg, max_positions=16384, interleave=True)).to(args.device, dtype)
    width = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    results = {}
    for name, lens in WORKLOADS.items():
        pool = _pool(lens, cfg, dtype, args.device)
        B = len(lens)
        q_nope = torch.randn(B, args.heads, cfg.qk_nope_head_dim, device=args.device, dtype=dtype)
        q_pe = torch.randn(B, args.heads, cfg.qk_rope_head_dim, device=args.device, dtype=dtype)
        batches = {"one_pass": _batch(lens, pool, args.device, False), "split": _batch(lens, pool, args.device, True)}
        times: dict[str, list[float]] = {k: [] for k in batches}
        outs = {}
        with torch.inference_mode():
            for _ in range(args.repeats + 1):  # the first round warms up
                for k, fb in batches.items():
                    outs[k], dt = _timed_core(attn, q_nope, q_pe, fb, pool)
                    times[k].append(dt)
        err = (outs["split"].float() - outs["one_pass"].float()).abs().max().item()
        plan = deepseek_v3.decode_plan(batches["split"], width)
        med = {k: statistics.median(v[1:]) for k, v in times.items()}
        results[name] = {
            "one_pass_ms": med["one_pass"] * 1e3, "split_ms": med["split"] * 1e3,
            "ratio": med["one_pass"] / med["split"], "max_abs_diff": err,
            "chunks": 0 if plan is None else len(plan[1]),
            "gather_one_pass": B * max(lens) * width,
            "gather_split": B * max(lens) * width if plan is None else max(n * (e - s) for s, e, n in plan[1]) * width,
        }
        r = results[name]
        print(f"{name:10s} one-pass {r['one_pass_ms']:8.2f} ms  split {r['split_ms']:8.2f} ms  "
              f"ratio {r['ratio']:5.2f}  chunks {r['chunks']:3d}  gather {r['gather_one_pass'] / 1e6:7.1f}M -> "
              f"{r['gather_split'] / 1e6:6.1f}M  max|diff| {err:.2e}")
    results["extend"] = _extend(attn, cfg, args)
    with open(args.out, "w") as f:
        json.dump({"device": args.device, "heads": args.heads, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
