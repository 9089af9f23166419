"""Checkpoint loader: sharding, FP8 block dequantization, MTP skipping, filtering, validation."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engine.models import loader
from engine.models.loader import (
    checkpoint_is_fp8,
    iter_checkpoint_tensors,
    load_model_config,
    resolve_model_path,
)

FP8_MAX = 448.0  # largest finite float8_e4m3fn

# The official DeepSeek-V3 config.json (older `rope_scaling` + `rope_theta` keys, FP8, one MTP layer).
OFFICIAL_DSV3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "auto_map": {
        "AutoConfig": "configuration_deepseek.DeepseekV3Config",
        "AutoModel": "modeling_deepseek.DeepseekV3Model",
        "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM",
    },
    "aux_loss_alpha": 0.001,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "pretraining_tp": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-06,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "seq_aux": True,
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}


def quantize_fp8_blockwise(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantizer: one scale per block x block tile (edge tiles partial)."""
    out_f, in_f = w.shape
    rows, cols = -(-out_f // block), -(-in_f // block)
    scale = torch.empty(rows, cols)
    q = torch.empty(out_f, in_f, dtype=torch.float8_e4m3fn)
    for r in range(rows):
        for c in range(cols):
            tile = w[r * block : (r + 1) * block, c * block : (c + 1) * block]
            s = tile.abs().max().clamp_min(1e-12) / FP8_MAX
            scale[r, c] = s
            q[r * block : (r + 1) * block, c * block : (c + 1) * block] = (tile / s).to(
                torch.float8_e4m3fn
            )
    return q, scale


def _synthetic_tensors(num_layers: int, mtp_layers: int = 0) -> tuple[dict, dict]:
    """(stored tensors, float32 originals of the FP8 weights) of a small DSV3-shaped checkpoint."""
    g = torch.Generator().manual_seed(0)
    stored: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": torch.randn(50, 16, generator=g)
    }
    originals: dict[str, torch.Tensor] = {}
    for i in range(num_layers + mtp_layers):
        p = f"model.layers.{i}"
        stored[f"{p}.input_layernorm.weight"] = torch.ones(16)
        stored[f"{p}.mlp.gate.e_score_correction_bias"] = torch.randn(4, generator=g) * 0.01
        stored[f"{p}.mlp.gate.weight"] = torch.randn(4, 16, generator=g)
        for j in range(4):
            stored[f"{p}.mlp.experts.{j}.up_proj.weight"] = torch.randn(8, 16, generator=g)
        # Non-multiple-of-128 shape: partial tiles on both edges.
        w = torch.randn(200, 300, generator=g) * 0.05
        q, s = quantize_fp8_blockwise(w)
        stored[f"{p}.self_attn.o_proj.weight"] = q
        stored[f"{p}.self_attn.o_proj.weight_scale_inv"] = s
        originals[f"{p}.self_attn.o_proj.weight"] = w
    stored["lm_head.weight"] = torch.randn(50, 16, generator=g)
    return stored, originals


def _write_single(path: Path, tensors: dict, config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    cfg = config or {"model_type": "deepseek_v3", "num_hidden_layers": 2}
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _write_sharded(path: Path, tensors: dict, shard_of) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    shards: dict[str, dict] = {}
    for name, t in tensors.items():
        shards.setdefault(shard_of(name), {})[name] = t
    for file, part in shards.items():
        save_file(part, str(path / file))
    index = {"metadata": {}, "weight_map": {n: shard_of(n) for n in tensors}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps({"model_type": "deepseek_v3"}))
    return path


def _shard_of(name: str) -> str:
    # Scales land in the shard after their weight's, so a lookup across files is needed.
    names = [f"model-0000{k}-of-00003.safetensors" for k in (1, 2, 3)]
    if name.startswith("model.layers.0."):
        k = 1 if name.endswith("_scale_inv") else 0
    elif name.startswith("model.layers.1."):
        k = 2 if name.endswith("_scale_inv") else 1
    else:
        k = 2
    return names[k]


def _load(path: Path, **kwargs) -> dict[str, torch.Tensor]:
    kwargs.setdefault("dtype", torch.float32)
    kwargs.setdefault("num_hidden_layers", 2)
    out: dict[str, torch.Tensor] = {}
    for name, t in iter_checkpoint_tensors(path, **kwargs):
        assert name not in out
        out[name] = t
    return out


@pytest.mark.parametrize("keep_fp8", [False, True])
def test_sharded_checkpoint_yields_same_tensors_as_single_file(tmp_path, keep_fp8):
    tensors, _ = _synthetic_tensors(num_layers=2)
    single = _load(_write_single(tmp_path / "single", tensors), keep_fp8=keep_fp8)
    sharded = _load(_write_sharded(tmp_path / "sharded", tensors, _shard_of), keep_fp8=keep_fp8)
    assert len({_shard_of(n) for n in tensors}) == 3
    assert single.keys() == sharded.keys()
    for name in single:
        assert single[name].dtype == sharded[name].dtype
        assert torch.equal(single[name].float(), sharded[name].float()), name
    has_scale = any(n.endswith("_scale_inv") for n in single)
    assert has_scale == keep_fp8


def test_fp8_block_weights_dequantize_within_fp8_error(tmp_path):
    tensors, originals = _synthetic_tensors(num_layers=2)
    path = _write_single(tmp_path / "fp8", tensors)
    assert checkpoint_is_fp8(path)
    got = _load(path)
    assert not any(n.endswith("_scale_inv") for n in got)
    for name, w in originals.items():
        deq = got[name]
        assert deq.dtype == torch.float32 and deq.shape == w.shape
        # e4m3 keeps 3 mantissa bits: relative rounding error <= 2^-4, plus subnormal spacing.
        scale = (
            tensors[name + "_scale_inv"]
            .repeat_interleave(128, 0)[:200]
            .repeat_interleave(128, 1)[:, :300]
        )
        bound = w.abs() / 16 + scale * 2.0**-9 + 1e-7
        assert ((deq - w).abs() <= bound).all(), name
        assert (deq - w).abs().max() > 0  # it really went through FP8
    bf16 = _load(path, dtype=torch.bfloat16)
    name = next(iter(originals))
    assert bf16[name].dtype == torch.bfloat16
    assert torch.allclose(bf16[name].float(), got[name], rtol=1e-2, atol=1e-4)
    # The routing bias stays float32 whatever the model dtype.
    assert bf16["model.layers.0.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert bf16["lm_head.weight"].dtype == torch.bfloat16


def test_keep_fp8_yields_raw_weight_and_scale(tmp_path):
    tensors, _ = _synthetic_tensors(num_layers=1)
    got = _load(_write_single(tmp_path / "c", tensors), num_hidden_layers=1, keep_fp8=True)
    w = "model.layers.0.self_attn.o_proj.weight"
    assert got[w].dtype == torch.float8_e4m3fn
    assert torch.equal(got[w].view(torch.uint8), tensors[w].view(torch.uint8))
    assert torch.equal(got[w + "_scale_inv"], tensors[w + "_scale_inv"])


def test_non_fp8_checkpoint_is_not_fp8(tmp_path):
    path = _write_single(tmp_path / "c", {"lm_head.weight": torch.zeros(2, 2)})
    assert not checkpoint_is_fp8(path)


def test_mtp_layers_are_skipped_with_one_log_line(tmp_path, caplog):
    tensors, _ = _synthetic_tensors(num_layers=2, mtp_layers=1)
    path = _write_single(tmp_path / "c", tensors)
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        got = _load(path, num_hidden_layers=2)
    assert not any(n.startswith("model.layers.2.") for n in got)
    assert any(n.startswith("model.layers.1.") for n in got)
    n_mtp = sum(n.startswith("model.layers.2.") for n in tensors)
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 1 and f"skipped {n_mtp} tensors" in lines[0]


def test_want_filter_skips_reading_unwanted_tensors(tmp_path, monkeypatch):
    tensors, _ = _synthetic_tensors(num_layers=2)
    path = _write_sharded(tmp_path / "c", tensors, _shard_of)
    read: list[str] = []
    opened: list[str] = []
    real_safe_open = loader.safe_open

    class RecordingHandle:
        def __init__(self, file, framework):
            opened.append(file)
            self._ctx = real_safe_open(file, framework=framework)

        def __enter__(self):
            self._f = self._ctx.__enter__()
            return self

        def __exit__(self, *exc):
            return self._ctx.__exit__(*exc)

        def keys(self):
            return self._f.keys()

        def get_tensor(self, name):
            read.append(name)
            return self._f.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", RecordingHandle)

    # A rank owning experts {0, 1} only.
    def want(name: str) -> bool:
        return ".mlp.experts." not in name or ".mlp.experts.0." in name or ".mlp.experts.1." in name

    got = _load(path, want=want)
    expected = {n for n in tensors if want(n) and not n.endswith("_scale_inv")}
    assert set(got) == expected
    assert not any(".experts.2." in n or ".experts.3." in n for n in read)
    assert set(read) == expected | {n for n in tensors if n.endswith("_scale_inv")}
    assert len(opened) == len(set(opened)) == 3  # each shard opened once


def test_resolve_model_path(tmp_path, monkeypatch):
    monkeypatch.setattr("engine.models.tiny.ensure_tiny_dsv3", lambda: tmp_path / "tiny")
    assert resolve_model_path("tiny-dsv3") == tmp_path / "tiny"
    assert resolve_model_path(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match=r"^model: .*tiny-dsv3.*local"):
        resolve_model_path(str(tmp_path / "missing"))


def test_official_deepseek_v3_config_loads(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(OFFICIAL_DSV3_CONFIG))
    cfg = load_model_config(tmp_path)
    assert cfg.num_hidden_layers == 61 and cfg.n_routed_experts == 256
    assert cfg.q_lora_rank == 1536 and cfg.kv_lora_rank == 512
    rope = cfg.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 40 and rope["rope_theta"] == 10000
    assert rope["original_max_position_embeddings"] == 4096
    assert checkpoint_is_fp8(tmp_path)


def test_non_deepseek_config_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llama", "architectures": ["LlamaForCausalLM"]})
    )
    with pytest.raises(ValueError, match=r"^model: .*not a DeepSeek-V3 checkpoint"):
        load_model_config(tmp_path)


def test_architectures_alone_identify_deepseek_v3(tmp_path):
    cfg = dict(OFFICIAL_DSV3_CONFIG)
    del cfg["model_type"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert load_model_config(tmp_path).num_hidden_layers == 61


def test_missing_path_is_rejected(tmp_path):
    with pytest.raises(ValueError, match=r"^model:"):
        load_model_config(tmp_path / "nope")
    with pytest.raises(ValueError, match=r"^model:"):
        resolve_model_path(str(tmp_path / "nope"))


def test_random_checkpoint_helper_honours_overrides_and_streams_hf_names(tmp_path):
    from tests.helpers import make_random_dsv3_checkpoint

    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    }
    path = make_random_dsv3_checkpoint(
        tmp_path / "ckpt",
        q_lora_rank=None,
        rope_parameters=yarn,
        n_group=1,
        topk_group=1,
        num_hidden_layers=2,
        first_k_dense_replace=0,
    )
    cfg = load_model_config(path)
    assert cfg.q_lora_rank is None and cfg.rope_parameters["rope_type"] == "yarn"
    assert (cfg.n_group, cfg.num_hidden_layers, cfg.first_k_dense_replace) == (1, 2, 0)
    got = _load(path, num_hidden_layers=cfg.num_hidden_layers)
    assert "model.layers.0.self_attn.q_proj.weight" in got
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in got
    assert got["model.embed_tokens.weight"].shape[0] == cfg.vocab_size
    bias = got["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0
    assert (path / "tokenizer.json").is_file()
