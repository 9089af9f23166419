"""The ingress's own tokenizer and the model limits it validates against.

The ingress tokenizes (and applies the chat template) itself so ranks receive token ids only: the
router then sees prompt lengths and prefixes, and bad prompts are refused before they cost a rank
round trip.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.config import EngineConfig


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_model_len: int


def load_tokenizer(config: EngineConfig) -> Any:
    """The same tokenizer the ranks load (`engine.tokenizer.load_tokenizer`)."""
    from engine.models.loader import resolve_model_path
    from engine.tokenizer import load_tokenizer as _load

    return _load(config.tokenizer or resolve_model_path(config.model))


def model_limits(config: EngineConfig) -> ModelLimits:
    """From the checkpoint's config.json; `max_model_len` in the engine config overrides."""
    from engine.models.loader import resolve_model_path

    hf = json.loads((resolve_model_path(config.model) / "config.json").read_text(encoding="utf-8"))
    max_len = config.max_model_len or int(hf.get("max_position_embeddings", 4096))
    return ModelLimits(vocab_size=int(hf["vocab_size"]), max_model_len=max_len)
