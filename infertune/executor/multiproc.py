"""Multiprocess executor: the model runner in a worker process of its own (spawned), reached by pickled messages.

The driver sends each step's SchedulerOutput (plain data) down a pipe and gets the SamplerOutput back; the worker
keeps its own request states, so nothing but that step's message crosses. A failure in the worker comes back as
the driver's exception (a ValueError from loading stays a ValueError); a worker that died is a RuntimeError that
says so. This is the process seam that tensor-parallel ranks (one worker per rank, torch.distributed between them)
and Ray actors build on; today it runs one worker.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import traceback

from infertune.config import EngineConfig
from infertune.executor.base import Executor
from infertune.runner.model_runner import KVCacheInfo
from infertune.runner.sampler import SamplerOutput
from infertune.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)


class WorkerError(RuntimeError):
    """The worker process failed; the message carries its traceback."""


def _portable(e: BaseException) -> BaseException:
    """The exception itself where it pickles and means the same on the driver's side, else a WorkerError."""
    if isinstance(e, (ValueError, TypeError, MemoryError)) and type(e).__module__ == "builtins":
        return e
    return WorkerError(f"the model worker failed: {type(e).__name__}: {e}\n{traceback.format_exc()}")


def _worker_main(conn, config: EngineConfig, show_progress: bool) -> None:
    from infertune.backends import get_backend
    from infertune.runner.model_runner import ModelRunner

    try:
        backend = get_backend(config.device.device)
        runner = ModelRunner(config, backend, show_progress)
        conn.send(("ready", (runner.kv_info, f"{backend.describe()}, {str(runner.dtype).removeprefix('torch.')}")))
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
            conn.send(("ok", runner.execute_model(payload)))
        except BaseException as e:  # noqa: BLE001 - the driver decides; the worker stays up for the next call
            conn.send(("error", _portable(e)))


class MultiprocExecutor(Executor):
    def __init__(self, config: EngineConfig, show_progress: bool = False) -> None:
        ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch threads or locks
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_worker_main, args=(child, config, show_progress), name="infertune-worker", daemon=True
        )
        self._proc.start()
        child.close()
        try:
            self._kv_info, self._describe = self._call(None)
        except WorkerError as e:
            raise WorkerError(
                f"{e} while starting; the worker is spawned, so a script that builds the engine must "
                "keep its top level under `if __name__ == '__main__':` (the worker's log above says "
                "more)"
            ) from None

    def _call(self, message):
        try:
            if message is not None:
                self._conn.send(message)
            kind, payload = self._conn.recv()
        except (EOFError, BrokenPipeError, ConnectionResetError):
            self._proc.join(1)
            raise WorkerError(f"the model worker process exited (exit code {self._proc.exitcode})") from None
        if kind == "error":
            raise payload
        return payload

    @property
    def kv_cache_info(self) -> KVCacheInfo:
        return self._kv_info

    def describe(self) -> str:
        return f"{self._describe} in worker process {self._proc.pid}"

    @property
    def runner(self):
        raise AttributeError(
            "the model runner lives in the worker process; the tools that read it (profile, eval, "
            "quantize, debug-layers, tune) need distributed_executor_backend='uni'"
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> SamplerOutput:
        return self._call(("step", scheduler_output))

    def shutdown(self) -> None:
        if self._proc.is_alive():
            try:
                self._conn.send(("stop", None))
            except (BrokenPipeError, OSError):
                pass
            self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(5)
        self._conn.close()
