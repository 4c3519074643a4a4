"""AsyncLLMEngine: the engine loop in its own thread, with an asyncio face for the server.

Only the engine thread touches the LLMEngine. The asyncio side hands it requests and aborts through a
locked inbox and receives RequestOutputs on a per-request asyncio.Queue (via call_soon_threadsafe),
so a long prefill step never blocks the HTTP event loop (torch releases the GIL while it computes).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from infertune.engine.llm_engine import LLMEngine
from infertune.engine.outputs import RequestOutput
from infertune.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """The waiting queue is at its limit: the caller should retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error; requests cannot be served."""


@dataclass(slots=True)
class _Submission:
    request_id: str
    prompt: object
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future
    queue: asyncio.Queue


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, error: BaseException | None = None) -> None:
    def set_it() -> None:
        if fut.done():  # the awaiting coroutine was cancelled
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(None)

    _call_soon(loop, set_it)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the client's event loop is already closed: nobody is listening
        pass


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, max_waiting: int | None = None, idle_wait_s: float = 0.05,
                 cap_max_tokens: bool = False) -> None:
        self.engine = engine
        # Servers follow OpenAI: a max_tokens past the context is an error, not silently shortened.
        self.cap_max_tokens = cap_max_tokens
        self.max_waiting = max_waiting
        self.idle_wait_s = idle_wait_s
        self._inbox: list[_Submission] = []
        self._aborts: list[str] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, _Submission] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.num_aborted = 0
        # Snapshot of engine stats, refreshed by the engine thread after each step (read by /metrics).
        self.stats: dict = engine.stats()
        self.step_listeners: list = []  # callables(outputs, step_seconds) run on the engine thread

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        assert self._thread is None, "already started"
        self._thread = threading.Thread(target=self._run, name="infertune-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- asyncio side ----------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: object, params: SamplingParams) -> "RequestStream":
        """Submit a request; return once the engine thread accepted it.

        Raises ValueError (invalid request), QueueFullError (backpressure) or EngineDeadError.
        """
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.error}")
        loop = asyncio.get_running_loop()
        sub = _Submission(request_id, prompt, params, loop, loop.create_future(), asyncio.Queue())
        with self._lock:
            self._inbox.append(sub)
        self._wake.set()
        try:
            await sub.accepted
        except asyncio.CancelledError:
            self.abort(request_id)  # it may have been accepted meanwhile
            raise
        return RequestStream(self, sub)

    async def generate(self, request_id: str, prompt: object, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """add_request + iterate: yields the RequestOutput after every step that advanced the request."""
        stream = await self.add_request(request_id, prompt, params)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                if self.engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    outputs = self.engine.step()
                    elapsed = time.perf_counter() - t0
                    for out in outputs:
                        self._deliver(out)
                    self.stats = self.engine.stats()
                    for listener in self.step_listeners:
                        listener(outputs, elapsed)
                else:
                    self.stats = self.engine.stats()
                    self._wake.wait(self.idle_wait_s)
                    self._wake.clear()
        except Exception as e:  # noqa: BLE001 - any engine failure must reach every waiting client
            log.exception("engine loop failed")
            self.error = e
            dead = EngineDeadError(f"the engine stopped after an error: {e}")
            with self._lock:
                pending = list(self._streams.values()) + self._inbox
                self._inbox.clear()
            for sub in pending:
                _resolve(sub.loop, sub.accepted, dead)
                _call_soon(sub.loop, sub.queue.put_nowait, dead)

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
        for request_id in aborts:
            if self.engine.abort_request(request_id):
                self.num_aborted += 1
            self._streams.pop(request_id, None)
        for sub in inbox:
            if self.max_waiting is not None and self.engine.scheduler.num_waiting >= self.max_waiting:
                _resolve(sub.loop, sub.accepted, QueueFullError(
                    f"the server is at capacity ({self.max_waiting} requests waiting); retry later"))
                continue
            try:
                self.engine.add_request(sub.request_id, sub.prompt, sub.params, cap_max_tokens=self.cap_max_tokens)
            except ValueError as e:
                _resolve(sub.loop, sub.accepted, e)
                continue
            self._streams[sub.request_id] = sub
            _resolve(sub.loop, sub.accepted)

    def _deliver(self, out: RequestOutput) -> None:
        sub = self._streams.get(out.request_id)
        if sub is None:
            return
        if out.finished:
            del self._streams[out.request_id]
        _call_soon(sub.loop, sub.queue.put_nowait, out)


class RequestStream:
    """The outputs of one accepted request. Leaving the iteration before the end aborts the request."""

    def __init__(self, engine: AsyncLLMEngine, sub: _Submission) -> None:
        self.engine = engine
        self.request_id = sub.request_id
        self._queue = sub.queue
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._queue.get()
                if isinstance(item, BaseException):
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)
