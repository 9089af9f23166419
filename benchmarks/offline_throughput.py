"""Offline throughput: this engine vs HF transformers `generate` (static batches of 32), one run.

Workload: N requests (default 64), prompt lengths 16-256, output lengths 16-128, ignore EOS,
fixed seed. Prints tokens/s for both and the ratio; writes JSON.

    python benchmarks/offline_throughput.py [--model tiny-dsv3] [--num-requests 64] [--out bench.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch


def workload(n: int, seed: int, vocab: int):
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(16, 257))] for _ in range(n)]
    outs = [rng.randrange(16, 129) for _ in range(n)]
    return prompts, outs


def run_engine(model: str, prompts, outs, **kw) -> tuple[float, int, object]:
    from engine import LLM, SamplingParams

    llm = LLM(model=model, **kw)
    try:
        llm.generate(prompt_token_ids=prompts[:2], sampling_params=SamplingParams(max_tokens=4))  # warm-up
        params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in outs]
        t0 = time.perf_counter()
        res = llm.generate(prompt_token_ids=prompts, sampling_params=params)
        dt = time.perf_counter() - t0
        stats = llm.engine.stats()
    finally:
        llm.shutdown()
    return dt, sum(len(r.token_ids) for r in res), stats


def run_hf(path, prompts, outs, batch: int) -> tuple[float, int]:
    from transformers import DeepseekV3ForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    total = 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for i in range(0, len(prompts), batch):
            ps, ms = prompts[i : i + batch], outs[i : i + batch]
            width = max(len(p) for p in ps)
            ids = torch.tensor([[0] * (width - len(p)) + p for p in ps], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps], device=device)
            # a static batch runs until its longest request is done; shorter ones are cut after
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max(ms), min_new_tokens=max(ms),
                           do_sample=False, pad_token_id=0)
            total += sum(ms)
    return time.perf_counter() - t0, total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-dsv3")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--hf-batch", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="offline_throughput.json")
    ap.add_argument("--skip-hf", action="store_true")
    args = ap.parse_args()

    from engine.models.loader import load_model_config, resolve_model_path

    path = resolve_model_path(args.model)
    vocab = load_model_config(path).vocab_size
    prompts, outs = workload(args.num_requests, args.seed, vocab)
    dt, toks, stats = run_engine(args.model, prompts, outs)
    rows = [("engine", dt, toks, toks / dt)]
    if not args.skip_hf:
        hdt, htoks = run_hf(path, prompts, outs, args.hf_batch)
        rows.append((f"hf generate (batch {args.hf_batch})", hdt, htoks, htoks / hdt))
    print(f"{'system':<28}{'time s':>10}{'tokens':>10}{'tok/s':>12}")
    for name, t, n, r in rows:
        print(f"{name:<28}{t:>10.2f}{n:>10}{r:>12.1f}")
    result = {"model": args.model, "num_requests": args.num_requests, "device": "cuda" if torch.cuda.is_available() else "cpu",
              "engine_tok_s": rows[0][3], "engine_steps": stats.steps, "engine_idle_fraction": stats.idle_fraction}
    if len(rows) > 1:
        result["hf_tok_s"] = rows[1][3]
        result["ratio"] = rows[0][3] / rows[1][3]
        print(f"ratio engine / hf: {result['ratio']:.2f}x")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
