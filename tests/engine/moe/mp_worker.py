"""Multi-rank MoE scenarios run in spawned gloo processes; the tests compare them to one rank.

Each rank builds only its own experts' slice of the same seeded weights and its own tokens, runs a
scenario through the factory's dispatcher + runner, and saves its [T_r, hidden] output. The parent
recomputes everything on one rank with the `none` backend.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
from moe_testing import make_inputs, make_weights


@dataclass(frozen=True)
class Scenario:
    backend: str  # "torch" | "deepep"
    tokens: tuple[int, ...]  # tokens on each rank (its length is the world size)
    hot_rank: int | None = None  # route every token only to this rank's experts
    num_experts: int = 8
    topk: int = 2
    hidden: int = 32
    inter: int = 16
    layout: str = "contiguous"
    alignment: int = 1
    delay_s: float = 0.0
    runner: str = "torch"
    modes: tuple[str, ...] = ("normal",)  # deepep: one step per entry, through set_mode
    deepep_mode: str = "normal"
    normal_fp8: bool = False
    low_latency_fp8: bool = True
    tbo: bool = False  # two dispatchers with interleaved halves, as two-batch overlap runs them
    signal: bool = False  # SBO: combine signalled by the down GEMM (antgroup-opt DeepEP + DeepGEMM fork)
    ll_capacity: int = 16  # deepep: num_max_dispatch_tokens_per_rank

    @property
    def world(self) -> int:
        return len(self.tokens)


def scenario_inputs(s: Scenario, rank: int, step: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    e_local = s.num_experts // s.world
    experts = None if s.hot_rank is None else range(s.hot_rank * e_local, (s.hot_rank + 1) * e_local)
    return make_inputs(s.tokens[rank], s.hidden, s.num_experts, s.topk, seed=1000 * step + 17 * rank + 1,
                       experts=experts)


def _run(name: str, s: Scenario, rank: int, out_dir: str) -> None:
    from engine.moe.factory import make_dispatcher, make_expert_runner
    from engine.moe.fp8 import quantize_per_block

    w13, w2 = make_weights(s.num_experts, s.hidden, s.inter)
    e_local = s.num_experts // s.world
    sl = slice(rank * e_local, (rank + 1) * e_local)
    if s.runner == "deep_gemm":
        (q13, s13), (q2, s2) = quantize_per_block(w13[sl]), quantize_per_block(w2[sl])
        runner = make_expert_runner("deep_gemm", q13, q2, w13_scale=s13, w2_scale=s2)
    else:
        runner = make_expert_runner("torch", w13[sl].clone(), w2[sl].clone())

    def new_dispatcher():  # noqa: ANN202
        return make_dispatcher(
            s.backend, num_experts=s.num_experts, hidden_size=s.hidden, ep_group=dist.group.WORLD,
            rank=rank, world_size=s.world, deepep_mode=s.deepep_mode, params_dtype=torch.float32,
            expert_alignment=s.alignment, layout=s.layout, delay_s=s.delay_s,
            normal_fp8=s.normal_fp8, low_latency_fp8=s.low_latency_fp8,
            num_max_dispatch_tokens_per_rank=s.ll_capacity)

    disp = new_dispatcher()
    result: dict = {"outputs": []}
    for step, mode in enumerate(s.modes):
        x, ids, w = scenario_inputs(s, rank, step)
        if s.backend == "deepep":
            disp.set_mode(mode)
        if s.tbo:
            result["outputs"].append(_tbo_step(disp, new_dispatcher(), runner, x, ids, w))
            continue
        disp.dispatch_a(x, ids, w)
        d = disp.dispatch_b()
        if s.signal:
            from engine.sbo import combine_overlapping_down_gemm

            result["signalled"] = disp.accepts_combine_signal(d) and runner.signals_down_gemm(d)
            combine_overlapping_down_gemm(disp, runner, d, comm_num_sms=3, gemm_num_sms=100)
        else:
            disp.combine_a(runner(d), d)
        result["outputs"].append(disp.combine_b())
    result["bytes_sent"] = getattr(disp, "bytes_sent", None)
    if s.backend == "deepep":
        result["calls"] = list(disp.buffer.calls)
    torch.save(result, os.path.join(out_dir, f"{name}.{rank}.pt"))


def _tbo_step(a, b, runner, x, ids, w) -> torch.Tensor:  # noqa: ANN001
    """Micro-batches A (first half of the tokens) and B, halves interleaved like TBO's stages."""
    h = x.shape[0] // 2
    a.dispatch_a(x[:h], ids[:h], w[:h])
    b.dispatch_a(x[h:], ids[h:], w[h:])
    da = a.dispatch_b()
    ya = runner(da)
    a.combine_a(ya, da)
    db = b.dispatch_b()
    yb = runner(db)
    b.combine_a(yb, db)
    return torch.cat([a.combine_b(), b.combine_b()])


def worker(rank: int, world: int, store_path: str, out_dir: str, scenarios: dict[str, Scenario],
           test_dir: str) -> None:
    sys.path[:0] = [p for p in (test_dir,) if p not in sys.path]
    torch.set_num_threads(1)  # 2 cores shared by all ranks
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    try:
        for name, s in scenarios.items():
            if s.backend == "deepep" or s.runner == "deep_gemm":
                import fake_deep_ep
                import fake_deep_gemm

                sys.modules["deep_ep"] = fake_deep_ep.make_module(sbo=s.signal)
                sys.modules["deep_gemm"] = fake_deep_gemm.make_module(signal=s.signal)
            from engine.moe.deepep import clear_buffers

            clear_buffers()  # each scenario sizes its own Buffer
            _run(name, s, rank, out_dir)
    finally:
        dist.destroy_process_group()
