"""Async Python facade with vLLM's shape: AsyncLLM(model, **engine options), `async for out in generate(...)`.

    async with AsyncLLM("path/to/model", max_model_len=2048) as engine:
        async for out in engine.generate("The cache", SamplingParams(max_tokens=32), "req-1"):
            print(out.outputs[0].text)  # cumulative: the text so far
        await engine.abort("req-2")  # from another task: req-2's iteration ends, its KV blocks are freed

The engine loop runs in its own thread (engine/async_engine.py, the server's); any number of generate() calls
run concurrently on one event loop and are batched together. Requests are admitted as the server admits them
(engine/admission.py: ValueError when one can never fit, Overloaded when the queue is full now), and a
max_tokens past the context is shortened to fit, as LLM.generate does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Iterable
from itertools import count

from infertune.config import EngineConfig
from infertune.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from infertune.engine.llm_engine import LLMEngine, check_request_options
from infertune.engine.outputs import OutputShaper, RequestOutput
from infertune.sampling_params import RequestOutputKind, SamplingParams


class AsyncLLM:
    """Load a Hugging Face folder once, then stream generations for concurrent requests from asyncio.

    Engine options are LLM's (see infertune.LLM and the README's options table). The engine thread starts here;
    shutdown() (or leaving `async with`) stops it.
    """

    def __init__(self, model: str | None = None, **engine_options) -> None:
        self.config = EngineConfig.create(model, **engine_options)
        self.engine = AsyncLLMEngine(LLMEngine(self.config), cap_max_tokens=True)
        self.engine.start()
        self._streams: dict[str, RequestStream | None] = {}  # (None: being submitted)
        self._ids = count()

    @classmethod
    def from_engine_args(cls, engine_args, *args, **kwargs) -> AsyncLLM:
        """vLLM's constructor: an engine from an AsyncEngineArgs (infertune.AsyncEngineArgs); vLLM's other
        arguments (usage_context, stat_loggers, ...) have nothing to set here."""
        options = {k: v for k, v in engine_args.options().items() if k not in ("chat_template", "show_progress")}
        return cls(engine_args.model, **options)

    @property
    def tokenizer(self):
        return self.engine.engine.tokenizer

    def get_tokenizer(self):
        """The engine's tokenizer (vLLM's AsyncLLM.get_tokenizer)."""
        return self.engine.engine.tokenizer

    async def generate(
        self,
        prompt: str | dict | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        lora_request=None,
        tokenization_kwargs: dict | None = None,
        trace_headers=None,
        priority: int = 0,
        prompt_text: str | None = None,
        data_parallel_rank: int | None = None,
        session_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Submit one prompt (text, token ids or {"prompt_token_ids": [...]}) and yield its RequestOutput after
        every step that advanced it (outputs are cumulative; the last has finished=True). Leaving the loop early
        aborts the request. After abort(request_id) the iteration ends with an output whose unfinished
        completions say finish_reason "abort" (none if nothing was generated yet). The keywords are vLLM's:
        tokenization_kwargs as LLM.generate takes them, prompt_text the output's prompt for token ids, trace_headers and
        session_id unread; a lora_request, a non-zero priority or data_parallel_rank is refused by name."""
        check_request_options(lora_request, priority)
        if prompt_text is not None and isinstance(prompt, dict) and prompt.get("prompt") is None:
            prompt = {**prompt, "prompt": prompt_text}
        if data_parallel_rank:
            raise ValueError("data_parallel_rank: one engine here (replicas: infertune serve --data-parallel-size)")
        if tokenization_kwargs:
            prompt = self.engine.engine.tokenized(prompt, tokenization_kwargs)
        request_id = str(request_id) if request_id is not None else f"async-{next(self._ids)}"
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        self._streams[request_id] = None  # (taken before the await: a second generate() with this id is refused)
        try:
            params = sampling_params or self.engine.engine.default_sampling_params()
            # (the engine thread hands over each request's newest whole output; vLLM's output_kind is applied here)
            shape = OutputShaper(params.output_kind)
            if params.output_kind:
                params = dataclasses.replace(params, output_kind=RequestOutputKind.CUMULATIVE)
            stream = await self.engine.add_request(request_id, prompt, params)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        self._streams[request_id] = stream
        last: RequestOutput | None = None
        try:
            async for out in stream:
                last = out
                if (shaped := shape(out)) is not None:
                    yield shaped
            if last is not None and not last.finished:  # aborted: say so once
                yield shape(_aborted(last))
        finally:
            self._streams.pop(request_id, None)
            stream.abort()

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop a request, or each of a list of them (vLLM's AsyncLLM.abort takes either): its KV blocks are freed
        within a step and its generate() iteration ends. An unknown or finished id is ignored."""
        ids = [request_id] if isinstance(request_id, str) or not isinstance(request_id, Iterable) else request_id
        for rid in ids:
            stream = self._streams.get(str(rid))
            if stream is not None:
                stream.cancel()

    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prompt prefix that no running request holds (vLLM's AsyncLLM.reset_prefix_cache), on
        the engine thread between two steps. True when nothing cached is left; False where running requests still
        hold blocks (they keep them: LLM.reset_prefix_cache's rule)."""
        return await self.engine.run_on_engine_thread(lambda engine: engine.reset_prefix_cache())

    def chat(self, messages: list[dict], chat_template: str | None = None, add_generation_prompt: bool = True) -> dict:
        """A conversation rendered through the model's chat template, as a prompt for generate()."""
        return self.engine.engine.render_chat(messages, chat_template, add_generation_prompt)

    @property
    def num_unfinished_requests(self) -> int:
        stats = self.engine.stats
        return stats["num_running"] + stats["num_waiting"]

    # vLLM's AsyncLLM health and bookkeeping calls, on the engine thread's state
    def get_num_unfinished_requests(self) -> int:
        return self.num_unfinished_requests

    @property
    def is_running(self) -> bool:
        """The engine thread runs and has not failed."""
        return self.engine.is_running

    @property
    def is_stopped(self) -> bool:
        return not self.engine.is_running

    @property
    def errored(self) -> bool:
        """The engine thread stopped on an error (dead_error says which)."""
        return self.engine.error is not None

    @property
    def dead_error(self) -> BaseException:
        return EngineDeadError(f"the engine stopped after an error: {self.engine.error}")

    async def check_health(self) -> None:
        """vLLM's: raise EngineDeadError once the engine thread has failed or stopped."""
        if self.engine.error is not None:
            raise self.dead_error
        if not self.engine.is_running:
            raise EngineDeadError("the engine is shut down")

    def shutdown(self) -> None:
        """Stop the engine thread and its workers; running requests end with an EngineDeadError."""
        self.engine.shutdown()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc) -> None:
        self.shutdown()


def _aborted(out: RequestOutput) -> RequestOutput:
    outputs = [c if c.finished else dataclasses.replace(c, finish_reason="abort") for c in out.outputs]
    return dataclasses.replace(out, outputs=outputs, finished=True)
