"""Shared by the cluster tests (a plain module: `conftest` is ambiguous across test folders)."""

from __future__ import annotations

import os

_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
_PYTHONPATH = os.pathsep.join([_ROOT, _HERE])
# Ray's node IP here is the host's outward address; rendezvous stays on loopback in tests.
LOOPBACK = "127.0.0.1"


def ray_runtime_env() -> dict:
    return {"env_vars": {"PYTHONPATH": _PYTHONPATH}}
