"""Single rank: the `none` dispatcher + torch runner against a token-by-token dense MoE."""

from __future__ import annotations

import pytest
import torch
from moe_testing import dense_reference, make_inputs, make_weights, moe_step, rel_err

from engine.moe import runners
from engine.moe.factory import make_dispatcher, make_expert_runner
from engine.moe.fp8 import (
    dequantize_per_block,
    dequantize_per_token,
    quantize_per_block,
    quantize_per_token,
)
from engine.moe.none import NoneDispatcher

E, H, INTER, K = 8, 32, 16, 3


def _none(layout: str = "contiguous", alignment: int = 1) -> NoneDispatcher:
    d = make_dispatcher("none", num_experts=E, hidden_size=H, ep_group=None, rank=0, world_size=1,
                        deepep_mode="auto", params_dtype=torch.float32, layout=layout,
                        expert_alignment=alignment)
    assert isinstance(d, NoneDispatcher)
    return d


@pytest.mark.parametrize("grouped", [True, False], ids=["grouped_mm", "per_expert"])
@pytest.mark.parametrize("layout,alignment", [("contiguous", 1), ("contiguous", 4), ("masked", 1)])
@pytest.mark.parametrize("num_tokens", [0, 1, 37])
def test_none_dispatch_with_torch_runner_matches_dense_moe(layout: str, alignment: int, num_tokens: int,
                                                           grouped: bool, monkeypatch) -> None:
    if grouped and not runners._grouped_mm_works(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no usable torch._grouped_mm")
    monkeypatch.setitem(runners._GROUPED_MM_OK, ("cpu", torch.float32), grouped)
    w13, w2 = make_weights(E, H, INTER)
    x, ids, w = make_inputs(num_tokens, H, E, K, seed=num_tokens)
    out = moe_step(_none(layout, alignment), make_expert_runner("torch", w13, w2), x, ids, w)
    assert out.shape == (num_tokens, H) and out.dtype == x.dtype
    torch.testing.assert_close(out.double(), dense_reference(x, ids, w, w13, w2), atol=1e-5, rtol=1e-5)


def test_dispatch_layouts_group_pairs_by_expert() -> None:
    x, ids, w = make_inputs(20, H, E, K, seed=1)
    d = _none("contiguous", 4)
    d.dispatch_a(x, ids, w)
    out = d.dispatch_b()
    counts = torch.bincount(ids.reshape(-1), minlength=E)
    padded = (counts + 3) // 4 * 4
    assert out.tokens_per_expert.tolist() == padded.tolist()
    start = 0
    for e in range(E):
        seg = out.hidden_states[start:start + int(padded[e])]
        expected = x[(ids == e).any(1)]  # stable: token order within the expert
        torch.testing.assert_close(seg[: int(counts[e])], expected)
        assert not seg[int(counts[e]):].any()  # padding rows are zeros
        start += int(padded[e])

    m = _none("masked")
    m.dispatch_a(x, ids, w)
    mo = m.dispatch_b()
    assert mo.layout == "masked" and mo.hidden_states.shape == (E, int(counts.max()), H)
    assert mo.tokens_per_expert.tolist() == counts.tolist()
    for e in range(E):
        torch.testing.assert_close(mo.hidden_states[e, : int(counts[e])], x[(ids == e).any(1)])


def test_masked_runner_ignores_garbage_past_counts() -> None:
    w13, w2 = make_weights(E, H, INTER)
    x, ids, w = make_inputs(16, H, E, K, seed=2)
    d = _none("masked")
    d.dispatch_a(x, ids, w)
    out = d.dispatch_b()
    for e, n in enumerate(out.tokens_per_expert.tolist()):
        out.hidden_states[e, n:] = float("nan")  # what an uninitialized DeepEP buffer may hold
    y = make_expert_runner("torch", w13, w2)(out)
    d.combine_a(y, out)
    torch.testing.assert_close(d.combine_b().double(), dense_reference(x, ids, w, w13, w2), atol=1e-5, rtol=1e-5)


def test_fp8_block_quantization_round_trips_within_fp8_precision() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=g) * torch.logspace(-3, 3, 300)  # ragged last block, wide range
    q, s = quantize_per_token(x)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (5, 3)
    # e4m3: <= 2^-4 relative rounding for normals, plus the subnormal step (2^-9 of the scale).
    bound = x.abs() / 16 + s.repeat_interleave(128, 1)[:, :300] / 512
    assert ((dequantize_per_token(q, s) - x).abs() <= bound).all()
    w = torch.randn(2, 200, 260, generator=g)
    qw, sw = quantize_per_block(w)
    assert sw.shape == (2, 2, 3)
    err = (dequantize_per_block(qw, sw) - w).abs().max() / w.abs().max()
    assert 0 < err < 0.07
    assert not quantize_per_token(torch.zeros(2, 128))[0].float().any()


def test_torch_runner_takes_fp8_weights_and_fp8_activations() -> None:
    w13, w2 = make_weights(E, 128, 128)
    (q13, s13), (q2, s2) = quantize_per_block(w13), quantize_per_block(w2)
    x, ids, w = make_inputs(12, 128, E, K, seed=3)
    ref = dense_reference(x, ids, w, dequantize_per_block(q13, s13), dequantize_per_block(q2, s2))
    d = _none()
    d.dispatch_a(x, ids, w)
    out = d.dispatch_b()
    out.hidden_states, out.hidden_scales = quantize_per_token(out.hidden_states)
    runner = make_expert_runner("torch", q13, q2, w13_scale=s13, w2_scale=s2)
    d.combine_a(runner(out), out)
    got = d.combine_b().double()
    assert rel_err(got, ref) < 0.05  # FP8 activations; weights exact (ref uses the dequantized ones)


@pytest.mark.parametrize("layout,alignment", [("contiguous", 1), ("contiguous", 4), ("masked", 1)])
@pytest.mark.parametrize("num_tokens", [0, 1, 29])
def test_permute_without_host_counts_matches(layout: str, alignment: int, num_tokens: int) -> None:
    """`all_valid` (router ids, never -1) skips the host copy of the counts where the layout allows:
    same layout, same permutation, same counts."""
    from engine.moe.permute import permute

    x, ids, _ = make_inputs(num_tokens, H, E, K, seed=3)
    ref = permute(x, ids, E, layout=layout, alignment=alignment)
    got = permute(x, ids, E, layout=layout, alignment=alignment, all_valid=True)
    torch.testing.assert_close(got[0], ref[0])
    assert got[2].tolist() == ref[2].tolist()
    assert torch.equal(got[3].pair_index, ref[3].pair_index) and torch.equal(got[3].dest_row, ref[3].dest_row)


def test_grouped_gemm_failure_falls_back_to_per_expert(monkeypatch) -> None:
    """A shape the probe did not cover makes torch._grouped_mm raise: the runner answers with the
    per-expert matmuls and stops using it."""
    monkeypatch.setitem(runners._GROUPED_MM_OK, ("cpu", torch.float32), True)

    def broken(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("unsupported shape")

    monkeypatch.setattr(torch, "_grouped_mm", broken, raising=False)
    w13, w2 = make_weights(E, H, INTER)
    x, ids, w = make_inputs(13, H, E, K, seed=2)
    out = moe_step(_none(), make_expert_runner("torch", w13, w2), x, ids, w)
    torch.testing.assert_close(out.double(), dense_reference(x, ids, w, w13, w2), atol=1e-5, rtol=1e-5)
    assert runners._GROUPED_MM_OK[("cpu", torch.float32)] is False
