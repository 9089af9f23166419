"""TBO/SBO off vs on at ep_size 2, decode and prefill, in one run.

Reports per-step forward time and the time ranks spend blocked in all-to-all waits, and the
fraction of that blocked time hidden by overlap (1 - blocked_on / blocked_off). `--delay-ms`
delays each all-to-all by a set latency (as if the ranks were on different nodes), so the effect
of inter-node latency shows on one machine.

    python benchmarks/ep_overlap.py [--delay-ms 2] [--model large] [--decode-requests 64,512]
                                    [--prefill-requests 64] [--repeats 3] [--out ep_overlap.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ep_harness import run_group  # noqa: E402

MODES = {"off": {}, "sbo": {"enable_single_batch_overlap": True}, "tbo": {"enable_two_batch_overlap": True},
         "tbo+sbo": {"enable_two_batch_overlap": True, "enable_single_batch_overlap": True}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--delay-ms", type=float, default=2.0)
    ap.add_argument("--decode-requests", default="64,512",
                    help="comma-separated decode batch sizes (requests over both ranks)")
    ap.add_argument("--prefill-requests", type=int, default=64)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the modes; medians reported")
    ap.add_argument("--model", default="tiny-dsv3",
                    help="tiny-dsv3, or 'large' for a random checkpoint with hidden 1024 (more compute per stage)")
    ap.add_argument("--out", default="ep_overlap.json")
    args = ap.parse_args()
    model = args.model
    if model == "large":
        import tempfile

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.helpers import make_random_dsv3_checkpoint

        model = str(make_random_dsv3_checkpoint(
            Path(tempfile.mkdtemp()) / "large", hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512,
            num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=384,
            kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, n_routed_experts=16,
            num_experts_per_tok=4, n_group=4, topk_group=2))
    rng = random.Random(0)
    workloads = {f"decode {n}": [([rng.randrange(3, 2000) for _ in range(4)], 32) for _ in range(n)]
                 for n in map(int, args.decode_requests.split(","))}
    workloads[f"prefill {args.prefill_requests}"] = [
        ([rng.randrange(3, 2000) for _ in range(rng.randrange(200, 400))], 1) for _ in range(args.prefill_requests)]
    modes = args.modes.split(",")
    if "off" not in modes:
        modes.insert(0, "off")  # the baseline every row is compared with
    runs: dict[tuple[str, str], list[dict]] = {}
    for wname, reqs in workloads.items():
        # the modes take turns, `--repeats` rounds, and each figure is the median over its rounds:
        # a shared machine's speed drifts more between runs than the effects measured here
        for _ in range(args.repeats):
            for mname in modes:
                kw = dict(model=model, ep_size=2, kv_cache_tokens=65536, moe_a2a_backend="torch",
                          enable_overlap_schedule=False, chunked_prefill_size=1024, **MODES[mname])
                res = run_group(2, kw, reqs, delay_ms=args.delay_ms)
                steps = max(r["steps"] for r in res)
                runs.setdefault((wname, mname), []).append({
                    "steps": steps,
                    "step_ms": 1e3 * max(r["forward_time_s"] for r in res) / steps,
                    "blocked_ms_per_step": 1e3 * sum(r["a2a_wait_s"] for r in res) / len(res) / steps,
                    "tbo_steps": max(r["tbo_steps"] for r in res),
                    "wall_s": max(r["wall_s"] for r in res),
                })
    results = {key: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for key, rs in runs.items()}
    print(f"model: {args.model}, delay per all-to-all: {args.delay_ms} ms")
    print(f"{'workload':<13}{'mode':<9}{'step ms':>9}{'blocked ms':>12}{'hidden':>8}{'speedup':>9}{'tbo steps':>11}")
    out = []
    for (wname, mname), r in results.items():
        base = results[(wname, "off")]
        hidden = 1 - r["blocked_ms_per_step"] / base["blocked_ms_per_step"] if base["blocked_ms_per_step"] else 0.0
        speedup = base["step_ms"] / r["step_ms"]
        print(f"{wname:<13}{mname:<9}{r['step_ms']:>9.2f}{r['blocked_ms_per_step']:>12.2f}{hidden:>8.0%}"
              f"{speedup:>9.2f}{r['tbo_steps']:>11.0f}")
        out.append({"workload": wname, "mode": mname, "hidden_fraction": hidden, "speedup": speedup, **r})
    with open(args.out, "w") as f:
        json.dump({"delay_ms": args.delay_ms, "rows": out}, f, indent=2)


if __name__ == "__main__":
    main()
