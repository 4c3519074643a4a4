"""Reference attention: per-sequence causal softmax(QK^T)V (within a sliding window, soft-capped where asked)
written out in fp64 with no cache and no paging.

It is the oracle the paged backends are tested against, so it shares no code with them and expands
grouped KV heads explicitly instead of relying on SDPA's GQA support.
"""

from __future__ import annotations

import torch


def reference_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [n, H, D] queries at the LAST n positions of a context k, v [C, Hkv, D]; returns [n, H, D]. With a window W
    a query sees its last W keys (its own included); a softcap c turns the scores into c * tanh(scores / c)."""
    n, h, _ = q.shape
    c, hkv, _ = k.shape
    rep = h // hkv
    k = k.repeat_interleave(rep, dim=1).double()  # [C, H, D]
    v = v.repeat_interleave(rep, dim=1).double()
    scores = torch.einsum("nhd,chd->hnc", q.double(), k) * scale  # [H, n, C]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    qpos = torch.arange(c - n, c).unsqueeze(1)
    kpos = torch.arange(c).unsqueeze(0)
    allowed = (kpos <= qpos) & (kpos > qpos - (window if window is not None else c))  # [n, C]
    scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)
    return out.to(q.dtype)
