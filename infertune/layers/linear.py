"""Linear layers whose matmul is delegated to a QuantMethod, plus packed QKV / gate-up variants.

A packed layer stores several Hugging Face projections in one weight (fewer, larger matmuls) and
knows how to load each shard into its slice; that knowledge lives on the parameter as `weight_loader`.
"""

from __future__ import annotations

import abc

import torch
import torch.nn.functional as F
from torch import nn

from infertune.kernels.interface import CompressedWeight, DecodeKernels, KernelLinear


class QuantMethod(abc.ABC):
    """How a linear layer's weights are created, post-processed after loading, and multiplied."""

    @abc.abstractmethod
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None: ...

    def process_weights_after_loading(self, layer: Linear) -> None:
        """Repack or quantize once the checkpoint is in place (no-op for plain weights)."""

    @abc.abstractmethod
    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor: ...

    def silu_and_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        """For an MLP's gate_up layer: silu(gate) * up of x straight from the matmul, or None (the MLP then runs
        the layer and the activation apart)."""
        return None

    def kernel_weights(self, layer: Linear) -> KernelLinear | None:
        """The layer's weights as the backend's kernels multiply them (for the fused step), or None where they are
        in a layout of torch's."""
        return None


class UnquantizedMethod(QuantMethod):
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        layer.weight = nn.Parameter(
            torch.empty(layer.out_features, layer.in_features, dtype=dtype), requires_grad=False
        )

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)


class PrepackedMethod(UnquantizedMethod):
    """Plain weights, reordered once after loading into the layout the backend multiplies fastest."""

    name = "prepacked"

    def __init__(self, backend) -> None:
        self.backend = backend

    def process_weights_after_loading(self, layer: Linear) -> None:
        packed = self.backend.prepack_linear_weight(layer.weight.data)
        assert packed is not None, "attach PrepackedMethod only where the backend packs such weights"
        del layer.weight
        layer.register_buffer("packed_weight", packed)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return self.backend.packed_linear(x, layer.packed_weight, layer.bias)


class DecodeKernelMethod(UnquantizedMethod):
    """Plain weights, left where they are: steps of up to kernels.max_rows("bf16") rows (decodes; with AMX also
    prompts and decode batches up to 128 rows) run the backend's small-batch kernel, bigger ones (prefills) and
    anything torch.compile traces run F.linear."""

    name = "decode-kernel"

    def __init__(self, kernels: DecodeKernels) -> None:
        self.kernels = kernels
        self.max_rows = kernels.max_rows("bf16")

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if x.dtype is torch.bfloat16 and x.numel() <= self.max_rows * x.shape[-1] and not torch.compiler.is_compiling():
            return self.kernels.linear_bf16(x, layer.weight, layer.bias)
        return F.linear(x, layer.weight, layer.bias)

    def kernel_weights(self, layer: Linear) -> KernelLinear:
        return KernelLinear("bf16", layer.out_features, layer.in_features, layer.bias, weight=layer.weight)


class CompressedMethod(DecodeKernelMethod):
    """Plain bf16 weights kept in the kernels' lossless compressed layout (`DecodeKernels.compress`; on x86, 12 bits
    a weight: kernels/x86.py): a decode step streams fewer weight bytes and the layer holds less memory, for the
    very same products as DecodeKernelMethod. Every step bf16 and outside torch.compile runs the kernels; traced
    code gets the dense weight back.

    An MLP's gate_up (a layer marked `silu_pairs`, without bias) is compressed so that silu_and_mul() hands the MLP
    silu(gate) * up straight from the matmul."""

    name = "decode-kernel-12bit"

    def process_weights_after_loading(self, layer: Linear) -> None:
        gate_up = getattr(layer, "silu_pairs", False) and layer.bias is None
        self.weight: CompressedWeight = self.kernels.compress(layer.weight.data, gate_up=gate_up)
        del layer.weight
        for name, t in self.weight.buffers.items():  # (the layer holds the memory: .to(), state_dict, sizes)
            layer.register_buffer(f"compressed_{name}", t)

    def dense_weight(self, layer: Linear) -> torch.Tensor:
        """The bf16 weight [out, in], bit for bit as loaded."""
        return self.weight.dense()

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return F.linear(x, self.dense_weight(layer), layer.bias)
        if x.dtype is torch.bfloat16:  # the kernel decodes as it multiplies at every size: no dense copy
            return self.weight.linear(x, layer.bias)
        return F.linear(x, self.dense_weight(layer).to(x.dtype), layer.bias)

    def silu_and_mul(self, layer: Linear, x: torch.Tensor) -> torch.Tensor | None:
        if x.dtype is not torch.bfloat16 or torch.compiler.is_compiling():
            return None
        return self.weight.silu_and_mul(x)

    def kernel_weights(self, layer: Linear) -> KernelLinear:
        return KernelLinear("bf16c", layer.out_features, layer.in_features, layer.bias, compressed=self.weight)


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
