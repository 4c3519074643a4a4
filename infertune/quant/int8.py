"""Int8 weights: W8A16 (weight-only, per output channel) and W8A8 (plus dynamic per-token int8 activations)."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from infertune.kernels import hugepages
from infertune.kernels.interface import DecodeKernels, KernelLinear
from infertune.layers.linear import Linear, QuantMethod, UnquantizedMethod

W8A8_MAX_K = 1 << 16  # the int32 sums of the kernels' W8A8 hold K up to this (kernels/cpu.py W8A8_MAX_K)


# Elements of a weight quantized at a time (a block of whole rows): the fp32 temporaries of a quantizing load stay
# a few MiB however large the weight (all at once, Llama-1B's gate_up 16384 x 2048 took ~380 MiB of them; a 70B
# model's ~2.8 GiB). Every quantizer works row by row, so the blocks give the same values.
QUANT_BLOCK_ELEMENTS = 1 << 20


def row_blocks(n: int, k: int) -> range:
    """Starts of the row blocks of QUANT_BLOCK_ELEMENTS (at least one row) that an [n, k] weight is quantized in."""
    return range(0, n, max(1, QUANT_BLOCK_ELEMENTS // max(k, 1)))


def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: w [N, K] -> (q int8 [N, K], scale fp32 [N]); |w - q * scale| <= scale / 2."""
    n, k = w.shape
    q = torch.empty((n, k), dtype=torch.int8, device=w.device)
    scale = torch.empty(n, dtype=torch.float32, device=w.device)
    blocks = row_blocks(n, k)
    for r in blocks:
        w32 = w[r : r + blocks.step].float()
        s = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
        q[r : r + blocks.step] = torch.round(w32 / s.unsqueeze(1)).clamp(-127, 127)
        scale[r : r + blocks.step] = s
    return q, scale


@functools.cache
def int_mm_is_exact() -> bool:
    """Whether torch._int_mm sums int8 products exactly on this CPU. oneDNN multiplies s8 x s8 as (x + 128) x w with
    VPMADDUBSW where the CPU has no VNNI (AVX2-only x86, or torch limited to AVX2), and that instruction saturates
    each pair of products at 32767: a row of 127s against a column of 127s sums wrong (measured: off by up to 139304
    with ONEDNN_MAX_CPU_ISA=AVX2). Probed once on exactly that case."""
    a = torch.full((32, 64), 127, dtype=torch.int8)
    a[16:] = -127
    b = torch.full((64, 32), 127, dtype=torch.int8)
    b[:, 16:] = -127
    want = (a.long() @ b.long()).to(torch.int32)
    try:
        return torch.equal(torch._int_mm(a, b), want)
    except RuntimeError:
        return False


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric per-row int8 of activations: x [M, K] -> (q int8 [M, K], scale fp32 [M, 1])."""
    x32 = x.float()
    scale = (x32.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
    return torch.round(x32 / scale).clamp(-127, 127).to(torch.int8), scale


class W8A16Method(UnquantizedMethod):
    """Loads weights in the model dtype, then keeps int8 weights + per-channel scales and drops the original.

    apply: the backend's kernels for a few rows where given; on x86 with AVX-512 the weight is kept in their packed
    layout (pack_w8a8, linear_w8p: one weight stream a thread; with AMX on AMX-INT8 tiles) and every row count goes
    through them;
    else the aten int8 weight-pack matmul (VNNI / AVX-512 on x86) where the device has it, or a
    dequantize-then-matmul reference.
    """

    name = "w8a16"
    kind = "w8p"  # the kernels' packed kind (DecodeKernels.max_rows(kind) > 0: pack at load)
    own_layout = False  # qweight is the kernels' pack_w8a8 layout (else int8 [N, K])
    kernel_rows = 0  # with own_layout: the rows up to which apply() calls the packed kernel (max_rows, asked once)
    # One instance packs every expert of a projection (quant/experts.py), and they must share one layout: the first
    # weight packed decides it; torch_layout_only keeps torch's [N, K] for all (a stored weight holding -128, which
    # the kernels refuse, sets it for its whole projection before packing starts: quant/checkpoint.py).
    packed_weights = 0
    torch_layout_only = False

    def __init__(
        self, fast_kernel: bool = True, kernel_max_rows: int | None = None, kernels: DecodeKernels | None = None
    ) -> None:
        self.fast_kernel = fast_kernel
        # The backend's own small-batch kernels (kernels/interface.py), used for decode steps when given.
        self.kernels = kernels
        # The weight-pack kernel is a GEMV at heart: past a few rows (a prefill), dequantizing the weight
        # once and running a dense matmul is much faster (measured 12.9 s -> see BENCHMARKS.md for 16x128).
        self.kernel_max_rows = kernel_max_rows

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, scale = quantize_int8_per_channel(layer.weight.data)
        dtype = layer.weight.dtype
        del layer.weight
        self.pack_weights(layer, q, scale, dtype)

    def _kernel_rows(self) -> int:
        return self.kernels.max_rows(self.kind) if self.kernels is not None else 0

    def _pack(self, q: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor | None, int]:
        """(the kernels' packed weight of int8 q [N, K], the rows they take), or (None, 0): keep torch's layout (no
        such kernel here, another dtype or device, K too wide, or a stored weight holding -128)."""
        rows = self._kernel_rows()
        first = self.packed_weights == 0
        self.packed_weights += 1
        if (
            self.torch_layout_only
            or not (first or self.own_layout)
            or rows <= 0
            or q.device.type != "cpu"
            or dtype is not torch.bfloat16
            or q.shape[1] > W8A8_MAX_K
        ):
            return None, 0
        try:
            packed = self.kernels.pack_w8a8(q.contiguous())
        except ValueError:  # (-128, outside the kernels' range: a stored checkpoint may hold it; torch's path)
            if not first:
                raise ValueError(
                    f"a {self.name} weight holds -128 while the ones packed before it with the same method do not: "
                    "scan the stacked weights first and set torch_layout_only"
                ) from None
            return None, 0
        self.own_layout, self.kernel_rows = True, rows
        return packed, rows

    def pack_weights(self, layer: Linear, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        """int8 q [N, K] and fp32 scale [N] -> the kernel's buffers (also for pre-quantized checkpoints). The scale
        is rounded to the model dtype either way (the packed layout keeps that value in fp32)."""
        packed, _ = self._pack(q, dtype)
        if packed is not None:
            layer.register_buffer("qweight", packed)
            layer.register_buffer("scales", scale.to(dtype).float().contiguous())  # [N] fp32
        else:  # [N, K] int8 (the GEMVs stream it: on 2 MB pages where the system allows, kernels/hugepages.py)
            layer.register_buffer("qweight", hugepages.copy(q) if q.device.type == "cpu" else q)
            layer.register_buffer("scales", scale.to(dtype))  # [N]

    def int8_weight(self, layer: Linear) -> torch.Tensor:
        """The int8 weight [N, K], whatever the layout it is kept in."""
        if self.own_layout:
            return self.kernels.unpack_w8a8(layer.qweight, layer.out_features, layer.in_features)
        return layer.qweight

    def dequantized_weight(self, layer: Linear) -> torch.Tensor:
        return self.int8_weight(layer).float() * layer.scales.float().unsqueeze(1)

    def kernel_weights(self, layer: Linear) -> KernelLinear | None:
        if self.own_layout:
            return KernelLinear(
                self.kind, layer.out_features, layer.in_features, layer.bias, qweight=layer.qweight, scales=layer.scales
            )
        if self.kernels is None or not layer.qweight.is_contiguous():
            return None
        return KernelLinear(
            "w8", layer.out_features, layer.in_features, layer.bias, qweight=layer.qweight, scales=layer.scales
        )

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.own_layout:
            if x2.shape[0] <= self.kernel_rows and x.dtype is torch.bfloat16:  # (torch.compile: an opaque op)
                return self.kernels.linear_w8p(x, layer.qweight, layer.scales, layer.bias)
            # (another dtype: the reference on the unpacked weight)
            w = self.int8_weight(layer).to(x.dtype) * layer.scales.to(x.dtype).unsqueeze(1)
            y = F.linear(x, w)
            return y if layer.bias is None else y + layer.bias
        if (
            self.kernels is not None
            and x.dtype is torch.bfloat16
            and x2.shape[0] <= self.kernels.max_rows("w8")
            and not torch.compiler.is_compiling()
        ):
            return self.kernels.linear_w8(x, layer.qweight, layer.scales, layer.bias)
        if self.fast_kernel and (self.kernel_max_rows is None or x2.shape[0] <= self.kernel_max_rows):
            y = torch._weight_int8pack_mm(x2, layer.qweight, layer.scales).view(*x.shape[:-1], -1)
        elif self.kernels is not None and x.dtype is torch.bfloat16 and not torch.compiler.is_compiling():
            # a prefill: the reference's rounding below, in one parallel pass; then the kernels' bf16 GEMM where it
            # beats torch's at this size (AVX2: every size; AMX: up to 128 rows)
            w = self.kernels.dequant_w8(layer.qweight, layer.scales)
            y = self.kernels.linear_bf16(x, w) if x2.shape[0] <= self.kernels.max_rows("bf16") else F.linear(x, w)
        else:
            w = layer.qweight.to(x.dtype) * layer.scales.to(x.dtype).unsqueeze(1)  # [N, K]
            y = F.linear(x, w)
        return y if layer.bias is None else y + layer.bias


class W8A8Method(W8A16Method):
    """Int8 weights and dynamic per-token int8 activations, multiplied in int32.

    The reference (apply's last lines) is torch._int_mm on the rounded activations. Where the backend's kernels have
    a W8A8 product (DecodeKernels.max_rows("w8a8") > 0: x86 with AVX-512 VNNI, AMX or not, or AVX2) and the model
    runs in bf16 on the CPU, the weight is kept in their own layout (pack_w8a8) and every step up to max_rows rows
    goes through linear_w8a8, bit for bit the reference's product; the fused step takes such layers too
    (kernel_weights)."""

    name = "w8a8"
    kind = "w8a8"

    def __init__(self, fast_kernel: bool = True, kernels: DecodeKernels | None = None) -> None:
        super().__init__(fast_kernel, None, kernels)
        # Probed here, not in apply(): under torch.compile the probe's torch.equal is a data-dependent graph break
        # (compile="on" refuses it), while a plain bool attribute is a constant to the tracer.
        self.cpu_int_mm_exact = fast_kernel and int_mm_is_exact()

    def pack_weights(self, layer: Linear, q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> None:
        """int8 q [N, K] and fp32 scale [N] -> the buffers (also for pre-quantized checkpoints)."""
        packed, _ = self._pack(q, dtype)
        if packed is not None:
            layer.register_buffer("qweight", packed)
        else:
            layer.register_buffer("qweight", q.contiguous())  # [N, K] int8 (_int_mm takes its transpose as a view)
        layer.register_buffer("scales", scale.float().contiguous())  # [N] fp32
        layer.out_dtype = dtype

    def quantize_input(self, layer: Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (int8 [M, K], scale [M, 1]): dynamic per-token (pre-quantized checkpoints may use static)."""
        return quantize_int8_per_token(x)

    def static_scale(self, layer: Linear) -> torch.Tensor | None:
        """The activations' calibrated scale, fp32 [1], where every token shares one; None: a scale per token."""
        return None

    def kernel_weights(self, layer: Linear) -> KernelLinear | None:
        if not self.own_layout:
            return None
        return KernelLinear(
            "w8a8",
            layer.out_features,
            layer.in_features,
            layer.bias,
            qweight=layer.qweight,
            scales=layer.scales,
            input_scale=self.static_scale(layer),
        )

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if self.own_layout and x2.shape[0] <= self.kernel_rows and x.dtype is torch.bfloat16:  # (compile: opaque)
            return self.kernels.linear_w8a8(x, layer.qweight, layer.scales, self.static_scale(layer), layer.bias)
        xq, xs = self.quantize_input(layer, x2)
        w = self.int8_weight(layer)
        if self.fast_kernel and (x.device.type != "cpu" or self.cpu_int_mm_exact):
            acc = torch._int_mm(xq, w.t()).float()  # [M, N] exact int32 sums
        elif x.device.type == "cpu":  # (its int8 GEMM saturates here: float64 holds the integer sums exactly)
            acc = (xq.double() @ w.t().double()).float()
        else:
            acc = xq.float() @ w.t().float()
        y = (acc * xs * layer.scales).to(x.dtype).view(*x.shape[:-1], -1)
        return y if layer.bias is None else y + layer.bias


__all__ = ["QuantMethod", "W8A16Method", "W8A8Method", "quantize_int8_per_channel", "quantize_int8_per_token"]
