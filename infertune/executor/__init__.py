"""Executors: how the engine reaches its model runner. `create_executor(config)` picks one from the config."""

from __future__ import annotations

from infertune.config import EngineConfig
from infertune.executor.base import Executor


def create_executor(config: EngineConfig, show_progress: bool = False) -> Executor:
    if config.parallel.distributed_executor_backend == "ray":
        from infertune.executor.ray_executor import RayExecutor

        return RayExecutor(config, show_progress)
    if config.parallel.distributed_executor_backend == "mp":
        from infertune.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor(config, show_progress)
    from infertune.executor.uniproc import UniProcExecutor

    return UniProcExecutor(config, show_progress)
