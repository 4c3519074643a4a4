"""W4A16: group-wise int4 weights (asymmetric by default, or symmetric) with bf16/fp32 activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infertune.kernels.interface import DecodeKernels, KernelLinear
from infertune.layers.linear import Linear, UnquantizedMethod
from infertune.quant.int8 import row_blocks


def quantize_int4_groupwise(
    w: torch.Tensor, group_size: int, symmetric: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int32 in [0, 15] [N, K], scale fp32 [N, K/g], min fp32 [N, K/g]); w ~ q * scale + min.

    Asymmetric: [min, max] of each group maps onto 0..15. Symmetric: [-amax, amax] onto -8..7 around 8
    (min = -8 * scale). Either way |w - dequant| <= scale / 2.
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features={k} is not a multiple of group_size={group_size}; pick a group size dividing it")
    q = torch.empty((n, k), dtype=torch.int32, device=w.device)
    scale = torch.empty((n, k // group_size), dtype=torch.float32, device=w.device)
    low = torch.empty_like(scale)
    blocks = row_blocks(n, k)  # (a few MiB of fp32 temporaries at a time: int8.QUANT_BLOCK_ELEMENTS)
    for r in blocks:
        rows = slice(r, r + blocks.step)
        g = w[rows].float().view(-1, k // group_size, group_size)
        if symmetric:
            s = (g.abs().amax(dim=-1) / 7.5).clamp(min=1e-12)
            lo = -8.0 * s
        else:
            lo, high = g.amin(dim=-1), g.amax(dim=-1)
            s = ((high - lo) / 15.0).clamp(min=1e-12)
        q[rows] = torch.round((g - lo.unsqueeze(-1)) / s.unsqueeze(-1)).clamp(0, 15).view(-1, k)
        scale[rows], low[rows] = s, lo
    return q, scale, low


def dequantize_int4(q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, group_size: int) -> torch.Tensor:
    n, k = q.shape
    g = q.view(n, k // group_size, group_size).float() * scale.unsqueeze(-1) + low.unsqueeze(-1)
    return g.view(n, k)


class W4A16Method(UnquantizedMethod):
    """Int4 weights packed for the aten int4 matmul on CPU (_weight_int4pack_mm_for_cpu); a dequantize
    reference path elsewhere (the CUDA int4 kernel is not wired: unverified without a GPU here)."""

    name = "w4a16"

    def __init__(
        self,
        group_size: int = 128,
        symmetric: bool = False,
        fast_kernel: bool = True,
        kernel_max_rows: int | None = None,
        kernels: DecodeKernels | None = None,
    ) -> None:
        self.group_size, self.symmetric, self.fast_kernel = group_size, symmetric, fast_kernel
        self.kernel_max_rows = kernel_max_rows  # past this many rows: dequantize once, dense matmul
        # The backend's own decode kernels (kernels/interface.py): where given, weights are kept in their layout.
        self.kernels = kernels
        self.own_layout = False
        # own_layout's kind: "w4" (pack_w4's rows, [N, K / 2]) or "w4p" (pack_w4p's blocks, where max_rows("w4p") > 0:
        # AVX-512 without AMX, and with AMX an MoE model's layers; the grouped expert GEMM reads either, csrc/moe.h).
        self.kernel_kind = "w4"
        self.moe = False  # a layer of a mixture-of-experts model (attach_linear_methods sets it): max_rows(moe=)

    def process_weights_after_loading(self, layer: Linear) -> None:
        w = layer.weight.data
        dtype = w.dtype
        q, scale, low = quantize_int4_groupwise(w, self.group_size, self.symmetric)
        del layer.weight
        self.pack_weights(layer, q, scale, low, dtype)

    def pack_weights(
        self, layer: Linear, q: torch.Tensor, scale: torch.Tensor, low: torch.Tensor, dtype: torch.dtype
    ) -> None:
        """q int32 [N, K] in 0..15, scale and low fp32 [N, K/g] -> the kernel's buffers (also for pre-quantized
        checkpoints)."""
        device = q.device
        if (
            self.kernels is not None
            and device.type == "cpu"
            and dtype is torch.bfloat16
            and self.kernels.w4_supported(q.shape[1], self.group_size)
        ):
            self.own_layout = True
            if self.kernels.max_rows("w4p", moe=self.moe) > 0:
                # pack_w4p's 64-feature blocks, its blocked fp32 scale and zero
                self.kernel_kind = "w4p"
                packed, scale, low = self.kernels.pack_w4p(q, scale.float(), low.float(), self.group_size)
            else:  # the kernels' int4 rows (pack_w4), fp32 scale and zero [N, K/g]
                packed, scale, low = self.kernels.pack_w4(q), scale.float().contiguous(), low.float().contiguous()
            layer.register_buffer("qweight", packed)
            layer.register_buffer("w4_scale", scale)
            layer.register_buffer("w4_zero", low)
            return
        # (aten's int4 pack takes N a multiple of 16; another N keeps the reference layout: dequantize, dense matmul)
        self.fast_kernel = self.fast_kernel and device.type == "cpu" and q.shape[0] % 16 == 0
        if not self.fast_kernel:
            layer.register_buffer("q_ref", q.to(torch.uint8))
            layer.register_buffer("scale_ref", scale)
            layer.register_buffer("low_ref", low)
            return
        # The kernel computes (q - 8) * scale + zero, so zero = low + 8 * scale; layout [K/g, N, 2].
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
        layer.register_buffer("qweight", packed)
        layer.register_buffer(
            "scales_and_zeros", torch.stack([scale.t(), (low + 8 * scale).t()], dim=-1).to(dtype).contiguous()
        )
        # Prefills need the dense weight; read it back from the kernel's layout when we know that layout,
        # else keep our own copy of the integers (one byte each).
        n, k = q.shape
        self.unpack_layout = next(
            (
                name
                for name, (rows, _) in CPU_INT4_LAYOUTS.items()
                if n % rows == 0 and k % 2 == 0 and torch.equal(_unpack_cpu_int4(packed, n, k, name), q)
            ),
            None,
        )
        self.unpack_known = self.unpack_layout is not None
        layer.register_buffer("q_dense", None if self.unpack_known else q.to(torch.uint8))

    def _dense_weight(self, layer: Linear, dtype: torch.dtype) -> torch.Tensor:
        n = layer.out_features
        if self.own_layout and self.kernel_kind == "w4p":  # (prompts: the kernel's GEMM on rebuilt slabs, no copy)
            q, scale, zero = self.kernels.unpack_w4p(layer.qweight, layer.w4_scale, layer.w4_zero, n, layer.in_features)
            w = q.view(n, -1, self.group_size).float() * scale.unsqueeze(-1) + zero.unsqueeze(-1)
            return w.view(n, -1).to(dtype)
        if self.own_layout and dtype is torch.bfloat16 and not torch.compiler.is_compiling():
            return self.kernels.dequant_w4(layer.qweight, layer.w4_scale, layer.w4_zero, self.group_size)
        if self.own_layout:
            q = self.kernels.unpack_w4(layer.qweight).view(n, -1, self.group_size).float()
            w = q * layer.w4_scale.unsqueeze(-1) + layer.w4_zero.unsqueeze(-1)
            return w.view(n, -1).to(dtype)
        q = (
            _unpack_cpu_int4(layer.qweight, n, layer.in_features, self.unpack_layout)
            if self.unpack_known
            else layer.q_dense
        )
        g = q.view(n, -1, self.group_size).to(dtype)
        sz = layer.scales_and_zeros.to(dtype)  # [K/g, N, 2]
        w = (g - 8) * sz[..., 0].t().unsqueeze(-1) + sz[..., 1].t().unsqueeze(-1)
        return w.view(n, -1)

    def kernel_weights(self, layer: Linear) -> KernelLinear | None:
        if not self.own_layout:
            return None
        return KernelLinear(
            self.kernel_kind,
            layer.out_features,
            layer.in_features,
            layer.bias,
            qweight=layer.qweight,
            scales=layer.w4_scale,
            zero=layer.w4_zero,
            group_size=self.group_size,
        )

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.own_layout and self.kernel_kind == "w4p" and x.dtype is torch.bfloat16:  # (compile: an opaque op)
            return self.kernels.linear_w4p(
                x, layer.qweight, layer.w4_scale, layer.w4_zero, self.group_size, layer.out_features, layer.bias
            )
        if self.own_layout:
            if (
                x.dtype is torch.bfloat16
                and x2.shape[0] <= self.kernels.max_rows("w4")
                and not torch.compiler.is_compiling()
            ):
                return self.kernels.linear_w4(
                    x, layer.qweight, layer.w4_scale, layer.w4_zero, self.group_size, layer.bias
                )
            w = self._dense_weight(layer, x.dtype)
            if (
                x.dtype is torch.bfloat16
                and x2.shape[0] <= self.kernels.max_rows("bf16")
                and not torch.compiler.is_compiling()
            ):  # the kernels' bf16 GEMM where it beats torch's at this size (AVX2: every size; AMX: up to 128 rows)
                y = self.kernels.linear_bf16(x, w)
            else:
                y = F.linear(x, w)
        elif not self.fast_kernel:
            w = dequantize_int4(layer.q_ref.to(torch.int32), layer.scale_ref, layer.low_ref, self.group_size)
            y = F.linear(x, w.to(x.dtype))
        elif self.kernel_max_rows is None or x2.shape[0] <= self.kernel_max_rows:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, layer.qweight, self.group_size, layer.scales_and_zeros)
            y = y.view(*x.shape[:-1], -1)
        else:  # a prefill: the weight-pack kernel is a GEMV at heart, a dense matmul is far faster here
            y = F.linear(x, self._dense_weight(layer, x.dtype))
        return y if layer.bias is None else y + layer.bias


def _unpack_avx512(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Per block of 64 rows, byte (k, j) holds row j of column k in its low nibble and row j + 32 in its high."""
    b = packed.view(n // 64, k, 32)
    rows = torch.cat([b & 0xF, b >> 4], dim=2)  # [N/64, K, 64]
    return rows.permute(0, 2, 1).reshape(n, k).to(torch.int32)


def _unpack_avx2(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Per block of 32 rows and pair of columns (2c, 2c + 1), 32 bytes: byte 16 i + j (i = 0, 1; j < 16) holds row j
    of column 2c + i in its low nibble and row j + 16 in its high."""
    b = packed.view(n // 32, k // 2, 2, 16)
    rows = torch.cat([b & 0xF, b >> 4], dim=3)  # [N/32, K/2, 2, 32]
    return rows.permute(0, 3, 1, 2).reshape(n, k).to(torch.int32)


def _unpack_default(packed: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """As _unpack_avx2, but byte 16 i + j holds rows 2 j (low nibble) and 2 j + 1 (high) of its block of 32."""
    b = packed.view(n // 32, k // 2, 2, 16)
    rows = torch.stack([b & 0xF, b >> 4], dim=4).view(n // 32, k // 2, 2, 32)
    return rows.permute(0, 3, 1, 2).reshape(n, k).to(torch.int32)


# torch's _convert_weight_to_int4pack_for_cpu lays the nibbles out by the kernels it dispatches to on this CPU
# (torch 2.x; torch.backends.cpu.get_cpu_capability()): AVX-512's blocks of 64 rows, AVX2's blocks of 32, or the
# scalar (DEFAULT) kernel's blocks of 32 with neighbouring rows in one byte. {name: (rows a block, unpack)}
CPU_INT4_LAYOUTS = {"avx512": (64, _unpack_avx512), "avx2": (32, _unpack_avx2), "default": (32, _unpack_default)}


def _unpack_cpu_int4(packed: torch.Tensor, n: int, k: int, layout: str = "avx512") -> torch.Tensor:
    """Integers [N, K] from _convert_weight_to_int4pack_for_cpu's `layout` (CPU_INT4_LAYOUTS; N a multiple of its
    block of rows). The caller checks the result against the integers it packed before relying on it."""
    return CPU_INT4_LAYOUTS[layout][1](packed, n, k)
