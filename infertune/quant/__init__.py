"""Quantization methods attached to linear layers, and the policy choosing which layers get them."""

from __future__ import annotations

import fnmatch

from torch import nn

from infertune.config import QuantConfig
from infertune.layers.linear import Linear
from infertune.quant.int4 import W4A16Method
from infertune.quant.int8 import W8A8Method, W8A16Method


def make_method(config: QuantConfig, fast_kernels: bool = True):
    if config.method == "w8a16":
        return W8A16Method(fast_kernels)
    if config.method == "w8a8":
        return W8A8Method(fast_kernels)
    if config.method == "w4a16":
        return W4A16Method(config.group_size, config.symmetric, fast_kernels)
    raise ValueError(f"quantization={config.method!r} is unknown")


def attach_quant_methods(model: nn.Module, config: QuantConfig, fast_kernels: bool = True) -> list[str]:
    """Give every Linear not kept in full precision a quant method; weights are quantized after loading.

    Returns the names of the quantized layers. Norms, rotary, softmax and logits are never quantized.
    """
    if config.method is None:
        return []
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        if any(fnmatch.fnmatch(name, pattern) or name.startswith(pattern + ".") for pattern in config.keep_fp):
            continue
        module.quant_method = make_method(config, fast_kernels)
        chosen.append(name)
    return chosen


__all__ = ["attach_quant_methods", "make_method", "W8A16Method", "W8A8Method", "W4A16Method"]
