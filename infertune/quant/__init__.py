"""Quantization methods attached to linear layers (and MoE experts), and the policy choosing which layers get them."""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from infertune.config import QuantConfig
from infertune.kernels.interface import DecodeKernels
from infertune.layers.linear import CompressedMethod, DecodeKernelMethod, Linear, PrepackedMethod
from infertune.layers.moe import CompressedExperts, Experts
from infertune.quant.experts import QuantizedExperts
from infertune.quant.int4 import W4A16Method
from infertune.quant.int8 import W8A8Method, W8A16Method


def make_method(
    config: QuantConfig,
    fast_kernels: bool = True,
    kernel_max_rows: int | None = None,
    kernels: DecodeKernels | None = None,
):
    """kernel_max_rows: above this many rows (prefill) a dequantized dense matmul beats the weight-pack kernels.
    kernels: the backend's own decode kernels (Backend.decode_kernels()), used by the methods that have one."""
    if config.method == "w8a16":
        return W8A16Method(fast_kernels, kernel_max_rows, kernels)
    if config.method == "w8a8":
        return W8A8Method(fast_kernels, kernels)
    if config.method == "w4a16":
        return W4A16Method(config.group_size, config.symmetric, fast_kernels, kernel_max_rows, kernels)
    raise ValueError(f"quantization={config.method!r} is unknown")


def attach_linear_methods(
    model: nn.Module,
    config: QuantConfig | None,
    backend=None,
    prepack: bool = True,
    dtype: torch.dtype | None = None,
    kernels: DecodeKernels | None = None,
    compress: bool = False,
) -> dict[str, str]:
    """Choose each Linear's method before loading: quantized (unless kept in full precision), the backend's
    decode kernels over plain bf16 weights (when `kernels` is given), prepacked into the backend's fast layout,
    or plain. Returns {layer name: method name} for the layers that changed.

    MoE experts (layers/moe.py Experts) follow the same rule: quantized, each expert as a Linear of its shape
    (quant/experts.py), unless keep_fp matches the experts module; the router and Qwen2-MoE's shared-expert gate are
    never quantized (they are not Linears), a shared expert's Linears are like any other. MLA's kv_b_proj
    (layers/attention/mla.py LatentUpProjection) stays in the model dtype too: its docstring says why.

    Norms, rotary, softmax and logits are never quantized. A weight shared with another module (tied
    embeddings) keeps its plain values, since the embedding reads it too; the decode kernels read it in place, or
    (with `compress`) the head multiplies a lossless 12-bit copy of it.
    With `compress`, the other plain bf16 layers under the decode kernels are kept in the kernels' lossless 12-bit
    layout where their shape and the CPU allow (CompressedMethod).
    """
    fast = backend.has_quant_kernels if backend is not None else True
    max_rows = backend.quant_kernel_max_rows if backend is not None else None
    shared = shared_parameters(model)
    chosen: dict[str, str] = {}
    plain_kernel = kernels is not None and (dtype or torch.float32) is torch.bfloat16
    # (a quantized layer of a mixture-of-experts model may take another layout: DecodeKernels.max_rows(moe=))
    moe = any(isinstance(m, Experts) for m in model.modules())
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            if config is not None and config.method is not None and not keeps(config, name):
                module.quant_method = QuantizedExperts(lambda: make_method(config, fast, max_rows, kernels))
                chosen[name] = module.quant_method.name
            elif plain_kernel and compress and _compressible_experts(module, kernels):
                module.quant_method = CompressedExperts(kernels)
                chosen[name] = module.quant_method.name
            continue
        if not isinstance(module, Linear):
            continue
        if config is not None and config.method is not None and config.quantize_lm_head and is_lm_head(name):
            # int8 per channel whatever the method: the head's rounding moves every logit, and int8 halves its bytes.
            # W8A16Method drops only this module's reference to a tied weight: the embedding keeps the tensor.
            module.quant_method = W8A16Method(fast, max_rows, kernels)
            chosen[name] = module.quant_method.name
            continue
        if id(module.weight) in shared:
            # A tied head: compressed, it is a 12-bit copy beside the embedding's bf16 table (which the lookups
            # read: a few rows a step), for 0.76x the bytes the head streams every step
            if plain_kernel and compress and kernels.can_compress(module.out_features, module.in_features):
                module.quant_method = CompressedMethod(kernels)
            elif plain_kernel:
                module.quant_method = DecodeKernelMethod(kernels)
            else:
                continue
            chosen[name] = module.quant_method.name
            continue
        if config is not None and config.method is not None and not keeps(config, name):
            module.quant_method = make_method(config, fast, max_rows, kernels)
            if hasattr(module.quant_method, "moe"):
                module.quant_method.moe = moe
        elif plain_kernel and compress and kernels.can_compress(module.out_features, module.in_features):
            module.quant_method = CompressedMethod(kernels)
        elif plain_kernel:
            module.quant_method = DecodeKernelMethod(kernels)
        elif prepack and backend is not None and backend.can_prepack(dtype or module.weight.dtype, module.in_features):
            module.quant_method = PrepackedMethod(backend)
        else:
            continue
        chosen[name] = module.quant_method.name
    return chosen


def _compressible_experts(experts: Experts, kernels: DecodeKernels) -> bool:
    """Whether every expert of both projections can take the kernels' compressed layout (a tensor-parallel rank's
    share too: its own shapes)."""
    (_, n_gu, k_gu), (_, n_d, k_d) = experts.gate_up_proj.shape, experts.down_proj.shape
    return kernels.can_compress(n_gu, k_gu) and kernels.can_compress(n_d, k_d)


def is_lm_head(name: str) -> bool:
    """Whether the module `name` is a model's LM head (what QuantConfig.quantize_lm_head quantizes)."""
    return name == "lm_head" or name.endswith(".lm_head")


def keeps(config: QuantConfig, name: str) -> bool:
    """Whether the module `name` stays in full precision: a keep_fp pattern or module prefix matches it, or it is the
    LM head (int8 with quantize_lm_head, else full precision whatever keep_fp says: a keep_fp of the user's replaces
    the default ("lm_head",), and an int4 head would move every logit and need a vocab the int4 layout takes)."""
    return is_lm_head(name) or any(fnmatch.fnmatch(name, p) or name.startswith(p + ".") for p in config.keep_fp)


def shared_parameters(model: nn.Module) -> set[int]:
    """ids of parameters that more than one module holds (tied embeddings)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            seen[id(p)] = seen.get(id(p), 0) + 1
    return {pid for pid, n in seen.items() if n > 1}


__all__ = ["attach_linear_methods", "make_method", "W8A16Method", "W8A8Method", "W4A16Method"]
