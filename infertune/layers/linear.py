"""Linear layers whose matmul is delegated to a QuantMethod, plus packed QKV / gate-up variants.

A packed layer stores several Hugging Face projections in one weight (fewer, larger matmuls) and
knows how to load each shard into its slice; that knowledge lives on the parameter as `weight_loader`.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import nn


class QuantMethod(abc.ABC):
    """How a linear layer's weights are created, post-processed after loading, and multiplied."""

    @abc.abstractmethod
    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None: ...

    def process_weights_after_loading(self, layer: "Linear") -> None:
        """Repack or quantize once the checkpoint is in place (no-op for plain weights)."""

    @abc.abstractmethod
    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor: ...


class UnquantizedMethod(QuantMethod):
    def create_weights(self, layer: "Linear", dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class PrepackedMethod(UnquantizedMethod):
    """Plain weights, reordered once after loading into the layout the backend multiplies fastest."""

    name = "prepacked"

    def __init__(self, backend) -> None:
        self.backend = backend

    def process_weights_after_loading(self, layer: "Linear") -> None:
        packed = self.backend.prepack_linear_weight(layer.weight.data)
        assert packed is not None, "attach PrepackedMethod only where the backend packs such weights"
        del layer.weight
        layer.register_buffer("packed_weight", packed)

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        return self.backend.packed_linear(x, layer.packed_weight, layer.bias)


class DecodeKernelMethod(UnquantizedMethod):
    """Plain weights, left where they are: steps of up to kernels.bf16_max_rows() rows (decodes; with AMX also
    prompts and decode batches up to 128 rows) run the backend's small-batch kernel, bigger ones (prefills) and
    anything torch.compile traces run F.linear."""

    name = "decode-kernel"

    def __init__(self, kernels) -> None:
        self.kernels = kernels
        self.max_rows = kernels.bf16_max_rows()

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if (x.dtype is torch.bfloat16 and x.numel() <= self.max_rows * x.shape[-1]
                and not torch.compiler.is_compiling()):
            return self.kernels.linear_bf16(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)


class Bf16cMethod(DecodeKernelMethod):
    """Plain bf16 weights stored losslessly in 12 bits a weight (kernels/cpu.py pack_bf16c): each weight's low
    byte plus a 4-bit code into the layer's 16 most common high bytes, the rare others patched in. The kernels
    decode tiles as they multiply, so a decode step streams 25% fewer weight bytes and the layer holds 0.75x the
    memory, for the very same products (bitwise those of DecodeKernelMethod on AMX). Every step bf16 and outside
    torch.compile runs the kernels (the tile GEMM past 16 rows); traced code gets the unpacked weight.

    An MLP's gate_up (a layer marked `silu_pairs`, without bias) is packed with its gate and up rows interleaved
    16 by 16, so that silu_and_mul() hands the MLP silu(gate) * up straight from the tiles."""

    name = "decode-kernel-12bit"
    inter = 0  # > 0: a gate_up packed interleaved (kernels.interleave_gate_up), its intermediate size

    def process_weights_after_loading(self, layer: "Linear") -> None:
        w = layer.weight.data
        if (getattr(layer, "silu_pairs", False) and layer.bias is None and w.shape[0] % 32 == 0):
            self.inter = w.shape[0] // 2
        packed = self.kernels.pack_bf16c(w, inter=self.inter)  # (gate and up interleaved where inter > 0)
        del layer.weight
        for name, t in packed.items():
            layer.register_buffer(f"bf16c_{name}", t)
        self.desc = self.kernels.bf16c_struct(packed)  # points at the buffers above (they live with the layer)

    def dense_weight(self, layer: "Linear") -> torch.Tensor:
        """The bf16 weight [out, in], bit for bit as loaded."""
        w = self.kernels.unpack_bf16c(self.desc, layer.out_features, layer.in_features)
        return self.kernels.deinterleave_gate_up(w) if self.inter else w

    def apply(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return F.linear(x, self.dense_weight(layer), layer.bias)
        if x.dtype is torch.bfloat16:  # the tile GEMM decodes as it goes at every size: no unpacked copy
            return self.kernels.linear_bf16c(x, self.desc, layer.out_features, layer.bias, inter=self.inter)
        return F.linear(x, self.dense_weight(layer).to(x.dtype), layer.bias)

    def silu_and_mul(self, layer: "Linear", x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this gate_up layer for x, from the tiles (None where it cannot: not interleaved, not
        bf16, or traced); rounded as layers/activation.py silu_and_mul on the bf16 gate_up."""
        if not self.inter or x.dtype is not torch.bfloat16 or torch.compiler.is_compiling():
            return None
        return self.kernels.linear_bf16c(x, self.desc, layer.out_features, inter=self.inter, silu=True)


def default_weight_loader(param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
    if param.shape != loaded.shape:
        raise ValueError(f"checkpoint tensor has shape {tuple(loaded.shape)}, the model expects {tuple(param.shape)}")
    param.data.copy_(loaded)


class Linear(nn.Module):
    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        quant_method: QuantMethod | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.quant_method = quant_method or UnquantizedMethod()
        self.quant_method.create_weights(self, dtype)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        for p in self.parameters(recurse=False):
            p.weight_loader = self.weight_loader

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.quant_method.apply(self, x)


class PackedLinear(Linear):
    """Several projections of the same input stacked along the output dim; shards keyed by name."""

    def __init__(self, in_features: int, shard_sizes: dict[object, int], bias: bool = False, **kw) -> None:
        self.shard_offsets: dict[object, tuple[int, int]] = {}
        offset = 0
        for key, size in shard_sizes.items():
            self.shard_offsets[key] = (offset, size)
            offset += size
        super().__init__(in_features, offset, bias=bias, **kw)

    def weight_loader(self, param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        if shard is None:
            return default_weight_loader(param, loaded)
        start, size = self.shard_offsets[shard]
        default_weight_loader(param.data.narrow(0, start, size), loaded)
