"""The deep_gemm runner against the DeepGEMM stand-in (CPU) and, marked gpu, the real library."""

from __future__ import annotations

import importlib.util
import sys

import fake_deep_gemm
import pytest
import torch
from moe_testing import dense_reference, make_inputs, make_weights, moe_step, rel_err

from engine.moe.factory import make_expert_runner
from engine.moe.fp8 import dequantize_per_block, quantize_per_block
from engine.moe.none import NoneDispatcher
from engine.moe.runners import DeepGemmExpertRunner

E, H, INTER, K = 4, 256, 128, 2


@pytest.fixture(params=[False, True], ids=["current_api", "legacy_api"])
def fake_dg(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm.make_module(legacy=request.param))
    return request.param


@pytest.mark.parametrize("layout,alignment", [("contiguous", 1), ("contiguous", 128), ("masked", 1)])
@pytest.mark.parametrize("num_tokens", [0, 21])
def test_deep_gemm_runner_matches_dense_moe_within_fp8_error(
        fake_dg: bool, layout: str, alignment: int, num_tokens: int) -> None:
    w13, w2 = make_weights(E, H, INTER)
    (q13, s13), (q2, s2) = quantize_per_block(w13), quantize_per_block(w2)
    x, ids, w = make_inputs(num_tokens, H, E, K, seed=4)
    runner = make_expert_runner("deep_gemm", q13, q2, w13_scale=s13, w2_scale=s2)
    assert isinstance(runner, DeepGemmExpertRunner) and runner.alignment == 128
    out = moe_step(NoneDispatcher(E, layout=layout, expert_alignment=alignment), runner, x, ids, w)
    assert out.shape == (num_tokens, H)
    if num_tokens:
        ref = dense_reference(x, ids, w, dequantize_per_block(q13, s13), dequantize_per_block(q2, s2))
        assert rel_err(out, ref) < 0.05


def test_deep_gemm_runner_quantizes_bf16_weights_itself(fake_dg: bool) -> None:
    w13, w2 = make_weights(E, H, INTER, seed=5)
    x, ids, w = make_inputs(9, H, E, K, seed=6)
    out = moe_step(NoneDispatcher(E), make_expert_runner("deep_gemm", w13.bfloat16(), w2.bfloat16()), x, ids, w)
    assert rel_err(out, dense_reference(x, ids, w, w13, w2)) < 0.06


def _real_deep_gemm() -> bool:
    return torch.cuda.is_available() and importlib.util.find_spec("deep_gemm") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _real_deep_gemm(), reason="needs CUDA and deep_gemm")
@pytest.mark.parametrize("layout", ["contiguous", "masked"])
def test_real_deep_gemm_runner_matches_torch_runner(layout: str) -> None:
    e, h, inter = 8, 2048, 512
    w13, w2 = make_weights(e, h, inter)
    (q13, s13), (q2, s2) = quantize_per_block(w13), quantize_per_block(w2)
    x, ids, w = make_inputs(300, h, e, 4, seed=7)
    dev = torch.device("cuda")
    args = [t.to(dev) for t in (q13, q2)]
    scales = dict(w13_scale=s13.to(dev), w2_scale=s2.to(dev))
    xs, ids_d, w_d = x.to(dev).bfloat16(), ids.to(dev), w.to(dev)
    got = moe_step(NoneDispatcher(e, layout=layout, expert_alignment=128),
                   make_expert_runner("deep_gemm", *args, **scales), xs, ids_d, w_d)
    ref = moe_step(NoneDispatcher(e), make_expert_runner("torch", *args, **scales), xs, ids_d, w_d)
    assert rel_err(got.float(), ref.float()) < 0.05


def test_signalled_down_gemm_is_detected_not_assumed(monkeypatch: pytest.MonkeyPatch) -> None:
    w13, w2 = make_weights(E, H, INTER)
    (q13, s13), (q2, s2) = quantize_per_block(w13), quantize_per_block(w2)
    x, ids, w = make_inputs(21, H, E, K, seed=8)
    masked = NoneDispatcher(E, layout="masked")
    masked.dispatch_a(x, ids, w)
    d = masked.dispatch_b()
    for signal in (False, True):
        monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm.make_module(signal=signal))
        runner = DeepGemmExpertRunner(q13, q2, w13_scale=s13, w2_scale=s2)
        assert runner.signals_down_gemm(d) is signal
        if not signal:
            with pytest.raises(ValueError, match="no signalled masked GEMM"):
                runner.down_signalled(d, runner.up(d), torch.zeros(64, dtype=torch.int32))
            continue
        # the split path (up, then the signalled down GEMM) gives the plain path's output
        counters = torch.zeros(E * -(-d.hidden_states.shape[1] // 64), dtype=torch.int32)
        out, block_m, threshold = runner.down_signalled(d, runner.up(d), counters, num_sms=100)
        assert (block_m, threshold) == (64, -(-H // 128))
        plain = runner(d)
        for e, n in enumerate(d.tokens_per_expert.tolist()):
            torch.testing.assert_close(out[e, :n], plain[e, :n])
            assert counters[e] == (threshold if n else 0)  # one block of <= 64 rows per expert here
        assert sys.modules["deep_gemm"].get_num_sms() == 132  # the SM cap was restored


def test_accepts_reads_compiled_signatures_from_the_docstring() -> None:
    from engine.moe.runners import _accepts

    def compiled(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        pass

    compiled.__doc__ = ("m_grouped_fp8_gemm_nt_masked(a: tuple, b: tuple, d: torch.Tensor, masked_m: torch.Tensor, "
                        "expected_m: int, enable_overlap: bool = False, signal: Optional[torch.Tensor] = None) "
                        "-> Optional[tuple]\n\nmore text")
    assert _accepts(compiled, "enable_overlap", "signal")
    compiled.__doc__ = "m_grouped_fp8_gemm_nt_masked(a: tuple, b: tuple, d: torch.Tensor) -> None"
    assert not _accepts(compiled, "enable_overlap", "signal")


def test_sbo_reports_why_the_signalled_combine_is_off_on_cpu() -> None:
    from engine.sbo import configure_sbo

    mode = configure_sbo(torch.device("cpu"), "deepep", "deep_gemm")
    assert not mode.combine_signal and "SM90" in mode.combine_signal_why
    assert "off: needs the deepep dispatcher" in configure_sbo(torch.device("cpu"), "torch", "torch").describe()
