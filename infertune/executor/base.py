"""Executor: how the engine reaches its model runner(s). In-process today; multi-process / Ray later."""

from __future__ import annotations

import abc

from infertune.runner.model_runner import KVCacheInfo
from infertune.runner.sampler import SamplerOutput
from infertune.scheduler_output import SchedulerOutput


class Executor(abc.ABC):
    @property
    @abc.abstractmethod
    def kv_cache_info(self) -> KVCacheInfo:
        """Blocks, block size and bytes per token of the KV cache the runner pre-allocated."""

    # Whether the engine may go on after execute_model raised (its step's requests aborted): the model runs in this
    # process, so nothing else waits on the failed step. Workers in other processes may be left mid-collective by a
    # rank that raised, so there a failed step stops the engine, as before.
    recovers_from_step_errors: bool = False

    @abc.abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> SamplerOutput:
        """Run one scheduled step (plain data: a worker in another process gets the same); SamplerOutput.token_ids
        has one entry per scheduled request, in its order (None: nothing sampled)."""

    @abc.abstractmethod
    def describe(self) -> str:
        """Where the model runs, for logs: device, dtype, process."""

    def check_health(self) -> None:
        """Raise (a WorkerError naming it) where a worker this executor depends on is gone, though no step has run
        since: the engine calls it while idle, so /health reports a dead worker before a request finds it."""

    def shutdown(self) -> None:
        """Release workers and device memory."""
