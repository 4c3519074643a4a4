"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics.

Client mistakes get OpenAI-style 4xx bodies (never a 500); a stream whose client goes away aborts its
request, which frees its KV blocks within a step.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from infertune.engine.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestStream
from infertune.engine.outputs import RequestOutput
from infertune.sampling_params import ParamError, SamplingParams
from infertune.serve.metrics import ServerMetrics
from infertune.serve.protocol import APIError, ChatCompletionRequest, CompletionRequest
from infertune.serve.responses import Formatter, sse

log = logging.getLogger(__name__)


class BodySizeLimit:
    """ASGI middleware: refuse bodies over max_bytes with 413, by Content-Length or by counting the stream."""

    def __init__(self, app, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send)
        seen = 0

        async def counting_receive():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge()
            return message

        try:
            await self.app(scope, counting_receive, send)
        except _TooLarge:
            await self._reject(send)

    async def _reject(self, send) -> None:
        err = APIError(413, f"request body is larger than the server's limit of {self.max_bytes} bytes",
                       code="request_too_large")
        body = json.dumps(err.body()).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status)


def create_app(engine: AsyncLLMEngine, model_name: str, api_key: str | None = None,
               max_body_bytes: int = 4 * 2**20) -> FastAPI:
    metrics = ServerMetrics(engine)
    tokenizer = engine.engine.tokenizer

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        if not engine.started:
            engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="infertune", description="OpenAI-compatible LLM server", lifespan=lifespan)
    app.state.engine, app.state.metrics = engine, metrics
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes)

    @app.exception_handler(APIError)
    async def on_api_error(request: Request, err: APIError):
        if err.status in (400, 404, 429, 503):
            metrics.rejected.labels(str(err.status)).inc()
        return _error(err)

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, err: RequestValidationError):
        first = err.errors()[0] if err.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            return _error(APIError(400, "the request body is not valid JSON"))
        param = ".".join(loc) or None
        metrics.rejected.labels("400").inc()
        return _error(APIError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param))

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, err: StarletteHTTPException):
        type_ = "not_found_error" if err.status_code == 404 else "invalid_request_error"
        return _error(APIError(err.status_code, str(err.detail), type_))

    @app.exception_handler(Exception)
    async def on_internal_error(request: Request, err: Exception):
        log.exception("internal error")
        return _error(APIError(500, f"internal error: {err}", "internal_error"))

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        if api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {api_key}":
                return _error(APIError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                                       "authentication_error", code="invalid_api_key"))
        return await call_next(request)

    @app.get("/health")
    async def health():
        if not engine.is_running:
            return _error(APIError(503, f"engine is not running: {engine.error}", "service_unavailable"))
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "infertune",
                                            "max_model_len": engine.engine.max_model_len}]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", param="model", code="model_not_found")

    def params_of(make) -> SamplingParams:
        try:
            return make()
        except ParamError as e:
            raise APIError(400, str(e), param=e.param) from None

    async def submit(request_id: str, prompts: list[object], params: SamplingParams, param: str
                     ) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                streams.append(await engine.add_request(f"{request_id}-{i}", prompt, params))
        except BaseException as e:
            for s in streams:  # all or nothing
                s.abort()
            if isinstance(e, QueueFullError):
                raise APIError(429, str(e), "rate_limit_error", code="queue_full") from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), "service_unavailable") from None
            if isinstance(e, ValueError):
                raise APIError(400, str(e), param=getattr(e, "param", param)) from None
            raise
        return streams

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        check_model(req.model)
        params = params_of(lambda: req.sampling_params(req.max_tokens, req.logprobs))
        prompts = req.prompts()
        fmt = Formatter(f"cmpl-{uuid.uuid4().hex}", model_name, tokenizer, chat=False)
        streams = await submit(fmt.id, prompts, params, "prompt")
        return await respond(fmt, streams, params.n, req.stream, req.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest):
        check_model(req.model)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = params_of(lambda: req.sampling_params(max_tokens, req.logprobs_k()))
        try:
            prompt = engine.engine.render_chat(req.conversation(), add_generation_prompt=req.add_generation_prompt)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        fmt = Formatter(f"chatcmpl-{uuid.uuid4().hex}", model_name, tokenizer, chat=True)
        streams = await submit(fmt.id, [prompt], params, "messages")
        return await respond(fmt, streams, params.n, req.stream, req.include_usage)

    async def respond(fmt: Formatter, streams: list[RequestStream], n: int, stream: bool, include_usage: bool):
        if stream:
            return StreamingResponse(stream_events(fmt, streams, n, include_usage), media_type="text/event-stream")
        finals: list[RequestOutput] = []
        try:
            for s in streams:
                last = None
                async for last in s:
                    pass
                finals.append(last)
        finally:
            for s in streams:
                s.abort()
        for out in finals:
            metrics.observe_finished(out)
        return fmt.response(finals, n)

    async def stream_events(fmt: Formatter, streams: list[RequestStream], n: int, include_usage: bool
                            ) -> AsyncIterator[str]:
        sent_text: dict[int, int] = {}
        sent_logprobs: dict[int, int] = {}
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge(streams):
                for c in out.outputs:
                    index = i * n + c.index
                    first = index not in sent_text
                    start, lp_start = sent_text.get(index, 0), sent_logprobs.get(index, 0)
                    delta = c.text[start:]
                    lp = fmt.logprobs(c.logprobs[lp_start:], start) if c.logprobs is not None else None
                    if delta or first or c.finish_reason or (lp and c.logprobs[lp_start:]):
                        yield sse(fmt.chunk(index, delta, c.finish_reason, lp, first=first))
                    sent_text[index] = len(c.text)
                    sent_logprobs[index] = len(c.logprobs or [])
                if out.finished:
                    finals[i] = out
                    metrics.observe_finished(out)
            if include_usage:
                yield sse(fmt.usage_chunk([finals[i] for i in sorted(finals)]))
            yield sse("[DONE]")
        except EngineDeadError as e:
            yield sse(APIError(503, str(e), "service_unavailable").body())
        finally:
            for s in streams:
                s.abort()

    return app


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output), as soon as each output arrives."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                await queue.put((i, out))
            await queue.put((i, done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
