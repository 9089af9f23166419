"""Run one workload on an EP group of processes (gloo on 127.0.0.1), return per-rank figures.

Each rank is a process holding an `Engine` with its own requests (DP attention), exactly as a
rank of a gang runs it, without Ray in between so the figures are the engine's own.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import asdict

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, config_kw: dict, requests: list, delay_ms: float, q) -> None:
    os.environ["MOE_A2A_DELAY_MS"] = str(delay_ms)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    from datetime import timedelta

    import torch.distributed as dist

    from engine.config import EngineConfig
    from engine.engine import Engine
    from engine.parallel import SINGLE_RANK, ParallelContext
    from engine.sampling_params import SamplingParams

    pc, harness = SINGLE_RANK, None
    if world > 1:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=120))
        pc = ParallelContext(rank, world, dist.new_group(backend="gloo"), dist.new_group(backend="gloo"))
        harness = dist.group.WORLD  # the harness's own barriers: never the engine's groups
    engine = Engine(EngineConfig(**config_kw), pc)
    mine = [r for i, r in enumerate(requests) if i % world == rank]

    def run_batch(batch) -> None:
        done = threading.Event()
        left = [len(batch)]

        def cb(out):
            if out.finished:
                left[0] -= 1
                if left[0] == 0:
                    done.set()

        for ids, max_tokens in batch:
            engine.add_request(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), cb)
        if batch:
            done.wait()

    run_batch(mine[:2])  # warm-up
    if harness is not None:
        dist.barrier(group=harness)
    s0 = engine.stats()
    b0 = _bytes(engine)
    t0 = time.perf_counter()
    run_batch(mine)
    if harness is not None:  # the group is busy until its slowest rank is done
        dist.barrier(group=harness)
    wall = time.perf_counter() - t0
    s1 = engine.stats()
    out = {k: (v - getattr(s0, k) if isinstance(v, (int, float)) and not isinstance(v, bool) else v)
           for k, v in asdict(s1).items()}
    out.update(rank=rank, wall_s=wall, a2a_bytes=_bytes(engine) - b0)
    q.put(out)
    engine.shutdown()
    if world > 1:
        dist.destroy_process_group()


def _bytes(engine) -> int:
    return sum(getattr(d, "bytes_sent", 0) for m in engine.model.moe_layers for d in m.dispatchers)


def run_group(world: int, config_kw: dict, requests: list, delay_ms: float = 0.0) -> list[dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, config_kw, requests, delay_ms, q))
             for r in range(world)]
    for p in procs:
        p.start()
    results = [q.get(timeout=1200) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    return sorted(results, key=lambda r: r["rank"])
