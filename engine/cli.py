"""`moe-serve` command line: `moe-serve plan ...` prints a deployment's memory plan."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="moe-serve")
    sub = ap.add_subparsers(dest="cmd", required=True)
    plan = sub.add_parser("plan", help="per-rank weight memory and KV capacity, without loading weights")
    plan.add_argument("--model", required=True, help="built-in name or a directory holding config.json")
    plan.add_argument("--ep-size", type=int, required=True)
    plan.add_argument("--gpu-memory-gib", type=float, default=80.0)
    plan.add_argument("--weights", choices=["fp8", "bf16"], default="fp8")
    plan.add_argument("--reserve-fraction", type=float, default=0.1)
    args = ap.parse_args(argv)

    from engine.models.loader import load_model_config, resolve_model_path
    from engine.plan import memory_plan

    try:
        cfg = load_model_config(resolve_model_path(args.model))
        p = memory_plan(cfg, args.ep_size, int(args.gpu_memory_gib * 2**30), fp8_weights=args.weights == "fp8",
                        reserve_fraction=args.reserve_fraction)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(p.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
