"""Shared test helpers: small random DeepSeek-V3 checkpoints for HF-oracle comparisons, and a
local Ray start that survives a slow machine."""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import torch

# Small but complete: q-LoRA, a dense first layer, grouped routing with more groups than picked.
_BASE_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    max_position_embeddings=2048,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rope_interleave=True,
    tie_word_embeddings=False,
    num_nextn_predict_layers=0,
)


def make_random_dsv3_checkpoint(
    path: str | Path, *, seed: int = 0, **config_overrides: Any
) -> Path:
    """Save a random `DeepseekV3ForCausalLM` (float32) plus the tiny-dsv3 tokenizer under `path`.

    `config_overrides` go to `DeepseekV3Config` (e.g. `q_lora_rank=None`,
    `rope_parameters={"rope_type": "yarn", ...}`, `n_group=1, topk_group=1`,
    `num_hidden_layers=2`, `first_k_dense_replace=0`). HF's own init (std 0.02, zero routing
    bias) makes every layer nearly the identity and routing nearly arbitrary, which would let
    bugs through; the weights are redrawn so each sublayer matters, norms are not all ones, the
    correction bias is non-zero, and gate logits are spread enough for decisive top-k.
    """
    from transformers import AutoTokenizer, DeepseekV3Config, DeepseekV3ForCausalLM

    from engine.models.tiny import ensure_tiny_dsv3

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tiny = ensure_tiny_dsv3()
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    kwargs: dict[str, Any] = dict(_BASE_CONFIG)
    kwargs.update(
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    kwargs.update(config_overrides)
    config = DeepseekV3Config(**kwargs)

    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).to(torch.float32).eval()
    _randomize(model, config, torch.Generator().manual_seed(seed + 1))
    model.save_pretrained(path)
    # Same tokenizer as tiny-dsv3: copy its files rather than re-training it.
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy2(f, path / f.name)
    return path


@torch.no_grad()
def _randomize(model: torch.nn.Module, config: Any, gen: torch.Generator) -> None:
    h = config.hidden_size
    for name, p in model.named_parameters():
        if name.endswith("embed_tokens.weight"):
            std = 1.0
        elif name == "lm_head.weight":
            std = 3.0 / math.sqrt(h)  # logits spread of a few units: no near-ties under greedy
        elif name.endswith("mlp.gate.weight"):
            std = 2.0 / math.sqrt(h)
        elif p.dim() == 1:  # RMSNorm weights
            p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            continue
        else:
            # Linear / fused expert weights: the last dim is fan-in in both layouts.
            std = 1.0 / math.sqrt(p.shape[-1])
            if name.endswith(("o_proj.weight", "down_proj.weight", "experts.down_proj")):
                std *= 0.5  # residual-writing projections: keep the stream from growing
        p.copy_(torch.randn(p.shape, generator=gen) * std)
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_((torch.rand(b.shape, generator=gen) - 0.5) * 0.2)


def _descendants() -> set[int]:
    """Pids of this process's descendants (from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # exited meanwhile
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [os.getpid()]
    while todo:
        for c in children.get(todo.pop(), []):
            found.add(c)
            todo.append(c)
    return found


def init_local_ray(attempts: int = 3, **kwargs: Any) -> None:
    """`ray.init(address="local", **kwargs)`, started again if the new node does not register in
    time. Ray gives a raylet a fixed 30 s to register with the GCS; on a loaded 2-core CI machine
    (the previous module's cluster still exiting) that can run out. The processes of a failed
    start are killed before the next (Ray keeps no handle on them). A start that fails for any
    other reason raises at once."""
    import ray

    for attempt in range(1, attempts + 1):
        before = _descendants()
        try:
            ray.init(address="local", **kwargs)
            return
        except Exception as e:
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            logging.getLogger(__name__).warning("local Ray start %d timed out; starting again", attempt)
            ray.shutdown()
            for pid in _descendants() - before:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(5)
