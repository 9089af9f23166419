"""Single-batch overlap: what this rank can overlap inside one MoE layer, detected, never assumed.

Always (any backend, CPU included): the shared experts are computed inside the communication
windows — their gate/up half between dispatch launch and wait, their down half between combine
launch and wait — so an asynchronous all-to-all (gloo/NCCL async ops, DeepEP hooks) proceeds
meanwhile.

On GPUs with DeepEP the SMs are partitioned: `comm_num_sms` SMs for communication kernels (3 on
Hopper, 32 on Blackwell, `MOE_SBO_COMM_NUM_SMS` overrides) and the rest for the GEMMs. Finer
modes need library support that only some builds have (DeepEP's low-latency combine taking a
completion signal from DeepGEMM's masked down GEMM, so combine starts per finished block); they
are detected from the installed functions' signatures and reported, and used only when present.
"""

from __future__ import annotations

import importlib.util
import inspect
import logging
from dataclasses import dataclass

import torch

from engine import envs

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SboMode:
    shared_experts_overlap: bool
    comm_num_sms: int | None
    gemm_num_sms: int | None
    # DeepEP LL combine waiting on DeepGEMM block signals: detected and reported; this build
    # does not drive that path yet, so the combine starts after the whole down GEMM.
    combine_signal_available: bool

    def describe(self) -> str:
        parts = ["shared experts inside dispatch/combine windows"]
        if self.comm_num_sms is not None:
            parts.append(f"SMs: {self.comm_num_sms} communication / {self.gemm_num_sms} GEMM")
        parts.append("down-GEMM -> combine signalling " + (
            "available in the installed libraries but not used" if self.combine_signal_available
            else "not supported by the installed DeepEP/DeepGEMM"))
        return "; ".join(parts)


def default_comm_num_sms(device: torch.device) -> int | None:
    override = envs.sbo_comm_num_sms()
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    major, _ = torch.cuda.get_device_capability(device)
    return 32 if major >= 10 else 3


def _signal_support() -> bool:
    """DeepEP's low-latency combine with a `comp_signal`/`src_signals` argument and DeepGEMM's
    masked GEMM with a `signal` output: both forks must be installed for the signalled mode."""
    if importlib.util.find_spec("deep_ep") is None or importlib.util.find_spec("deep_gemm") is None:
        return False
    try:
        import deep_ep
        import deep_gemm

        combine = inspect.signature(deep_ep.Buffer.low_latency_combine).parameters
        gemm = getattr(deep_gemm, "m_grouped_fp8_gemm_nt_masked", None)
        gemm_params = inspect.signature(gemm).parameters if gemm is not None else {}
    except (ImportError, TypeError, ValueError):
        return False
    return ("comp_signal" in combine or "src_signals" in combine) and "signal" in gemm_params


def configure_sbo(device: torch.device, a2a_backend: str) -> SboMode:
    comm = default_comm_num_sms(device) if a2a_backend == "deepep" else None
    gemm = None
    if comm is not None and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).multi_processor_count
        gemm = total - comm
        if importlib.util.find_spec("deep_gemm") is not None:
            import deep_gemm

            if hasattr(deep_gemm, "set_num_sms"):
                deep_gemm.set_num_sms(gemm)
    mode = SboMode(True, comm, gemm, a2a_backend == "deepep" and _signal_support())
    logger.info("single-batch overlap: %s", mode.describe())
    return mode
