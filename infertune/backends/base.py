"""Backend: the one place that names a device. Everything above asks the backend instead of checking hardware."""

from __future__ import annotations

import abc
import ctypes
import functools
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from infertune.kernels.interface import DecodeKernels


@functools.cache
def libc_function(name: str):
    """A function of the C library the process already has (glibc's malloc_trim, mallopt), or None without it."""
    try:
        return getattr(ctypes.CDLL(None), name, None)
    except OSError:
        return None


def trim_host_heap() -> bool:
    """Give the free pages inside the C heap back to the OS (glibc malloc_trim(0)); False where there is no glibc.

    Whatever the device, a load passes every checkpoint tensor through host memory, and a quantizing load makes
    temporaries besides (fp32 copies, rounding buffers). glibc serves blocks under its mmap threshold (which it
    raises up to 32 MiB as large blocks are freed) from its heap, and a heap only shrinks from its top: freed
    blocks below a live one stay resident. Loading the 386M model with W4A16 left 700-990 MiB of free heap resident
    (RSS 687-1451 MiB after the load, by run, against 560 of live memory); the loader calls this every
    loader.TRIM_EVERY_BYTES of tensors and at the end, which costs a few ms a call."""
    trim = libc_function("malloc_trim")
    if trim is None:
        return False
    trim(0)
    return True


class Backend(abc.ABC):
    name: str = "abstract"
    # Distributed backend for torch.distributed when the executor grows past one process.
    dist_backend: str = "gloo"
    # Whether the aten int8 / int4 weight-pack matmuls run here; else quantized layers use a reference path.
    has_quant_kernels: bool = False
    supports_compile: bool = False  # torch.compile (Inductor) of the decoder's dense stages works here
    # Tensor-parallel ranks on this host may sum small activations through shared memory (layers/shm_allreduce.py):
    # host memory whose plain stores other cores see in order (x86-64)
    shm_allreduce: bool = False
    compile_by_default: bool = False  # compile="auto" turns it on (only where it was measured faster)

    def __init__(self, index: int = 0) -> None:
        self.index = index

    @property
    @abc.abstractmethod
    def device(self) -> torch.device: ...

    @classmethod
    @abc.abstractmethod
    def is_available(cls) -> bool: ...

    @abc.abstractmethod
    def supported_dtypes(self) -> tuple[torch.dtype, ...]: ...

    def resolve_dtype(self, requested: str, checkpoint_dtype: str | None) -> torch.dtype:
        """Map "auto" / a dtype name to what this device runs, with a clear error for an unsupported choice."""
        name = checkpoint_dtype if requested == "auto" else requested
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(
            name or "float32", torch.float32
        )
        if dtype not in self.supported_dtypes():
            if requested == "auto":
                return self.supported_dtypes()[0]
            ok = ", ".join(str(d).removeprefix("torch.") for d in self.supported_dtypes())
            raise ValueError(f"dtype={requested!r} is not supported on {self.name}; choose one of: {ok}")
        return dtype

    def can_prepack(self, dtype: torch.dtype, in_features: int | None = None) -> bool:
        """Whether prepack_linear_weight gives a faster layout for such weights (decode and prefill alike)."""
        return False

    def prepack_linear_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        """The weight [N, K] reordered into this device's fastest matmul layout, or None to keep it as is."""
        return None

    def packed_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError(f"{self.name} has no packed linear layout")

    def kv_cache_storage(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The KV cache's one allocation, zero (stale memory is never read as KV). The CPU backend places it on 2 MB
        pages where the system allows (kernels/hugepages.py): every decode step streams it."""
        return torch.zeros(shape, dtype=dtype, device=device)

    def prepare_host_memory(self) -> str | None:
        """Called by the model runner once the weights and the KV cache are in place: set up host memory reuse
        where the backend's steps allocate on the host (the CPU backend tunes malloc). Returns what was done, or
        None."""
        return None

    def decode_kernels(self) -> DecodeKernels | None:
        """This backend's own kernels (the contract: kernels/interface.py), or None where torch's operators are all
        there is. The CPU backend's are x86's (kernels/x86.py), where the CPU and a C compiler allow."""
        return None

    def kernels_unavailable_reason(self) -> str | None:
        """Why decode_kernels() is None here (None when it is not)."""
        return "this backend has no kernels of its own"

    # Rows (tokens) up to which the int8 / int4 weight-pack matmuls beat dequantize + dense matmul.
    quant_kernel_max_rows: int = 16

    @abc.abstractmethod
    def free_memory_bytes(self) -> int:
        """Memory still available for the KV cache on this device."""

    def total_memory_bytes(self) -> int:
        return self.free_memory_bytes()

    def profiler_activities(self) -> list:
        """torch.profiler activities that see this device's work (the CPU always)."""
        from torch.profiler import ProfilerActivity

        return [ProfilerActivity.CPU]

    def synchronize(self) -> None:
        """Wait for queued device work (a no-op where execution is synchronous)."""

    def seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    # The Ray resource one tensor-parallel rank of this backend asks for beside its CPUs ("GPU", "NPU"; None: CPUs only)
    ray_resource: str | None = None

    def device_count(self) -> int:
        """Devices of this kind this process sees."""
        return 1

    def set_device(self, index: int) -> None:
        """Make `index` this process's current device (NCCL / HCCL take each rank's from there)."""

    def bind_rank(self, rank: int, size: int) -> str:
        """Give this process (tensor-parallel rank `rank` of `size`, every rank on this host) its share of the device;
        -> what it got, for logs. A device backend: one device a rank, index + rank (TP=2 from cuda:0 runs on cuda:0
        and cuda:1), as NCCL and HCCL need; a clear error where the host has fewer. (Ray gives each rank actor its
        own device instead: it starts at index 0 of what the actor sees.) UNVERIFIED on GPUs / NPUs: none was lent."""
        index = self.index + rank
        count = self.device_count()
        if index >= count:
            raise ValueError(
                f"tensor parallel rank {rank} of {size} needs {self.name}:{index}, one device a rank from "
                f"{self.name}:{self.index}, but this process sees {count} {self.name} device{'s' * (count != 1)}; "
                "lower tensor_parallel_size or start from a lower device index"
            )
        self.index = index
        self.set_device(index)
        return f"{self.name}:{index}"

    def describe(self) -> str:
        return f"{self.name}:{self.index}"
