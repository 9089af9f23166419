"""The rank's model is built on the meta device and given storage once, in its final dtype, on its
device; the checkpoint then fills every weight."""

from __future__ import annotations

import pytest
import torch

from engine.layers.rotary import RotaryEmbedding
from engine.model_runner import _materialize
from engine.models.loader import iter_checkpoint_tensors, load_model_config, resolve_model_path
from engine.parallel import SINGLE_RANK


def test_weights_in_their_final_dtype_and_rope_tables_kept():
    path = resolve_model_path("tiny-dsv3")
    hf = load_model_config(path)
    model = _materialize(hf, 512, SINGLE_RANK, False, torch.bfloat16, torch.device("cpu"))
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert all(b.device.type == "cpu" and b.dtype == torch.float32 for b in model.buffers())
    rope = next(m for m in model.modules() if isinstance(m, RotaryEmbedding))
    fresh = RotaryEmbedding(hf, 513, interleave=True)
    assert torch.equal(rope.cos, fresh.cos) and torch.equal(rope.sin, fresh.sin)  # not left uninitialized
    assert not any(bool(moe.experts.loaded.any()) for moe in model.moe_layers)


def test_every_weight_comes_from_the_checkpoint():
    path = resolve_model_path("tiny-dsv3")
    hf = load_model_config(path)
    model = _materialize(hf, 512, SINGLE_RANK, False, torch.float32, torch.device("cpu"))
    tensors = list(iter_checkpoint_tensors(path, dtype=torch.float32, num_hidden_layers=hf.num_hidden_layers))
    dropped = [(n, t) for n, t in tensors if not n.endswith("q_a_layernorm.weight")]
    with pytest.raises(ValueError, match="missing"):
        model.load_weights(iter(dropped))
    model.load_weights(iter(tensors))
    ref = dict(tensors)
    assert torch.equal(model.model.norm.weight, ref["model.norm.weight"])
