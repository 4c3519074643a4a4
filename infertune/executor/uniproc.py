"""Single-process executor: the model runner lives in the engine's own process."""

from __future__ import annotations

from infertune.backends import get_backend
from infertune.config import EngineConfig
from infertune.executor.base import Executor
from infertune.runner.model_runner import KVCacheInfo, ModelRunner
from infertune.runner.sampler import SamplerOutput
from infertune.scheduler_output import SchedulerOutput


class UniProcExecutor(Executor):
    recovers_from_step_errors = True  # (the runner is here: a step that raised leaves no other process waiting)

    def __init__(self, config: EngineConfig, show_progress: bool = False) -> None:
        self.backend = get_backend(config.device.device)
        self.runner = ModelRunner(config, self.backend, show_progress)

    @property
    def kv_cache_info(self) -> KVCacheInfo:
        return self.runner.kv_info

    def describe(self) -> str:
        return f"{self.backend.describe()}, {str(self.runner.dtype).removeprefix('torch.')}"

    def execute_model(self, scheduler_output: SchedulerOutput) -> SamplerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        pass  # the runner lives and dies with this process; tools may still read it after a server stops
