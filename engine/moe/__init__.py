"""MoE communication (dispatchers) and expert compute (runners), chosen by name, imported lazily."""

from __future__ import annotations

import importlib.util


def deepep_available() -> bool:
    """DeepEP can run here: the library imports and CUDA is present."""
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("deep_ep") is not None


def deep_gemm_available() -> bool:
    import torch

    return torch.cuda.is_available() and importlib.util.find_spec("deep_gemm") is not None
