"""tiny-dsv3: deterministic, atomic, cached generation of a real HF DeepSeek-V3 checkpoint."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch

from engine.models import tiny
from engine.models.loader import iter_checkpoint_tensors, load_model_config
from engine.models.tiny import ensure_tiny_dsv3
from engine.tokenizer import load_tokenizer


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> Path:
    return ensure_tiny_dsv3(str(tmp_path_factory.mktemp("cache_a")))


def test_generation_is_deterministic(tiny_path, tmp_path):
    other = ensure_tiny_dsv3(str(tmp_path))
    assert other != tiny_path and other.name == tiny_path.name == "tiny-dsv3-v1"
    for f in ("model.safetensors", "tokenizer.json", "config.json"):
        assert _sha256(other / f) == _sha256(tiny_path / f), f
    # No temp directories are left behind next to the result.
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-dsv3-v1"]


def test_second_call_reuses_the_cache(tiny_path):
    mtime = (tiny_path / "model.safetensors").stat().st_mtime_ns
    start = time.perf_counter()
    again = ensure_tiny_dsv3(str(tiny_path.parent))
    assert time.perf_counter() - start < 0.5
    assert again == tiny_path
    assert (tiny_path / "model.safetensors").stat().st_mtime_ns == mtime


def test_cache_dir_defaults_to_env(tiny_path, monkeypatch):
    monkeypatch.setenv("MOE_CACHE_DIR", str(tiny_path.parent))
    assert ensure_tiny_dsv3() == tiny_path


def test_losing_the_rename_race_uses_the_winners_copy(tmp_path, monkeypatch):
    final = tmp_path / "tiny-dsv3-v1"

    def write_while_another_process_wins(out: Path) -> None:
        (out / "config.json").write_text("{}  # loser")
        final.mkdir()  # the other process renamed its complete copy into place meanwhile
        (final / "config.json").write_text("{}  # winner")

    monkeypatch.setattr(tiny, "_write_tiny_dsv3", write_while_another_process_wins)
    assert ensure_tiny_dsv3(str(tmp_path)) == final
    assert (final / "config.json").read_text() == "{}  # winner"
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-dsv3-v1"]


def test_config_matches_the_spec(tiny_path):
    cfg = load_model_config(tiny_path)
    tok = load_tokenizer(tiny_path)
    assert cfg.vocab_size == len(tok)
    assert (cfg.bos_token_id, cfg.eos_token_id) == (tok.bos_token_id, tok.eos_token_id)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.first_k_dense_replace) == (256, 4, 1)
    assert (cfg.q_lora_rank, cfg.kv_lora_rank) == (128, 64)
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (
        16,
        4,
        4,
        2,
    )
    rope = cfg.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 1024
    assert cfg.rope_interleave and not cfg.tie_word_embeddings
    biases = dict(
        iter_checkpoint_tensors(
            tiny_path,
            dtype=torch.float32,
            num_hidden_layers=cfg.num_hidden_layers,
            want=lambda n: n.endswith("e_score_correction_bias"),
        )
    )
    assert len(biases) == 3 and all(b.abs().min() > 0 for b in biases.values())


def test_hf_loads_it_without_missing_keys_and_generates_varied_tokens(tiny_path):
    from transformers import DeepseekV3ForCausalLM

    model, info = DeepseekV3ForCausalLM.from_pretrained(tiny_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    tok = load_tokenizer(tiny_path)
    ids = torch.tensor([tok.encode("def add(a, b):\n    return")])
    with torch.no_grad():
        logits = model(ids).logits[0]
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    # Logits spread a few units: greedy decoding does not sit on near-ties.
    assert 1.0 < logits.std(-1).mean() < 10.0
    top2 = logits.topk(2, dim=-1).values
    assert (top2[:, 0] - top2[:, 1]).min() > 1e-3
    generated = out[0, ids.shape[1] :].tolist()
    assert len(set(generated)) > 4


def test_tokenizer_round_trips_and_applies_chat_template(tiny_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_path)
    assert tok.is_fast and len(tok) == 2048
    text = "def f(x):\n    return x  # naïve Grüße 世界 🎉\tend"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text
    for special in ("<|begin▁of▁sentence|>", "<|end▁of▁sentence|>", "<|User|>", "<|Assistant|>"):
        assert len(tok.encode(special, add_special_tokens=False)) == 1
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again"},
    ]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert prompt == (
        "<|begin▁of▁sentence|>Be brief.<|User|>Hi<|Assistant|>Hello<|end▁of▁sentence|>"
        "<|User|>Again<|Assistant|>"
    )
    no_gen = tok.apply_chat_template(messages[:2], add_generation_prompt=False, tokenize=False)
    assert no_gen == "<|begin▁of▁sentence|>Be brief.<|User|>Hi"
