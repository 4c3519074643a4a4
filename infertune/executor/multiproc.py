"""Multiprocess executor: the model runner in worker processes of their own (spawned), one per tensor-parallel rank,
reached by pickled messages.

The driver sends each step's SchedulerOutput (plain data) down every worker's pipe and gets rank 0's SamplerOutput
back (the other ranks, which computed the same, answer only that they are done); each worker keeps its own request
states, so nothing but that step's message crosses. With tensor_parallel_size > 1 the workers form a
torch.distributed group (the backend's: gloo on CPU) on 127.0.0.1, each pinned to its share of the CPUs
(Backend.bind_rank).

Failures: a worker's exception comes back as the driver's (a ValueError from loading stays a ValueError); with one
worker it stays up for the next call. A worker that dies is a WorkerError that names its rank; with several ranks
any failure stops the whole group (the others would wait in a collective for the missing rank forever), so later
calls fail at once with the first error.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing as mp
import traceback
import weakref
from multiprocessing.connection import wait

from infertune.config import EngineConfig
from infertune.executor.base import Executor
from infertune.executor.worker import free_port, run_step, start_worker, take_comm_stats
from infertune.runner.model_runner import KVCacheInfo
from infertune.runner.sampler import SamplerOutput
from infertune.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)

# After one rank raised, how long the others get to answer before the group is stopped (after one died, none: the
# others wait for it in their next collective, and a client's stream would wait with them).
FAILURE_GRACE_S = 5.0


class WorkerError(RuntimeError):
    """A worker process failed; the message carries its traceback or says which rank died."""


def _portable(e: BaseException) -> BaseException:
    """The exception itself where it pickles and means the same on the driver's side, else a WorkerError."""
    if isinstance(e, (ValueError, TypeError, MemoryError)) and type(e).__module__ == "builtins":
        return e
    return WorkerError(f"the model worker failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")


def _worker_main(conn, config: EngineConfig, show_progress: bool, rank: int = 0, size: int = 1, port: int = 0):
    try:
        runner, describe = start_worker(config, show_progress, rank, size, f"tcp://127.0.0.1:{port}")
        conn.send(("ready", (runner.kv_info, describe)))
    except BaseException as e:  # noqa: BLE001 - handed to the driver, which raises it
        conn.send(("error", _portable(e)))
        return
    while True:
        try:
            kind, payload = conn.recv()
        except EOFError:  # the driver is gone
            return
        if kind == "stop":
            return
        try:
            if kind == "comm_stats":
                conn.send(("ok", take_comm_stats()))
                continue
            out = run_step(runner, payload)
            conn.send(("ok", out if rank == 0 else None))  # the other ranks computed the same
        except BaseException as e:  # noqa: BLE001 - the driver decides; the worker stays up for the next call
            conn.send(("error", _portable(e)))


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, show_progress: bool = False) -> None:
        self.size = size = config.parallel.tensor_parallel_size
        config.model.arch.for_tensor_parallel(
            size, config.parallel.enable_expert_parallel
        )  # a shape that does not split: its error before any spawn
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch threads or locks
        port = free_port() if size > 1 else 0
        self._conns, self._procs = [], []
        self._failed: BaseException | None = None
        for rank in range(size):
            conn, child = ctx.Pipe()
            name = "infertune-worker" if size == 1 else f"infertune-tp{rank}"
            proc = ctx.Process(
                target=_worker_main, args=(child, config, show_progress, rank, size, port), name=name, daemon=True
            )
            proc.start()
            child.close()
            self._conns.append(conn)
            self._procs.append(proc)
        self._proc = self._procs[0]  # rank 0 (the one worker without tensor parallel)
        # A script that exits without shutdown(): the workers are told to stop, as shutdown() does, before
        # multiprocessing's own exit hook (registered earlier, so run later) terminates them mid-wait, which left
        # their semaphores to the resource tracker ("leaked semaphore objects" at exit). A weak reference: an
        # executor dropped without shutdown still closes its pipes, which ends its workers.
        this = weakref.ref(self)

        def stop_at_exit() -> None:
            executor = this()
            if executor is not None:
                executor.shutdown()

        self._stop_at_exit = stop_at_exit
        atexit.register(stop_at_exit)
        try:
            self._kv_info, self._describe = self._call(None)
        except WorkerError as e:
            raise WorkerError(
                f"{e} while starting; the worker is spawned, so a script that builds the engine must "
                "keep its top level under `if __name__ == '__main__':` (the worker's log above says "
                "more)"
            ) from None

    def _rank_name(self, rank: int) -> str:
        return "the model worker process" if self.size == 1 else f"tensor-parallel rank {rank} (worker process)"

    def _call(self, message, every: bool = False):
        """Send `message` to every rank (None: only listen, at start-up) and return rank 0's answer (every: the list
        of every rank's answers)."""
        if self._failed is not None:
            raise WorkerError(f"the tensor-parallel workers were stopped after an earlier failure: {self._failed}")
        for rank, conn in enumerate(self._conns):
            if message is not None:
                try:
                    conn.send(message)
                except (BrokenPipeError, OSError):
                    self._procs[rank].join(1)
                    return self._fail(rank, self._died(rank))
        answers: dict[int, tuple[str, object]] = {}
        pending = dict(enumerate(self._conns))
        first_error, died = None, False
        while pending and not (died and self.size > 1):
            sentinels = {self._procs[r].sentinel: r for r in pending}
            ready = wait([*pending.values(), *sentinels], timeout=FAILURE_GRACE_S if first_error is not None else None)
            if not ready:  # ranks still waiting on the failed one: stop the group
                break
            for obj in ready:
                rank = sentinels.get(obj)
                if rank is None:
                    rank = next(r for r, c in pending.items() if c is obj)
                    try:
                        answers[rank] = pending.pop(rank).recv()
                    except (EOFError, ConnectionResetError, OSError):
                        pending.pop(rank, None)
                        self._procs[rank].join(1)
                        answers[rank], died = ("error", self._died(rank)), True
                elif rank in pending and not pending[rank].poll():  # exited without answering
                    self._procs[rank].join(1)
                    pending.pop(rank)
                    answers[rank], died = ("error", self._died(rank)), True
                if answers.get(rank, ("",))[0] == "error" and first_error is None:
                    first_error = rank
        if first_error is not None:
            error = answers[first_error][1]
            if self.size == 1:
                raise error  # (one worker stays up, unless it died)
            return self._fail(first_error, error)
        return [answers[r][1] for r in range(self.size)] if every else answers[0][1]

    def _died(self, rank: int) -> WorkerError:
        proc = self._procs[rank]
        return WorkerError(f"{self._rank_name(rank)} exited (pid {proc.pid}, exit code {proc.exitcode})")

    def check_health(self) -> None:
        if self._failed is not None:
            raise WorkerError(f"the tensor-parallel workers were stopped after an earlier failure: {self._failed}")
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                proc.join(1)
                self._fail(rank, self._died(rank))

    def _fail(self, rank: int, error: BaseException):
        """Stop every rank after `rank` failed (they cannot go on without it) and raise its error."""
        if self.size > 1:
            self._failed = error
            log.error("tensor-parallel rank %d failed (%s); stopping the other ranks", rank, error)
            self._stop_all(grace=0.0)
        raise error

    @property
    def kv_cache_info(self) -> KVCacheInfo:
        return self._kv_info

    def describe(self) -> str:
        if self.size == 1:
            return f"{self._describe} in worker process {self._proc.pid}"
        pids = ", ".join(str(p.pid) for p in self._procs)
        return f"{self._describe}, tensor parallel over {self.size} worker processes ({pids})"

    @property
    def runner(self):
        raise AttributeError(
            "the model runner lives in the worker process; the tools that read it (profile's op table, eval, "
            "quantize, debug-layers, tune) need distributed_executor_backend='uni'"
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> SamplerOutput:
        return self._call(("step", scheduler_output))

    def comm_stats(self) -> list[dict]:
        """Each rank's step time and collectives since the last call (CommStats.take), rank order."""
        return self._call(("comm_stats", None), every=True)

    def _stop_all(self, grace: float) -> None:
        for conn, proc in zip(self._conns, self._procs):
            if proc.is_alive() and grace:
                try:
                    conn.send(("stop", None))
                except (BrokenPipeError, OSError):
                    pass
        for proc in self._procs:
            if grace:
                proc.join(grace)
            if proc.is_alive():
                proc.kill()
                proc.join(5)

    def shutdown(self) -> None:
        atexit.unregister(self._stop_at_exit)
        self._stop_all(grace=10.0)
        for conn in self._conns:
            conn.close()
