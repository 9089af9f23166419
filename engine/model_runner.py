"""Owns the device side of a rank: model weights, KV pool, FutureMap, sampling.

`forward` runs on the forward executor (a worker thread with its own CUDA stream, or inline) and
is the only code that touches device tensors after start-up.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.mem.pool import MLATokenPool
from engine.models.deepseek_v3 import CommStats, DeepseekV3ForCausalLM
from engine.models.loader import checkpoint_is_fp8, iter_checkpoint_tensors
from engine.moe.factory import make_dispatcher, make_expert_runner, resolve_runner_backend
from engine.parallel import ParallelContext
from engine.sampler import sample
from engine.tbo import DELTA_STAGES

logger = logging.getLogger(__name__)


@dataclass
class ForwardOutput:
    """Device results of one step; `to_host` is called where the step's results are processed."""

    next_ids: torch.Tensor | None
    logprobs: torch.Tensor | None
    prompt_logprobs: torch.Tensor | None
    forward_time: float = 0.0


class FutureMap:
    """Device ring buffer of sampled token ids; negative input ids are slots to read from it."""

    def __init__(self, capacity: int, device) -> None:
        self.buf = torch.zeros(capacity, dtype=torch.int64, device=device)

    def resolve(self, ids: torch.Tensor) -> torch.Tensor:
        return torch.where(ids < 0, self.buf[(-ids).clamp(min=0)], ids)

    def store(self, slots: torch.Tensor, ids: torch.Tensor) -> None:
        self.buf[slots] = ids


# Below this many bytes per expert (gate, up and down) a CPU GEMM is too small to split across
# threads: in a thread other than the main one each OpenMP parallel region costs ~80 us, more than
# the split saves (tiny-dsv3 decode runs 2x faster on one thread than on two; a hidden-1024 model
# runs 1.25x faster on two).
_SMALL_EXPERT_BYTES = 1 << 20


def _cpu_threads(config: EngineConfig, hf_config, dtype: torch.dtype) -> int:
    if config.cpu_threads is not None:
        return config.cpu_threads
    expert_bytes = 3 * hf_config.hidden_size * hf_config.moe_intermediate_size * dtype.itemsize
    return 1 if expert_bytes < _SMALL_EXPERT_BYTES else torch.get_num_threads()


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model_path, parallel: ParallelContext,
                 max_model_len: int, num_pages: int, future_capacity: int) -> None:
        self.config = config
        self.parallel = parallel
        self.device = torch.device(config.resolved_device)
        self.dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[config.dtype]
        runner_backend = config.moe_runner_backend
        if runner_backend == "auto" and self.dtype == torch.float32:
            runner_backend = "torch"  # FP8 grouped GEMMs would not keep float32 accuracy
        runner_backend = resolve_runner_backend(runner_backend)
        # an FP8 checkpoint run by the FP8 expert runner keeps its expert weights as stored
        keep_fp8 = runner_backend == "deep_gemm" and checkpoint_is_fp8(model_path)
        t0 = time.time()
        with torch.device("cpu"):
            model = DeepseekV3ForCausalLM(hf_config, max_positions=max_model_len + 1,
                                          rank=parallel.rank, world_size=parallel.world_size)
        if keep_fp8:
            for moe in model.moe_layers:
                moe.experts.keep_fp8()
        model.load_weights(iter_checkpoint_tensors(model_path, dtype=torch.float32,
                                                   num_hidden_layers=hf_config.num_hidden_layers,
                                                   want=model.wants, keep_fp8=keep_fp8))
        for name, p in model.named_parameters():  # buffers (rope tables, gate bias) stay float32
            if p.dtype != torch.float8_e4m3fn and not name.endswith("_scale"):
                p.data = p.data.to(self.dtype)
        self.model = model.to(self.device).eval()
        logger.info("rank %d loaded %s in %.1fs (experts %s)", parallel.rank, model_path,
                    time.time() - t0, model.expert_range)
        a2a = config.resolved_a2a_backend
        self.a2a_backend = a2a
        n_micro = 2 if config.enable_two_batch_overlap else 1
        side = torch.cuda.Stream(self.device) if config.enable_single_batch_overlap and self.device.type == "cuda" else None
        for moe in self.model.moe_layers:
            moe.dispatchers = [make_dispatcher(
                a2a, num_experts=hf_config.n_routed_experts, hidden_size=hf_config.hidden_size,
                ep_group=parallel.ep_group, rank=parallel.rank, world_size=parallel.world_size,
                deepep_mode=config.deepep_mode, params_dtype=self.dtype) for _ in range(n_micro)]
            ex = moe.experts
            moe.runner = make_expert_runner(runner_backend, ex.w13, ex.w2, w13_scale=ex.w13_scale, w2_scale=ex.w2_scale)
            moe.sbo = config.enable_single_batch_overlap
            moe.alt_stream = side
        if config.enable_single_batch_overlap:
            from engine.sbo import configure_sbo

            self.sbo_mode = configure_sbo(self.device, a2a, runner_backend)
            if self.sbo_mode.combine_signal:
                for moe in self.model.moe_layers:
                    moe.combine_signal_sms = (self.sbo_mode.comm_num_sms, self.sbo_mode.gemm_num_sms)
        self.pool = MLATokenPool(hf_config.num_hidden_layers, num_pages, config.page_size,
                                 hf_config.kv_lora_rank, hf_config.qk_rope_head_dim, self.dtype, self.device)
        for layer in self.model.model.layers:
            layer.pool = self.pool
        self.comm_stats = CommStats()
        self.futures = FutureMap(future_capacity, self.device)
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(config.seed)
        self.cpu_threads = _cpu_threads(config, hf_config, self.dtype) if self.device.type == "cpu" else None

    def _set_deepep_mode(self, mode: ForwardMode) -> None:
        """DeepEP `auto`: normal kernels for prefill, low-latency kernels for decode."""
        if self.a2a_backend != "deepep" or self.config.deepep_mode != "auto" or mode == ForwardMode.IDLE:
            return
        for moe in self.model.moe_layers:
            for d in moe.dispatchers:
                d.set_mode("low_latency" if mode == ForwardMode.DECODE else "normal")

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ForwardOutput:
        t0 = time.perf_counter()
        if self.cpu_threads is not None and torch.get_num_threads() != self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)  # per calling thread (OpenMP); set where forwards run
        fb = fb.to(self.device)
        fb.input_ids = self.futures.resolve(fb.input_ids)
        self._set_deepep_mode(fb.forward_mode)
        if fb.tbo_children is not None:
            hidden = self.model.hidden_states_tbo(fb, DELTA_STAGES[fb.forward_mode], self.comm_stats)
        else:
            hidden = self.model.hidden_states(fb, self.comm_stats)
        if fb.forward_mode == ForwardMode.IDLE or fb.batch_size == 0:
            return ForwardOutput(None, None, None, time.perf_counter() - t0)
        logits = self.model.logits(hidden[fb.sample_index])
        next_ids, logprobs = sample(logits, fb.sampling, self.generator)
        self.futures.store(fb.future_slots, next_ids)
        plp = None
        if fb.prompt_logprob_ranges:
            idx = torch.cat([torch.arange(s, e) for s, e, _ in fb.prompt_logprob_ranges]).to(self.device)
            lp = torch.log_softmax(self.model.logits(hidden[idx]), dim=-1)
            plp = lp.gather(1, fb.prompt_logprob_targets[:, None]).squeeze(1)
        return ForwardOutput(next_ids, logprobs, plp, time.perf_counter() - t0)
