"""The OpenAI HTTP API end to end: a real local Ray + Serve running the app of configs/tiny.yaml
(one shared app for the module), driven by the official `openai` client and raw httpx."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import ray
import yaml
from ray import serve

from serving.config import ServingConfig

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
MODEL = "tiny-dsv3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _real_stack_available() -> bool:
    try:
        import cluster.serve_rank  # noqa: F401

        import engine.async_engine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def server() -> Any:
    http_port, metrics_port = _free_port(), _free_port()
    # address="local": never attach to a cluster someone else started on this machine.
    ray.init(
        address="local",
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        _metrics_export_port=metrics_port,
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
    )
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    args = yaml.safe_load(TINY.read_text())["applications"][0]["args"]
    config = ServingConfig.from_args(args)
    real = _real_stack_available()
    if real:
        from serving.app import build_app

        app = build_app(args)
    else:  # until the engine and cluster layers land: same ingress, stand-in ranks
        import standin

        from serving.app import ingress_app, router_config

        ray.cloudpickle.register_pickle_by_value(standin)
        ranks = standin.StandInRank.options(
            ray_actor_options={"num_cpus": 0.5}, request_router_config=router_config(config)
        )
        app = ingress_app(config, ranks.bind(config.engine))
    serve.run(app, name="moe", route_prefix="/", blocking=False)
    base = f"http://127.0.0.1:{http_port}"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(base + "/v1/models", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(1)
    else:
        pytest.fail("the app did not come up")
    from serving.tokenizer import load_tokenizer

    yield SimpleNamespace(
        base=base,
        client=openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120),
        metrics_port=metrics_port,
        tokenizer=load_tokenizer(config.engine),
        config=config,
        real=real,
    )
    serve.shutdown()
    ray.shutdown()


def test_models_and_health(server: Any) -> None:
    assert httpx.get(server.base + "/health").status_code == 200
    models = server.client.models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion_usage_and_length(server: Any) -> None:
    prompt = "def fibonacci(n):"
    r = server.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True}
    )
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    n_prompt = len(server.tokenizer.encode(prompt))
    assert r.usage.prompt_tokens == n_prompt
    assert r.usage.completion_tokens == 8
    assert r.usage.total_tokens == n_prompt + 8
    assert r.usage.prompt_tokens_details.cached_tokens >= 0


def test_streaming_equals_non_streaming_and_reports_usage(server: Any) -> None:
    kw = dict(model=MODEL, prompt="import os\nimport sys\n", max_tokens=12, temperature=0.0, seed=1)
    full = server.client.completions.create(**kw)
    chunks = list(
        server.client.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[
        0
    ].finish_reason
    assert (
        chunks[-1].choices == []
        and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    )
    assert len({c.id for c in chunks}) == 1


def test_raw_sse_ends_with_done(server: Any) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)


def test_chat_non_streaming_and_streaming(server: Any) -> None:
    msgs = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "Sort a list."},
    ]
    r = server.client.chat.completions.create(
        model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0.0, logprobs=True
    )
    assert r.id.startswith("chatcmpl-") and r.choices[0].message.role == "assistant"
    rendered = server.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    )
    assert r.usage.prompt_tokens == len(server.tokenizer.encode(rendered, add_special_tokens=False))
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(t.logprob <= 0.0 for t in r.choices[0].logprobs.content)
    chunks = list(
        server.client.chat.completions.create(
            model=MODEL, messages=msgs, max_tokens=10, temperature=0.0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == r.choices[0].message.content


def test_stop_string_truncates_and_reports_stop(server: Any) -> None:
    kw = dict(
        model=MODEL, prompt="for i in range(10):", temperature=0.0, extra_body={"ignore_eos": True}
    )
    text = server.client.completions.create(**kw, max_tokens=24).choices[0].text
    stop = next((text[i : i + 2] for i in range(3, len(text) - 2) if text[i : i + 2].strip()), None)
    if stop is None:
        pytest.skip(f"greedy output {text!r} has no usable stop string")
    r = server.client.completions.create(**kw, max_tokens=24, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_greedy_output_matches_offline_llm(server: Any) -> None:
    if not server.real:
        pytest.skip("engine.async_engine / cluster.serve_rank not available yet")
    from engine import LLM, SamplingParams

    prompt = "class Stack:\n    def push(self, x):"
    r = server.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0)
    e = server.config.engine
    llm = LLM(
        model=e.model,
        ep_size=1,
        dtype=e.dtype,
        device="cpu",
        max_model_len=e.max_model_len,
        seed=e.seed,
    )
    try:
        out = llm.generate(
            prompts=[prompt], sampling_params=SamplingParams(max_tokens=16, temperature=0.0)
        )[0]
    finally:
        llm.shutdown()
    assert r.choices[0].text == out.text
    assert r.usage.completion_tokens == len(out.token_ids)


def test_bad_requests_get_openai_errors_while_a_stream_completes(server: Any) -> None:
    too_long = "x " * (server.config.engine.max_model_len + 10)
    bad: list[tuple[str, Any, int, str | None]] = [
        ("/v1/completions", b"{not json", 400, None),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
        (
            "/v1/completions",
            {"model": MODEL, "prompt": "hi", "temperature": "hot"},
            400,
            "temperature",
        ),
        ("/v1/completions", {"model": "gpt-4", "prompt": "hi"}, 404, "model"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": too_long, "max_tokens": 4}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": [1, 2, 10**9]}, 400, "prompt"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 2}, 400, "n"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "tools": []},
            400,
            "tools",
        ),
        ("/v1/chat/completions", {"model": MODEL, "messages": "hello"}, 400, "messages"),
    ]

    async def stream() -> tuple[int, list[str]]:
        body = {
            "model": MODEL,
            "prompt": "while True:",
            "max_tokens": 48,
            "stream": True,
            "ignore_eos": True,
        }
        async with (
            httpx.AsyncClient(timeout=120) as c,
            c.stream("POST", server.base + "/v1/completions", json=body) as r,
        ):
            return r.status_code, [ln async for ln in r.aiter_lines() if ln]

    async def one(c: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
        if isinstance(body, bytes):
            return await c.post(
                server.base + path, content=body, headers={"content-type": "application/json"}
            )
        return await c.post(server.base + path, json=body)

    async def main() -> tuple[tuple[int, list[str]], list[httpx.Response]]:
        s = asyncio.create_task(stream())
        await asyncio.sleep(0.2)
        async with httpx.AsyncClient(timeout=60) as c:
            rs = [await one(c, path, body) for path, body, _, _ in bad]
        return await s, rs

    (status, lines), responses = asyncio.run(main())
    for (_path, body, want, param), r in zip(bad, responses, strict=True):
        assert r.status_code == want, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
        if param is not None:
            assert err["param"] == param or param in err["message"], (body, err)
    assert status == 200 and lines[-1] == "data: [DONE]"
    finals = [json.loads(ln[6:])["choices"][0]["finish_reason"] for ln in lines[:-1]]
    assert finals[-1] == "length"


def test_client_disconnect_is_counted_and_server_keeps_serving(server: Any) -> None:
    body = {
        "model": MODEL,
        "prompt": "def f():",
        "max_tokens": 200,
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
        for _ in zip(range(3), r.iter_lines(), strict=False):
            pass  # leave after a few chunks: closing the connection must abort the request
    r = server.client.completions.create(model=MODEL, prompt="ok", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def _scrape(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def test_metrics_exported_after_traffic(server: Any) -> None:
    server.client.completions.create(model=MODEL, prompt="metrics", max_tokens=4, stream=False)
    want = [
        "ray_moe_serve_requests_total",
        "ray_moe_serve_ttft_seconds_bucket",
        "ray_moe_serve_inter_token_latency_seconds_bucket",
        "ray_moe_serve_e2e_latency_seconds_count",
        "ray_moe_serve_prompt_tokens_total",
        "ray_moe_serve_generation_tokens_total",
        "ray_moe_serve_rank_running_requests",
        "ray_moe_serve_rank_kv_usage",
        "ray_moe_serve_rank_step_stat",
    ]
    deadline = time.time() + float(os.environ.get("MOE_TEST_METRICS_WAIT_S", "60"))
    missing = want
    text = ""
    while time.time() < deadline:
        text = _scrape(server.metrics_port)
        missing = [n for n in want if n not in text]
        if not missing and 'status="499"' in text:
            break
        time.sleep(2)
    assert not missing, missing
    assert 'endpoint="completions"' in text and 'status="200"' in text and 'status="400"' in text
    assert 'status="499"' in text  # the disconnect of the previous test
