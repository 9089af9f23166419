"""The OpenAI-compatible HTTP ingress: validate → tokenize → route to a rank → stream back.

One `OpenAIIngress` replica serves many requests concurrently (async); it holds a
`DeploymentHandle` to the EP-rank deployment whose request router (`serving.router`) picks a rank
per request. The ingress owns every HTTP concern (errors, SSE, usage, admission, metrics) so the
ranks only ever see token ids and `SamplingParams` dicts.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.sampling_params import SamplingParams
from serving.config import ServingConfig
from serving.metrics import get_metrics
from serving.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    bad_request,
    validation_to_api_error,
)
from serving.responses import SSE_DONE, ResponseBuilder, merge_full, sse
from serving.tokenizer import ModelLimits, load_tokenizer, model_limits

logger = logging.getLogger("ray.serve")

app = FastAPI(title="moe-serve OpenAI-compatible API")

_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
RETRY_AFTER_S = 1


def error_response(e: APIError, request_id: str | None = None) -> JSONResponse:
    headers = {}
    if e.retry_after_s is not None:
        headers["Retry-After"] = str(e.retry_after_s)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


# FastAPI's own errors (unknown route, wrong method) in OpenAI's shape too.
@app.exception_handler(StarletteHTTPException)
async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(exc.status_code, str(exc.detail), type=kind))


@app.exception_handler(RequestValidationError)
async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return error_response(bad_request(str(exc.errors())))


def _unwrap(e: BaseException) -> BaseException:
    """The user exception inside a Ray task error, if any (RayTaskError carries it as `cause`)."""
    return getattr(e, "cause", None) or e


_END = object()


@dataclass(frozen=True)
class _Prompt:
    """One prompt of a request, checked and tokenized, with its sampling parameters."""

    ids: list[int]
    params: SamplingParams
    echo: bool = False
    echo_text: str = ""  # echo: the prompt as the client sent it (token ids: decoded)
    hide_output: bool = False  # max_tokens 0 with echo: the one generated token is not reported


def _own_internal_request_id() -> None:
    """Give the current context's Serve handle calls an internal request id of their own. They
    inherit the HTTP request's, and Serve's routing (ours too) tracks calls by it: n concurrent
    calls sharing one are taken for one, and all but the first are never routed."""
    from ray.serve._private.utils import generate_request_id
    from ray.serve.context import _set_request_context

    _set_request_context(_internal_request_id=generate_request_id())


async def _merge(gens: list[AsyncIterator[Any]]) -> AsyncIterator[tuple[int, Any]]:
    """(choice index, output) from n output streams as they arrive. The first error (an
    APIError) ends the whole; closing it closes every stream, whose cleanup aborts its engine
    request."""
    if len(gens) == 1:
        try:
            async for out in gens[0]:
                yield 0, out
        finally:
            await gens[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: AsyncIterator[Any]) -> None:
        _own_internal_request_id()  # this task's context only (tasks copy the context)
        try:
            async for out in gen:
                queue.put_nowait((i, out, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, None, e))
            return
        queue.put_nowait((i, None, _END))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        live = len(gens)
        while live:
            i, out, err = await queue.get()
            if err is _END:
                live -= 1
            elif err is not None:
                raise err
            else:
                yield i, out
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for g in gens:
            await g.aclose()


class OpenAIIngress:
    def __init__(self, ranks: DeploymentHandle, config: ServingConfig) -> None:
        self.config = config
        self.model_name = config.served_model_name
        self.ranks = ranks
        # options() initializes the handle's router once; every call below shares it, so the
        # router's in-flight bookkeeping (load, prefix table, abort pinning) sees all requests.
        self._stream_handle = ranks.options(stream=True)
        self.tokenizer = load_tokenizer(config.engine)
        self.limits: ModelLimits = model_limits(config.engine)
        self._inflight = 0
        self.metrics = get_metrics()
        self._tags = {"model": self.model_name}

    # ---- routes -------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self) -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "moe-serve",
                    "max_model_len": self.limits.max_model_len,
                }
            ],
        }

    @app.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle(request, "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle(request, "chat")

    # ---- request handling ---------------------------------------------------------------------
    async def _handle(self, request: Request, kind: str) -> Response:
        arrival = time.perf_counter()
        header_id = request.headers.get("x-request-id", "")
        prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
        # Serve's proxy forwards (or assigns) `x-request-id`; reusing it ties our logs to Serve's
        # access log. OpenAI ids carry a type prefix, so it is added unless already there.
        if not _REQUEST_ID_RE.match(header_id):
            header_id = uuid.uuid4().hex
        rid = header_id if header_id.startswith(prefix) else prefix + header_id
        endpoint = "chat" if kind == "chat" else "completions"
        try:
            if self._inflight >= self.config.ingress.max_concurrent_requests:
                raise APIError(
                    429,
                    "server is saturated; retry later",
                    type="rate_limit_error",
                    code="saturated",
                    retry_after_s=RETRY_AFTER_S,
                )
            body = await request.body()
            req, prompts = self._prepare(body, kind)
        except APIError as e:
            self._count(endpoint, e.status)
            logger.info("request %s rejected: %d %s", rid, e.status, e.message)
            return error_response(e, rid)

        # choice index = prompt index * n + j: one engine request each (with a seed, choice j of
        # a prompt samples with seed + j)
        n = req.n
        builders, gens = [], []
        for p, pr in enumerate(prompts):
            for j in range(n):
                index = p * n + j
                builders.append(ResponseBuilder(
                    kind="chat" if kind == "chat" else "completion",
                    request_id=rid,
                    model=self.model_name,
                    prompt_tokens=len(pr.ids),
                    logprobs=bool(pr.params.logprobs),
                    tokenizer=self.tokenizer,
                    index=index,
                    echo_ids=pr.ids if pr.echo else None,
                    echo_text=pr.echo_text,
                    hide_output=pr.hide_output,
                ))
                params = (pr.params if j == 0 or pr.params.seed is None
                          else pr.params.model_copy(update={"seed": pr.params.seed + j}))
                gens.append(self._generate(rid if len(prompts) * n == 1 else f"{rid}-{index}", pr.ids,
                                           params, arrival))
        logger.info(
            "request %s: %s, %d prompt(s), %d prompt tokens, max_tokens=%d, n=%d, stream=%s",
            rid,
            endpoint,
            len(prompts),
            sum(len(pr.ids) for pr in prompts),
            prompts[0].params.max_tokens,
            n,
            req.stream,
        )
        self._inflight += 1
        self.metrics.running.set(self._inflight, tags=self._tags)
        outputs = _merge(gens)
        if req.stream:
            # The first output is awaited before answering so that routing-time failures
            # (backpressure, a rank refusing the prompt) still get a proper status code.
            try:
                first = await outputs.__anext__()
            except APIError as e:
                await outputs.aclose()
                self._done(endpoint, e.status)
                return error_response(e, rid)
            except StopAsyncIteration:
                first = None
            return StreamingResponse(
                self._sse(outputs, first, builders, req.include_usage_in_stream, endpoint, n),
                media_type="text/event-stream",
                headers={"x-request-id": rid},
            )
        status = 500
        try:
            finals: dict[int, Any] = {}
            async for i, out in outputs:
                finals[i] = out
            if len(finals) < len(builders):
                raise APIError(500, f"no output (request id {rid})", type="internal_error")
            status = 200
            body = merge_full([b.full(finals[b.index]) for b in builders], n)
            return JSONResponse(body, headers={"x-request-id": rid})
        except APIError as e:
            status = e.status
            return error_response(e, rid)
        except asyncio.CancelledError:
            status = 499  # client went away; `_generate`'s cleanup aborted the engine requests
            raise
        finally:
            await outputs.aclose()
            self._done(endpoint, status)

    def _prepare(self, body: bytes, kind: str) -> tuple[Any, list[_Prompt]]:
        """Parse, validate and tokenize; raises APIError (400/404) naming the problem."""
        model_cls = ChatCompletionRequest if kind == "chat" else CompletionRequest
        try:
            req = model_cls.model_validate_json(body)
        except ValidationError as e:
            raise validation_to_api_error(e) from None
        if req.model != self.model_name:
            raise APIError(
                404,
                f"model {req.model!r} does not exist; this server serves {self.model_name!r}",
                type="not_found_error",
                param="model",
                code="model_not_found",
            )
        if isinstance(req, ChatCompletionRequest):
            messages = [{"role": m.role, "content": m.text()} for m in req.messages]
            try:
                text = self.tokenizer.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=False
                )
            except Exception as e:  # a template may reject e.g. a role order it does not support
                raise bad_request(
                    f"messages: chat template failed: {e}", param="messages"
                ) from None
            # The template writes BOS itself; encoding it again would add a second one.
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            max_tokens, max_param = (
                req.requested_max_tokens,
                (
                    "max_completion_tokens"
                    if req.max_completion_tokens is not None
                    else "max_tokens"
                ),
            )
            want_logprobs, top = req.logprobs, req.top_logprobs or 0
            return req, [self._prompt(req, ids, max_tokens, max_param, want_logprobs, top, False, "")]
        prompts = []
        for k, prompt in enumerate(req.prompts):
            ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
            echo_text = prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)
            where = "prompt" if len(req.prompts) == 1 else f"prompt[{k}]"
            try:
                prompts.append(self._prompt(req, ids, req.max_tokens, "max_tokens", req.logprobs is not None,
                                            req.logprobs or 0, req.echo, echo_text))
            except APIError as e:  # name the prompt of a batch that failed
                if where != "prompt" and e.message.startswith("prompt:"):
                    raise bad_request(where + e.message.removeprefix("prompt"), param=where,
                                      code=e.code) from None
                raise
        return req, prompts

    def _prompt(self, req: Any, ids: list[int], max_tokens: int | None, max_param: str,
                want_logprobs: bool, top: int, echo: bool, echo_text: str) -> _Prompt:
        """One prompt's checks against the model's limits, and its sampling parameters."""
        lim = self.limits
        if not ids:
            raise bad_request("prompt: empty after tokenization", param="prompt")
        if any(not 0 <= t < lim.vocab_size for t in ids):
            raise bad_request(
                f"prompt: token ids must lie in [0, {lim.vocab_size})", param="prompt"
            )
        if len(ids) >= lim.max_model_len:
            raise bad_request(
                f"prompt: {len(ids)} tokens leave no room to generate within the model's "
                f"context of {lim.max_model_len} tokens",
                param="prompt",
                code="context_length_exceeded",
            )
        room = lim.max_model_len - len(ids)
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise bad_request(
                f"{max_param}: prompt ({len(ids)} tokens) + {max_param} ({max_tokens}) exceeds the "
                f"model's context of {lim.max_model_len} tokens",
                param=max_param,
                code="context_length_exceeded",
            )
        try:
            params = SamplingParams(
                max_tokens=max(max_tokens, 1),  # echo with max_tokens 0: one token, not reported
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                presence_penalty=req.presence_penalty or 0.0,
                frequency_penalty=req.frequency_penalty or 0.0,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                logit_bias={int(t): b for t, b in req.logit_bias.items()} if req.logit_bias else None,
                seed=req.seed,
                stop=req.stop,
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                logprobs=want_logprobs,
                top_logprobs=top,
                prompt_logprobs=echo and want_logprobs,
            )
        except ValidationError as e:
            raise validation_to_api_error(e) from None
        if params.logit_bias and any(t >= lim.vocab_size for t in params.logit_bias):
            raise bad_request(f"logit_bias: token ids must lie in [0, {lim.vocab_size})", param="logit_bias")
        return _Prompt(ids, params, echo, echo_text, hide_output=max_tokens == 0)

    async def _generate(
        self, rid: str, ids: list[int], params: SamplingParams, arrival: float
    ) -> AsyncIterator[Any]:
        """Engine outputs for one request, with latency metrics; aborts the engine request when
        the consumer stops early (client disconnect cancels the handler, or the generator is
        closed). Rank-side failures become APIErrors."""
        m, tags = self.metrics, self._tags
        stream = self._stream_handle.generate.remote(rid, ids, params.model_dump())
        finished = False
        last_t, n_tokens, out = None, 0, None
        try:
            while True:
                try:
                    out = await stream.__anext__()
                except StopAsyncIteration:
                    break
                now = time.perf_counter()
                new = len(out.token_ids) - n_tokens
                if new > 0:
                    if last_t is None:
                        m.ttft.observe(now - arrival, tags=tags)
                    else:
                        gap = (now - last_t) / new  # a chunk may carry several tokens
                        for _ in range(new):
                            m.itl.observe(gap, tags=tags)
                    last_t, n_tokens = now, len(out.token_ids)
                if out.finished:
                    finished = True
                    if out.error:
                        logger.error("request %s failed in the engine: %s", rid, out.error)
                        raise APIError(
                            500, f"internal error (request id {rid})", type="internal_error"
                        )
                    if out.finish_reason == "abort":
                        raise APIError(
                            503,
                            f"request {rid} was aborted by the server",
                            type="server_error",
                            code="aborted",
                            retry_after_s=RETRY_AFTER_S,
                        )
                yield out
                if finished:
                    break
        except APIError:
            raise
        except BackPressureError:
            raise APIError(
                503,
                "all ranks are saturated; retry later",
                type="server_error",
                code="saturated",
                retry_after_s=RETRY_AFTER_S,
            ) from None
        except (ActorDiedError, ActorUnavailableError, RayActorError):
            logger.exception("request %s: rank unavailable", rid)
            raise APIError(
                503,
                f"a rank of the serving group failed; retry later (request id {rid})",
                type="server_error",
                code="rank_unavailable",
                retry_after_s=5,
            ) from None
        except (asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:
            cause = _unwrap(e)
            if isinstance(cause, ValueError):  # the engine's own validation (names the field)
                raise bad_request(str(cause)) from None
            logger.exception("request %s: internal error", rid)
            raise APIError(
                500, f"internal error (request id {rid})", type="internal_error"
            ) from None
        finally:
            if not finished:
                stream.cancel()
                # Cancellation reaches the rank's generator at its next await and aborts there;
                # the explicit abort (pinned to the same rank by the router) also covers a rank
                # that is inside a long non-awaiting step.
                self.ranks.abort.remote(rid)
                logger.info("request %s: aborted before finishing", rid)
            elif out is not None:
                m.e2e.observe(time.perf_counter() - arrival, tags=tags)
                m.prompt_tokens.inc(len(ids), tags=tags)
                if out.token_ids:
                    m.generation_tokens.inc(len(out.token_ids), tags=tags)
                cached = out.metrics.num_cached_tokens if out.metrics is not None else 0
                if cached:
                    m.cached_tokens.inc(cached, tags=tags)
                logger.info(
                    "request %s finished: %s, %d tokens, %.3f s",
                    rid,
                    out.finish_reason,
                    len(out.token_ids),
                    time.perf_counter() - arrival,
                )

    async def _sse(
        self,
        outputs: AsyncIterator[tuple[int, Any]],
        first: tuple[int, Any] | None,
        builders: list[ResponseBuilder],
        include_usage: bool,
        endpoint: str,
        n: int = 1,
    ) -> AsyncIterator[str]:
        status = 499
        last: dict[int, Any] = {}
        try:
            for b in builders:
                opening = b.first_chunk()
                if opening:
                    yield opening

            async def rest() -> AsyncIterator[tuple[int, Any]]:
                if first is not None:
                    yield first
                async for item in outputs:
                    yield item

            try:
                async for i, out in rest():
                    last[i] = out
                    chunk = builders[i].delta_chunk(out)
                    if chunk:
                        yield chunk
            except APIError as e:
                # Headers are gone already: report the failure in-band, then end the stream.
                status = e.status
                yield sse(e.body())
                yield SSE_DONE
                return
            if include_usage and last:
                prompt_tokens = sum(b.prompt_tokens for b in builders[::n])
                yield builders[0].usage_chunk([last[i] for i in sorted(last)], prompt_tokens)
            yield SSE_DONE
            status = 200
        finally:
            await outputs.aclose()
            self._done(endpoint, status)

    # ---- bookkeeping --------------------------------------------------------------------------
    def _count(self, endpoint: str, status: int) -> None:
        self.metrics.requests.inc(tags={**self._tags, "endpoint": endpoint, "status": str(status)})

    def _done(self, endpoint: str, status: int) -> None:
        self._inflight -= 1
        self.metrics.running.set(self._inflight, tags=self._tags)
        self._count(endpoint, status)


# Serve wraps the class with the FastAPI app; deployment options are set by serving.app.
OpenAIIngressDeployment = serve.deployment(name="OpenAIIngress")(serve.ingress(app)(OpenAIIngress))
