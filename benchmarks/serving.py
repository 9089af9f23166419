"""Online serving benchmark: Poisson arrivals against an OpenAI-compatible endpoint.

    python benchmarks/serving.py --base-url http://127.0.0.1:8000 --model tiny-dsv3 \
        --rate 4 --num-requests 32 --max-tokens 32 --out serving_bench.json

Streams every request (so TTFT and inter-token latency are measured at the client), bounds both
the request count and the wall time, prints a small table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import asdict, dataclass, field

import httpx

PROMPTS = [
    "def quicksort(xs):",
    "import os\nimport sys\n\ndef main():",
    "class LRUCache:\n    def __init__(self, capacity):",
    "The quick brown fox",
    "for i in range(100):\n    if i % 3 == 0:",
]


@dataclass
class Result:
    ok: bool
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float = 0.0
    completion_tokens: int = 0
    error: str | None = None


async def one(client: httpx.AsyncClient, url: str, body: dict) -> Result:
    start = time.perf_counter()
    last = None
    res = Result(ok=False)
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                return Result(ok=False, error=f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return Result(ok=False, error=chunk["error"]["message"])
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    now = time.perf_counter()
                    if last is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
    except httpx.HTTPError as e:
        return Result(ok=False, error=repr(e))
    res.ok, res.e2e_s = True, time.perf_counter() - start
    return res


def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


async def run(args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    url = args.base_url.rstrip("/") + "/v1/completions"
    tasks: list[asyncio.Task[Result]] = []
    limits = httpx.Limits(max_connections=args.num_requests)
    async with httpx.AsyncClient(timeout=args.timeout_s, limits=limits) as client:
        start = time.perf_counter()
        for i in range(args.num_requests):
            if time.perf_counter() - start > args.duration_s:
                break
            body = {
                "model": args.model,
                "prompt": PROMPTS[i % len(PROMPTS)],
                "max_tokens": args.max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            tasks.append(asyncio.create_task(one(client, url, body)))
            await asyncio.sleep(rng.expovariate(args.rate))
        remaining = max(1.0, args.duration_s + args.timeout_s - (time.perf_counter() - start))
        done, pending = await asyncio.wait(tasks, timeout=remaining)
        for t in pending:
            t.cancel()
        wall = time.perf_counter() - start
    results = [t.result() for t in done]
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    tokens = sum(r.completion_tokens for r in ok)
    return {
        "config": vars(args),
        "sent": len(tasks),
        "completed": len(ok),
        "failed": len(results) - len(ok) + len(pending),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "wall_s": wall,
        "request_throughput_rps": len(ok) / wall,
        "output_throughput_tok_s": tokens / wall,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "itl_p50_s": pct(itl, 50),
        "itl_p99_s": pct(itl, 99),
        "e2e_mean_s": statistics.fmean([r.e2e_s for r in ok]) if ok else None,
        "results": [asdict(r) | {"itl_s": None} for r in results] if args.per_request else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="tiny-dsv3")
    ap.add_argument("--rate", type=float, default=2.0, help="mean arrivals per second (Poisson)")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--duration-s", type=float, default=60.0, help="stop sending after this long")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="per-request timeout")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--per-request", action="store_true", help="include per-request results in JSON"
    )
    ap.add_argument("--out", default="serving_bench.json")
    args = ap.parse_args()
    report = asyncio.run(run(args))

    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    print(f"{'metric':<24}{'value':>12}")
    for name, val in [
        ("requests ok/sent", f"{report['completed']}/{report['sent']}"),
        ("req/s", f"{report['request_throughput_rps']:.2f}"),
        ("output tok/s", f"{report['output_throughput_tok_s']:.1f}"),
        ("TTFT p50 / p99 (ms)", f"{ms(report['ttft_p50_s'])} / {ms(report['ttft_p99_s'])}"),
        ("ITL p50 / p99 (ms)", f"{ms(report['itl_p50_s'])} / {ms(report['itl_p99_s'])}"),
    ]:
        print(f"{name:<24}{val:>12}")
    if report["errors"]:
        print("errors:", *report["errors"], sep="\n  ")
    with open(args.out, "w") as f:
        json.dump(report, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
