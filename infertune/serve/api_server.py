"""OpenAI-compatible HTTP server: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /kv_transfer.

Client mistakes get OpenAI-style 4xx bodies (never a 500). What a request will cost is weighed before it is
queued (engine/admission.py): a request that could never be served is a 400 that says the numbers, one that
cannot be served now a 429 / 503 with Retry-After. Every request whose client goes away, streamed or not, is
aborted, which frees its KV blocks within a step. Prompts are tokenized and chats rendered off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from infertune.engine.admission import NeverFits, Overloaded
from infertune.engine.async_engine import (
    AsyncLLMEngine,
    EngineDeadError,
    RequestFailedError,
    RequestStream,
    RequestTimeoutError,
)
from infertune.engine.outputs import RequestOutput
from infertune.kv_transfer import KVTransferError
from infertune.sampling_params import ParamError, SamplingParams
from infertune.serve.metrics import ServerMetrics
from infertune.serve.protocol import STREAMED, APIError, ChatCompletionRequest, CompletionRequest, error_responses
from infertune.serve.responses import Formatter, sse
from infertune.serve.tokenizer_routes import add_tokenizer_routes
from infertune.serve.tools import ToolFormatter, ToolPlan, template_tools

log = logging.getLogger(__name__)


class BodySizeLimit:
    """ASGI middleware: refuse bodies over max_bytes with 413, by Content-Length or by counting the stream."""

    def __init__(self, app, max_bytes: int, on_reject=None) -> None:
        self.app, self.max_bytes, self.on_reject = app, max_bytes, on_reject

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._reject(send)
        if declared is None and scope.get("method") in ("POST", "PUT", "PATCH"):
            # A chunked body has no length to check up front: read it here (up to the limit), then hand it on.
            # (Counting it as the app reads would raise inside the framework's body parsing, which answers 400.)
            held, size = [], 0
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    held.append(message)
                    break
                size += len(message.get("body", b""))
                if size > self.max_bytes:
                    return await self._reject(send)
                held.append(message)
                if not message.get("more_body", False):
                    break

            async def replay():
                return held.pop(0) if held else await receive()

            return await self.app(scope, replay, send)
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
        if self.on_reject is not None:
            self.on_reject()
        err = APIError(
            413, f"request body is larger than the server's limit of {self.max_bytes} bytes", code="request_too_large"
        )
        body = json.dumps(err.body()).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
            }
        )
        await send({"type": "http.response.body", "body": body})


class _TooLarge(Exception):
    pass


def _error(err: APIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def _api_error(e: BaseException, param: str) -> APIError | None:
    """The HTTP answer to an engine's refusal, or None for an exception that is not one."""
    if isinstance(e, Overloaded):
        status = 503 if e.reason == "memory_rss" else 429
        return APIError(
            status,
            str(e),
            "rate_limit_error" if status == 429 else "service_unavailable",
            code=e.reason,
            retry_after=e.retry_after,
        )
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), "service_unavailable", code="engine_unavailable", retry_after=5)
    if isinstance(e, RequestTimeoutError):
        return APIError(408, str(e), "timeout_error", code="request_timeout")
    if isinstance(e, RequestFailedError):  # (its step raised: this request aborted, the engine goes on)
        return APIError(500, str(e), "internal_error", code="step_failed")
    if isinstance(e, KVTransferError):  # prefill/decode disaggregation: the two sides' mismatch, or a failed transfer
        type_ = "service_unavailable" if e.status == 503 else "internal_error"
        return APIError(e.status, str(e), type_, code=e.code)
    if isinstance(e, NeverFits):
        return APIError(400, str(e), param=e.param, code="request_too_large")
    if isinstance(e, ValueError):
        return APIError(400, str(e), param=getattr(e, "param", param))
    return None


async def _until_disconnected(request: Request) -> None:
    """Return when the client has gone away (the body was read already, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def create_app(
    engine: AsyncLLMEngine,
    model_name: str | list[str],
    api_key: str | None = None,
    max_body_bytes: int = 4 * 2**20,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    chat_template: str | None = None,
) -> FastAPI:
    """The FastAPI app of one engine: the OpenAI routes of an APIServer, its error handlers and its limits.

    model_name: the served name, or several (vLLM's --served-model-name a b): requests may send any, /v1/models lists
    them all, responses and /metrics report the first. tool_call_parser (serve/tool_parsers.py) and
    enable_auto_tool_choice: tool_choice "auto", as vLLM's flags. chat_template (the text of serve --chat-template):
    the template of chats whose request sends none, in place of the checkpoint's."""
    server = APIServer(engine, model_name, api_key)
    server.tool_call_parser, server.enable_auto_tool_choice = tool_call_parser, enable_auto_tool_choice
    server.chat_template = chat_template
    app = FastAPI(title="infertune", description="OpenAI-compatible LLM server", lifespan=server.lifespan)
    app.state.engine, app.state.metrics, app.state.server = engine, server.metrics, server
    app.add_middleware(
        BodySizeLimit, max_bytes=max_body_bytes, on_reject=lambda: server.metrics.refuse(413, "request_too_large")
    )
    app.add_exception_handler(APIError, server.on_api_error)
    app.add_exception_handler(RequestValidationError, server.on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    app.add_exception_handler(Exception, _on_internal_error)
    app.middleware("http")(server.check_api_key)
    server.add_routes(app)
    return app


def _check_remote_decode(params: SamplingParams, prompts: int, stream: bool) -> None:
    """A prefill for remote decode (kv_transfer_params {"do_remote_decode": true}: the router's prefill step) answers
    one transfer: one prompt, one sample, not streamed. Anything else would lease blocks nobody is told of."""
    asked = params.kv_transfer_params
    if not (isinstance(asked, dict) and asked.get("do_remote_decode")):
        return
    if prompts > 1 or params.n > 1 or stream:
        what = "several prompts" if prompts > 1 else f"n={params.n}" if params.n > 1 else "a stream"
        raise APIError(
            400,
            f'kv_transfer_params {{"do_remote_decode": true}} hands one prompt\'s KV to one consumer: one prompt, n=1, '
            f"not streamed (this request asks for {what})",
            param="kv_transfer_params",
        )


def _field_path(error: dict) -> str:
    """A validation error's place in the body as a dotted path of field names and indexes: pydantic's union member
    tags ("literal['none','auto']", "NamedToolChoice", "dict[any,any]", "bool") and "body" left out."""
    keep = [str(x) for x in error.get("loc", ()) if isinstance(x, int) or (x != "body" and str(x).isidentifier())]
    return ".".join(k for k in keep if not k[:1].isupper())


async def _on_http_error(request: Request, err: StarletteHTTPException):
    type_ = "not_found_error" if err.status_code == 404 else "invalid_request_error"
    # (starlette's own headers kept: a 405 says the methods the route takes in Allow, as RFC 9110 asks)
    return _error(APIError(err.status_code, str(err.detail), type_, headers=err.headers))


async def _on_internal_error(request: Request, err: Exception):
    log.exception("internal error")
    return _error(APIError(500, f"internal error: {err}", "internal_error"))


_REFUSALS = error_responses(400, 401, 404, 408, 413, 429, 503)


class APIServer:
    """What the routes of one app share: the engine, its tokenizer and limits, the served name, the metrics.

    The route handlers carry no docstrings on purpose: FastAPI would publish them in the OpenAPI schema.
    """

    def __init__(self, engine: AsyncLLMEngine, model_name: str | list[str], api_key: str | None = None) -> None:
        self.served_model_names = [model_name] if isinstance(model_name, str) else list(model_name)
        if not self.served_model_names or not all(isinstance(n, str) and n for n in self.served_model_names):
            raise ValueError(f"served model names must be non-empty strings, got {model_name!r}")
        self.model_name = self.served_model_names[0]  # (what responses and /metrics report)
        self.engine, self.api_key = engine, api_key
        self.started = int(time.time())  # (/v1/models' "created": when this server came up)
        self.tool_call_parser: str | None = None  # tool_choice "auto" (set by create_app)
        self.enable_auto_tool_choice = False
        self.chat_template: str | None = None  # serve --chat-template (set by create_app): a request's own wins
        self.metrics = ServerMetrics(engine, self.model_name)
        self.tokenizer = engine.engine.tokenizer
        self.limits = engine.limits
        # What the server keeps of a finished non-streamed request (its response body) counts in its host cost.
        measure = Formatter("measure", self.model_name, self.tokenizer, chat=False)
        if not engine.started:
            engine.measure_host_cost(lambda out: json.dumps(measure.response([out], len(out.outputs))))

    def add_routes(self, app: FastAPI) -> None:
        app.get("/health", responses=error_responses(503))(self.health)
        app.get(
            "/metrics",
            response_class=Response,
            responses={200: {"content": {"text/plain": {}}, "description": "Prometheus text exposition format"}},
        )(self.prometheus)
        app.get("/v1/models", responses=error_responses(401))(self.models)
        app.get("/v1/models/{model_id:path}", responses=error_responses(401, 404))(self.model)
        app.get("/kv_transfer")(self.kv_transfer)  # (what P/D role and KV layout this server has: the router checks it)
        # (a producer's lease the decode side will not load: the router ends it; not in the OpenAPI schema)
        app.post("/kv_transfer/release", include_in_schema=False)(self.kv_transfer_release)
        app.post("/v1/completions", responses=STREAMED | _REFUSALS)(self.completions)
        app.post("/v1/chat/completions", responses=STREAMED | _REFUSALS)(self.chat_completions)
        add_tokenizer_routes(app, self)  # /tokenize, /detokenize, /tokenizer_info, /version

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI):
        if not self.engine.started:
            self.engine.start()
        yield
        self.engine.shutdown()

    # ---- errors and the API key ---------------------------------------------------------------
    async def on_api_error(self, request: Request, err: APIError):
        self.metrics.refuse(err.status, err.code or err.type)
        return _error(err)

    async def on_validation_error(self, request: Request, err: RequestValidationError):
        errors = err.errors()
        first = errors[0] if errors else {}
        if first.get("type") == "json_invalid":
            return _error(APIError(400, "the request body is not valid JSON"))
        # A field that takes one of several shapes (tool_choice: a string or a named function) fails once a shape:
        # each is said, and the param is the field's path without pydantic's shape tags ("literal[...]", "bool")
        field = _field_path(first)
        said = [e for e in errors if _field_path(e).split(".")[0] == field.split(".")[0]][:3]
        message = "; or ".join(f"{_field_path(e) or 'body'}: {e.get('msg', 'invalid value')}" for e in said)
        self.metrics.refuse(400, "invalid_request")
        return _error(APIError(400, message, param=field.split(".")[0] if len(said) > 1 else field or None))

    async def check_api_key(self, request: Request, call_next):
        if self.api_key and request.url.path.startswith("/v1/"):
            if request.headers.get("authorization", "") != f"Bearer {self.api_key}":
                return _error(
                    APIError(
                        401,
                        "missing or wrong API key: send 'Authorization: Bearer <key>'",
                        "authentication_error",
                        code="invalid_api_key",
                        headers={"WWW-Authenticate": "Bearer"},  # (RFC 9110: a 401 says the scheme it wants)
                    )
                )
        return await call_next(request)

    # ---- routes (no docstrings: see the class's) -----------------------------------------------
    async def health(self):
        if not self.engine.is_running:
            return _error(APIError(503, f"engine is not running: {self.engine.error}", "service_unavailable"))
        return {"status": "ok"}

    async def kv_transfer(self):
        connector = self.engine.engine.kv_connector
        if connector is None:
            return {"kv_role": None, "kv_connector": None}
        return connector.describe()

    async def kv_transfer_release(self, request: Request):
        connector = self.engine.engine.kv_connector
        if connector is None or connector.role != "producer":
            return _error(
                APIError(404, "this server is not a KV producer (serve --kv-role producer)", "not_found_error")
            )
        try:
            body = json.loads(await request.body())
            transfer_id = body["transfer_id"]
        except (ValueError, TypeError, KeyError):
            transfer_id = None
        if not isinstance(transfer_id, str):
            return _error(APIError(400, 'send {"transfer_id": "<id from kv_transfer_params>"}', param="transfer_id"))
        self.engine.release_kv_transfer(transfer_id)  # (the engine thread ends it if it is one of its leases)
        return JSONResponse({"transfer_id": transfer_id, "queued": True}, status_code=202)

    async def prometheus(self):
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_card(self, name: str) -> dict:
        return {
            "id": name,
            "object": "model",
            "created": self.started,
            "owned_by": "infertune",
            "root": self.engine.engine.config.model.model,
            "parent": None,
            "max_model_len": self.engine.engine.max_model_len,
        }

    async def models(self):
        return {"object": "list", "data": [self.model_card(name) for name in self.served_model_names]}

    async def model(self, model_id: str):
        self.check_model(model_id)  # (OpenAI's models.retrieve: a 404 model_not_found for another name)
        return self.model_card(model_id)

    async def completions(self, req: CompletionRequest, request: Request):
        self.check_model(req.model)
        req.check_supported()
        params = self.params_of(lambda: req.completion_params(self.engine.engine.sampling_defaults))
        prompts = req.prompts()
        if len(prompts) > self.limits.max_prompts:
            raise APIError(
                400,
                f"{len(prompts)} prompts in one request is more than this server's limit of "
                f"{self.limits.max_prompts} (engine option max_prompts); send them in several requests",
                param="prompt",
                code="request_too_large",
            )
        fmt = Formatter(f"cmpl-{uuid.uuid4().hex}", self.model_name, self.tokenizer, chat=False, echo=req.echo)
        _check_remote_decode(params, len(prompts), req.stream)
        streams = await self.submit(
            fmt.id, prompts, params, "prompt", req.truncate_prompt_tokens, constraint=req.constraint_field()
        )
        return await self.respond(request, fmt, streams, params.n, req.stream, req.include_usage, req.continuous_usage)

    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        self.check_model(req.model)
        req.check_supported()
        if req.continue_final_message and req.add_generation_prompt:
            raise APIError(
                400,
                "continue_final_message continues the last message: send add_generation_prompt=false with it",
                param="continue_final_message",
            )
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        # (a bad max_completion_tokens is named as the client sent it)
        renamed = {"logprobs": "top_logprobs"}  # (chat's logprobs is a switch; the count is top_logprobs)
        if req.max_completion_tokens is not None:
            renamed["max_tokens"] = "max_completion_tokens"
        defaults = self.engine.engine.sampling_defaults  # (the model's generation_config.json)
        params = self.params_of(lambda: req.sampling_params(max_tokens, req.logprobs_k(), defaults=defaults), renamed)
        # Tool calling (serve/tools.py): the plan checks tool_choice, adjusts params, parses the output.
        tools = template_tools(req.tools)
        plan = ToolPlan.of(
            tools, req.tool_choice, req.parallel_tool_calls, self.tool_call_parser, self.enable_auto_tool_choice
        )
        params = self.params_of(lambda: plan.sampling_params(params, req.guided_whitespace_pattern))
        try:
            prompt = await asyncio.to_thread(
                self.engine.engine.render_chat,
                req.conversation(),
                chat_template=self.template_of(req.chat_template),
                add_generation_prompt=req.add_generation_prompt,
                tools=tools,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.chat_template_kwargs,
            )
        except ParamError as e:  # (a chat_template_kwargs key the server sets itself)
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        fmt_args = (f"chatcmpl-{uuid.uuid4().hex}", self.model_name, self.tokenizer)
        fmt = ToolFormatter(plan, *fmt_args, chat=True) if plan.active else Formatter(*fmt_args, chat=True)
        _check_remote_decode(params, 1, req.stream)
        # (a forced tool_choice's constraint is the tools' parameters schemas)
        constraint = "tools" if plan.choice in ("required", "named") else req.constraint_field()
        streams = await self.submit(
            fmt.id, [prompt], params, "messages", req.truncate_prompt_tokens, constraint=constraint
        )
        return await self.respond(request, fmt, streams, params.n, req.stream, req.include_usage, req.continuous_usage)

    # ---- from a request to the engine's streams ---------------------------------------------------
    def template_of(self, requested: str | None) -> str | None:
        """The chat template a request renders with: its own, else the server's (--chat-template), else None (the
        checkpoint's)."""
        return requested if requested is not None else self.chat_template

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            served = " or ".join(repr(n) for n in self.served_model_names)
            raise APIError(
                404,
                f"the model {name!r} does not exist; this server serves {served}",
                "not_found_error",
                param="model",
                code="model_not_found",
            )

    @staticmethod
    def params_of(make, renamed: dict[str, str] | None = None) -> SamplingParams:
        try:
            return make()
        except ParamError as e:
            param = (renamed or {}).get(e.param, e.param)
            raise APIError(400, str(e).replace(e.param, param, 1), param=param) from None

    def tokenized(self, prompts: list[object], truncate: int | None = None) -> list[dict]:
        """Text prompts as {"prompt", "prompt_token_ids"}, so the engine thread does not tokenize (run off-loop).
        truncate (vLLM's truncate_prompt_tokens): keep each prompt's last `truncate` tokens (-1: max_model_len - 1);
        the text then goes (the response's prompt is the kept tokens' text)."""
        if truncate == -1:
            truncate = self.engine.engine.max_model_len - 1
        out = []
        for p in prompts:
            text, ids = self.engine.engine.tokenize(p)
            if truncate is not None and len(ids) > truncate:
                text, ids = None, ids[len(ids) - truncate :]
            out.append({"prompt": text, "prompt_token_ids": ids})
        return out

    async def submit(
        self,
        request_id: str,
        prompts: list[object],
        params: SamplingParams,
        param: str,
        truncate: int | None = None,
        constraint: str = "structured_outputs",
    ) -> list[RequestStream]:
        """constraint: the request's field that asked for params.structured_outputs (named by a compile error)."""
        try:
            if params.structured_outputs is not None:  # compile (or find cached) the grammar off the event loop
                try:
                    await asyncio.to_thread(self.engine.engine.structured_output_spec, params)
                except ParamError as e:
                    raise APIError(400, str(e), param=constraint) from None
            self.engine.engine.check_params(params)  # cheap bounds first: no tokenizing for a request refused anyway
            prompts = await asyncio.to_thread(self.tokenized, prompts, truncate)
            return await self.engine.add_requests(request_id, prompts, params)
        except Exception as e:  # noqa: BLE001 - refusals become their HTTP answers, anything else a 500
            err = _api_error(e, param)
            if err is None:
                raise
            raise err from None

    # ---- from the streams to the client -----------------------------------------------------------
    async def respond(
        self,
        request: Request,
        fmt: Formatter,
        streams: list[RequestStream],
        n: int,
        stream: bool,
        include_usage: bool,
        continuous_usage: bool = False,
    ):
        if stream:
            events = self.stream_events(fmt, streams, n, include_usage, continuous_usage)
            return StreamingResponse(events, media_type="text/event-stream")
        collecting = asyncio.ensure_future(_collect(streams))
        gone = asyncio.ensure_future(_until_disconnected(request))
        try:
            await asyncio.wait({collecting, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not collecting.done():
                collecting.cancel()  # the client went away (or this handler was cancelled): abort below
            for s in streams:
                s.abort()
        if not collecting.done() or collecting.cancelled():
            return Response(status_code=499)  # nobody reads it; nginx's "client closed request"
        try:
            finals = collecting.result()
        except Exception as e:  # noqa: BLE001 - an engine refusal mid-request (timeout, shutdown) -> its answer
            err = _api_error(e, "prompt")
            if err is None:
                raise
            raise err from None
        for out in finals:
            self.metrics.observe_finished(out)
        return fmt.response(finals, n)

    async def stream_events(
        self, fmt: Formatter, streams: list[RequestStream], n: int, include_usage: bool, continuous_usage: bool = False
    ) -> AsyncIterator[str]:
        """continuous_usage (vLLM's continuous_usage_stats): every chunk carries its choice's usage so far."""
        sent_text: dict[int, int] = {}
        sent_logprobs: dict[int, int] = {}
        next_offset: dict[int, int] = {}  # choice -> the text offset of its next logprob entry
        finals: dict[int, RequestOutput] = {}
        try:
            async for i, out in merge(streams):
                for c in out.outputs:
                    index = i * n + c.index
                    first = index not in sent_text
                    start, lp_start = sent_text.get(index, 0), sent_logprobs.get(index, 0)
                    delta = c.text[start:]
                    if first and fmt.echo:  # the prompt (and its logprobs) go out with the first chunk
                        delta = fmt.prompt_text(out) + delta
                        lp = fmt.echoed(out, c, c.logprobs[lp_start:])[1] if c.logprobs is not None else None
                    else:  # (text offsets run on from the last token's, as in the whole response)
                        offset = next_offset.get(index, len(fmt.prompt_text(out)) if fmt.echo else 0)
                        lp = fmt.logprobs(c.logprobs[lp_start:], offset) if c.logprobs is not None else None
                    if lp and lp.get("tokens"):
                        next_offset[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
                    chunks = []
                    if isinstance(fmt, ToolFormatter):  # tool calling: content and tool-call deltas
                        chunks = fmt.tool_chunks(index, c, lp, first)
                    elif delta or first or c.finish_reason or (lp and c.logprobs[lp_start:]):
                        chunks = [fmt.chunk(index, delta, c.finish_reason, lp, first=first, stop_reason=c.stop_reason)]
                    for chunk in chunks:
                        if continuous_usage:  # (this choice's: its prompt and its tokens so far, as vLLM's)
                            prompt, done = len(out.prompt_token_ids), len(c.token_ids)
                            chunk["usage"] = {
                                "prompt_tokens": prompt,
                                "completion_tokens": done,
                                "total_tokens": prompt + done,
                            }
                        yield sse(chunk)
                    sent_text[index] = len(c.text)
                    sent_logprobs[index] = len(c.logprobs or [])
                if out.finished:
                    finals[i] = out
                    self.metrics.observe_finished(out)
            if include_usage:
                yield sse(fmt.usage_chunk([finals[i] for i in sorted(finals)]))
            yield sse("[DONE]")
        except (EngineDeadError, RequestTimeoutError, RequestFailedError) as e:
            err = _api_error(e, "prompt")
            self.metrics.refuse(err.status, err.code)
            yield sse(err.body())
            yield sse("[DONE]")  # (the stream ends as every stream does, as vLLM's does after an error event)
        finally:
            for s in streams:
                s.abort()


async def _collect(streams: list[RequestStream]) -> list[RequestOutput]:
    """The final output of each stream, in order."""
    finals = []
    for s in streams:
        last = None
        async for out in s:
            last = out
        finals.append(last)
    return finals


async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several request streams as (stream index, output), as soon as each output arrives."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    # Bounded: a pump waits while the consumer (a slow client) lags, and its stream skips to the newest output.
    queue: asyncio.Queue = asyncio.Queue(maxsize=len(streams))
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
