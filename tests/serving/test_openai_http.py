"""The OpenAI HTTP API end to end: a real local Ray + Serve running the app of configs/tiny.yaml
(real engine, one EP group of two CPU ranks; one shared app for the module), driven by the
official `openai` client and raw httpx. Per-rank state is observed through the ranks' own metrics
(each rank exports its load report and engine step stats, see `serving.metrics`)."""

from __future__ import annotations

import asyncio
import json
import os
import re
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
from tests.helpers import init_local_ray

openai = pytest.importorskip("openai")

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny.yaml"
MODEL = "tiny-dsv3"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server() -> Any:
    http_port = _free_port()
    # a fresh local instance (address="local"): never one someone else started on this machine
    init_local_ray(
        num_cpus=2,
        include_dashboard=False,
        _node_ip_address="127.0.0.1",
        # Export every second (default 10 s) so the metric checks below see fresh values quickly.
        _system_config={"metrics_report_interval_ms": 1000},
        runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}},
    )
    # the port Ray chose for the node's Prometheus endpoint (choosing one here could race Ray's own)
    metrics_port = ray._private.worker.global_worker.node.metrics_export_port
    serve.start(http_options={"host": "127.0.0.1", "port": http_port})
    args = yaml.safe_load(TINY.read_text())["applications"][0]["args"]
    config = ServingConfig.from_args(args)
    from serving.app import build_app

    app = build_app(args)
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
        model=MODEL, messages=msgs, max_completion_tokens=10, temperature=0.0, logprobs=True,
        top_logprobs=3,
    )
    assert r.id.startswith("chatcmpl-") and r.choices[0].message.role == "assistant"
    rendered = server.tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    )
    assert r.usage.prompt_tokens == len(server.tokenizer.encode(rendered, add_special_tokens=False))
    assert len(r.choices[0].logprobs.content) == r.usage.completion_tokens
    assert all(t.logprob <= 0.0 for t in r.choices[0].logprobs.content)
    for t in r.choices[0].logprobs.content:  # greedy: the chosen token is the most likely one
        assert len(t.top_logprobs) == 3
        assert (t.top_logprobs[0].token, t.top_logprobs[0].logprob) == (t.token, t.logprob)
        assert t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob >= t.top_logprobs[2].logprob
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
    assert stop is not None, f"greedy output {text!r} has no usable stop string"
    r = server.client.completions.create(**kw, max_tokens=24, stop=[stop])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text == text[: text.index(stop)]


def test_greedy_output_matches_offline_llm(server: Any) -> None:
    """The served EP2 group (configs/tiny.yaml) produces exactly the offline engine's greedy
    tokens. The offline side is `LLM` with the same engine settings at ep_size 1 (EP2 == EP1 is
    proven in tests/cluster; an offline EP2 group would not fit beside the app on 2 CPUs)."""
    from engine import LLM, SamplingParams

    prompts = ["class Stack:\n    def push(self, x):", "The capital of France is"]
    penalties = {"frequency_penalty": 1.2, "presence_penalty": 0.4, "repetition_penalty": 1.3}
    served = [
        server.client.completions.create(
            model=MODEL, prompt=p, max_tokens=16, temperature=0.0, extra_body={"ignore_eos": True}
        )
        for p in prompts
    ]
    # penalties: OpenAI's two as fields, the repetition penalty through extra_body
    served_pen = [
        server.client.completions.create(
            model=MODEL, prompt=p, max_tokens=16, temperature=0.0,
            frequency_penalty=penalties["frequency_penalty"], presence_penalty=penalties["presence_penalty"],
            extra_body={"ignore_eos": True, "repetition_penalty": penalties["repetition_penalty"]},
        )
        for p in prompts
    ]
    engine_args = server.config.engine.model_dump()
    engine_args.update(ep_size=1, moe_a2a_backend="auto")
    llm = LLM(**engine_args)
    try:
        outs = llm.generate(
            prompts=prompts,
            sampling_params=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
        )
        outs_pen = llm.generate(
            prompts=prompts,
            sampling_params=SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, **penalties),
        )
    finally:
        llm.shutdown()
    assert [r.choices[0].text for r in served_pen] == [o.text for o in outs_pen]
    assert [o.token_ids for o in outs_pen] != [o.token_ids for o in outs]  # the penalties bit
    for r, out in zip(served, outs, strict=True):
        assert len(out.token_ids) == 16 == r.usage.completion_tokens
        assert r.choices[0].text == out.text
        assert r.choices[0].finish_reason == out.finish_reason == "length"


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
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "n": 17}, 400, "n"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
        ("/v1/completions", {"model": MODEL, "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
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


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


def _scrape(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text


def _samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of the metric `name` in Prometheus text format."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            out.append((dict(_LABEL.findall(m.group(2) or "")), float(m.group(3))))
    return out


def _per_rank(text: str, name: str) -> dict[str, float]:
    """Metric value by `gang_rank` (one gang in these tests)."""
    return {labels["gang_rank"]: v for labels, v in _samples(text, name) if "gang_rank" in labels}


def _wait_metrics(
    port: int, done: Any, what: str, missing: list[str] | None = None, timeout_s: float = 60.0
) -> str:
    deadline = time.time() + float(os.environ.get("MOE_TEST_METRICS_WAIT_S", timeout_s))
    text = ""
    while time.time() < deadline:
        text = _scrape(port)
        if done(text):
            return text
        time.sleep(1)
    pytest.fail(f"metrics never showed {what}; missing: {missing}")


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_aborts_the_engine_request(server: Any, n: int) -> None:
    """Leaving a stream early aborts the request in the engine (all n of its engine requests):
    every rank's own load report shows nothing running or waiting, long before the request
    could have finished, and the ranks generated only a few of its tokens. Then the server
    keeps serving."""
    gen = "ray_moe_serve_rank_generated_tokens_total"
    # Quiet first: both ranks idle and their generated-token totals settled (unchanged across
    # scrapes further apart than a report + export period), so later changes are ours.
    totals: list[float] = []

    def quiet(t: str) -> bool:
        running = _per_rank(t, "ray_moe_serve_rank_running_requests")
        totals.append(sum(_per_rank(t, gen).values()))
        time.sleep(2)
        return len(running) == 2 and not any(running.values()) and totals[-2:] == totals[-1:] * 2

    _wait_metrics(server.metrics_port, quiet, "both ranks idle")
    generated_before = totals[-1]
    prompt = "def f():"
    max_tokens = server.config.engine.max_model_len - len(server.tokenizer.encode(prompt)) - 1
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True, "n": n}  # fmt: skip
    with httpx.stream("POST", server.base + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for _ in zip(range(4), r.iter_lines(), strict=False):
            pass  # leave after a few chunks: closing the connection must abort the request

    def aborted(t: str) -> bool:
        running = _per_rank(t, "ray_moe_serve_rank_running_requests")
        waiting = _per_rank(t, "ray_moe_serve_rank_waiting_requests")
        # A report taken after our tokens were generated (fresh), with nothing left anywhere.
        fresh = sum(_per_rank(t, gen).values()) > generated_before
        return fresh and not any(running.values()) and not any(waiting.values())

    after = _wait_metrics(server.metrics_port, aborted, "the request gone from every rank")
    generated = sum(_per_rank(after, gen).values()) - generated_before
    assert 0 < generated < n * max_tokens // 2, generated  # stopped early, not run to max_tokens
    r2 = server.client.completions.create(model=MODEL, prompt="ok", max_tokens=2)
    assert r2.usage.completion_tokens >= 1


def test_metrics_exported_after_traffic(server: Any) -> None:
    server.client.completions.create(model=MODEL, prompt="metrics", max_tokens=4, stream=False)
    request_level = [
        "ray_moe_serve_requests_total",
        "ray_moe_serve_ttft_seconds_bucket",
        "ray_moe_serve_inter_token_latency_seconds_bucket",
        "ray_moe_serve_e2e_latency_seconds_count",
        "ray_moe_serve_prompt_tokens_total",
        "ray_moe_serve_generation_tokens_total",
    ]
    from serving.metrics import (
        RANK_LOAD_GAUGES,
        RANK_STEP_COUNTERS,
        RANK_STEP_GAUGES,
        TBO_STEP_FRACTION,
    )

    rank = "ray_moe_serve_rank_"
    # Gauges exist for every rank from its first report. Counters appear at their first increment
    # (Prometheus convention for Ray counters): steps and forward time on every rank (lockstep:
    # a rank without requests still runs idle steps), the traffic ones at least on the rank(s)
    # that served; retractions, TBO steps and prefix-cache hits stay absent while zero.
    per_rank = [rank + m for m, _ in [*RANK_LOAD_GAUGES.values(), *RANK_STEP_GAUGES.values()]]
    per_rank += [rank + TBO_STEP_FRACTION[0], rank + "steps_total", rank + "forward_seconds_total"]
    some_rank = [
        rank + RANK_STEP_COUNTERS[k][0] + "_total"
        for k in ("prefill_steps", "decode_steps", "generated_tokens", "prefill_tokens")
    ]
    missing: list[str] = []

    def ready(t: str) -> bool:
        missing[:] = [n for n in request_level if not _samples(t, n)]
        missing.extend(n for n in per_rank if set(_per_rank(t, n)) != {"0", "1"})
        missing.extend(n for n in some_rank if not any(_per_rank(t, n).values()))
        if len(_samples(t, "ray_moe_serve_router_rank_reports_total")) < 2:
            missing.append("ray_moe_serve_router_rank_reports_total")
        if 'status="499"' not in t:
            missing.append('status="499"')
        return not missing

    text = _wait_metrics(server.metrics_port, ready, "every named metric for both ranks", missing)
    assert 'endpoint="completions"' in text and 'status="200"' in text and 'status="400"' in text
    assert 'status="499"' in text  # the disconnect of the previous test
    # Both ranks step in lockstep and sample tokens; the router used both ranks' reports.
    steps = _per_rank(text, rank + "steps_total")
    assert all(v > 0 for v in steps.values()), steps
    assert all(v > 0 for v in _per_rank(text, rank + "forward_seconds_total").values())
    assert sum(_per_rank(text, rank + "generated_tokens_total").values()) > 0
    assert set(_per_rank(text, rank + "overlap_enabled").values()) <= {0.0, 1.0}
    assert set(_per_rank(text, rank + "sbo_enabled").values()) == {0.0}  # tiny.yaml: SBO off
    assert all(0.0 <= v <= 1.0 for v in _per_rank(text, rank + "kv_usage").values())
    assert all(0.0 <= v <= 1.0 for v in _per_rank(text, rank + "idle_fraction").values())
    replicas = {lb["rank_replica"] for lb, _ in _samples(text, rank + "running_requests")}
    reports = _samples(text, "ray_moe_serve_router_rank_reports_total")
    assert {lb["rank_replica"] for lb, _ in reports} == replicas and len(replicas) == 2
    assert all(v >= 1 for _, v in reports)
    outstanding = _samples(text, "ray_moe_serve_router_outstanding_tokens")
    assert {lb["rank_replica"] for lb, _ in outstanding} == replicas


def test_completion_top_logprobs_streamed_equal_whole(server: Any) -> None:
    """Legacy completions `logprobs=2`: the chosen token and the 2 most likely per token, the
    same whether streamed or not."""
    kw = dict(model=MODEL, prompt="def main():", max_tokens=8, temperature=0.0, logprobs=2,
              extra_body={"ignore_eos": True})
    whole = server.client.completions.create(**kw).choices[0].logprobs
    assert len(whole.tokens) == 8
    for tok, lp, top in zip(whole.tokens, whole.token_logprobs, whole.top_logprobs, strict=True):
        assert top[tok] == lp and 1 <= len(top) <= 3  # the chosen (greedy: the top one) + the 2 best
        assert max(top.values()) == lp
    streamed = [c.choices[0].logprobs for c in server.client.completions.create(stream=True, **kw)
                if c.choices and c.choices[0].logprobs is not None]
    assert [t for s in streamed for t in s.top_logprobs] == whole.top_logprobs


def test_n_choices_streamed_and_whole(server: Any) -> None:
    """n choices: one engine request each (seed + i), usage counting the prompt once; streamed
    choices interleave by index and add up to the same texts."""
    kw = dict(model=MODEL, prompt="import os\n", max_tokens=12, temperature=1.0, seed=5, n=3,
              extra_body={"ignore_eos": True})
    whole = server.client.completions.create(**kw)
    assert sorted(c.index for c in whole.choices) == [0, 1, 2]
    assert len({c.text for c in whole.choices}) > 1  # different seeds, different samples
    assert whole.usage.completion_tokens == 36
    assert whole.usage.prompt_tokens == len(server.tokenizer.encode("import os\n"))
    single = server.client.completions.create(**{**kw, "n": 1, "seed": 6})
    assert single.choices[0].text == whole.choices[1].text  # choice 1 sampled with seed 5 + 1
    texts: dict[int, str] = {}
    usage = None
    for chunk in server.client.completions.create(stream=True, stream_options={"include_usage": True}, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
        usage = chunk.usage or usage
    assert texts == {c.index: c.text for c in whole.choices}
    assert usage.completion_tokens == 36
    chat = server.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0, n=2)
    assert [c.index for c in chat.choices] == [0, 1]
    forced = server.client.completions.create(model=MODEL, prompt="x", max_tokens=5, temperature=0.0,
                                              logit_bias={"42": 100}, extra_body={"ignore_eos": True})
    assert forced.choices[0].text == server.tokenizer.decode([42] * 5)  # the biased token, 5 times
    assert chat.choices[0].message.content == chat.choices[1].message.content  # greedy: the same


def test_echo_scores_the_prompt_as_eval_harnesses_ask(server: Any) -> None:
    """Legacy completions `echo` (lm-eval-harness's loglikelihood request: echo, logprobs=1,
    max_tokens 0): the prompt's own tokens with their logprobs (None for the first) and the
    most likely token at each position, equal to the offline engine's; no completion tokens.
    With max_tokens > 0 the completion follows the prompt, streamed or not."""
    from engine import LLM, SamplingParams

    text = "def add(a, b):\n    return a + b\n"
    ids = server.tokenizer.encode(text)
    r = server.client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                         temperature=0.0)
    c = r.choices[0]
    assert c.text == server.tokenizer.decode(ids) and c.finish_reason == "length"  # token ids: decoded
    assert r.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for tok, chosen, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
        assert top[tok] == chosen and 1 <= len(top) <= 2 and max(top.values()) >= chosen
    engine_args = server.config.engine.model_dump()
    engine_args.update(ep_size=1, moe_a2a_backend="auto")
    llm = LLM(**engine_args)
    try:
        ref = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(
            max_tokens=1, prompt_logprobs=True, top_logprobs=1))[0]
    finally:
        llm.shutdown()
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], ref.prompt_logprobs[1:])) < 1e-3
    best = [max(top, key=top.get) for top in lp.top_logprobs[1:]]
    assert best == [server.tokenizer.decode([next(iter(t))]) for t in ref.prompt_top_logprobs[1:]]

    kw = dict(model=MODEL, prompt=text, max_tokens=4, echo=True, logprobs=0, temperature=0.0,
              extra_body={"ignore_eos": True})
    whole = server.client.completions.create(**kw).choices[0]
    assert whole.text.startswith(text) and len(whole.text) > len(text)
    assert len(whole.logprobs.tokens) == len(ids) + 4
    streamed = "".join(ch.choices[0].text for ch in server.client.completions.create(stream=True, **kw)
                       if ch.choices)
    assert streamed == whole.text


def test_a_batch_of_prompts(server: Any) -> None:
    """Legacy completions with a list of prompts: choices prompt-major (index = prompt * n + j),
    each equal to the prompt asked alone; usage counts every prompt once. A bad prompt in the
    batch is a 400 naming it."""
    prompts = ["def f(x):", "import numpy as np\n", "The answer is"]
    kw = dict(model=MODEL, max_tokens=6, temperature=0.0, extra_body={"ignore_eos": True})
    alone = [server.client.completions.create(prompt=p, **kw).choices[0].text for p in prompts]
    r = server.client.completions.create(prompt=prompts, n=2, **kw)
    assert [c.index for c in r.choices] == list(range(6))
    assert [c.text for c in r.choices] == [t for t in alone for _ in range(2)]
    assert r.usage.prompt_tokens == sum(len(server.tokenizer.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == 36
    texts: dict[int, str] = {}
    for chunk in server.client.completions.create(prompt=prompts, stream=True, **kw):
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
    assert texts == dict(enumerate(alone))
    too_long = "x " * (server.config.engine.max_model_len + 10)
    bad = httpx.post(server.base + "/v1/completions", json={"model": MODEL, "prompt": ["ok", too_long]},
                     timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt[1]"
