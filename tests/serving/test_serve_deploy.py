"""`ray start --head` + `serve deploy configs/tiny.yaml` serves a request (the README's cluster
path), then the cluster is stopped. Subprocess-based and slow (cluster start + model load)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill_our_cluster(temp_dir: str) -> None:
    """Stop only the processes of the cluster we started (`ray stop` would stop every Ray on the
    machine, including other users' test clusters): they all carry our temp dir in argv."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            argv = (entry / "cmdline").read_bytes()
            if temp_dir.encode() in argv:
                os.kill(int(entry.name), signal.SIGTERM)
        except (OSError, ProcessLookupError):
            pass


@pytest.mark.slow
def test_ray_start_then_serve_deploy_tiny_serves_a_request() -> None:
    pytest.importorskip("cluster.serve_rank")
    temp_dir = tempfile.mkdtemp(prefix="moe_serve_deploy_", dir="/tmp")
    gcs, dash = _free_port(), _free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ray_bin = str(Path(sys.executable).parent / "ray")
    serve_bin = str(Path(sys.executable).parent / "serve")
    subprocess.run(
        [ray_bin, "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1", "--num-cpus=2",
         f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, cwd=REPO, check=True, timeout=180,
    )  # fmt: skip
    try:
        subprocess.run(
            [serve_bin, "deploy", str(REPO / "configs" / "tiny.yaml"), "-a", f"http://127.0.0.1:{dash}"],
            env=env, cwd=REPO, check=True, timeout=180,
        )  # fmt: skip
        body = {"model": "tiny-dsv3", "prompt": "def add(a, b):", "max_tokens": 4}
        deadline, last = time.time() + 400, None
        while time.time() < deadline:
            try:
                last = httpx.post("http://127.0.0.1:8000/v1/completions", json=body, timeout=60)
                if last.status_code == 200:
                    break
            except httpx.HTTPError as e:
                last = e
            time.sleep(3)
        assert isinstance(last, httpx.Response) and last.status_code == 200, last
        assert last.json()["usage"]["completion_tokens"] >= 1
    finally:
        _kill_our_cluster(temp_dir)
