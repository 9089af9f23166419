"""The one validated configuration tree of a rank's engine.

`EngineConfig` is what `LLM(...)` takes as keywords and what the `engine:` section of a Serve config
file holds, name for name. It is frozen: derived values are properties, never mutations.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_PROCESS_EXECUTOR_ERROR = ("forward_executor: `process` runs the forwards of a single rank; with ep_size > 1 "
                           "use `thread` (or `auto`): the MoE process groups live in the rank's process")


class EngineConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str = Field("tiny-dsv3", description="built-in model name or a local HF checkpoint directory")
    tokenizer: str | None = Field(None, description="tokenizer directory; defaults to the model's")
    ep_size: int = Field(1, ge=1, description="expert-parallel ranks in one group")
    dtype: Literal["float32", "bfloat16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"

    enable_overlap_schedule: bool = True
    forward_executor: Literal["auto", "thread", "process"] = Field("auto", description=(
        "where the overlap loop runs its forwards: `thread` (a worker thread; on CUDA it launches "
        "onto its own stream) or `process` (a child process owning the model, so the forward's "
        "Python (CPU tensor work, or CUDA kernel launches) does not share the GIL with the "
        "scheduler). `auto`: process for one CPU rank, thread otherwise; `process` needs ep_size 1"))
    cuda_graph_max_bs: int = Field(256, ge=0, description=(
        "CUDA: decode steps of up to this many requests replay captured graphs (0: off); one rank "
        "(ep_size 1) without TBO/SBO and with the torch expert runner"))
    enable_two_batch_overlap: bool = False
    enable_single_batch_overlap: bool = False
    moe_a2a_backend: Literal["auto", "none", "torch", "deepep"] = "auto"
    deepep_mode: Literal["auto", "normal", "low_latency"] = "auto"
    deepep_ll_max_tokens: int | None = Field(None, ge=1, description=(
        "DeepEP low-latency buffers: the most tokens one rank dispatches in a step; default "
        "max_running_requests (a rank's largest decode batch). Under `auto`, a decode step where "
        "any rank has more runs the normal kernels"))
    moe_runner_backend: Literal["auto", "torch", "deep_gemm"] = "auto"
    tbo_token_distribution_threshold: float = Field(0.48, gt=0.0, lt=0.5)
    tbo_min_tokens: int = Field(2, ge=2, description="below this many tokens on a rank TBO falls back")

    chunked_prefill_size: int = Field(2048, ge=1, description="token budget of one prefill batch")
    max_running_requests: int = Field(256, ge=1)
    max_prefill_requests: int | None = Field(None, ge=1)
    page_size: int = Field(16, ge=1)
    kv_cache_tokens: int | None = Field(None, ge=1, description="KV pool size in tokens; default from memory budget")
    kv_cache_memory_bytes: int | None = Field(None, ge=1, description="memory budget for the KV pool")
    kv_cache_memory_fraction: float = Field(0.85, gt=0, le=1, description=(
        "CUDA, when neither kv_cache_tokens nor kv_cache_memory_bytes is set: the share of device "
        "memory still free once weights and communication buffers are loaded that the KV pool "
        "takes (the rest is for activations)"))
    max_model_len: int | None = Field(None, ge=1, description="context limit; defaults to the model's")
    enable_prefix_caching: bool = True
    schedule_policy: Literal["fcfs", "priority"] = "fcfs"
    seed: int = 0
    cpu_threads: int | None = Field(None, ge=1, description=(
        "intra-op threads of the CPU forward; default: one for models whose expert GEMMs are too "
        "small to split, the process's torch thread count otherwise"))
    stall_timeout_s: float = Field(60.0, gt=0, description="health fails after this long without progress while work is pending")
    warmup: bool = Field(True, description=(
        "before serving, run one short request (a prefill and two decode steps) through the loop, "
        "so first-use costs (kernel JIT and autotuning, library handles, communication buffers, the "
        "first CUDA graph) are paid at start, not by the first request or against the stall check"))

    @property
    def resolved_a2a_backend(self) -> str:
        """`auto`: no all-to-all for one rank, DeepEP when it can run, torch collectives otherwise."""
        if self.moe_a2a_backend != "auto":
            return self.moe_a2a_backend
        if self.ep_size == 1:
            return "none"
        from engine.moe import deepep_available

        return "deepep" if deepep_available() else "torch"

    @model_validator(mode="after")
    def _process_executor_is_single_rank(self) -> EngineConfig:
        if self.forward_executor == "process" and self.ep_size > 1:
            raise ValueError(_PROCESS_EXECUTOR_ERROR)
        return self

    @property
    def resolved_forward_executor(self) -> str:
        """`inline` for the normal loop; else `thread` or `process` (see `forward_executor`)."""
        from engine import envs

        if not self.enable_overlap_schedule or envs.disable_overlap_schedule():
            return "inline"
        if self.forward_executor == "auto":
            return "process" if self.ep_size == 1 and self.resolved_device == "cpu" else "thread"
        return self.forward_executor

    @property
    def resolved_deepep_ll_max_tokens(self) -> int:
        return self.deepep_ll_max_tokens or self.max_running_requests

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"
