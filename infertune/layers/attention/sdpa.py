"""Reference attention: per-sequence causal softmax(QK^T)V written out with no cache and no paging.

It is the oracle the paged backends are tested against, so it shares no code with them and expands
grouped KV heads explicitly instead of relying on SDPA's GQA support.
"""

from __future__ import annotations

import torch


def reference_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D] queries at the LAST n positions of a context k, v [C, Hkv, D]; returns [n, H, D]."""
    n, h, _ = q.shape
    c, hkv, _ = k.shape
    rep = h // hkv
    k = k.repeat_interleave(rep, dim=1).double()  # [C, H, D]
    v = v.repeat_interleave(rep, dim=1).double()
    scores = torch.einsum("nhd,chd->hnc", q.double(), k) * scale  # [H, n, C]
    qpos = torch.arange(c - n, c).unsqueeze(1)
    allowed = torch.arange(c).unsqueeze(0) <= qpos  # [n, C]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)
    return out.to(q.dtype)
