"""AttentionBackend contract and the per-step metadata every backend reads.

Layout of a step's tokens: the decode tokens (one per decoding sequence) come first, then each
prefill chunk as a contiguous run. The paged KV cache of one layer is [2, num_blocks, block_size, Hkv, D].
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class PrefillChunk:
    """One sequence's run of new tokens in the flattened batch."""

    query_start: int  # offset in the flattened token dim
    query_len: int
    context_len: int  # tokens of KV the chunk attends to, its own included (= num_computed + query_len)
    # Slots of all context_len tokens (only when earlier KV must be read from the cache), [context_len]
    context_slots: torch.Tensor | None = None


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot (block_id * block_size + offset) of every new token
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks], padded with 0
    decode_context_lens: torch.Tensor | None = None  # [num_decodes], the new token included
    decode_max_context_len: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)
    # Per-step values a backend derives once and every layer reuses (e.g. the decode length mask).
    step_cache: dict = field(default_factory=dict)
    # With several KV cache groups (layers grouped by sliding window, each with its own block tables): a layer's
    # window -> its group's metadata (slot mapping, block tables, context slots). None: one group, this one.
    by_window: dict | None = None
    # The same per layer (layer index -> its group's metadata), where groups are more than windows (KV compression
    # splits the full layers by budget). None: found by window.
    by_layer: list | None = None
    # KV compression (SnapKV's observation window): the rows whose queries each layer keeps, [R], and what the
    # layers put there: layer index -> q[press_rows] [R, H, D] (after rotary, as the keys are cached).
    press_rows: torch.Tensor | None = None
    press_queries: dict = field(default_factory=dict)
    # A layer-by-layer KV connector's worker (kv_transfer/base.py, layerwise) with this step's metadata: the model's
    # layer loop calls kv_hook.wait_for_layer_load(i) before layer i and kv_hook.save_kv_layer(i) after it. None: none.
    kv_hook: object | None = None

    def for_window(self, window: int | None) -> AttentionMetadata:
        """The metadata of the KV cache group whose layers attend within `window`."""
        return self if self.by_window is None else self.by_window[window]

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata of layer's KV cache group where groups are found by layer (else this, found by window)."""
        return self if self.by_layer is None else self.by_layer[layer]


class AttentionBackend(abc.ABC):
    name = "abstract"
    cache_dtype: torch.dtype | None = None  # None: the KV cache is kept in the model dtype

    def kv_bytes_per_token(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """Cache bytes one token takes in one layer (K and V)."""
        return 2 * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim)

    def write_kv(
        self, kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        # key, value [T, Hkv, D] -> the cache's flat slot dim
        _, num_blocks, block_size, hkv, d = kv_cache.shape
        kv_cache[0].view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, key)
        kv_cache[1].view(num_blocks * block_size, hkv, d).index_copy_(0, slot_mapping, value)

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [T, H, D]
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:  # [T, H, D]
        """Write this step's KV into the cache, then attend every query to its sequence's causal context: with a
        window W, to its last W keys only (its own included: key j is seen from query i iff i - W < j <= i); with a
        softcap c, over scores c * tanh(scores / c) (Gemma 2)."""
