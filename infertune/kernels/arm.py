"""The Arm CPU kernels behind the `DecodeKernels` contract (kernels/interface.py): `NeonKernels`, AArch64 Advanced SIMD.

`kernels/cpu.py` builds and binds the C library (csrc/arm/neon) with the x86 libraries' entry points, so the calls
are the AVX2 variant's (`x86.Avx2Kernels`: the GEMVs, the prefills' dequantization, the elementwise kernels, the
MoE routing and grouped experts; no 12-bit weights and no fused step) on another library. Verified for correctness
under qemu-user on x86 (tests/test_neon.py runs every GEMV / dequantization / elementwise oracle of
tests/test_kernels.py on it); its speed on Arm hardware, and its row limits, are not measured yet.
"""

from __future__ import annotations

from infertune.kernels import cpu
from infertune.kernels.interface import FusedDecoder, FusedModel
from infertune.kernels.x86 import Avx2Kernels

_instance: NeonKernels | None = None


class NeonKernels(Avx2Kernels):
    """lib: a library from cpu.load_variant("neon") (default: the process's), or a stand-in with its entry points
    (tests/neon_qemu.py runs them under qemu)."""

    variant = "neon"
    bf16_rows = cpu.MAX_ROWS  # (a GEMV only: no GEMM in the NEON library yet)

    def fused_decoder(self, model: FusedModel) -> FusedDecoder | str:
        return "the fused step has no NEON variant yet (AVX-512 and AVX2 only)"

    def fused_step_timers(self, reset: bool = False) -> dict[str, float]:
        return {**dict.fromkeys(cpu.FUSED_PARTS, 0.0), "calls": 0.0, "rows": 0.0}


def kernels() -> NeonKernels | None:
    """The process's Arm kernels where cpu.variant() loaded them, else None (cpu.unavailable_reason() says why)."""
    global _instance
    if _instance is None and cpu.available() and cpu.variant() == "neon":
        _instance = NeonKernels(cpu.library())
    return _instance if cpu.available() else None
