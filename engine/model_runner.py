"""Owns the device side of a rank: model weights, KV pool, FutureMap, sampling.

`forward` runs on the forward executor (a worker thread with its own CUDA stream, inline, or in the
executor's child process) and is the only code that touches device tensors after start-up. The KV
pool is sized last, from what the weights and buffers left (`kv_cache_pages`).
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from engine.config import EngineConfig
from engine.cuda_graph import DecodeGraphRunner
from engine.forward_batch import ForwardBatch, ForwardMode
from engine.layers.fp8_linear import Fp8Linear, convert_linears, dense_fp8_gemm
from engine.mem.pool import MLATokenPool
from engine.models.deepseek_v3 import DECODE_GATHER_ELEMS, CommStats, DeepseekV3ForCausalLM
from engine.models.loader import checkpoint_is_fp8, fp8_weight_names, iter_checkpoint_tensors
from engine.moe.factory import make_dispatcher, make_expert_runner, resolve_runner_backend
from engine.parallel import ParallelContext
from engine.penalties import PenaltyState
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
    top_ids: torch.Tensor | None = None  # [B, K] the most likely tokens (top_logprobs)
    top_logprobs: torch.Tensor | None = None  # [B, K]
    prompt_top_ids: torch.Tensor | None = None  # [N, K] at the prompt-logprob positions
    prompt_top_logprobs: torch.Tensor | None = None

    def host_tensors(self) -> tuple[torch.Tensor | None, ...]:
        """The tensors `HostOutput` is made of, in its field order."""
        return (self.next_ids, self.logprobs, self.prompt_logprobs, self.top_ids, self.top_logprobs,
                self.prompt_top_ids, self.prompt_top_logprobs)


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
_CPU_KV_BUDGET_BYTES = 512 << 20
_LOGPROB_ROWS = 1024  # prompt-logprob rows per logits chunk


def kv_cache_pages(config: EngineConfig, hf_config, max_model_len: int, device: torch.device,
                   dtype: torch.dtype) -> int:
    """Pages of the KV pool, the reserved padding page included. On CUDA the default budget is a
    share of the memory still free, so it must be taken once weights and communication buffers
    are allocated (the runner calls this at the end of its set-up)."""
    P = config.page_size
    if config.kv_cache_tokens is not None:
        tokens = config.kv_cache_tokens
    else:
        per_token = MLATokenPool.bytes_per_token(hf_config.num_hidden_layers, hf_config.kv_lora_rank,
                                                 hf_config.qk_rope_head_dim, dtype)
        if config.kv_cache_memory_bytes is not None:
            budget = config.kv_cache_memory_bytes
        elif device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            budget = int(free * config.kv_cache_memory_fraction)
        else:
            budget = _CPU_KV_BUDGET_BYTES
        tokens = min(budget // per_token, config.max_running_requests * max_model_len)
        if tokens < P:
            raise ValueError(f"KV cache budget of {budget} bytes holds {tokens} tokens, less than one "
                             f"page ({P}); lower the memory use or set kv_cache_tokens")
    return math.ceil(tokens / P) + 1


def _cpu_threads(config: EngineConfig, hf_config, dtype: torch.dtype) -> int:
    if config.cpu_threads is not None:
        return config.cpu_threads
    expert_bytes = 3 * hf_config.hidden_size * hf_config.moe_intermediate_size * dtype.itemsize
    return 1 if expert_bytes < _SMALL_EXPERT_BYTES else torch.get_num_threads()


def _materialize(hf_config, max_model_len: int, parallel: ParallelContext, keep_fp8: bool,
                 dtype: torch.dtype, device: torch.device,
                 fp8_linears: set[str] = frozenset()) -> DeepseekV3ForCausalLM:
    """The rank's model with uninitialized weights in their final dtype, already on `device`.

    Built on the meta device and given storage only once every dtype is final: a DeepSeek-V3 rank
    never holds a float32 (or randomly initialized) copy of its weights in host memory, and the
    checkpoint is copied tensor by tensor straight into device memory. `load_weights` then fails
    on any weight the checkpoint does not provide, so nothing uninitialized survives. The rope
    tables, built on the host at construction, are kept. The linear layers whose checkpoint
    weights are named in `fp8_linears` become `Fp8Linear`s (FP8 as stored, see
    `engine.layers.fp8_linear`).
    """
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(hf_config, max_positions=max_model_len + 1,
                                      rank=parallel.rank, world_size=parallel.world_size)
        if keep_fp8:
            for moe in model.moe_layers:
                moe.experts.keep_fp8()
        convert_linears(model, set(fp8_linears))
    for name, p in model.named_parameters():  # buffers (rope tables, gate bias) stay float32
        if p.dtype != torch.float8_e4m3fn and not name.endswith(("_scale", "_scale_inv")):
            p.data = p.data.to(dtype)
    built = {name: b for name, b in model.named_buffers() if b.device.type != "meta"}
    model.to_empty(device=device)
    for name, b in built.items():
        owner, _, leaf = name.rpartition(".")
        setattr(model.get_submodule(owner), leaf, b.to(device))
    return model


def _graph_blocker(config: EngineConfig, a2a: str, runner_backend: str) -> str | None:
    """Why decode steps cannot be captured as CUDA graphs here (None: they can)."""
    if a2a != "none":
        return f"the {a2a} all-to-all of an EP group"
    if config.enable_two_batch_overlap or config.enable_single_batch_overlap:
        return "TBO/SBO interleave streams and micro-batches per step"
    if runner_backend != "torch":
        return f"the {runner_backend} expert runner sizes its expert segments on the host"
    return None


class ModelRunner:
    def __init__(self, config: EngineConfig, hf_config, model_path, parallel: ParallelContext,
                 max_model_len: int, future_capacity: int) -> None:
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
        # and so do its other projections, where DeepGEMM has the dense FP8 GEMM to run them
        dense_gemm = dense_fp8_gemm() if keep_fp8 else None
        fp8_linears = fp8_weight_names(model_path) if dense_gemm is not None else set()
        t0 = time.time()
        model = _materialize(hf_config, max_model_len, parallel, keep_fp8, self.dtype, self.device, fp8_linears)
        for m in model.modules():
            if isinstance(m, Fp8Linear):
                m.gemm = dense_gemm
        model.load_weights(iter_checkpoint_tensors(model_path, dtype=torch.float32,
                                                   num_hidden_layers=hf_config.num_hidden_layers,
                                                   want=model.wants, keep_fp8=keep_fp8))
        self.model = model.eval()
        logger.info("rank %d loaded %s in %.1fs (experts %s)", parallel.rank, model_path,
                    time.time() - t0, model.expert_range)
        a2a = config.resolved_a2a_backend
        self.a2a_backend = a2a
        n_micro = 2 if config.enable_two_batch_overlap else 1
        side = torch.cuda.Stream(self.device) if config.enable_single_batch_overlap and self.device.type == "cuda" else None
        fp8_runner = runner_backend == "deep_gemm"
        for moe in self.model.moe_layers:
            ex = moe.experts
            moe.runner = make_expert_runner(runner_backend, ex.w13, ex.w2, w13_scale=ex.w13_scale, w2_scale=ex.w2_scale)
            # For DeepGEMM the dispatch delivers expert segments already padded to its M alignment
            # (no repacking before the grouped GEMM) and, in DeepEP's normal mode, FP8 tokens with
            # their per-token scales (half the bytes; the runner quantizes to FP8 anyway).
            moe.dispatchers = [make_dispatcher(
                a2a, num_experts=hf_config.n_routed_experts, hidden_size=hf_config.hidden_size,
                ep_group=parallel.ep_group, rank=parallel.rank, world_size=parallel.world_size,
                deepep_mode=config.deepep_mode, params_dtype=self.dtype,
                expert_alignment=getattr(moe.runner, "alignment", 1) if fp8_runner else 1,
                normal_fp8=fp8_runner,
                num_max_dispatch_tokens_per_rank=config.resolved_deepep_ll_max_tokens) for _ in range(n_micro)]
            moe.sbo = config.enable_single_batch_overlap
            moe.alt_stream = side
        if config.enable_single_batch_overlap:
            from engine.sbo import configure_sbo

            self.sbo_mode = configure_sbo(self.device, a2a, runner_backend)
            if self.sbo_mode.combine_signal:
                for moe in self.model.moe_layers:
                    moe.combine_signal_sms = (self.sbo_mode.comm_num_sms, self.sbo_mode.gemm_num_sms)
        # last: the pool takes a share of what the weights and buffers above left free
        self.num_pages = kv_cache_pages(config, hf_config, max_model_len, self.device, self.dtype)
        self.pool = MLATokenPool(hf_config.num_hidden_layers, self.num_pages, config.page_size,
                                 hf_config.kv_lora_rank, hf_config.qk_rope_head_dim, self.dtype, self.device)
        for layer in self.model.model.layers:
            layer.pool = self.pool
        self.comm_stats = CommStats()
        self.futures = FutureMap(future_capacity, self.device)
        self.graphs: DecodeGraphRunner | None = None
        if self.device.type == "cuda" and config.cuda_graph_max_bs > 0:
            if (blocker := _graph_blocker(config, a2a, runner_backend)) is not None:
                logger.info("decode CUDA graphs off: %s", blocker)
            else:
                self.graphs = DecodeGraphRunner(
                    lambda fb: self.model.hidden_states(fb), device=self.device, max_seq=max_model_len + 1,
                    max_bs=min(config.cuda_graph_max_bs, config.max_running_requests),
                    max_keys=DECODE_GATHER_ELEMS["cuda"] // self.pool.buf.shape[-1])
        self.penalties: PenaltyState | None = None
        self.generator = torch.Generator(device=self.device)  # sampling noise is drawn where the logits are
        self.generator.manual_seed(config.seed)
        self.cpu_threads = _cpu_threads(config, hf_config, self.dtype) if self.device.type == "cpu" else None

    def _set_deepep_mode(self, fb: ForwardBatch) -> None:
        """DeepEP `auto`: the group's mode for this step (`fb.moe_a2a_mode`, agreed in lockstep),
        idle ranks included; without one (a batch not from the engine loop), normal kernels for
        prefill and low-latency kernels for decode."""
        if self.a2a_backend != "deepep" or self.config.deepep_mode != "auto":
            return
        mode = fb.moe_a2a_mode
        if mode is None:
            if fb.forward_mode == ForwardMode.IDLE:
                return
            mode = "low_latency" if fb.forward_mode == ForwardMode.DECODE else "normal"
        for moe in self.model.moe_layers:
            for d in moe.dispatchers:
                d.set_mode(mode)

    def _token_logprobs(self, hidden: torch.Tensor, targets: torch.Tensor,
                        top: int = 0) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """log p(target) of each row, and with `top` the most likely tokens' (ids, logprobs), in
        row chunks: a long prompt's full-vocabulary float32 logits (8192 x 129280 is 4 GB, twice
        with a log-softmax) never exist at once."""
        n = hidden.shape[0]
        out = torch.empty(n, dtype=torch.float32, device=hidden.device)
        top_ids = torch.empty(n, top, dtype=torch.int64, device=hidden.device) if top else None
        top_lps = torch.empty(n, top, dtype=torch.float32, device=hidden.device) if top else None
        for s in range(0, n, _LOGPROB_ROWS):
            logits = self.model.logits(hidden[s:s + _LOGPROB_ROWS])
            norm = torch.logsumexp(logits, dim=-1)
            out[s:s + _LOGPROB_ROWS] = logits.gather(1, targets[s:s + _LOGPROB_ROWS, None]).squeeze(1) - norm
            if top:
                best = logits.topk(min(top, logits.shape[-1]), dim=-1)
                top_ids[s:s + _LOGPROB_ROWS] = best.indices
                top_lps[s:s + _LOGPROB_ROWS] = best.values - norm[:, None]
        return out, top_ids, top_lps

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch) -> ForwardOutput:
        t0 = time.perf_counter()
        if self.cpu_threads is not None and torch.get_num_threads() != self.cpu_threads:
            torch.set_num_threads(self.cpu_threads)  # per calling thread (OpenMP); set where forwards run
        fb = fb.to(self.device)
        fb.input_ids = self.futures.resolve(fb.input_ids)
        self._set_deepep_mode(fb)
        # a decode step that fits a graph replays it; None: run eager
        hidden = self.graphs.run(fb) if self.graphs is not None else None
        if hidden is None and fb.tbo_children is not None:
            hidden = self.model.hidden_states_tbo(fb, DELTA_STAGES[fb.forward_mode], self.comm_stats)
        elif hidden is None:
            hidden = self.model.hidden_states(fb, self.comm_stats)
        if fb.forward_mode == ForwardMode.IDLE or fb.batch_size == 0:
            return ForwardOutput(None, None, None, time.perf_counter() - t0)
        logits = raw = self.model.logits(hidden[fb.sample_index])
        if fb.sampling.bias_index is not None:
            logits = logits.index_put((fb.sampling.bias_index[0], fb.sampling.bias_index[1]),
                                      fb.sampling.bias_values, accumulate=True)
        penalties = fb.sampling.penalties
        if penalties is not None:
            if self.penalties is None:  # allocated on first use: [slots, vocab] counts
                self.penalties = PenaltyState(self.config.max_running_requests + 1, logits.shape[-1], self.device)
            logits = self.penalties.apply(logits, penalties)
        # logprobs reported are the model's own (before penalties)
        sampled = sample(logits, fb.sampling, self.generator, model_logits=raw)
        next_ids = sampled.ids
        if penalties is not None:
            self.penalties.observe(penalties, next_ids)
        self.futures.store(fb.future_slots, next_ids)
        plp = plp_ids = plp_top = None
        if fb.prompt_logprob_ranges:
            idx = torch.cat([torch.arange(s, e) for s, e, _ in fb.prompt_logprob_ranges]).to(self.device)
            plp, plp_ids, plp_top = self._token_logprobs(hidden[idx], fb.prompt_logprob_targets,
                                                         fb.prompt_logprob_top)
        return ForwardOutput(next_ids, sampled.logprobs, plp, time.perf_counter() - t0,
                             sampled.top_ids, sampled.top_logprobs, plp_ids, plp_top)
