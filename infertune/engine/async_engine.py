"""AsyncLLMEngine: the engine loop in its own thread, with an asyncio face for the server.

Only the engine thread touches the LLMEngine. The asyncio side hands it submissions and aborts through a
locked inbox; each accepted request gets a mailbox that holds its newest RequestOutput (outputs are cumulative,
so a consumer that falls behind skips to the latest and at most one output per request waits in memory), woken
through call_soon_threadsafe. A long prefill step never blocks the HTTP event loop (torch releases the GIL).

Admission (engine/admission.py) happens on the engine thread before anything is queued: a submission of several
prompts is accepted or refused whole. Deadlines (LimitsConfig.request_timeout) are enforced there too.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from infertune.engine.admission import Admission, HostCost, Overloaded
from infertune.engine.host_memory import auto_ceiling, process_rss
from infertune.engine.llm_engine import STEP_REQUESTS, LLMEngine
from infertune.engine.outputs import RequestOutput
from infertune.sampling_params import SamplingParams

log = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine loop stopped after an internal error, or the server is shutting down."""


class RequestTimeoutError(RuntimeError):
    """The request passed its deadline (LimitsConfig.request_timeout) and was aborted."""


class RequestFailedError(RuntimeError):
    """A step running this request raised: the step's requests were aborted and the engine went on (a 500 for
    them; the others never see it). Several failed steps in a row stop the engine (EngineDeadError)."""


# Failed steps in a row after which the engine is taken for broken (a dead worker fails every step) and stops.
MAX_FAILED_STEPS = 3


class _Mailbox:
    """The newest output (or the error) of one request, handed from the engine thread to one asyncio consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._lock = threading.Lock()
        self._item: RequestOutput | BaseException | None = None
        self._event = asyncio.Event()

    def put(self, item: RequestOutput | BaseException) -> None:  # engine thread
        with self._lock:
            if isinstance(self._item, BaseException):
                return  # an error is the last word
            wake = self._item is None
            self._item = item
        if wake:
            _call_soon(self.loop, self._event.set)

    async def get(self) -> RequestOutput | BaseException:  # the consumer's event loop
        while True:
            await self._event.wait()
            with self._lock:
                item, self._item = self._item, None
                self._event.clear()
            if item is not None:
                return item


@dataclass(slots=True)
class _Submission:
    key: str  # the admission ledger's key: one submission, accepted or refused whole
    request_ids: list[str]
    prompts: list[object]
    params: SamplingParams
    loop: asyncio.AbstractEventLoop
    accepted: asyncio.Future
    mailboxes: list[_Mailbox]
    arrival: float = field(default_factory=time.perf_counter)


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, error: BaseException | None = None) -> None:
    def set_it() -> None:
        if fut.done():  # the awaiting coroutine was cancelled
            return
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(None)

    _call_soon(loop, set_it)


def _settle(fut: asyncio.Future, result, error: BaseException | None) -> None:
    if not fut.done():  # (the awaiting coroutine was cancelled)
        fut.set_exception(error) if error is not None else fut.set_result(result)


def _call_soon(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the client's event loop is already closed: nobody is listening
        pass


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, idle_wait_s: float = 0.05, cap_max_tokens: bool = False) -> None:
        self.engine = engine
        # Servers follow OpenAI: a max_tokens past the context is an error, not silently shortened.
        self.cap_max_tokens = cap_max_tokens
        self.limits = engine.config.limits
        self.idle_wait_s = idle_wait_s
        baseline = process_rss()
        info = engine.executor.kv_cache_info
        ceiling = self.limits.memory_limit or auto_ceiling(baseline)
        if self.limits.memory_limit is not None and self.limits.memory_limit <= baseline:
            engine.shutdown()
            raise ValueError(
                f"memory_limit={self.limits.memory_limit / 2**20:.0f} MiB is at or below what this process holds "
                f"with the model loaded ({baseline / 2**20:.0f} MiB): every request would be refused; raise it (or "
                "leave it unset: 90% of what the process could hold at start-up)"
            )
        # The host cost is measured once, by measure_host_cost() (the server's, with its response body) or at start.
        self.admission = Admission(
            self.limits,
            info.num_blocks,
            info.block_size,
            None,
            ceiling,
            baseline,
            process_rss,
            engine.config.scheduler.max_num_seqs,
            engine.block_manager.max_blocks_per_seq,
        )
        self._inbox: list[_Submission] = []
        self._aborts: list[str] = []
        self._releases: list[str] = []  # producer leases to end (release_kv_transfer)
        self._calls: list[tuple] = []  # (fn, loop, future): run_on_engine_thread's, between two steps
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._mailboxes: dict[str, _Mailbox] = {}
        self._group_of: dict[str, str] = {}  # request id -> its submission's key
        self._group_left: dict[str, int] = {}  # submission key -> its requests not yet finished
        self._deadlines: list[tuple[float, str, tuple[str, ...]]] = []  # heap of (deadline, key, request ids)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.num_aborted = 0
        self.num_timed_out = 0
        self.num_failed_steps = 0  # steps that raised (their requests aborted, the engine went on)
        self._end_in_flight = threading.Event()  # (end_in_flight: the server's grace period is over)
        self.failed_steps_in_a_row = 0
        # Finished requests by finish reason, counted here (not by the HTTP handler) so a request whose client left
        # just as it finished is still counted: each accepted request ends up finished, aborted or timed out.
        self.num_finished: dict[str, int] = {}
        # Snapshot of engine stats, refreshed by the engine thread after each step (read by /metrics).
        self.stats: dict = engine.stats()
        self.step_listeners: list = []  # callables(outputs, step_seconds) run on the engine thread

    def measure_host_cost(self, response_of=None) -> None:
        """Measure what a request holds, with what the caller keeps of a finished one (response_of(output), e.g. the
        server's response body). Before start(); start() measures without it if nobody did."""
        assert not self.started, "measure the host cost before the engine loop starts"
        self.admission.host = self.engine.measure_host_cost(response_of)

    @property
    def host_cost(self) -> HostCost:
        if self.admission.host is None:
            self.measure_host_cost()
        return self.admission.host

    def describe_limits(self) -> str:
        a, c, lim = self.admission, self.host_cost, self.limits
        return (
            f"admission: n <= {lim.max_n}, {lim.max_waiting} waiting sequences ({lim.max_seqs_per_request} a "
            f"request); host memory ceiling {a.ceiling_bytes / 2**30:.2f} GiB, {a.baseline_bytes / 2**30:.2f} GiB "
            f"at start-up; a request holds ~{c.per_seq / 1024:.1f} KiB a sequence + {c.per_token:.0f} B a token "
            f"(+{c.per_logprob:.0f} B a logprob entry); deadline "
            + (f"{lim.request_timeout:g} s" if lim.request_timeout else "none")
        )

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        assert self._thread is None, "already started"
        if self.admission.host is None:
            self.measure_host_cost()
        self._thread = threading.Thread(target=self._run, name="infertune-engine", daemon=True)
        self._thread.start()

    def end_in_flight(self) -> None:
        """End every request now (the server's grace period is over): each consumer gets EngineDeadError "the server
        is shutting down" (a stream's error event, a 503), the engine frees their blocks; new ones keep coming in
        only until the server stops accepting. Thread-safe: done by the engine thread before its next step."""
        self._end_in_flight.set()
        self._wake.set()

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                return  # still inside a step: its workers go down with the process
        self.engine.shutdown()

    @property
    def started(self) -> bool:
        return self._thread is not None

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- asyncio side ----------------------------------------------------------------------------
    async def add_request(self, request_id: str, prompt: object, params: SamplingParams) -> RequestStream:
        """Submit one request; return once the engine thread accepted it.

        Raises ValueError (invalid: NeverFits / ParamError), Overloaded (not now: 429 / 503) or EngineDeadError.
        """
        return (await self._submit(request_id, [request_id], [prompt], params))[0]

    async def add_requests(self, request_id: str, prompts: list[object], params: SamplingParams) -> list[RequestStream]:
        """Submit several prompts as one request (ids request_id-0, -1, ...): all are accepted or none."""
        ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        return await self._submit(request_id, ids, list(prompts), params)

    async def _submit(
        self, key: str, request_ids: list[str], prompts: list[object], params: SamplingParams
    ) -> list[RequestStream]:
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.error}")
        if self._stop.is_set():
            raise EngineDeadError("the server is shutting down")
        loop = asyncio.get_running_loop()
        sub = _Submission(
            key, request_ids, prompts, params, loop, loop.create_future(), [_Mailbox(loop) for _ in request_ids]
        )
        with self._lock:
            self._inbox.append(sub)
        self._wake.set()
        try:
            await sub.accepted
        except asyncio.CancelledError:
            for request_id in request_ids:
                self.abort(request_id)  # it may have been accepted meanwhile
            raise
        return [RequestStream(self, rid, box) for rid, box in zip(request_ids, sub.mailboxes)]

    async def generate(self, request_id: str, prompt: object, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """add_request + iterate: yields the RequestOutput after every step that advanced the request."""
        stream = await self.add_request(request_id, prompt, params)
        async for out in stream:
            yield out

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.append(request_id)
        self._wake.set()

    async def run_on_engine_thread(self, fn):
        """fn(engine) on the engine thread between two steps (the LLMEngine is not thread-safe), its result or its
        exception handed back here: for calls on the engine's state from a client (reset_prefix_cache)."""
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error: {self.error}")
        if self._stop.is_set():
            raise EngineDeadError("the engine is shut down")
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            self._calls.append((fn, loop, fut))
        self._wake.set()
        return await fut

    def release_kv_transfer(self, transfer_id: str) -> None:
        """End a producer's lease on the engine thread (LLMEngine.release_kv_transfer), before its next step."""
        with self._lock:
            self._releases.append(transfer_id)
        self._wake.set()

    # ---- engine thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain_inbox()
                self._expire_deadlines()
                if self._end_in_flight.is_set():
                    self._end_in_flight.clear()
                    self._end_all(EngineDeadError("the server is shutting down"))
                if self.engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    try:
                        outputs = self.engine.step()
                    except Exception as e:  # noqa: BLE001 - a failed step: its requests only, where that is safe
                        if getattr(e, STEP_REQUESTS, None) is None:
                            raise  # (not a step's failure: the loop's own, fatal as before)
                        self._step_failed(getattr(e, STEP_REQUESTS), e)
                        continue
                    self.failed_steps_in_a_row = 0
                    elapsed = time.perf_counter() - t0
                    self.stats = self.engine.stats()  # (before the outputs: a client that reads them sees this step)
                    for out in outputs:
                        self._deliver(out)
                    for listener in self.step_listeners:
                        listener(outputs, elapsed)
                else:
                    self.engine.executor.check_health()  # (a worker that died while idle: /health says so now)
                    self.engine.poll_kv_transfers()  # (a producer frees confirmed or expired leases while idle)
                    self.stats = self.engine.stats()
                    wait = self.idle_wait_s
                    if self._deadlines:
                        wait = min(wait, max(self._deadlines[0][0] - time.perf_counter(), 0.0))
                    self._wake.wait(wait)
                    self._wake.clear()
        except Exception as e:  # noqa: BLE001 - any engine failure must reach every waiting client
            log.exception("engine loop failed")
            self.error = e
            self._fail_all(EngineDeadError(f"the engine stopped after an error: {e}"))
            return
        self._fail_all(EngineDeadError("the server is shutting down"))
        for request_id in list(self._group_of):
            self.engine.abort_request(request_id)

    def _step_failed(self, request_ids: list[str], cause: Exception) -> None:
        """One step raised (a request's options the checks let through that the model code cannot run, a bug): its
        requests are aborted and told why (RequestFailedError, a 500), the engine goes on for everyone else. A few
        failures in a row mean the engine itself is broken: raised on, it stops (EngineDeadError for all)."""
        self.failed_steps_in_a_row += 1
        self.num_failed_steps += 1
        if self.failed_steps_in_a_row >= MAX_FAILED_STEPS or not self.engine.executor.recovers_from_step_errors:
            raise cause  # (a broken engine, or workers in other processes a failed step may leave waiting)
        log.error("a step failed; its %d request(s) were aborted, the engine goes on", len(request_ids), exc_info=cause)
        error = RequestFailedError(
            f"the engine step running this request failed and it was aborted: {type(cause).__name__}: {cause}"
        )
        for request_id in request_ids:
            self._end_request(request_id, error)

    def _end_all(self, error: EngineDeadError) -> None:
        """Abort every admitted request and hand its consumer `error` (engine thread)."""
        for request_id in list(self._group_of):
            self.num_aborted += self._end_request(request_id, error)

    def _end_request(self, request_id: str, error: BaseException) -> bool:
        """Abort one admitted request, hand its consumer `error` (its last output was delivered if it had finished:
        the mailbox is gone then) and close it (engine thread). Returns whether it was still running."""
        box = self._mailboxes.get(request_id)
        aborted = self.engine.abort_request(request_id)
        if aborted and box is not None:
            box.put(error)
        self._close(request_id)
        return aborted

    def _fail_all(self, error: EngineDeadError) -> None:
        with self._lock:
            pending, self._inbox = self._inbox, []
            calls, self._calls = self._calls, []
        for sub in pending:
            _resolve(sub.loop, sub.accepted, error)
        for _, loop, fut in calls:  # (run_on_engine_thread's callers: the engine is gone, not hung)
            _call_soon(loop, _settle, fut, None, error)
        for box in self._mailboxes.values():
            box.put(error)

    def _drain_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
            aborts, self._aborts = self._aborts, []
            releases, self._releases = self._releases, []
            calls, self._calls = self._calls, []
        for fn, loop, fut in calls:
            try:
                result, error = fn(self.engine), None
            except Exception as e:  # noqa: BLE001 - the caller's to handle
                result, error = None, e
            _call_soon(loop, _settle, fut, result, error)
        for transfer_id in releases:
            self.engine.release_kv_transfer(transfer_id)
        for sub in inbox:  # before the aborts: a submission cancelled while queued is aborted right after
            self._admit(sub)
        for request_id in aborts:
            if self.engine.abort_request(request_id):
                self.num_aborted += 1
            self._close(request_id)

    def _admit(self, sub: _Submission) -> None:
        engine, params = self.engine, sub.params
        try:
            prepared = [engine.prepare(p, params, self.cap_max_tokens) for p in sub.prompts]
            cost = self.admission.cost(
                [len(p.token_ids) for p in prepared], [p.max_tokens for p in prepared], params.n, params.logprobs
            )
            self.admission.reserve(sub.key, cost, engine.scheduler.num_waiting)
        except (ValueError, Overloaded) as e:
            _resolve(sub.loop, sub.accepted, e)
            return
        except Exception as e:  # noqa: BLE001 - one submission's failure is its own, never the engine loop's
            log.exception("a request could not be prepared")
            _resolve(sub.loop, sub.accepted, RequestFailedError(f"the request could not be prepared: {e}"))
            return
        added: list[str] = []
        try:
            for request_id, prep in zip(sub.request_ids, prepared):
                engine.enqueue(request_id, prep, params, arrival_time=sub.arrival)
                added.append(request_id)
        except ValueError as e:  # a duplicate id: undo the whole submission
            for request_id in added:
                engine.abort_request(request_id)
            self.admission.release(sub.key)
            _resolve(sub.loop, sub.accepted, e)
            return
        for request_id, box in zip(sub.request_ids, sub.mailboxes):
            self._mailboxes[request_id] = box
            self._group_of[request_id] = sub.key
        self._group_left[sub.key] = len(sub.request_ids)
        if self.limits.request_timeout is not None:
            heapq.heappush(
                self._deadlines, (sub.arrival + self.limits.request_timeout, sub.key, tuple(sub.request_ids))
            )
        _resolve(sub.loop, sub.accepted)

    def _expire_deadlines(self) -> None:
        now = time.perf_counter()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, key, request_ids = heapq.heappop(self._deadlines)
            if key not in self._group_left:
                continue  # finished in time
            self.num_timed_out += 1
            error = RequestTimeoutError(
                f"the request did not finish within the server's request timeout of {self.limits.request_timeout:g} s"
                " and was aborted"
            )
            for request_id in request_ids:
                self._end_request(request_id, error)

    def _close(self, request_id: str) -> None:
        """The request is done (finished, aborted or expired): forget its mailbox, release its submission."""
        self._mailboxes.pop(request_id, None)
        key = self._group_of.pop(request_id, None)
        if key is None:
            return
        self._group_left[key] -= 1
        if not self._group_left[key]:
            del self._group_left[key]
            self.admission.release(key)

    def _deliver(self, out: RequestOutput) -> None:
        if out.finished:
            for c in out.outputs:
                reason = c.finish_reason or "unknown"
                self.num_finished[reason] = self.num_finished.get(reason, 0) + 1
        box = self._mailboxes.get(out.request_id)
        if box is None:
            return
        box.put(out)
        if out.finished:
            self._close(out.request_id)


class RequestCancelled(Exception):
    """What cancel() hands a waiting consumer: its iteration ends (no exception reaches it)."""


class RequestStream:
    """The outputs of one accepted request. Leaving the iteration before the end aborts the request."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, mailbox: _Mailbox) -> None:
        self.engine = engine
        self.request_id = request_id
        self._mailbox = mailbox
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._mailbox.get()
                if isinstance(item, RequestCancelled):
                    return
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

    def cancel(self) -> None:
        """Abort from outside the iteration (another task, e.g. AsyncLLM.abort): a consumer waiting for the next
        output wakes and its iteration ends."""
        if not self.finished:
            self.abort()
            self._mailbox.put(RequestCancelled())
