"""An FP8 block-quantized checkpoint (the official DeepSeek-V3 format) served two ways:
dequantized on load for the torch runner, and with the routed experts kept in FP8 exactly as
stored for the deep_gemm runner (run here through the DeepGEMM stand-in)."""

from __future__ import annotations

import json
import sys

import fake_deep_gemm
import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.layers.fp8_linear import Fp8Linear
from engine.moe.fp8 import quantize_per_block
from tests.helpers import make_random_dsv3_checkpoint

SKIP_QUANT = ("embed_tokens", "lm_head", "norm", "mlp.gate.weight")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8")
    src = make_random_dsv3_checkpoint(root / "bf", seed=5, hidden_size=128, intermediate_size=256,
                                      moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2,
                                      n_group=2, topk_group=1, num_hidden_layers=2)
    out = {}
    for name, t in load_file(src / "model.safetensors").items():
        if t.dim() == 2 and not any(k in name for k in SKIP_QUANT):
            q, s = quantize_per_block(t)
            out[name], out[name + "_scale_inv"] = q, s
        else:
            out[name] = t
    dst = root / "fp8"
    dst.mkdir()
    save_file(out, dst / "model.safetensors")
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                  "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            (dst / f.name).write_bytes(f.read_bytes())
    return dst, out


def _prompt_logprobs(llm, prompts):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=True))
    return [o.prompt_logprobs[1:] for o in outs]


def test_fp8_experts_kept_as_stored_and_close_to_dequantized(fp8_checkpoint, monkeypatch):
    path, tensors = fp8_checkpoint
    prompts = [[5, 9, 200, 31, 77, 4, 18, 3], [100, 101, 102]]
    llm = LLM(model=str(path), kv_cache_tokens=1024, forward_executor="thread")  # the model in this process
    try:
        ref = _prompt_logprobs(llm, prompts)
        assert llm.engine.model.moe_layers[0].experts.w13.dtype == torch.float32  # dequantized
    finally:
        llm.shutdown()

    monkeypatch.setitem(sys.modules, "deep_gemm", fake_deep_gemm.make_module())
    llm = LLM(model=str(path), kv_cache_tokens=1024, moe_runner_backend="deep_gemm", forward_executor="thread")
    try:
        ex = llm.engine.model.model.layers[1].mlp.experts
        assert ex.w13.dtype == torch.float8_e4m3fn
        # byte-for-byte the checkpoint's FP8 weights and scales (gate rows, then up rows)
        gate = tensors["model.layers.1.mlp.experts.2.gate_proj.weight"]
        up = tensors["model.layers.1.mlp.experts.2.up_proj.weight"]
        assert torch.equal(ex.w13[2].view(torch.uint8), torch.cat([gate, up]).view(torch.uint8))
        assert torch.equal(ex.w2_scale[2], tensors["model.layers.1.mlp.experts.2.down_proj.weight_scale_inv"])
        # so are the other projections, run by the dense FP8 GEMM; kv_b_proj (absorbed) is dequantized
        model = llm.engine.model
        fp8 = {n for n, m in model.named_modules() if isinstance(m, Fp8Linear)}
        assert fp8 >= {"model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.o_proj",
                       "model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_experts.gate_proj"}
        assert not any("kv_b_proj" in n for n in fp8)
        assert model.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.float32
        name = "model.layers.1.self_attn.o_proj"
        o_proj = model.get_submodule(name)
        assert o_proj.gemm is not None
        # the dispatch hands DeepGEMM segments padded to its M alignment (no repacking in the runner)
        assert all(d.expert_alignment == 128 for moe in model.moe_layers for d in moe.dispatchers)
        assert torch.equal(o_proj.weight.view(torch.uint8), tensors[name + ".weight"].view(torch.uint8))
        assert torch.equal(o_proj.weight_scale_inv, tensors[name + ".weight_scale_inv"])
        got = _prompt_logprobs(llm, prompts)
    finally:
        llm.shutdown()
    # FP8 activations and bf16 GEMM outputs: close to, not equal to, the dequantized float32 run.
    diff = [abs(x - y) for a, b in zip(ref, got) for x, y in zip(a, b)]
    # FP8 activations into every projection now (measured: max 0.14, mean 0.05 on logprobs down
    # to -17); a wrong scale or block layout would be off by whole units
    assert 0 < max(diff) < 0.25 and sum(diff) / len(diff) < 0.08
