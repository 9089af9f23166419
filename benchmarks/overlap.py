"""Overlap scheduler on vs off, in one run, on two workloads.

  overhead-bound: many concurrent short decodes on tiny-dsv3 (scheduling cost ~ forward cost),
                  offline (`LLM.generate`) and streamed (`AsyncEngine`, one consumer per request,
                  as the server's ranks run it)
  compute-bound:  fewer requests on a larger random DeepSeek-V3 checkpoint

Overlap runs with each forward executor named by `--executors` (on CPU: `process`, the default
for one rank, and `thread`, which shares the GIL with the scheduler). Reports throughput
(generated tok/s), the on/off ratio (median over rounds, each ratio taken within its round) and the
executor idle fraction (gaps between consecutive forwards while work was pending, over the
executor's busy span). `bound` = 1 / (1 - idle fraction off): the most any overlap can gain, since
it can only remove the normal loop's gaps; a forward that itself runs on the CPU cannot shrink.

On CUDA, single-rank decode steps replay CUDA graphs (`cuda_graph_max_bs`), so a decode forward
costs the host a few buffer copies; `--executors thread,process` compares the two executors there.

    python benchmarks/overlap.py [--requests 256] [--repeats 5] [--executors process,thread] [--dtype auto]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import tempfile
import time


def _result(toks: int, dt: float, base, s) -> dict:
    fwd = s.forward_time_s - base.forward_time_s
    bubble = s.bubble_time_s - base.bubble_time_s
    return {"tok_s": toks / dt, "time_s": dt, "steps": s.steps - base.steps,
            "idle_fraction": bubble / (fwd + bubble) if fwd + bubble else 0.0,
            "forward_ms_per_step": 1e3 * fwd / max(1, s.steps - base.steps)}


def run_streaming(model: str, prompts, max_tokens: int, overlap: bool, **kw):
    """Every request streamed to its own asyncio consumer, as the server's rank does
    (`AsyncEngine.generate`): per-token work in the engine's process grows."""
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.sampling_params import SamplingParams

    eng = AsyncEngine(EngineConfig(model=model, enable_overlap_schedule=overlap, **kw))
    sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)

    async def consume(ids, params) -> int:
        n = 0
        async for out in eng.generate(ids, params):
            n += len(out.delta_token_ids)
        return n

    async def main():
        await asyncio.gather(*[consume(p, SamplingParams(max_tokens=2)) for p in prompts[:4]])
        base = eng.engine.stats()
        t0 = time.perf_counter()
        toks = sum(await asyncio.gather(*[consume(p, sp) for p in prompts]))
        return _result(toks, time.perf_counter() - t0, base, eng.engine.stats())

    try:
        return asyncio.run(main())
    finally:
        eng.shutdown()


def run(model: str, prompts, max_tokens: int, overlap: bool, **kw):
    """`LLM.generate` over all prompts at once (offline)."""
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
    return _result(sum(len(o.token_ids) for o in outs), dt, base, s)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--large-requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3, help="rounds per workload (median ratio reported)")
    ap.add_argument("--executors", default="process,thread",
                    help="overlap executors to compare with the normal loop (`process` needs a CPU)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                    help="auto: bfloat16 on CUDA (grouped expert GEMMs, decode CUDA graphs), float32 on CPU")
    ap.add_argument("--out", default="overlap.json")
    args = ap.parse_args()
    if args.dtype == "auto":
        import torch

        args.dtype = "bfloat16" if torch.cuda.is_available() else "float32"
    rng = random.Random(0)
    executors = args.executors.split(",")
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
        short = [[rng.randrange(3, 2000) for _ in range(rng.randrange(8, 32))] for _ in range(args.requests)]
        workloads = {
            "overhead-bound (tiny-dsv3)": (run, "tiny-dsv3", short, args.max_tokens),
            "overhead-bound, streamed": (run_streaming, "tiny-dsv3", short, args.max_tokens),
            "compute-bound (hidden 1024)": (run, str(large), [[rng.randrange(3, 2000) for _ in range(rng.randrange(32, 128))]
                                                              for _ in range(args.large_requests)], args.max_tokens),
        }
        for name, (fn, model, prompts, mt) in workloads.items():
            # Each round runs off and every executor back to back (order rotated), and each ratio
            # is taken within its round: a shared machine's speed drifts between rounds.
            rounds = []
            for i in range(args.repeats):
                configs = ["off", *executors]
                configs = configs[i % len(configs):] + configs[:i % len(configs)]
                r = {c: fn(model, prompts, mt, c != "off", forward_executor="auto" if c == "off" else c,
                            kv_cache_tokens=65536, max_running_requests=256, dtype=args.dtype) for c in configs}
                rounds.append(r)
            for ex in executors:
                ratios = sorted((r[ex]["tok_s"] / r["off"]["tok_s"], j) for j, r in enumerate(rounds))
                ratio, j = ratios[len(ratios) // 2]
                med = rounds[j]
                # the bound: overlap can at most remove the normal loop's gaps between forwards
                results[f"{name}, {ex}"] = {"off": med["off"], "on": med[ex], "ratio": ratio,
                                            "ratios": [x for x, _ in ratios],
                                            "bound": 1 / (1 - med["off"]["idle_fraction"])}
    print(f"{'workload, executor':<38}{'off tok/s':>11}{'on tok/s':>11}{'ratio':>8}{'bound':>8}{'idle off':>10}"
          f"{'idle on':>9}  ratios")
    for name, r in results.items():
        print(f"{name:<38}{r['off']['tok_s']:>11.1f}{r['on']['tok_s']:>11.1f}{r['ratio']:>8.2f}{r['bound']:>8.2f}"
              f"{r['off']['idle_fraction']:>10.1%}{r['on']['idle_fraction']:>9.1%}  "
              + " ".join(f"{x:.2f}" for x in r["ratios"]))
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
