"""The x86 CPU kernels behind the `DecodeKernels` contract (kernels/interface.py).

`kernels/cpu.py` builds, loads and binds the C library (cpu_kernels.c: AVX-512 BF16 / VNNI, AMX tiles where the
CPU has them); this class is what the engine sees of it. The x86 package's own knowledge stays here and in
x86_fused.py: which row counts each kernel wins at (AMX or not), the 12-bit weight layout and its gate/up
interleaving, the nibble order of int4 weights, the C structs of the fused step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from infertune.kernels import cpu
from infertune.kernels.interface import FusedDecoder, FusedModel, LinearKind


class Bf16cWeight:
    """A bf16 weight in the kernels' lossless 12-bit layout (cpu.pack_bf16c), with the C description that points at
    its buffers. gate_up: its gate and up rows are interleaved 16 by 16, so that the SiLU runs in the epilogue."""

    def __init__(self, weight: torch.Tensor, gate_up: bool) -> None:
        self.out_features, self.in_features = weight.shape
        self.inter = self.out_features // 2 if gate_up else 0
        self.gate_up = gate_up
        self.buffers = cpu.pack_bf16c(weight, inter=self.inter)
        self.desc = cpu.bf16c_struct(self.buffers)  # points at the buffers (the layer holding them keeps them alive)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return cpu.linear_bf16c(x, self.desc, self.out_features, bias, inter=self.inter)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        if not self.inter:
            return None
        return cpu.linear_bf16c(x, self.desc, self.out_features, inter=self.inter, silu=True)

    def dense(self) -> torch.Tensor:
        w = cpu.unpack_bf16c(self.desc, self.out_features, self.in_features)
        return cpu.deinterleave_gate_up(w) if self.inter else w


class X86Kernels:
    """infertune's x86 kernels (one instance per process is enough: it holds no state of its own)."""

    fused_parts = cpu.FUSED_PARTS

    def __init__(self) -> None:
        if not cpu.available():
            raise RuntimeError(f"the x86 kernels are unavailable: {cpu.unavailable_reason()}")
        self.amx = cpu.bf16_max_rows() > cpu.MAX_ROWS
        self.name = "x86 avx512-bf16/vnni" + (" + amx" if self.amx else "")

    def __repr__(self) -> str:
        return f"X86Kernels({self.name})"

    def max_rows(self, kind: LinearKind) -> int:
        # bf16 (plain or 12-bit) keeps the AMX tile GEMM up to 128 rows; the int8 / int4 kernels are GEMVs at heart
        return cpu.bf16_max_rows() if kind in ("bf16", "bf16c") else cpu.MAX_ROWS

    def linear_bf16(self, x, weight, bias=None):
        return cpu.linear_bf16(x, weight, bias)

    def linear_w8(self, x, qweight, scales, bias=None):
        return cpu.linear_w8(x, qweight, scales, bias)

    def dequant_w8(self, qweight, scales):
        return cpu.dequant_w8(qweight, scales)

    def w4_supported(self, in_features: int, group_size: int) -> bool:
        return cpu.w4_supported(in_features, group_size)

    def pack_w4(self, q):
        return cpu.pack_w4(q)

    def unpack_w4(self, packed):
        return cpu.unpack_w4(packed)

    def linear_w4(self, x, packed, scale, zero, group_size, bias=None):
        return cpu.linear_w4(x, packed, scale, zero, group_size, bias)

    def dequant_w4(self, packed, scale, zero, group_size):
        return cpu.dequant_w4(packed, scale, zero, group_size)

    def rms_norm(self, x, weight, eps):
        return cpu.rms_norm(x, weight, eps)

    def silu_and_mul(self, gate_up):
        return cpu.silu_and_mul(gate_up)

    def rotary_(self, qk, cos, sin) -> bool:
        return cpu.rotary_(qk, cos, sin)

    def can_compress(self, out_features: int, in_features: int) -> bool:
        return cpu.bf16c_supported(out_features, in_features)

    def compress(self, weight: torch.Tensor, gate_up: bool = False) -> Bf16cWeight:
        # (the tile pairs of an interleaved gate_up need whole pairs of 16 features)
        return Bf16cWeight(weight, gate_up and weight.shape[0] % 32 == 0)

    def fused_decoder(self, model: FusedModel) -> FusedDecoder | str:
        from infertune.kernels.x86_fused import X86FusedDecoder

        return X86FusedDecoder.build(model, amx=self.amx)

    def fused_step_timers(self, reset: bool = False) -> dict[str, float]:
        return cpu.fused_step_timers(reset)

    def profiled(self, name: str) -> AbstractContextManager:
        return cpu.profiled(name)


_instance: X86Kernels | None = None


def kernels() -> X86Kernels | None:
    """The process's x86 kernels, or None where they cannot run here (cpu.unavailable_reason() says why)."""
    global _instance
    if _instance is None and cpu.available():
        _instance = X86Kernels()
    return _instance if cpu.available() else None
