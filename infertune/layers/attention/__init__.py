"""Attention backends over the paged KV cache."""

from infertune.layers.attention.base import AttentionBackend, AttentionMetadata, PrefillChunk
from infertune.layers.attention.paged import Int8PagedAttention, TorchPagedAttention

__all__ = ["AttentionBackend", "AttentionMetadata", "Int8PagedAttention", "PrefillChunk", "TorchPagedAttention"]
