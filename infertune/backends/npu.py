"""Ascend NPU backend through torch_npu.

UNVERIFIED: no Ascend hardware was available when this was written. It follows torch_npu's documented
API (torch.npu.*, device type "npu", HCCL); treat it as a starting point and run the test suite on a
910B before relying on it.
"""

from __future__ import annotations

import importlib

import torch

from infertune.backends.base import Backend


def _torch_npu():
    """Import torch_npu lazily: it registers the "npu" device with torch as a side effect."""
    return importlib.import_module("torch_npu")


class NPUBackend(Backend):
    name = "npu"
    dist_backend = "hccl"
    ray_resource = "NPU"  # (Ray's Ascend accelerator resource: it sets ASCEND_RT_VISIBLE_DEVICES for the actor)

    @property
    def device(self) -> torch.device:
        return torch.device("npu", self.index)

    @classmethod
    def is_available(cls) -> bool:
        try:
            _torch_npu()
        except ImportError:
            return False
        return bool(torch.npu.is_available())  # type: ignore[attr-defined]

    def device_count(self) -> int:
        return int(torch.npu.device_count())  # type: ignore[attr-defined]

    def set_device(self, index: int) -> None:
        torch.npu.set_device(index)  # type: ignore[attr-defined]

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        return (torch.float16, torch.bfloat16, torch.float32)

    def free_memory_bytes(self) -> int:
        free, _ = torch.npu.mem_get_info(self.index)  # type: ignore[attr-defined]
        return free

    def total_memory_bytes(self) -> int:
        _, total = torch.npu.mem_get_info(self.index)  # type: ignore[attr-defined]
        return total

    def profiler_activities(self) -> list:
        # torch_npu registers "npu" as torch's PrivateUse1 device (unverified here; torch_npu also ships
        # its own profiler, torch_npu.profiler, with richer NPU traces).
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU, ProfilerActivity.PrivateUse1]

    def synchronize(self) -> None:
        torch.npu.synchronize(self.index)  # type: ignore[attr-defined]

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.npu.manual_seed_all(seed)  # type: ignore[attr-defined]
