"""RMSNorm computed in fp32 whatever the model dtype (the seeds' mixed-precision rule)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.kernels = None  # the backend's kernels (runner/fused_decode.use_kernels), same rounding

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, hidden]
        if self.kernels is not None and not torch.compiler.is_compiling():
            out = self.kernels.rms_norm(x, self.weight, self.eps)
            if out is not None:
                return out
        # Same rounding order as the reference implementation: normalise in fp32, cast, then scale.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)
