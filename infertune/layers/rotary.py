"""Rotary position embedding (neox / rotate-half layout) with default, linear, llama3, YaRN and LongRoPE (its
short_factor: config.py refuses a max_model_len past the original context, where transformers switches to
long_factor) frequency scaling.

The cos/sin table is computed once in fp32 for every position up to the engine's max_model_len, and
the rotation is applied in fp32 before casting back, so bf16 models lose no precision in positions.
YaRN also scales the table by its attention factor (rope_attention_factor), as Hugging Face does.
"""

from __future__ import annotations

import math

import torch

from infertune.layers.kernel_op import KernelOp


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    kind = (scaling or {}).get("rope_type", "default")
    if kind == "default":
        return inv_freq.float()
    if kind == "longrope":  # per-pair divisors of the frequencies (transformers' _compute_longrope_parameters)
        return (inv_freq / torch.tensor(scaling["short_factor"], dtype=torch.float64)).float()
    factor = float(scaling["factor"])
    if kind == "linear":
        return (inv_freq / factor).float()
    if kind == "llama3":
        # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, and the band between
        # the two cut-offs is blended linearly in 1/wavelength.
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        original = float(scaling["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        blend = ((original / wavelen) - low) / (high - low)
        blended = (1 - blend) * inv_freq / factor + blend * inv_freq
        out = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
        in_band = (wavelen <= original / low) & (wavelen >= original / high)
        return torch.where(in_band, blended, out).float()
    if kind == "yarn":
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling).float()
    raise ValueError(f"rope type {kind!r} is not supported")


def _yarn_inv_freq(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: dict) -> torch.Tensor:
    """YaRN: dimensions that turn fewer than beta_slow times over the original context are interpolated (slowed by
    `factor`), those that turn more than beta_fast times are kept, and a linear ramp over the dimension index blends
    the band between."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast, beta_slow = float(scaling.get("beta_fast") or 32), float(scaling.get("beta_slow") or 1)

    def dim_of(rotations: float) -> float:  # the dimension that turns `rotations` times over the original context
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(beta_fast), dim_of(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-dimension band: keep the ramp finite
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    return inv_freq / factor * ramp + inv_freq * (1 - ramp)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature for a context stretched `factor` times (1 where it is not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(scaling: dict | None) -> float:
    """The factor the cos/sin table is multiplied by: YaRN's attention_factor (given, or from factor and DeepSeek's
    mscale / mscale_all_dim), LongRoPE's (config.py fills it in), 1 for the other rope types."""
    if (scaling or {}).get("rope_type") == "longrope":
        return float(scaling["attention_factor"])
    if (scaling or {}).get("rope_type") != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = float(scaling["factor"])
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    return yarn_mscale(factor)


class RotaryEmbedding(KernelOp):
    def __init__(self, head_dim: int, max_position: int, theta: float, scaling: dict | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_position = max_position
        self.theta = theta
        self.scaling = scaling
        self.register_buffer("cos_sin", torch.empty(max_position, head_dim), persistent=False)

    def reset_buffers(self) -> None:
        """Fill the table on whatever device the module now lives on (it is built on the meta device)."""
        device = self.cos_sin.device
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        pos = torch.arange(self.max_position, dtype=torch.float32, device=device)
        freqs = torch.outer(pos, inv_freq)  # [P, D/2]
        self.cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * rope_attention_factor(self.scaling)  # [P, D]

    def cos_sin_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, D/2] (fp32) of the step's positions; computed once per step and shared by every layer."""
        cos, sin = self.cos_sin[positions].unsqueeze(1).chunk(2, dim=-1)
        return cos, sin

    def forward_native(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate qk [T, Hq + Hkv, D] (the query and key heads, side by side) in place; returns it.

        Rotated in fp32 and rounded once to qk's dtype, exactly as rotating q and k separately would.
        """
        x1, x2 = qk.float().chunk(2, dim=-1)
        return qk.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))

    def forward_kernels(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        return qk if self.kernels.rotary_(qk, cos, sin) else None
