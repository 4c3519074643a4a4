"""Calibration: run sample text through the engine and record, per linear layer, statistics of its input.

Per layer (the engine's module, e.g. `model.layers.0.self_attn.qkv_proj`, whose input q/k/v share):
* `absmax` [K]: max |x| per input channel over every calibration token (SmoothQuant's activation range);
* `percentile`: the mean over calibration samples of each sample's nearest-rank percentile of |x| (all
  tokens and channels of that sample; 99.9 by default, the seeds' recommendation). Averaging per-sample
  percentiles bounds memory (no need to keep every activation) and is what per-batch percentile observers do.

The static activation scale of W8A8 is then `percentile / 127` (or `max(absmax) / 127` with minmax clipping).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from infertune.evaluate.data import encode_documents


def nearest_rank(values: torch.Tensor, percentile: float) -> float:
    """The smallest v in values with at least `percentile` % of values <= v (nearest-rank definition)."""
    flat = values.reshape(-1)
    # round first: 99.9 / 100 * 1000 is 999.0000000000001 in binary floating point, and must give rank 999
    k = min(max(math.ceil(round(percentile / 100.0 * flat.numel(), 9)), 1), flat.numel())
    return float(flat.kthvalue(k).values)


@dataclass
class ActivationStats:
    """Running statistics of one linear layer's input."""

    in_features: int
    percentile: float = 99.9
    absmax: torch.Tensor = field(default=None)  # [K] fp32
    percentile_sum: float = 0.0
    samples: int = 0
    tokens: int = 0

    def __post_init__(self) -> None:
        if self.absmax is None:
            self.absmax = torch.zeros(self.in_features)

    def update(self, x: torch.Tensor, divisor: torch.Tensor | None = None) -> None:
        """Add one sample's input x [T, K] (statistics of x / divisor when a smoothing divisor [K] is given)."""
        a = x.reshape(-1, self.in_features).detach().float().abs().cpu()
        if divisor is not None:
            a = a / divisor
        self.absmax = torch.maximum(self.absmax, a.amax(dim=0))
        self.percentile_sum += nearest_rank(a, self.percentile)
        self.samples += 1
        self.tokens += a.shape[0]

    @property
    def percentile_value(self) -> float:
        return self.percentile_sum / self.samples if self.samples else 0.0

    @property
    def max(self) -> float:
        return float(self.absmax.max())

    def clip_value(self, act_clip: str) -> float:
        """The |x| that maps to 127: the percentile (percentile:P) or the max (minmax)."""
        return self.max if act_clip == "minmax" else self.percentile_value


def calibration_samples(tokenizer, docs: list[str], num_samples: int, seq_len: int) -> list[list[int]]:
    """Each document cut into windows of seq_len tokens (the last one may be shorter), in order, until num_samples."""
    samples: list[list[int]] = []
    for ids in encode_documents(tokenizer, docs):
        for start in range(0, len(ids), seq_len):
            window = ids[start : start + seq_len]
            if len(window) >= 2:
                samples.append(window)
            if len(samples) == num_samples:
                return samples
    return samples


def collect(
    runner,
    layer_names: list[str],
    samples: list[list[int]],
    percentile: float,
    divisors: dict[str, torch.Tensor] | None = None,
    desc: str = "calibrating",
    show_progress: bool = True,
) -> dict[str, ActivationStats]:
    """Forward every sample (one sequence at a time) through runner's model with hooks on the named layers."""
    modules = dict(runner.model.named_modules())
    stats = {name: ActivationStats(modules[name].in_features, percentile) for name in layer_names}
    divisors = divisors or {}

    def hook_for(name):
        def hook(module, args):
            stats[name].update(args[0], divisors.get(name))

        return hook

    handles = [modules[name].register_forward_pre_hook(hook_for(name)) for name in layer_names]
    try:
        for ids in tqdm(samples, desc=desc, unit="sample", disable=not show_progress):
            table = list(range(-(-len(ids) // runner.block_size)))  # offline: the pool's first blocks are free
            runner.prompt_logits(ids, table)
    finally:
        for h in handles:
            h.remove()
    return stats
