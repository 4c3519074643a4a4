"""Which attention backend a model runs: the one place the choice is made (the runner asks here)."""

from __future__ import annotations

import torch

from infertune.config import ArchConfig
from infertune.layers.attention.base import AttentionBackend
from infertune.layers.attention.mla import DecompressedMlaAttention, Int8MlaAttention, MlaAttention
from infertune.layers.attention.paged import Int8PagedAttention, TorchPagedAttention


def attention_backend(
    arch: ArchConfig, kv_cache_dtype: str, dtype: torch.dtype, int4_tier: bool = False, mla_cache: str = "latent"
) -> AttentionBackend:
    """The latent cache for an MLA model (DeepSeek; mla_cache="decompressed": each head's K / V instead, for
    comparison), the paged K/V cache for the others; int8 or the model dtype; int4_tier: the int8 cache's tables may
    hold the int4 tier's entries (CacheConfig.kv_int4_after)."""
    int8 = kv_cache_dtype == "int8"
    if arch.mla is not None and mla_cache == "decompressed":
        return DecompressedMlaAttention(arch.mla, arch.num_attention_heads)
    if arch.mla is not None:
        return Int8MlaAttention(arch.mla, dtype) if int8 else MlaAttention(arch.mla)
    return Int8PagedAttention(dtype, int4_tier) if int8 else TorchPagedAttention()
