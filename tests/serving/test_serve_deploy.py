"""`ray start --head` + `serve deploy configs/tiny.yaml` serves a request (the README's cluster
path), then the cluster is stopped. Subprocess-based and slow (cluster start + model load).

Ray 2.60 token authentication: `ray start --head` turns it on when a token exists
(`~/.ray/auth_token`, which any earlier local `ray.init()` / `serve run` creates) or when
`RAY_AUTH_MODE=token`, and the dashboard's REST API (what `serve deploy` talks to) then answers
401 "Missing authentication token" unless the client sends the token. The `serve` CLI only sends
it when `RAY_AUTH_MODE=token` is set in *its* environment; it never turns the mode on by itself.
So the test runs the cluster and the CLI with `RAY_AUTH_MODE=token` and a private token in
`RAY_AUTH_TOKEN` (never the user's `~/.ray/auth_token`), and checks both halves: without the
token the API refuses, with it the deploy serves a completion.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _our_pids(temp_dir: str) -> list[int]:
    """Processes of the cluster we started: they all carry our temp dir in argv."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if temp_dir.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:
            pass
    return pids


def _kill_our_cluster(temp_dir: str, grace_s: float = 10.0) -> None:
    """Stop only the processes of the cluster we started (`ray stop` would stop every Ray on the
    machine, including other users' test clusters). SIGTERM first; whatever outlives the grace
    period (gcs_server and the autoscaler monitor wait for peers that are already gone) gets
    SIGKILL."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in _our_pids(temp_dir):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.time() + grace_s
        while time.time() < deadline and _our_pids(temp_dir):
            time.sleep(0.5)


def _private_cluster_env(token: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env.update(PYTHONPATH=str(REPO), RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)
    return env


@pytest.mark.slow
def test_ray_start_then_serve_deploy_tiny_serves_a_request() -> None:
    temp_dir = tempfile.mkdtemp(prefix="moe_serve_deploy_", dir="/tmp")
    gcs, dash, http_port = _free_port(), _free_port(), _free_port()
    env = _private_cluster_env(secrets.token_hex(32))
    # configs/tiny.yaml as is, except its HTTP port (8000 may be taken on a shared machine).
    doc = yaml.safe_load((REPO / "configs" / "tiny.yaml").read_text())
    doc["http_options"]["port"] = http_port
    config = Path(temp_dir) / "tiny.yaml"
    config.write_text(yaml.safe_dump(doc))
    ray_bin = str(Path(sys.executable).parent / "ray")
    serve_bin = str(Path(sys.executable).parent / "serve")
    dashboard = f"http://127.0.0.1:{dash}"
    subprocess.run(
        [ray_bin, "start", "--head", f"--port={gcs}", f"--dashboard-port={dash}",
         "--dashboard-host=127.0.0.1", "--node-ip-address=127.0.0.1", "--num-cpus=2",
         f"--temp-dir={temp_dir}", "--disable-usage-stats"],
        env=env, cwd=REPO, check=True, timeout=180,
    )  # fmt: skip
    try:
        # Token auth is on: the REST API refuses a client without the token.
        r = httpx.get(dashboard + "/api/serve/applications/", timeout=30)
        assert r.status_code == 401, (r.status_code, r.text)
        subprocess.run(
            [serve_bin, "deploy", str(config), "-a", dashboard],
            env=env, cwd=REPO, check=True, timeout=180,
        )  # fmt: skip
        body = {"model": "tiny-dsv3", "prompt": "def add(a, b):", "max_tokens": 4}
        deadline, last = time.time() + 400, None
        while time.time() < deadline:
            try:
                last = httpx.post(
                    f"http://127.0.0.1:{http_port}/v1/completions", json=body, timeout=60
                )
                if last.status_code == 200:
                    break
            except httpx.HTTPError as e:
                last = e
            time.sleep(3)
        assert isinstance(last, httpx.Response) and last.status_code == 200, last
        assert last.json()["usage"]["completion_tokens"] >= 1
    finally:
        _kill_our_cluster(temp_dir)
    shutil.rmtree(temp_dir, ignore_errors=True)  # kept on failure: the cluster's logs
