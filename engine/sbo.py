"""Single-batch overlap: what this rank can overlap inside one MoE layer, detected, never assumed.

Always (any backend, CPU included): the shared experts are computed inside the communication
windows — their gate/up half between dispatch launch and wait, their down half between combine
launch and wait — so an asynchronous all-to-all (gloo/NCCL async ops, DeepEP hooks) proceeds
meanwhile.

On GPUs with DeepEP the SMs are partitioned: `comm_num_sms` SMs for communication kernels (3 on
Hopper, 32 on Blackwell, `MOE_SBO_COMM_NUM_SMS` overrides) and the rest for the GEMMs. Finer
modes need library support that only some builds have: DeepEP's low-latency combine taking a
completion signal from DeepGEMM's masked down GEMM, so the combine sends each block of rows as
soon as it is computed, the GEMM on the GEMM SMs and the combine on the communication SMs at
once (`combine_overlapping_down_gemm`). It is detected from the installed functions' signatures
and the GPU, reported, and used only when all are there.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass

import torch

from engine import envs
from engine.moe.base import CombineSignal, Dispatcher, DispatchOutput, ExpertRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SboMode:
    shared_experts_overlap: bool
    comm_num_sms: int | None
    gemm_num_sms: int | None
    # DeepEP LL combine sending each block as soon as DeepGEMM's masked down GEMM signals it done
    combine_signal: bool
    combine_signal_why: str = ""

    def describe(self) -> str:
        parts = ["shared experts inside dispatch/combine windows"]
        if self.comm_num_sms is not None:
            parts.append(f"SMs: {self.comm_num_sms} communication / {self.gemm_num_sms} GEMM")
        parts.append("down GEMM -> combine signalling " + (
            "on (low-latency steps)" if self.combine_signal else f"off: {self.combine_signal_why}"))
        return "; ".join(parts)


def default_comm_num_sms(device: torch.device) -> int | None:
    override = envs.sbo_comm_num_sms()
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    major, _ = torch.cuda.get_device_capability(device)
    return 32 if major >= 10 else 3


def _signal_support(device: torch.device, a2a_backend: str, runner_backend: str) -> tuple[bool, str]:
    """The signalled combine needs DeepEP's antgroup-opt `low_latency_combine(comp_signal=...)`,
    DeepGEMM's SGLang-fork masked GEMM with `enable_overlap`/`signal`, and SM90 (the fork's SM100
    kernel ignores the signal, so a combine waiting on it would never start)."""
    if a2a_backend != "deepep" or runner_backend != "deep_gemm":
        return False, "needs the deepep dispatcher and the deep_gemm runner"
    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] != 9:
        return False, "only the SM90 (Hopper) DeepGEMM kernel signals"
    if importlib.util.find_spec("deep_ep") is None or importlib.util.find_spec("deep_gemm") is None:
        return False, "deep_ep / deep_gemm not installed"
    import deep_ep
    import deep_gemm

    from engine.moe.deepep import combine_takes_signal
    from engine.moe.runners import _accepts

    if not combine_takes_signal(deep_ep.Buffer):
        return False, "this DeepEP's low_latency_combine takes no comp_signal (antgroup-opt branch has it)"
    gemm = next((getattr(deep_gemm, n) for n in ("m_grouped_fp8_gemm_nt_masked", "fp8_m_grouped_gemm_nt_masked")
                 if hasattr(deep_gemm, n)), None)
    if gemm is None or not _accepts(gemm, "enable_overlap", "signal"):
        return False, "this DeepGEMM's masked GEMM takes no signal (SGLang's fork has it)"
    return True, ""


def configure_sbo(device: torch.device, a2a_backend: str, runner_backend: str = "torch") -> SboMode:
    comm = default_comm_num_sms(device) if a2a_backend == "deepep" else None
    gemm = None
    if comm is not None and device.type == "cuda":
        gemm = torch.cuda.get_device_properties(device).multi_processor_count - comm
        if importlib.util.find_spec("deep_gemm") is not None:
            import deep_gemm

            if hasattr(deep_gemm, "set_num_sms"):  # GEMMs leave the communication SMs free
                deep_gemm.set_num_sms(gemm)
    ok, why = _signal_support(device, a2a_backend, runner_backend)
    mode = SboMode(True, comm, gemm, ok, why)
    logger.info("single-batch overlap: %s", mode.describe())
    return mode


def combine_overlapping_down_gemm(dispatcher: Dispatcher, runner: ExpertRunner, d: DispatchOutput,
                                  comm_num_sms: int, gemm_num_sms: int | None) -> None:
    """The expert step of a low-latency MoE layer with the signalled combine: gate/up GEMM, then
    the down GEMM queued on `gemm_num_sms` SMs counting finished tiles into a signal tensor, and
    the combine launched at once on its own stream and `comm_num_sms` SMs, sending each block of
    rows when its tiles are all done. `combine_b` joins the streams."""
    act = runner.up(d)
    num_experts, m_max = d.hidden_states.shape[:2]
    dev = d.hidden_states.device
    # one counter per (expert, block of rows); blocks are >= 64 rows, so this always suffices
    signal = torch.zeros(num_experts * -(-m_max // 64), dtype=torch.int32, device=dev)
    ready = None
    if dev.type == "cuda":
        ready = torch.cuda.Event()
        ready.record()  # the combine may start once the GEMM's inputs are ready, not after it
    out, block_m, threshold = runner.down_signalled(d, act, signal, gemm_num_sms)
    dispatcher.combine_a(out, d, CombineSignal(signal, block_m, threshold, comm_num_sms, ready))
