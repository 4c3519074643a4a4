"""Paged attention in plain PyTorch: SDPA over KV gathered from the block table (works on any device).

Decode rows are batched: their blocks are gathered into a padded [B, Hkv, L, D] view with a length mask.
A fresh prefill attends to its own K/V with a causal SDPA (flash kernel where the device has one); a
chunk with earlier context (prefix-cache hit, chunked prefill) gathers that context from the cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infertune.layers.attention.base import AttentionBackend, AttentionMetadata


class TorchPagedAttention(AttentionBackend):
    name = "torch-paged"

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.write_kv(kv_cache, key, value, meta.slot_mapping)
        out = torch.empty_like(query)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(query[:nd], kv_cache, meta, scale)
        for chunk in meta.prefills:
            s, n = chunk.query_start, chunk.query_len
            q = query[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            if chunk.context_slots is None:  # the chunk is the whole context: causal self-attention
                k = key[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, Hkv, n, D]
                v = value[s : s + n].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                hkv, d = kv_cache.shape[-2:]
                k = kv_cache[0].view(-1, hkv, d)[chunk.context_slots].transpose(0, 1).unsqueeze(0)  # [1, Hkv, C, D]
                v = kv_cache[1].view(-1, hkv, d)[chunk.context_slots].transpose(0, 1).unsqueeze(0)
                past = chunk.context_len - n
                # Query i sits at absolute position past + i and sees keys 0 .. past + i.
                qpos = torch.arange(past, past + n, device=query.device).unsqueeze(1)
                kpos = torch.arange(chunk.context_len, device=query.device).unsqueeze(0)
                mask = kpos <= qpos  # [n, C]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[s : s + n] = o.squeeze(0).transpose(0, 1)
        return out

    def _decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        _, _, block_size, hkv, d = kv_cache.shape
        tables = meta.decode_block_tables  # [B, M]
        b, m = tables.shape
        k = kv_cache[0][tables].view(b, m * block_size, hkv, d).transpose(1, 2)  # [B, Hkv, L, D]
        v = kv_cache[1][tables].view(b, m * block_size, hkv, d).transpose(1, 2)
        kpos = torch.arange(m * block_size, device=q.device)
        mask = (kpos.unsqueeze(0) < meta.decode_context_lens.unsqueeze(1)).view(b, 1, 1, m * block_size)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return o.squeeze(2)  # [B, H, D]
