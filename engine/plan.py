"""Memory plan of a deployment without loading it: per-rank weight bytes and KV capacity.

Parameters are counted on the meta device from the very model class a rank builds (so the plan
and the engine cannot disagree about what a rank holds): replicated attention, dense layers,
shared experts, embeddings and head, plus this rank's 1/ep_size of the routed experts.
With FP8 weights (the official DeepSeek-V3 checkpoint format, run by DeepGEMM) every projection
matrix takes one byte per parameter plus a float32 scale per 128x128 block, as the engine keeps
them (`engine.layers.fp8_linear`); `kv_b_proj` (absorbed into attention), embeddings, head, norms
and router stay in bfloat16/float32. The KV cache holds the MLA latent and rope key per token per layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engine.layers.fp8_linear import NOT_CONVERTED
from engine.mem.pool import MLATokenPool


@dataclass(frozen=True)
class MemoryPlan:
    ep_size: int
    weight_format: str
    routed_expert_params: int  # this rank's
    replicated_params: int
    weight_bytes: int
    gpu_bytes: int
    reserved_bytes: int  # activations, communication buffers, allocator slack
    kv_bytes_per_token: int
    kv_tokens: int

    def table(self) -> str:
        gib = 1 << 30

        def count(n: int) -> str:
            return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"

        rows = [
            ("ep_size", str(self.ep_size)),
            ("weights", self.weight_format),
            ("routed expert params / rank", count(self.routed_expert_params)),
            ("replicated params / rank", count(self.replicated_params)),
            ("weight memory / rank", f"{self.weight_bytes / gib:.2f} GiB"),
            ("reserved / rank", f"{self.reserved_bytes / gib:.1f} GiB"),
            ("KV bytes / token", f"{self.kv_bytes_per_token}"),
            ("KV capacity / rank", f"{self.kv_tokens:,} tokens"),
        ]
        return "\n".join(f"{k:<30}{v:>18}" for k, v in rows)


def _linear_bytes(shape: torch.Size, fp8: bool, dense_bytes: int) -> int:
    n = math.prod(shape)
    if not fp8:
        return n * dense_bytes
    blocks = math.prod(math.ceil(d / 128) for d in shape[-2:]) * math.prod(shape[:-2])
    return n + 4 * blocks


def memory_plan(hf_config, ep_size: int, gpu_bytes: int, *, fp8_weights: bool = True,
                kv_dtype: torch.dtype = torch.bfloat16, reserve_fraction: float = 0.1,
                max_model_len: int | None = None) -> MemoryPlan:
    from engine.models.deepseek_v3 import DeepseekV3ForCausalLM

    if gpu_bytes <= 0:
        raise ValueError("gpu_memory: must be positive")
    with torch.device("meta"):
        model = DeepseekV3ForCausalLM(hf_config, max_positions=2, rank=0, world_size=ep_size)
    routed = replicated = weight_bytes = 0
    for name, p in model.named_parameters():
        n = p.numel()
        if ".experts.w" in name:
            routed += n
        else:
            replicated += n
        is_matrix = p.dim() >= 2 and not name.endswith(("embed_tokens.weight", "lm_head.weight", "gate.weight"))
        is_matrix = is_matrix and not any(f".{m}." in name for m in NOT_CONVERTED)
        weight_bytes += _linear_bytes(p.shape, fp8_weights and is_matrix, 2)
    weight_bytes += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "correction_bias" in n)
    reserved = int(gpu_bytes * reserve_fraction)
    per_token = MLATokenPool.bytes_per_token(hf_config.num_hidden_layers, hf_config.kv_lora_rank,
                                             hf_config.qk_rope_head_dim, kv_dtype)
    free = gpu_bytes - reserved - weight_bytes
    if free <= 0:
        raise ValueError(f"gpu_memory: {gpu_bytes / 2**30:.1f} GiB cannot hold this rank's weights "
                         f"({weight_bytes / 2**30:.1f} GiB) plus the reserve; raise ep_size")
    return MemoryPlan(ep_size, "fp8 (128x128 block scales)" if fp8_weights else "bf16", routed, replicated,
                      weight_bytes, gpu_bytes, reserved, per_token, free // per_token)
