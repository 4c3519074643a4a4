"""Weight quantization with a clipping choice: minmax (the engine's on-the-fly rule), percentile, or MSE search.

Clipping shrinks the range a row (int8, per output channel) or a group (int4) is mapped onto, trading a
larger error on a few outliers for a finer step on everything else. Every choice ends in the engine's own
quantizers (quantize_int8_per_channel, quantize_int4_groupwise) applied to the clamped weight, so minmax
gives bit for bit what `LLM(model, quantization=...)` computes, and the others differ only in the range.

* minmax: the full range of each row / group.
* percentile:P: the nearest-rank P-th percentile of |w| per row (int8), or the (100-P)-th and P-th
  percentiles of w per group (int4). With groups of 32-128 weights, P = 99.9 keeps the extremes (minmax).
* mse: per row (int8) or per group (int4), the ratio r in {1.00, 0.98, ..., 0.50} of the range that
  minimises the squared reconstruction error sum (w - dequant(quant(w)))^2; r = 1 is minmax, so the
  result is never worse than minmax in that error.
"""

from __future__ import annotations

import math

import torch

from infertune.quant.int4 import dequantize_int4, quantize_int4_groupwise
from infertune.quant.int8 import quantize_int8_per_channel

MSE_RATIOS = tuple(round(1.0 - 0.02 * i, 2) for i in range(26))  # 1.00 .. 0.50


def parse_clip(text: str) -> tuple[str, float | None]:
    """'minmax' | 'mse' | 'percentile:99.9' -> (kind, percentile)."""
    kind, _, value = text.partition(":")
    if kind in ("minmax", "mse") and not value:
        return kind, None
    if kind == "percentile":
        try:
            p = float(value or 99.9)
        except ValueError:
            p = float("nan")
        if not 50.0 < p <= 100.0:
            raise ValueError(f"clip {text!r}: the percentile must be in (50, 100], e.g. percentile:99.9")
        return kind, p
    raise ValueError(f"clip {text!r} is not one of minmax, mse, percentile:P (e.g. percentile:99.9)")


def _rank_value(sorted_vals: torch.Tensor, percentile: float) -> torch.Tensor:
    """Nearest-rank percentile along the last dim of an ascending-sorted tensor."""
    n = sorted_vals.shape[-1]
    k = min(max(math.ceil(round(percentile / 100.0 * n, 9)), 1), n)  # round: 99.9 / 100 * 1000 -> 999, not 1000
    return sorted_vals[..., k - 1]


# ---- int8, per output channel ---------------------------------------------------------------------------------
def _int8_error(w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    scale = (amax / 127.0).clamp(min=1e-12).unsqueeze(1)
    deq = torch.round(w / scale).clamp(-127, 127) * scale
    return ((w - deq) ** 2).sum(dim=1)


def int8_clip_amax(w: torch.Tensor, clip: str) -> torch.Tensor | None:
    """Per row, the |w| mapped onto 127 (None = minmax)."""
    kind, p = parse_clip(clip)
    w = w.float()
    if kind == "minmax":
        return None
    amax = w.abs().amax(dim=1)
    if kind == "percentile":
        return _rank_value(w.abs().sort(dim=1).values, p)
    best, best_err = amax.clone(), torch.full_like(amax, float("inf"))
    for r in MSE_RATIOS:
        err = _int8_error(w, amax * r)
        better = err < best_err
        best = torch.where(better, amax * r, best)
        best_err = torch.where(better, err, best_err)
    return best


def quantize_int8(w: torch.Tensor, clip: str = "minmax") -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int8 [N, K], scale fp32 [N]) with the chosen clipping."""
    amax = int8_clip_amax(w, clip)
    w = w.float()
    if amax is not None:  # clamping makes the row's max |w| equal amax, so the engine's rule gives scale = amax/127
        w = torch.maximum(torch.minimum(w, amax.unsqueeze(1)), -amax.unsqueeze(1))
    return quantize_int8_per_channel(w)


# ---- int4, per group of input columns -------------------------------------------------------------------------
def _shrink(low: torch.Tensor, high: torch.Tensor, r: float | torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pull the range's ends towards zero by r (an end on the far side of zero from its direction stays put)."""
    return torch.where(low < 0, low * r, low), torch.where(high > 0, high * r, high)


def int4_clip_range(w: torch.Tensor, group_size: int, symmetric: bool, clip: str):
    """Per group, the clamp range (low, high) [N, K/g] (None = minmax)."""
    kind, p = parse_clip(clip)
    if kind == "minmax":
        return None
    n, k = w.shape
    g = w.float().view(n, k // group_size, group_size)
    if kind == "percentile":
        s = g.sort(dim=-1).values
        low, high = -_rank_value((-s).flip(-1), p), _rank_value(s, p)  # (100-P)-th and P-th percentiles
        if symmetric:
            amax = torch.maximum(low.abs(), high.abs())
            return -amax, amax
        return low, high
    low0, high0 = g.amin(dim=-1), g.amax(dim=-1)
    if symmetric:
        amax = torch.maximum(low0.abs(), high0.abs())
        low0, high0 = -amax, amax
    best_r = torch.ones_like(low0)
    best_err = torch.full_like(low0, float("inf"))
    for r in MSE_RATIOS:
        low, high = _shrink(low0, high0, r)
        clamped = torch.maximum(torch.minimum(g, high.unsqueeze(-1)), low.unsqueeze(-1))
        q, scale, zero = quantize_int4_groupwise(clamped.view(n, k), group_size, symmetric)
        err = ((g - dequantize_int4(q, scale, zero, group_size).view_as(g)) ** 2).sum(dim=-1)
        better = err < best_err
        best_r = torch.where(better, torch.full_like(best_r, r), best_r)
        best_err = torch.where(better, err, best_err)
    return _shrink(low0, high0, best_r)


def quantize_int4(
    w: torch.Tensor, group_size: int, symmetric: bool = False, clip: str = "minmax"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (q int32 in 0..15 [N, K], scale fp32 [N, K/g], zero fp32 [N, K/g]); w ~ q * scale + zero."""
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"in_features={k} is not a multiple of --group-size {group_size}; pick one dividing it")
    rng = int4_clip_range(w, group_size, symmetric, clip)
    w = w.float()
    if rng is not None:
        low, high = rng
        g = w.view(n, k // group_size, group_size)
        w = torch.maximum(torch.minimum(g, high.unsqueeze(-1)), low.unsqueeze(-1)).reshape(n, k)
    return quantize_int4_groupwise(w, group_size, symmetric)


def reconstruction_error(
    w: torch.Tensor, method: str, clip: str, group_size: int = 128, symmetric: bool = False
) -> float:
    """Sum of squared weight errors after quantization (for the report and the tests)."""
    w = w.float()
    if method == "w4a16":
        q, scale, zero = quantize_int4(w, group_size, symmetric, clip)
        return float(((w - dequantize_int4(q, scale, zero, group_size)) ** 2).sum())
    q, scale = quantize_int8(w, clip)
    return float(((w - q.float() * scale.unsqueeze(1)) ** 2).sum())
