"""Memory plan for DeepSeek-V3 on 16 x 80 GB, computed from its official config without weights."""

from __future__ import annotations

import json

import pytest

from engine.cli import main
from engine.models.loader import load_model_config
from engine.plan import memory_plan

# the published DeepSeek-V3 config.json (values only; no weights needed for a plan)
DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "num_nextn_predict_layers": 1, "bos_token_id": 0, "eos_token_id": 1,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}


@pytest.fixture
def dsv3_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DSV3))
    return tmp_path


def test_dsv3_ep16_on_80gb(dsv3_dir):
    cfg = load_model_config(dsv3_dir)
    one = memory_plan(cfg, 1, 10**15)
    # the whole model (without the MTP layer): ~671B parameters
    assert 665e9 < one.routed_expert_params + one.replicated_params < 675e9
    p = memory_plan(cfg, 16, 80 * 10**9)
    assert p.routed_expert_params * 16 == one.routed_expert_params  # 16 experts of 256 per rank
    assert p.replicated_params == one.replicated_params
    # FP8: ~41B routed + ~17B replicated params, about 1 byte each: 55-62 GB per rank
    assert 55e9 < p.weight_bytes < 62e9
    # MLA cache: 61 layers x (512 + 64) x 2 bytes
    assert p.kv_bytes_per_token == 61 * 576 * 2
    assert p.kv_tokens == (80 * 10**9 - p.reserved_bytes - p.weight_bytes) // p.kv_bytes_per_token
    assert 100_000 < p.kv_tokens < 250_000
    with pytest.raises(ValueError, match="gpu_memory"):
        memory_plan(cfg, 8, 80 * 10**9)  # 32 experts per rank do not fit next to the rest


def test_plan_cli(dsv3_dir, capsys):
    assert main(["plan", "--model", str(dsv3_dir), "--ep-size", "16", "--gpu-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "KV capacity / rank" in out and "tokens" in out
    assert main(["plan", "--model", str(dsv3_dir), "--ep-size", "2", "--gpu-memory-gib", "80"]) == 2
