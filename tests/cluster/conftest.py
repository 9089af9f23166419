from __future__ import annotations

import sys

import pytest

# Ray workers import by module name; make the repo root and this folder (stub_engine) importable
# in every worker whatever directory pytest was started from.
from cluster_testing import _HERE, _ROOT, LOOPBACK, ray_runtime_env  # noqa: F401

from tests.helpers import init_local_ray


@pytest.fixture(scope="module")
def local_ray():
    """A private loopback Ray instance for one test module (4 logical CPUs on a 2-core box: the
    ranks mostly wait on each other)."""
    import ray

    sys.path[:0] = [p for p in (_ROOT, _HERE) if p not in sys.path]
    init_local_ray(
        num_cpus=4,
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        runtime_env=ray_runtime_env(),
        logging_level="WARNING",
    )
    yield ray
    ray.shutdown()
