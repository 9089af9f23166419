"""Environment variables, all with the `MOE_` prefix, read in one place."""

from __future__ import annotations

import os


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def disable_overlap_schedule() -> bool:
    """`MOE_DISABLE_OVERLAP_SCHEDULE=1` forces the normal (non-overlapped) event loop."""
    return _flag("MOE_DISABLE_OVERLAP_SCHEDULE")


def sbo_comm_num_sms() -> int | None:
    """`MOE_SBO_COMM_NUM_SMS`: SMs given to DeepEP communication under SBO (default by arch)."""
    v = os.environ.get("MOE_SBO_COMM_NUM_SMS")
    return int(v) if v else None


def cache_dir() -> str:
    """`MOE_CACHE_DIR`: where built-in models are generated (default ~/.cache/moe-serve)."""
    return os.environ.get("MOE_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "moe-serve"))
