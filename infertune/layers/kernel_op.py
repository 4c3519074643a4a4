"""Modules with two forwards: PyTorch's, and the backend's own kernel, chosen once at load.

A `KernelOp` (RMSNorm, rotary, SiLU-and-multiply, a MoE layer's router and experts) defines `forward_native`, the PyTorch formula (the reference the
kernel is tested against, and what torch.compile traces), and `forward_kernels`, the same computation through the
backend's `DecodeKernels` (kernels/interface.py), rounded the same way. The runner calls `attach_kernels` once
after loading; a module without kernels, or inside a torch.compile trace, runs forward_native. forward_kernels may
return None where a kernel does not take the input's layout (dtype, strides), and forward_native then runs.
"""

from __future__ import annotations

import torch
from torch import nn

from infertune.kernels.interface import DecodeKernels


class KernelOp(nn.Module):
    kernels: DecodeKernels | None = None  # set by attach_kernels

    def forward_native(self, *args):
        raise NotImplementedError

    def forward_kernels(self, *args):
        """The kernels' result, or None to run forward_native."""
        return None

    def use_kernels(self, kernels: DecodeKernels | None) -> None:
        self.kernels = kernels

    def forward(self, *args):
        if self.kernels is not None and not torch.compiler.is_compiling():
            out = self.forward_kernels(*args)
            if out is not None:
                return out
        return self.forward_native(*args)


def attach_kernels(model: nn.Module, kernels: DecodeKernels | None) -> int:
    """Give every KernelOp of the model the backend's kernels (None: PyTorch's formulas). Returns how many."""
    ops = [m for m in model.modules() if isinstance(m, KernelOp)]
    for op in ops:
        op.use_kernels(kernels)
    return len(ops) if kernels is not None else 0
