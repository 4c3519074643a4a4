"""SiLU-and-multiply (and Gemma's GeLU-and-multiply) over a merged [gate | up] projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infertune.layers.kernel_op import KernelOp


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)  # in place on silu's fresh output: one [T, I] buffer, not two


class SiluAndMul(KernelOp):
    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(gate_up)

    def forward_kernels(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        return self.kernels.silu_and_mul(gate_up)


class GeluAndMul(KernelOp):
    """gelu(gate) * up with GeLU's tanh approximation (transformers' gelu_pytorch_tanh)."""

    def forward_native(self, gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] -> [T, I]
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh").mul_(up)

    def forward_kernels(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        return self.kernels.gelu_and_mul(gate_up)
