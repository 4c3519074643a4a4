"""RMSNorm computed in fp32 whatever the model dtype (the seeds' mixed-precision rule), and Gemma's (1 + w) variant."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infertune.layers.kernel_op import KernelOp


class RMSNorm(KernelOp):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        # Same rounding order as the reference implementation: normalise in fp32, cast, then scale.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def forward_kernels(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.kernels.rms_norm(x, self.weight, self.eps)


class GemmaRMSNorm(RMSNorm):
    """Gemma's RMSNorm: the checkpoint stores w around 0 and the scale is (1 + w); unlike Llama's, the product is
    taken in fp32 and rounded once to the model dtype (the kernels' gemma_rms_norm)."""

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:  # [..., hidden]
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)

    def forward_kernels(self, x: torch.Tensor) -> torch.Tensor | None:
        return self.kernels.gemma_rms_norm(x, self.weight, self.eps)
