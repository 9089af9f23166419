"""Decode step time and all-to-all bytes per step for ep_size 1, 2, 4 on this machine (one run).

    python benchmarks/ep_decode.py [--requests 32] [--max-tokens 48] [--out ep_decode.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _ep_harness import run_group  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--sizes", default="1,2,4")
    ap.add_argument("--out", default="ep_decode.json")
    args = ap.parse_args()
    rng = random.Random(0)
    # short prompts, long outputs: the steps are almost all decode steps
    reqs = [([rng.randrange(3, 2000) for _ in range(4)], args.max_tokens) for _ in range(args.requests)]
    rows = []
    for ep in [int(x) for x in args.sizes.split(",")]:
        kw = dict(model="tiny-dsv3", ep_size=ep, kv_cache_tokens=16384, enable_overlap_schedule=False,
                  moe_a2a_backend="torch" if ep > 1 else "none")
        res = run_group(ep, kw, reqs)
        steps = max(r["steps"] for r in res)
        fwd = max(r["forward_time_s"] for r in res)
        rows.append({"ep_size": ep, "steps": steps, "step_ms": 1e3 * fwd / steps,
                     "a2a_bytes_per_step": sum(r["a2a_bytes"] for r in res) / steps,
                     "a2a_wait_ms_per_step": 1e3 * max(r["a2a_wait_s"] for r in res) / steps,
                     "tokens": sum(r["generated_tokens"] for r in res)})
    print(f"{'ep_size':>8}{'steps':>8}{'step ms':>10}{'a2a KB/step':>13}{'a2a wait ms':>13}")
    for r in rows:
        print(f"{r['ep_size']:>8}{r['steps']:>8}{r['step_ms']:>10.2f}{r['a2a_bytes_per_step'] / 1024:>13.1f}"
              f"{r['a2a_wait_ms_per_step']:>13.2f}")
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
