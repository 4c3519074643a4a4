"""CUDA backend (NVIDIA GPUs). Verified only where a GPU was lent; CI runs on CPU."""

from __future__ import annotations

import torch

from infertune.backends.base import Backend


class CUDABackend(Backend):
    name = "cuda"
    dist_backend = "nccl"
    supports_compile = True  # Inductor with Triton kernels; not verified on a GPU here
    ray_resource = "GPU"

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.index)

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def set_device(self, index: int) -> None:
        torch.cuda.set_device(index)

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        bf16 = torch.cuda.is_bf16_supported()
        return (torch.bfloat16, torch.float16, torch.float32) if bf16 else (torch.float16, torch.float32)

    def free_memory_bytes(self) -> int:
        free, _ = torch.cuda.mem_get_info(self.index)
        return free

    def total_memory_bytes(self) -> int:
        _, total = torch.cuda.mem_get_info(self.index)
        return total

    def profiler_activities(self) -> list:
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU, ProfilerActivity.CUDA]

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.cuda.manual_seed_all(seed)
