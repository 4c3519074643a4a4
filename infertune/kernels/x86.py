"""The x86 CPU kernels behind the `DecodeKernels` contract (kernels/interface.py), one class per ISA variant.

`kernels/cpu.py` builds, loads and binds the C libraries (csrc/x86/avx512: AVX-512 BF16 / VNNI, AMX tiles where the
CPU has them; csrc/x86/avx2: AVX2 + FMA); `X86Kernels` and `Avx2Kernels` are what the engine sees of them, and
`kernels()` picks the one the process loaded (cpu.variant()). The x86 package's own knowledge stays here and in
x86_fused.py: which row counts each kernel wins at (AMX or not), the 12-bit weight layout and its gate/up
interleaving, the nibble order of int4 weights, the C structs of the fused step.
"""

from __future__ import annotations

import weakref
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING

import torch

from infertune.kernels import cpu
from infertune.kernels.interface import FusedDecoder, FusedModel, LinearKind, MoeRouting
from infertune.kernels.x86_fused import X86FusedDecoder, expert_lin, moe_rule

if TYPE_CHECKING:
    pass


# The packed int8 products as opaque custom ops, so that torch.compile (runner/compiled.py) calls them as extern
# kernels (their weights exist in the packed layout only; ctypes calls are not traceable). The process's library.
@torch.library.custom_op("infertune::linear_w8p", mutates_args=())
def _linear_w8p_op(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return cpu.linear_w8p(x, packed, scales, bias)


@_linear_w8p_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], scales.numel()))


@torch.library.custom_op("infertune::linear_w4p", mutates_args=())
def _linear_w4p_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    n: int,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return cpu.linear_w4p(x, packed, scale, zero, group_size, n, bias)


@_linear_w4p_op.register_fake
def _(x, packed, scale, zero, group_size, n, bias) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], n))


@torch.library.custom_op("infertune::linear_w8a8", mutates_args=())
def _linear_w8a8_op(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    input_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
) -> torch.Tensor:
    return cpu.linear_w8a8(x, packed, scales, input_scale, bias)


@_linear_w8a8_op.register_fake
def _(x, packed, scales, input_scale, bias) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], scales.numel()))


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
    """infertune's x86 kernels (one instance per process is enough: it holds no state of its own; each fused decoder
    it builds keeps its own step counters)."""

    fused_parts = cpu.FUSED_PARTS

    def __init__(self) -> None:
        if not cpu.available():
            raise RuntimeError(f"the x86 kernels are unavailable: {cpu.unavailable_reason()}")
        self.lib = None  # (None: the library the process loaded)
        self.amx = cpu.amx()
        self.name = cpu.VARIANTS["avx512"].title + (" + amx" if self.amx else "")
        self._experts_lins = weakref.WeakKeyDictionary()  # KernelExperts -> its two it_lin, or why it does not fit

    def __repr__(self) -> str:
        return f"X86Kernels({self.name})"

    def max_rows(self, kind: LinearKind, *, moe: bool = False) -> int:
        # bf16 (plain or 12-bit) keeps the AMX tile GEMM up to 128 rows, without AMX the VDPBF16PS GEMM; the int8 /
        # int4 kernels are GEMVs at heart, except past 16 rows, where they rebuild their weight in bf16 a chunk at a
        # time for those GEMMs (with AMX up to 128 rows, quant_amx.c; without, every row count, gemv_quant.c).
        # W8A8: its VPDPBUSD GEMM on weights packed at load (gemm_i8.c) at every row count, with AMX too: measured on
        # a Xeon with AMX (2026-12-05, the 386M model's four linears), 1.6-1.8x torch._int_mm (oneDNN's AMX int8) at
        # 1-64 rows and 1.5-2.8x at 128-2048.
        if kind == "w8a8":
            return cpu.NOAMX_QUANT_MAX_ROWS if cpu.w8a8_supported(self.lib) else 0
        # W8A16 / W4A16 on their packed weights (gemm_w8p.c / gemm_w4p.c): without AMX at every row count, where one
        # weight stream a thread beats the row layouts' kernels (benchmarks/bench_packed_quant.py). W8A16 with AMX
        # too: the packed weight is AMX-INT8's B operand as it lies (gemm_i8_amx.c: x's h and l bytes on the tiles),
        # which beat the row layout's dequantize-then-bf16-tiles at every row count (BENCHMARKS.md, 2026-12-06); past
        # 16 rows its words are now rebuilt in bf16 for the 12-bit weights' tile GEMM instead (gemm_w8p.c: the SiLU
        # and residual epilogues of the fused step; BENCHMARKS.md, 2026-12-07).
        # W4A16 with AMX: MoE models only. Past 16 rows the packed nibbles are rebuilt in bf16 a 64-feature chunk at a
        # time for the 12-bit weights' tile GEMM (gemm_w4p.c, bf16c_gemm.c tiles_gemm: the bf16 products of the row
        # layout's dequantize-then-AMX-GEMM, no dequantized copy), so MoE prompts run in the fused step: on a Xeon
        # with AMX (2026-12-06) the MoE preset's 16 x (128 + 32) TTFT 1.42 -> 0.78 s, its decode at 16 1.9x (each
        # expert's one or two rows on the int kernel beat the row layout's tile rebuild). A dense model keeps the
        # rows: there the row layout's 1-row GEMV decoded the 386M model 1.10x faster and its 2-16-row tile rebuild
        # 1.3x at 16 requests, and its prompts (dequantize, oneDNN) ran 0.82 s against the packed tiles' 1.0 (their
        # gate_up has no SiLU epilogue: its [T, 2I] product goes to memory and back).
        if kind == "w8p":
            return cpu.NOAMX_QUANT_MAX_ROWS if cpu.w8p_supported(self.lib) else 0
        if kind == "w4p":
            offered = cpu.w4p_supported(self.lib) and (moe or not self.amx)
            return cpu.NOAMX_QUANT_MAX_ROWS if offered else 0
        return cpu.bf16_max_rows() if kind in ("bf16", "bf16c") else cpu.quant_max_rows()

    def linear_bf16(self, x, weight, bias=None):
        return cpu.linear_bf16(x, weight, bias, lib=self.lib)

    def linear_w8(self, x, qweight, scales, bias=None):
        return cpu.linear_w8(x, qweight, scales, bias, lib=self.lib)

    def dequant_w8(self, qweight, scales):
        return cpu.dequant_w8(qweight, scales, lib=self.lib)

    def pack_w8a8(self, q):
        return cpu.pack_w8a8(q, lib=self.lib)

    def unpack_w8a8(self, packed, out_features, in_features):
        return cpu.unpack_w8a8(packed, out_features, in_features, lib=self.lib)

    def linear_w8a8(self, x, packed, scales, input_scale=None, bias=None):
        if torch.compiler.is_compiling() and self.lib is None:
            return _linear_w8a8_op(x, packed, scales, input_scale, bias)
        return cpu.linear_w8a8(x, packed, scales, input_scale, bias, lib=self.lib)

    def linear_w8p(self, x, packed, scales, bias=None):
        if torch.compiler.is_compiling() and self.lib is None:
            return _linear_w8p_op(x, packed, scales, bias)
        return cpu.linear_w8p(x, packed, scales, bias, lib=self.lib)

    def pack_w4p(self, q, scale, zero, group_size):
        return cpu.pack_w4p(q, scale, zero, group_size)

    def unpack_w4p(self, packed, scale, zero, out_features, in_features):
        return cpu.unpack_w4p(packed, scale, zero, out_features, in_features)

    def linear_w4p(self, x, packed, scale, zero, group_size, out_features, bias=None):
        if torch.compiler.is_compiling() and self.lib is None:
            return _linear_w4p_op(x, packed, scale, zero, group_size, out_features, bias)
        return cpu.linear_w4p(x, packed, scale, zero, group_size, out_features, bias, lib=self.lib)

    def w4_supported(self, in_features: int, group_size: int) -> bool:
        return cpu.w4_supported(in_features, group_size)

    def pack_w4(self, q):
        return cpu.pack_w4(q)

    def unpack_w4(self, packed):
        return cpu.unpack_w4(packed)

    def linear_w4(self, x, packed, scale, zero, group_size, bias=None):
        return cpu.linear_w4(x, packed, scale, zero, group_size, bias, lib=self.lib)

    def dequant_w4(self, packed, scale, zero, group_size):
        return cpu.dequant_w4(packed, scale, zero, group_size, lib=self.lib)

    def rms_norm(self, x, weight, eps):
        return cpu.rms_norm(x, weight, eps, lib=self.lib)

    def greedy_tokens(self, logits):
        return cpu.argmax_rows(logits, lib=self.lib)

    def silu_and_mul(self, gate_up):
        return cpu.silu_and_mul(gate_up, lib=self.lib)

    def gemma_rms_norm(self, x, weight, eps):
        return cpu.gemma_rms_norm(x, weight, eps, lib=self.lib)

    def gelu_and_mul(self, gate_up):
        return cpu.gelu_and_mul(gate_up, lib=self.lib)

    def rotary_(self, qk, cos, sin) -> bool:
        return cpu.rotary_(qk, cos, sin, lib=self.lib)

    def can_compress(self, out_features: int, in_features: int) -> bool:
        return cpu.bf16c_supported(out_features, in_features)

    def compress(self, weight: torch.Tensor, gate_up: bool = False) -> Bf16cWeight:
        # (the tile pairs of an interleaved gate_up need whole pairs of 16 features)
        return Bf16cWeight(weight, gate_up and weight.shape[0] % 32 == 0)

    def moe_route(self, logits, moe, correction_bias=None, tied=None):
        rule = moe_rule(moe, self.lib)
        got = cpu.moe_route(logits, rule, correction_bias, lib=self.lib) if rule is not None else None
        if got is not None or rule is None or tied is None:
            return MoeRouting(*got) if got is not None else None
        # a tie at the boundary in some rows: route() picks theirs (tied), the kernel's picks stand for the others,
        # as the fused step's hand-back merges them (csrc/fused_step.h moe_mlp)
        rows = cpu.moe_route_rows(logits, rule, correction_bias, lib=self.lib)
        if rows is None:
            return None
        weights, ids, which = rows
        w, i = tied(logits[which])
        weights[which], ids[which] = w.to(weights.dtype), i.to(ids.dtype)
        return MoeRouting.grouped(weights, ids, moe.num_experts)

    def moe_experts(self, x, experts, routing):
        # 12-bit experts at any row count: each expert's rows go through one linear_bf16c (the AMX tile GEMM, or
        # VDPBF16PS on the decoded tiles without AMX), a prefill's as a decode step's, and the layer has no dense
        # weight for torch's GEMM. Plain bf16 experts up to as many rows per expert, on average, as linear_bf16 beats
        # torch's GEMM at (one expert may get every row: the GEMM takes any count); W8A8 and the packed W8A16 / W4A16
        # at any row count too (their kernels take any, the tiles with AMX: the fused step's prompts run the same
        # grouped kernel); int8 / int4 experts on the row layouts, 16 rows a pass, up to cpu.MAX_ROWS on average.
        kind = experts.gate_up.kind
        rows = self.max_rows(kind) if kind == "bf16" else cpu.MAX_ROWS
        any_rows = kind in ("bf16c", "w8a8", "w8p", "w4p")
        if x.dim() != 2 or (not any_rows and x.shape[0] * routing.ids.shape[1] > rows * experts.num_experts):
            return None
        lins = self._experts_lins.get(experts)
        if lins is None:  # (checked once per layer: the tensors it points at are the layer's, kept alive by it)
            lins = [expert_lin(lin, experts.num_experts, self.lib) for lin in (experts.gate_up, experts.down)]
            self._experts_lins[experts] = lins
        if any(isinstance(lin, str) for lin in lins):
            return None
        return cpu.moe_experts(
            x,
            *lins,
            experts.total or experts.num_experts,
            routing.weights,
            routing.order,
            routing.counts,
            first=experts.first,
            local=experts.num_experts,
            lib=self.lib,
        )

    def fused_decoder(self, model: FusedModel) -> FusedDecoder | str:
        return X86FusedDecoder.build(model, amx=self.amx)

    def profiled(self, name: str) -> AbstractContextManager:
        return cpu.profiled(name)


class Avx2Kernels(X86Kernels):
    """The AVX2 + FMA variant (x86 CPUs without AVX-512): the GEMVs (bf16, W8A16, W4A16), the bf16 FMA GEMM, the
    prefills' dequantization, the elementwise kernels and the fused step (csrc/fused_step.h over
    csrc/x86/avx2/fused.c), through X86Kernels' calls on its own library; no 12-bit weights (those need AVX-512 VBMI
    and AMX). lib: a library from cpu.load_variant(variant) (default: the process's, where it is that one).
    kernels/arm.py's NeonKernels is the same set on the NEON library, less the GEMM and the fused step."""

    variant = "avx2"
    bf16_rows = cpu.AVX2_GEMM_MAX_ROWS  # (bf16 linears: the GEMV, then the FMA GEMM from it_gemm_rows_fma() rows)

    def __init__(self, lib=None) -> None:
        if lib is None:
            got = cpu.load_variant(self.variant)
            if isinstance(got, str):
                raise RuntimeError(f"the {self.variant} kernels are unavailable: {got}")
            lib = got
        self.lib = lib
        self.amx = False
        self.name = cpu.VARIANTS[self.variant].title
        self._experts_lins = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name})"

    def max_rows(self, kind: LinearKind, *, moe: bool = False) -> int:
        # bf16: the GEMV below it_gemm_rows_fma() rows, the FMA GEMM past it, at every step size (torch's bf16 GEMM
        # limited to AVX2 is slower at every size: benchmarks/bench_gemm_avx2.py). W8A16 / W4A16: the integer
        # kernels (x rounded to int16 per row, VPMADDWD against the int8 / int4 weights, MR2 = 2 rows a pass over a
        # block of 4 weight rows) up to AVX2_QUANT_MAX_ROWS rows (24: decode batches; cpu.py says where the FMA GEMM
        # on the dequantized weight overtakes them). Past them the layer dequantizes and runs linear_bf16.
        # 12-bit weights do not exist here.
        # W8A8: VPMADDUBSW on weights packed at load (csrc/x86/avx2/gemm_i8.c) at every row count (NEON, which
        # inherits this: SDOT or SMULL + SADALP on the same layout, csrc/arm/neon/gemm_i8.c; no Arm timing)
        if kind == "w8a8":
            return cpu.NOAMX_QUANT_MAX_ROWS if cpu.w8a8_supported(self.lib) else 0
        if kind in ("bf16c", "w8p", "w4p"):  # (no 12-bit weights; W8A16 / W4A16 keep their VPMADDWD kernels here)
            return 0
        return self.bf16_rows if kind == "bf16" else cpu.AVX2_QUANT_MAX_ROWS

    def can_compress(self, out_features: int, in_features: int) -> bool:
        return False

    def compress(self, weight: torch.Tensor, gate_up: bool = False):
        raise NotImplementedError("the 12-bit weights need AVX-512 VBMI and AMX (can_compress is False here)")

    def fused_decoder(self, model: FusedModel) -> FusedDecoder | str:
        return X86FusedDecoder.build(model, amx=False, avx2_lib=self.lib)


_instance: X86Kernels | Avx2Kernels | None = None


def kernels() -> X86Kernels | Avx2Kernels | None:
    """The process's x86 kernels (the variant cpu.variant() loaded), or None where none can run here
    (cpu.unavailable_reason() says why)."""
    global _instance
    if _instance is None and cpu.available() and cpu.variant() != "neon":  # (neon: kernels/arm.py)
        _instance = Avx2Kernels(cpu.library()) if cpu.variant() == "avx2" else X86Kernels()
    return _instance if cpu.available() else None
