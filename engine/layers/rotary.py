"""Rotary embedding for MLA's decoupled rope key, matching HF DeepSeek-V3 numerically.

Frequencies and the YaRN attention factor come from transformers' own rope initialisers (so every
rope type a DeepSeek config can name is supported exactly as the reference computes it); cos/sin
are tabulated once for all positions.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


class RotaryEmbedding(torch.nn.Module):
    def __init__(self, hf_config, max_positions: int, interleave: bool) -> None:
        super().__init__()
        rope_type = hf_config.rope_parameters.get("rope_type", "default")
        # tables are built on the host whatever the ambient default device (plans use "meta")
        with torch.device("cpu"):
            self._build(hf_config, rope_type, max_positions)
        self.interleave = interleave

    def _build(self, hf_config, rope_type: str, max_positions: int) -> None:
        if rope_type == "default":
            dim = hf_config.qk_rope_head_dim
            base = hf_config.rope_parameters["rope_theta"]
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            attention_factor = 1.0
        else:
            inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[rope_type](hf_config, "cpu")
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = t[:, None] * inv_freq.float()[None, :]  # [P, dim/2]
        self.register_buffer("cos", freqs.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", freqs.sin() * attention_factor, persistent=False)

    def forward(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, ..., dim] at `positions` [T].

        Interleaved checkpoints pair dims (0,1),(2,3)...; like the reference we emit the rotated
        halves de-interleaved. Queries and keys get the same layout, so scores are unchanged.
        """
        cos = self.cos[positions].to(x.dtype)
        sin = self.sin[positions].to(x.dtype)
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[-1],)
        cos, sin = cos.view(shape), sin.view(shape)
        if self.interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
