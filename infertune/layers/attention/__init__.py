"""Attention backends over the paged KV cache."""

from infertune.layers.attention.base import AttentionBackend, AttentionMetadata, PrefillChunk
from infertune.layers.attention.mla import (
    DecompressedMlaAttention,
    Int8MlaAttention,
    LatentUpProjection,
    MlaAttention,
)
from infertune.layers.attention.paged import Int8PagedAttention, TorchPagedAttention
from infertune.layers.attention.select import attention_backend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "DecompressedMlaAttention",
    "Int8MlaAttention",
    "Int8PagedAttention",
    "LatentUpProjection",
    "MlaAttention",
    "PrefillChunk",
    "TorchPagedAttention",
    "attention_backend",
]
