"""Overlap scheduler on vs off, in one run, on two workloads.

  overhead-bound: many concurrent short decodes on tiny-dsv3 (scheduling cost ~ forward cost)
  compute-bound:  fewer requests on a larger random DeepSeek-V3 checkpoint

Reports throughput (generated tok/s), the on/off ratio (median of back-to-back pairs) and the
executor idle fraction (gaps between consecutive forwards while work was pending, over the
executor's busy span). `bound` = 1 / (1 - idle fraction off): the most any overlap can gain, since
it can only remove the normal loop's gaps; a forward that itself runs on the CPU cannot shrink.

    python benchmarks/overlap.py [--requests 256] [--out overlap.json]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time


def run(model: str, prompts, max_tokens: int, overlap: bool, **kw):
    from engine import LLM, SamplingParams

    llm = LLM(model=model, enable_overlap_schedule=overlap, **kw)
    try:
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompt_token_ids=prompts[:4], sampling_params=SamplingParams(max_tokens=2))
        base = llm.engine.stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        dt = time.perf_counter() - t0
        s = llm.engine.stats()
    finally:
        llm.shutdown()
    fwd = s.forward_time_s - base.forward_time_s
    bubble = s.bubble_time_s - base.bubble_time_s
    toks = sum(len(o.token_ids) for o in outs)
    return {"tok_s": toks / dt, "time_s": dt, "steps": s.steps - base.steps,
            "idle_fraction": bubble / (fwd + bubble) if fwd + bubble else 0.0,
            "forward_ms_per_step": 1e3 * fwd / max(1, s.steps - base.steps)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--large-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="off/on pairs per workload (median reported)")
    ap.add_argument("--out", default="overlap.json")
    args = ap.parse_args()
    rng = random.Random(0)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.helpers import make_random_dsv3_checkpoint

        large = make_random_dsv3_checkpoint(
            Path(tmp) / "large", hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
            kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16,
            num_experts_per_tok=4, n_group=4, topk_group=2)
        workloads = {
            "overhead-bound (tiny-dsv3)": ("tiny-dsv3", [[rng.randrange(3, 2000) for _ in range(rng.randrange(8, 32))]
                                                         for _ in range(args.requests)], args.max_tokens),
            "compute-bound (hidden 1024)": (str(large), [[rng.randrange(3, 2000) for _ in range(rng.randrange(32, 128))]
                                                         for _ in range(args.large_requests)], args.max_tokens),
        }
        for name, (model, prompts, mt) in workloads.items():
            # off and on alternate, `--repeats` pairs: a shared machine's speed drifts between runs,
            # so each pair's ratio is taken back to back and the median pair reported
            pairs = []
            for _ in range(args.repeats):
                off = run(model, prompts, mt, False, kv_cache_tokens=65536, max_running_requests=256)
                on = run(model, prompts, mt, True, kv_cache_tokens=65536, max_running_requests=256)
                pairs.append({"off": off, "on": on, "ratio": on["tok_s"] / off["tok_s"]})
            pairs.sort(key=lambda p: p["ratio"])
            med = pairs[len(pairs) // 2]
            # the bound: overlap can at most remove the normal loop's gaps between forwards
            bound = 1 / (1 - med["off"]["idle_fraction"])
            results[name] = {**med, "ratios": [p["ratio"] for p in pairs], "bound": bound}
    print(f"{'workload':<30}{'off tok/s':>11}{'on tok/s':>11}{'ratio':>8}{'bound':>8}{'idle off':>10}"
          f"{'idle on':>9}  ratios")
    for name, r in results.items():
        print(f"{name:<30}{r['off']['tok_s']:>11.1f}{r['on']['tok_s']:>11.1f}{r['ratio']:>8.2f}{r['bound']:>8.2f}"
              f"{r['off']['idle_fraction']:>10.1%}{r['on']['idle_fraction']:>9.1%}  "
              + " ".join(f"{x:.2f}" for x in r["ratios"]))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
