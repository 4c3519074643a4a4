"""Executor: how the engine reaches its model runner(s). In-process today; multi-process / Ray later."""

from __future__ import annotations

from typing import TYPE_CHECKING

import abc

from infertune.runner.model_runner import KVCacheInfo
from infertune.runner.sampler import SamplerOutput

if TYPE_CHECKING:
    from infertune.engine.scheduler import ScheduledBatch


class Executor(abc.ABC):
    @property
    @abc.abstractmethod
    def kv_cache_info(self) -> KVCacheInfo:
        """Blocks, block size and bytes per token of the KV cache the runner pre-allocated."""

    @abc.abstractmethod
    def execute_model(self, batch: ScheduledBatch) -> SamplerOutput:
        """Run one scheduled step; SamplerOutput.token_ids has one entry per batch entry (None: nothing sampled)."""

    def shutdown(self) -> None:
        """Release workers and device memory."""
