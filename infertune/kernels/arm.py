"""The Arm CPU kernels behind the `DecodeKernels` contract (kernels/interface.py): `NeonKernels`, AArch64 Advanced SIMD.

`kernels/cpu.py` builds and binds the C library (csrc/arm/neon) with the x86 libraries' entry points, so the calls
are the AVX2 variant's (`x86.Avx2Kernels`: the GEMVs, the bf16 GEMM, the prefills' dequantization, the elementwise
kernels, the fused decoder step, the MoE routing and grouped experts; no 12-bit weights) on another library.
Verified for correctness under qemu-user on x86 (tests/test_neon.py; every GEMV / dequantization / elementwise
oracle of tests/test_kernels.py runs on it too); its speed on Arm hardware, and its row limits, are not measured.
"""

from __future__ import annotations

from infertune.kernels import cpu
from infertune.kernels.x86 import Avx2Kernels

_instance: NeonKernels | None = None


class NeonKernels(Avx2Kernels):
    """lib: a library from cpu.load_variant("neon") (default: the process's), or a stand-in with its entry points
    (tests/neon_qemu.py runs them under qemu)."""

    variant = "neon"
    # bf16 linears up to 16 rows (the GEMV, the GEMM from it_gemm_rows_fma() rows), torch's GEMM past them: no Arm
    # timing says where, if anywhere, the NEON GEMM beats torch's (oneDNN / ACL) GEMMs
    bf16_rows = cpu.MAX_ROWS
    # (fused_decoder: Avx2Kernels', kernels/x86_fused.py over this library's it_decode_layers, csrc/arm/neon/fused.c)


def kernels() -> NeonKernels | None:
    """The process's Arm kernels where cpu.variant() loaded them, else None (cpu.unavailable_reason() says why)."""
    global _instance
    if _instance is None and cpu.available() and cpu.variant() == "neon":
        _instance = NeonKernels(cpu.library())
    return _instance if cpu.available() else None
