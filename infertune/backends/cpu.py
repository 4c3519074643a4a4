"""CPU backend: the default, and what CI runs on."""

from __future__ import annotations

import functools
import logging
import os
import platform
from typing import TYPE_CHECKING

import psutil
import torch

from infertune.backends.base import Backend, libc_function, trim_host_heap

if TYPE_CHECKING:
    from infertune.kernels.interface import DecodeKernels

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


# oneDNN's ONEDNN_MAX_CPU_ISA values (oneDNN docs, "CPU dispatcher control") that stop short of AVX-512 BF16
_ONEDNN_BELOW_BF16 = frozenset(
    {"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE", "AVX512_CORE_VNNI", "AVX512_MIC"}
)


def torch_isa_limits() -> str | None:
    """Why torch will not run native bf16 math here although the CPU may have it (ATEN_CPU_CAPABILITY below AVX512,
    or ONEDNN_MAX_CPU_ISA below AVX512_CORE_BF16), or None."""
    cap = torch.backends.cpu.get_cpu_capability()  # what ATen dispatches to: DEFAULT, AVX2, AVX512, ...
    if not cap.startswith("AVX512"):
        return f"ATen runs its {cap} kernels"
    isa = (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").strip().upper()
    if isa in _ONEDNN_BELOW_BF16:
        return f"oneDNN is limited to {isa} (ONEDNN_MAX_CPU_ISA)"
    return None


def cpu_supports_bf16() -> bool:
    """True where the CPU has native bf16 math (AVX512-BF16 or AMX) and torch will use it: ATen's dispatch
    (ATEN_CPU_CAPABILITY) and oneDNN's (ONEDNN_MAX_CPU_ISA) are not limited below it. Elsewhere bf16 is emulated
    and slow, and oneDNN's bf16 weight packing refuses to run."""
    flags = _cpu_flags()
    return ("avx512_bf16" in flags or "amx_bf16" in flags) and torch_isa_limits() is None


@functools.lru_cache(maxsize=1)
def _bf16_prepack_works() -> bool:
    """oneDNN packs a bf16 weight here (a probe on a tiny one: the ISA oneDNN picks is its own decision, and a
    refusal raises, it does not fall back)."""
    if not (cpu_supports_bf16() and torch.backends.mkldnn.is_available()):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16), 1)
    except RuntimeError as e:
        logger.info("oneDNN bf16 weight packing unavailable: %s", str(e).splitlines()[0])
        return False
    return True


_PREPACK_MAX_IN_FEATURES = 2048


# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
# By default glibc gives each block of 128 KiB or more its own mmap and unmaps it on free (freeing such a block
# raises that threshold, to 32 MiB at most; the loader's read buffers are mappings of its own, so they never do),
# and hands freed heap tops back to the OS. So every step faulted its activations in afresh: ~40,000 page faults
# (+30% TTFT) for a 128-token prefill of the 386M benchmark model, ~350,000 (1.4 GB of zeroed pages) for 16 x 128
# tokens, whose gate_up output alone is 38 MiB a layer. Blocks up to 64 MiB now come from the heap, and up to
# 512 MiB of freed heap stays mapped for the next step.
_KEEP_MMAP_THRESHOLD = 64 << 20
_KEEP_TRIM_THRESHOLD = 512 << 20
_KEEP_TOP_PAD = 16 << 20
_host_memory_done: str | None = None


def keep_host_memory() -> str:
    """Tune glibc malloc (once per process) so that freed activation memory is reused rather than returned to the
    OS and faulted in again at the next step, as vLLM gets from tcmalloc. The process's peak RSS is unchanged; RSS
    between steps stays near the peak. INFERTUNE_KEEP_HOST_MEMORY=0 leaves malloc alone. Returns what was done."""
    global _host_memory_done
    if _host_memory_done is not None:
        return _host_memory_done
    if os.environ.get("INFERTUNE_KEEP_HOST_MEMORY", "1").lower() in ("0", "false", "off", "no"):
        _host_memory_done = "left alone (INFERTUNE_KEEP_HOST_MEMORY=0)"
        return _host_memory_done
    mallopt = libc_function("mallopt")
    if mallopt is None:
        _host_memory_done = "left alone (no glibc mallopt)"
    else:
        ok = all(
            mallopt(param, value) == 1
            for param, value in (
                (_M_MMAP_THRESHOLD, _KEEP_MMAP_THRESHOLD),
                (_M_TRIM_THRESHOLD, _KEEP_TRIM_THRESHOLD),
                (_M_TOP_PAD, _KEEP_TOP_PAD),
            )
        )
        _host_memory_done = (
            "freed blocks up to 64 MiB are reused (glibc mmap threshold 64 MiB, trim threshold 512 MiB)"
            if ok
            else "left alone (glibc refused mallopt)"
        )
    logger.info("host memory: %s", _host_memory_done)
    return _host_memory_done


# oneDNN's packed linear as an opaque custom op: torch.compile (runner/compiled.py) then calls it as an extern
# kernel. Inductor's own lowering of mkldnn._linear_pointwise only accepts weights packed by its freezing pass.
@torch.library.custom_op("infertune::mkldnn_packed_linear", mutates_args=())
def mkldnn_packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@mkldnn_packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], packed.shape[0]))


class CPUBackend(Backend):
    name = "cpu"
    dist_backend = "gloo"
    has_quant_kernels = True
    supports_compile = True
    # Measured slower than eager on the 386M benchmark model (benchmarks/bench_compile_ab.py: decode 0.72-0.89x at
    # batch 16, interleaved in one process), so "auto" leaves it off here; compile="on" still works.
    compile_by_default = False

    @property
    def device(self) -> torch.device:
        return torch.device("cpu")

    @classmethod
    def is_available(cls) -> bool:
        return True

    def supported_dtypes(self) -> tuple[torch.dtype, ...]:
        # float16 matmuls on CPU are emulated and slow; checkpoints saved in fp16 run in bf16 or fp32.
        return (torch.bfloat16, torch.float32) if cpu_supports_bf16() else (torch.float32, torch.bfloat16)

    def resolve_dtype(self, requested: str, checkpoint_dtype: str | None) -> torch.dtype:
        if requested == "auto" and checkpoint_dtype == "float16":
            return self.supported_dtypes()[0]
        if requested == "float16":
            raise ValueError("dtype='float16' runs slowly and inaccurately on CPU; use 'bfloat16' or 'float32'")
        return super().resolve_dtype(requested, checkpoint_dtype)

    def can_prepack(self, dtype: torch.dtype, in_features: int | None = None) -> bool:
        # oneDNN's blocked bf16 layout (packed for one row) streams weights faster than the plain row-major
        # F.linear path in decode (1.2-1.6x per step on the 386M benchmark model) and matches it in prefill
        # for K <= 1024; for long rows (K = 4864, down_proj) it measured ~2x slower at 2048 rows, so those
        # stay plain. fp32 gains nothing.
        if in_features is not None and in_features > _PREPACK_MAX_IN_FEATURES:
            return False
        return dtype is torch.bfloat16 and _bf16_prepack_works()

    def prepack_linear_weight(self, weight: torch.Tensor) -> torch.Tensor | None:
        if not self.can_prepack(weight.dtype, weight.shape[1]):
            return None
        return torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def packed_linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if torch.compiler.is_compiling():  # opaque to Inductor; eager skips the custom op's dispatch (~30 us a call)
            return mkldnn_packed_linear(x, packed, bias)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    def kv_cache_storage(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        from infertune.kernels import hugepages

        return hugepages.zeros(shape, dtype) if device.type == "cpu" else super().kv_cache_storage(shape, dtype, device)

    def prepare_host_memory(self) -> str | None:
        from infertune.kernels import hugepages

        trim_host_heap()  # (what came after the load: the KV cache's set-up, the kernels' packing)
        done = keep_host_memory()
        logger.info("host memory: %s", hugepages.report().summary())
        return done

    def decode_kernels(self) -> DecodeKernels | None:
        from infertune.kernels import arm, cpu, x86  # built on first use; None where the CPU or the compiler lacks

        return arm.kernels() if cpu.variant() == "neon" else x86.kernels()

    def kernels_unavailable_reason(self) -> str | None:
        from infertune.kernels import cpu

        return cpu.unavailable_reason()

    shm_allreduce = platform.machine().lower() in ("x86_64", "amd64")

    def bind_rank(self, rank: int, size: int) -> str:
        """Rank `rank` of `size` on one host: its block of the CPUs this process may use (pinned, so that the ranks'
        OpenMP threads never share a core), one torch (and kernel) thread per CPU of it."""
        cpus = sorted(os.sched_getaffinity(0))
        share = max(1, len(cpus) // size)
        mine = cpus[rank * share : (rank + 1) * share] or [cpus[rank % len(cpus)]]  # more ranks than CPUs: shared
        os.sched_setaffinity(0, mine)
        torch.set_num_threads(len(mine))
        return f"cpu {','.join(map(str, mine))}, {len(mine)} thread{'s' * (len(mine) > 1)}"

    def free_memory_bytes(self) -> int:
        return psutil.virtual_memory().available

    def total_memory_bytes(self) -> int:
        return psutil.virtual_memory().total
