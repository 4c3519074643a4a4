"""Paged attention in plain PyTorch: SDPA over KV gathered from the block table (works on any device).

Decode rows are batched: their blocks are gathered into a padded [B, Hkv, L, D] view with a length mask.
A fresh prefill attends to its own K/V with a causal SDPA (flash kernel where the device has one); a
chunk with earlier context (prefix-cache hit, chunked prefill) gathers that context from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infertune.layers.attention.base import AttentionBackend, AttentionMetadata


def _fresh_runs(prefills) -> list[tuple[int, int, int]]:
    """(start, count, length) of each run of consecutive fresh prefills (the chunk is the whole context, so causal
    self-attention) of the same length that sit back to back in the flattened batch: one batched SDPA call each
    instead of one per sequence (16 prompts of 128 tokens: 1 call a layer instead of 16)."""
    runs: list[list[int]] = []
    for c in prefills:
        if c.context_slots is not None:
            continue
        if runs and runs[-1][2] == c.query_len and runs[-1][0] + runs[-1][1] * c.query_len == c.query_start:
            runs[-1][1] += 1
        else:
            runs.append([c.query_start, 1, c.query_len])
    return [tuple(r) for r in runs]


class TorchPagedAttention(AttentionBackend):
    name = "torch-paged"

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write_kv(kv_cache, key, value, meta.slot_mapping)
        out = torch.empty_like(query)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(query[:nd], kv_cache, meta, scale)
        for s, g, n in _fresh_runs(meta.prefills):  # g fresh prompts of n tokens each, back to back from s
            q, k, v = (t[s : s + g * n].view(g, n, *t.shape[1:]).transpose(1, 2) for t in (query, key, value))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)  # [g, H, n, D]
            out[s : s + g * n] = o.transpose(1, 2).reshape(g * n, *query.shape[1:])
        for chunk in meta.prefills:  # chunks that continue earlier context (prefix-cache hit, chunked prefill)
            if chunk.context_slots is None:  # done above
                continue
            s, n = chunk.query_start, chunk.query_len
            q = query[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            k = self._read_slots(kv_cache, 0, chunk.context_slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, C, D]
            v = self._read_slots(kv_cache, 1, chunk.context_slots).transpose(0, 1).unsqueeze(0)
            past = chunk.context_len - n
            # Query i sits at absolute position past + i and sees keys 0 .. past + i.
            qpos = torch.arange(past, past + n, device=query.device).unsqueeze(1)
            kpos = torch.arange(chunk.context_len, device=query.device).unsqueeze(0)
            mask = kpos <= qpos  # [n, C]
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[s : s + n] = o.squeeze(0).transpose(0, 1)
        return out

    def _read_slots(self, kv_cache: torch.Tensor, which: int, slots: torch.Tensor) -> torch.Tensor:
        """K (0) or V (1) of the given cache slots: [len(slots), Hkv, D] in the compute dtype."""
        _, num_blocks, block_size, hkv, width = kv_cache.shape
        return self._decoded(kv_cache[which].view(num_blocks * block_size, hkv, width)[slots])

    def _decoded(self, raw: torch.Tensor) -> torch.Tensor:
        """Cache entries -> values in the compute dtype (identity for a cache kept in the model dtype)."""
        return raw

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        _, _, block_size, hkv, _ = kv_cache.shape
        tables = meta.decode_block_tables  # [B, M]
        b, m = tables.shape
        length = m * block_size
        mask = meta.step_cache.get("decode_mask")
        if mask is None:  # the same for every layer of the step: built once
            kpos = torch.arange(length, device=q.device)
            mask = (kpos.unsqueeze(0) < meta.decode_context_lens.unsqueeze(1)).view(b, 1, 1, length)
            meta.step_cache["decode_mask"] = mask
        kv = self._decoded(kv_cache[:, tables])  # K and V in one gather: [2, B, M, block, Hkv, D]
        kv = kv.view(2, b, length, hkv, -1).transpose(2, 3)  # [2, B, Hkv, L, D]
        o = F.scaled_dot_product_attention(q.unsqueeze(2), kv[0], kv[1], attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)  # [B, H, D]


class Int8PagedAttention(TorchPagedAttention):
    """The same attention over an INT8 KV cache with one fp32 scale per token and KV head.

    Each cache row is D int8 values followed by the 4 bytes of its scale, so one int8 tensor per layer
    holds both ([2, blocks, block_size, Hkv, D + 4]): (D + 4) / (2 D) of a bf16 cache, 0.53 at D = 64.
    New K/V are quantized as they are written (symmetric, amax / 127); reads dequantize on the fly. A
    fresh prefill attends to its own unquantized K/V, as it never reads the cache.
    """

    name = "torch-paged-int8"
    cache_dtype = torch.int8
    SCALE_BYTES = 4

    def __init__(self, compute_dtype: torch.dtype) -> None:
        self.compute_dtype = compute_dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim + self.SCALE_BYTES)

    def kv_bytes_per_token(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_kv_heads * (head_dim + self.SCALE_BYTES)

    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        _, num_blocks, block_size, hkv, width = kv_cache.shape
        for which, x in ((0, key), (1, value)):  # x [T, Hkv, D]
            x32 = x.float()
            scale = (x32.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-8)  # [T, Hkv, 1]
            q = torch.round(x32 / scale).clamp(-127, 127).to(torch.int8)
            row = torch.cat([q, scale.view(torch.int8)], dim=-1)  # [T, Hkv, D + 4]
            kv_cache[which].view(num_blocks * block_size, hkv, width).index_copy_(0, slot_mapping, row)

    def _decoded(self, raw: torch.Tensor) -> torch.Tensor:
        d = raw.shape[-1] - self.SCALE_BYTES
        scale = raw[..., d:].contiguous().view(torch.float32)  # [..., 1]
        return (raw[..., :d].float() * scale).to(self.compute_dtype)
