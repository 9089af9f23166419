from __future__ import annotations

import os
import sys

import pytest

# Ray workers import by module name; make the repo root and this folder (stub_engine) importable
# in every worker whatever directory pytest was started from.
_HERE = os.path.dirname(os.path.abspath(__file__))
_ROOT = os.path.dirname(os.path.dirname(_HERE))
_PYTHONPATH = os.pathsep.join([_ROOT, _HERE])
# Ray's node IP here is the host's outward address; rendezvous stays on loopback in tests.
LOOPBACK = "127.0.0.1"


def ray_runtime_env() -> dict:
    return {"env_vars": {"PYTHONPATH": _PYTHONPATH}}


@pytest.fixture(scope="module")
def local_ray():
    """A private loopback Ray instance for one test module (4 logical CPUs on a 2-core box: the
    ranks mostly wait on each other)."""
    import ray

    sys.path[:0] = [p for p in (_ROOT, _HERE) if p not in sys.path]
    ray.init(
        address="local",
        num_cpus=4,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        runtime_env=ray_runtime_env(),
        logging_level="WARNING",
    )
    yield ray
    ray.shutdown()
