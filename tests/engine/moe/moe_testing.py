"""Shared pieces of the MoE tests: seeded weights/inputs, a dense reference, one MoE step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.moe.base import Dispatcher, ExpertRunner


def make_weights(num_experts: int, hidden: int, inter: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Global w13 [E, 2I, H] and w2 [E, H, I]; every rank slices its own experts from these."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g) / hidden**0.5
    w2 = torch.randn(num_experts, hidden, inter, generator=g) / inter**0.5
    return w13, w2


def make_inputs(num_tokens: int, hidden: int, num_experts: int, topk: int, seed: int,
                experts: range | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H], distinct top-k ids (drawn from `experts`, default all), normalized weights."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(num_experts) if experts is None else torch.tensor(list(experts))
    x = torch.randn(num_tokens, hidden, generator=g)
    scores = torch.rand(num_tokens, len(pool), generator=g)
    ids = pool[scores.topk(topk, dim=1).indices] if num_tokens else torch.empty(0, topk, dtype=torch.long)
    w = torch.rand(num_tokens, topk, generator=g) + 0.1
    w = (w / w.sum(1, keepdim=True) * 2.5).float()  # x routed_scaling_factor, as the model does
    return x, ids.long(), w


def dense_reference(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor) -> torch.Tensor:
    """Token by token, slot by slot: sum_j w[t,j] * expert_{ids[t,j]}(x[t]), in float64."""
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            out[t] += float(w[t, j]) * (w2[e].double() @ (F.silu(h[:inter]) * h[inter:]))
    return out


def moe_step(dispatcher: Dispatcher, runner: ExpertRunner, x: torch.Tensor, ids: torch.Tensor,
             w: torch.Tensor) -> torch.Tensor:
    """One MoE layer through the four halves, in the documented order."""
    dispatcher.dispatch_a(x, ids, w)
    d = dispatcher.dispatch_b()
    y = runner(d)
    dispatcher.combine_a(y, d)
    return dispatcher.combine_b()


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error, the usual yardstick for FP8/BF16 GEMM paths."""
    return float((got.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))
