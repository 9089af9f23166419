"""Choose a dispatcher / expert runner by name; each backend's module is imported only when chosen."""

from __future__ import annotations

from typing import Any

import torch

from engine.moe import deep_gemm_available, deepep_available
from engine.moe.base import Dispatcher, ExpertRunner

DISPATCHERS = ("none", "torch", "deepep")
RUNNERS = ("torch", "deep_gemm")


def resolve_dispatcher_backend(backend: str, world_size: int) -> str:
    """"auto": none for one rank, else deepep where it runs (CUDA + library), else torch."""
    if backend != "auto":
        return backend
    if world_size == 1:
        return "none"
    return "deepep" if deepep_available() else "torch"


def resolve_runner_backend(backend: str) -> str:
    """"auto": deep_gemm where it runs (CUDA + library), else torch."""
    if backend != "auto":
        return backend
    return "deep_gemm" if deep_gemm_available() else "torch"


def make_dispatcher(backend: str, *, num_experts: int, hidden_size: int, ep_group: Any, rank: int,
                    world_size: int, deepep_mode: str = "auto",
                    params_dtype: torch.dtype = torch.bfloat16, expert_alignment: int = 1,
                    layout: str = "contiguous", delay_s: float | None = None,
                    normal_fp8: bool = False, low_latency_fp8: bool = True,
                    num_max_dispatch_tokens_per_rank: int = 128) -> Dispatcher:
    """A fresh dispatcher (one per micro-batch under TBO; DeepEP ones share the group's Buffer).

    `expert_alignment`: pad contiguous segments (128 when the runner is deep_gemm).
    `layout`: none/torch only ("contiguous" | "masked"); deepep's follows its mode.
    `delay_s`: torch only, emulated all-to-all latency (default: `MOE_A2A_DELAY_MS`).
    `normal_fp8`, `low_latency_fp8`, `num_max_dispatch_tokens_per_rank`: deepep only.
    """
    backend = resolve_dispatcher_backend(backend, world_size)
    if backend == "none":
        if world_size != 1:
            raise ValueError("moe_a2a_backend 'none' needs ep_size 1")
        from engine.moe.none import NoneDispatcher

        return NoneDispatcher(num_experts, layout=layout, expert_alignment=expert_alignment)  # type: ignore[arg-type]
    if backend == "torch":
        from engine.moe.torch_a2a import TorchA2ADispatcher

        return TorchA2ADispatcher(num_experts, ep_group=ep_group, rank=rank, world_size=world_size,
                                  layout=layout, expert_alignment=expert_alignment, delay_s=delay_s)  # type: ignore[arg-type]
    if backend == "deepep":
        from engine.moe.deepep import DeepEPDispatcher

        return DeepEPDispatcher(num_experts=num_experts, hidden_size=hidden_size, ep_group=ep_group,
                                rank=rank, world_size=world_size, deepep_mode=deepep_mode,
                                params_dtype=params_dtype, expert_alignment=expert_alignment,
                                normal_fp8=normal_fp8, low_latency_fp8=low_latency_fp8,
                                num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank)
    raise ValueError(f"unknown moe_a2a_backend {backend!r}; choose from {DISPATCHERS} or 'auto'")


def make_expert_runner(backend: str, w13: torch.Tensor, w2: torch.Tensor, *,
                       w13_scale: torch.Tensor | None = None,
                       w2_scale: torch.Tensor | None = None) -> ExpertRunner:
    """Runner over this rank's local expert weights (w13 [E_local, 2I, H], w2 [E_local, H, I])."""
    backend = resolve_runner_backend(backend)
    if backend == "torch":
        from engine.moe.runners import TorchExpertRunner

        return TorchExpertRunner(w13, w2, w13_scale=w13_scale, w2_scale=w2_scale)
    if backend == "deep_gemm":
        from engine.moe.runners import DeepGemmExpertRunner

        return DeepGemmExpertRunner(w13, w2, w13_scale=w13_scale, w2_scale=w2_scale)
    raise ValueError(f"unknown moe_runner_backend {backend!r}; choose from {RUNNERS} or 'auto'")
