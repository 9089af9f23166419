"""Checkpoint discovery and streaming: from a model name to (name, tensor) pairs.

The loader knows the file formats (HF config.json, single or sharded safetensors, DeepSeek's FP8
block quantization) and nothing about where a tensor goes: the model's parameters carry their own
weight loaders (sharding, expert ownership), and hand `want` down so a rank never reads the
experts it does not own.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from transformers import DeepseekV3Config

logger = logging.getLogger(__name__)

_BUILTIN_MODELS = ("tiny-dsv3",)
_SCALE_SUFFIX = "_scale_inv"
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")
# Kept in float32 whatever the model dtype: the routing bias is added to sigmoid scores, and in
# bfloat16 it would lose the small differences that decide ties between experts.
_FP32_SUFFIXES = ("e_score_correction_bias",)
_DEFAULT_FP8_BLOCK = (128, 128)

PathLike = str | os.PathLike[str]


def resolve_model_path(model: str) -> Path:
    """Map `model` (a built-in name or a local checkpoint directory) to a directory."""
    if model == "tiny-dsv3":
        from engine.models.tiny import ensure_tiny_dsv3

        return ensure_tiny_dsv3()
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    raise ValueError(
        f"model: {model!r} is neither a built-in model name ({', '.join(_BUILTIN_MODELS)}) "
        "nor a local checkpoint directory"
    )


def _read_config_json(path: Path) -> dict[str, Any]:
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"model: {path} is not a DeepSeek-V3 checkpoint: no config.json there")
    try:
        return json.loads(cfg_file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(
            f"model: {path} is not a DeepSeek-V3 checkpoint: bad config.json ({e})"
        ) from e


def load_model_config(path: PathLike) -> DeepseekV3Config:
    """Read and validate `config.json`; official and HF-style rope keys are both accepted."""
    path = Path(path)
    raw = _read_config_json(path)
    model_type = raw.get("model_type")
    archs = raw.get("architectures") or []
    if model_type != "deepseek_v3" and "DeepseekV3ForCausalLM" not in archs:
        raise ValueError(
            f"model: {path} is not a DeepSeek-V3 checkpoint: model_type={model_type!r}, "
            f"architectures={archs!r}"
        )
    # DeepseekV3Config turns the official `rope_scaling` + `rope_theta` into `rope_parameters`.
    raw = {k: v for k, v in raw.items() if k != "model_type"}
    return DeepseekV3Config.from_dict(raw)


def checkpoint_is_fp8(path: PathLike) -> bool:
    """True when the checkpoint stores block-quantized FP8 weights (DeepSeek-V3's release format)."""
    path = Path(path)
    qcfg = _read_config_json(path).get("quantization_config") or {}
    if qcfg.get("quant_method") == "fp8" or str(qcfg.get("fmt", "")).startswith("e4m3"):
        return True
    return any(name.endswith("weight" + _SCALE_SUFFIX) for name in _tensor_locations(path))


def fp8_weight_names(path: PathLike) -> set[str]:
    """Names of the checkpoint's weights stored with a block scale (`X.weight` with
    `X.weight_scale_inv`); reads index or headers only."""
    names = _tensor_locations(Path(path))
    return {n.removesuffix(_SCALE_SUFFIX) for n in names if n.endswith("weight" + _SCALE_SUFFIX)}


def _tensor_locations(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (reads headers only)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map: dict[str, str] = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        return {name: path / shard for name, shard in weight_map.items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise ValueError(f"model: {path} has no model.safetensors or model.safetensors.index.json")


def _fp8_block_size(path: Path) -> tuple[int, int]:
    qcfg = _read_config_json(path).get("quantization_config") or {}
    block = qcfg.get("weight_block_size") or _DEFAULT_FP8_BLOCK
    return int(block[0]), int(block[1])


def dequantize_fp8_blockwise(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = _DEFAULT_FP8_BLOCK
) -> torch.Tensor:
    """float32 weight = fp8 weight * scale of its (block[0] x block[1]) tile.

    Edge tiles may be partial (dimensions need not be multiples of the block). Works one row-tile
    at a time so the only full-size temporary is the float32 result itself.
    """
    out_f, in_f = weight.shape
    br, bc = block
    if scale_inv.shape != ((out_f + br - 1) // br, (in_f + bc - 1) // bc):
        raise ValueError(
            f"fp8 scale shape {tuple(scale_inv.shape)} does not match weight {tuple(weight.shape)} "
            f"with {br}x{bc} blocks"
        )
    result = weight.to(torch.float32)
    scale = scale_inv.to(torch.float32)
    for r in range(scale.shape[0]):
        row_scale = scale[r].repeat_interleave(bc)[:in_f]
        result[r * br : (r + 1) * br].mul_(row_scale)
    return result


@dataclass(frozen=True)
class _PlanItem:
    name: str
    file: Path
    scale_name: str | None  # set for FP8 weights: their block scales
    scale_file: Path | None


def iter_checkpoint_tensors(
    path: PathLike,
    *,
    dtype: torch.dtype,
    num_hidden_layers: int,
    want: Callable[[str], bool] | None = None,
    keep_fp8: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Stream the checkpoint's tensors one at a time as (name, tensor), cast to `dtype`.

    - `want(name)` False: the tensor is never read (a rank skips experts it does not own). An FP8
      weight's scale follows its weight's decision.
    - Layers `model.layers.{i}` with i >= num_hidden_layers (DeepSeek-V3's MTP modules) are
      skipped, reported in one log line.
    - FP8 (`X.weight` float8_e4m3fn with `X.weight_scale_inv`): dequantized to `dtype` and the
      scale is not yielded; with `keep_fp8` the weight is yielded as stored and the scale under its
      own name, in float32.
    - `e_score_correction_bias` stays float32.

    Each safetensors file is opened once, when first needed, and closed after its last use, so
    memory beyond the model stays near one tensor.
    """
    path = Path(path)
    locations = _tensor_locations(path)
    block = _fp8_block_size(path)

    plan: list[_PlanItem] = []
    skipped_mtp = 0
    # Shards in file-name order, names sorted within: deterministic and each file read in one go.
    for name in sorted(locations, key=lambda n: (str(locations[n]), n)):
        m = _LAYER_RE.match(name)
        if m is not None and int(m.group(1)) >= num_hidden_layers:
            skipped_mtp += 1
            continue
        if name.endswith(_SCALE_SUFFIX) and name[: -len(_SCALE_SUFFIX)] in locations:
            continue  # handled together with its weight
        if want is not None and not want(name):
            continue
        scale_name = name + _SCALE_SUFFIX
        if scale_name in locations:
            plan.append(_PlanItem(name, locations[name], scale_name, locations[scale_name]))
        else:
            plan.append(_PlanItem(name, locations[name], None, None))
    if skipped_mtp:
        logger.info(
            "skipped %d tensors of layers >= %d (multi-token-prediction modules) in %s",
            skipped_mtp,
            num_hidden_layers,
            path,
        )

    last_use: dict[Path, int] = {}
    for i, item in enumerate(plan):
        last_use[item.file] = i
        if item.scale_file is not None:
            last_use[item.scale_file] = i

    with ExitStack() as stack:
        handles: dict[Path, tuple[Any, ExitStack]] = {}

        def handle(file: Path) -> Any:
            if file not in handles:
                file_stack = ExitStack()
                stack.callback(file_stack.close)
                handles[file] = (
                    file_stack.enter_context(safe_open(str(file), framework="pt")),
                    file_stack,
                )
            return handles[file][0]

        for i, item in enumerate(plan):
            tensor = handle(item.file).get_tensor(item.name)
            if item.scale_name is None:
                if tensor.dtype == torch.float8_e4m3fn:
                    raise ValueError(
                        f"model: {path}: fp8 tensor {item.name} has no {_SCALE_SUFFIX}"
                    )
                keep32 = item.name.endswith(_FP32_SUFFIXES)
                yield item.name, tensor.to(torch.float32 if keep32 else dtype)
            else:
                assert item.scale_file is not None
                scale = handle(item.scale_file).get_tensor(item.scale_name)
                if keep_fp8:
                    yield item.name, tensor
                    yield item.scale_name, scale.to(torch.float32)
                else:
                    yield item.name, dequantize_fp8_blockwise(tensor, scale, block).to(dtype)
            del tensor
            for file in {item.file, item.scale_file}:
                if file is not None and last_use[file] == i:
                    handles[file][1].close()
