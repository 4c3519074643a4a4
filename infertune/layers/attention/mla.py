"""Multi-head latent attention (DeepSeek-V2 / V3) over a paged cache of latents: one plane per layer.

Per token the cache keeps one row of cache_width = kv_lora_rank + qk_rope_head_dim values: the latent c (after
kv_a_layernorm) and the shared rotated key k_pe; decompressed K and V never exist in it. The layer's kv_b_proj
(LatentUpProjection) maps c to each head's k_nope (W_UK) and v (W_UV).

- Decode (absorbed): W_UK is folded into the query (q_lat = q_nope W_UK per head), so a score is q_lat . c +
  q_pe . k_pe against the cached row itself, the softmax-weighted sum of the rows' c is the output in latent space,
  and W_UV takes it to each head's v. A decode step reads only the latent rows of its block tables.
- Prefill decompresses: K = [k_nope from c, k_pe on every head], V from c, causal SDPA (a chunk with earlier
  context decompresses that context's latents read back from the cache).

The layer calls `forward(q_nope, q_pe, latent, kv_cache, meta, scale, kv_up)`: MLA's K and V are functions of the
latent and of that layer's up-projection, so these replace the (query, key, value) of AttentionBackend.forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infertune.config import MlaArch
from infertune.layers.attention.base import AttentionBackend, AttentionMetadata
from infertune.layers.attention.paged import _fresh_runs


class LatentUpProjection(nn.Module):
    """kv_b_proj: latent c [kv_lora_rank] -> per head [k_nope (qk_nope_head_dim), v (v_head_dim)].

    Not a Linear, so no quantization method replaces its weight: decode multiplies by its per-head views
    (w_uk, w_uv), prefill by the whole weight.

    Why W8A16 / W4A16 leave it in the model dtype: the absorbed decode reads it as two per-head batched matmuls
    (H x [nope, R] into the query, H x [v, R] after attention), not as one [N, K] GEMV, and no backend kernel takes
    int8 / int4 weights batched over heads. Kept quantized, each decode step would dequantize the whole matrix
    first: 1 (int4: 0.5) byte read + 2 written + 2 read back per weight, ~2.5x the traffic of reading it in bf16,
    so decode gets slower for a memory saving of ~0.15% of DeepSeek-V3's weights (128 heads x 256 x 512 x 61
    layers = 1.02 G of 671 G) and ~0.36% of V2-Lite's (57 M of 15.7 G). (W8A16's per-row scales would fold into
    the absorbed math exactly -- W_UK's into the query, W_UV's after it; it is the matmul kernel that is missing.)
    An fp8 checkpoint's kv_b_proj is dequantized at load like the rest."""

    def __init__(self, num_heads: int, mla: MlaArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.nope_dim, self.v_dim = num_heads, mla.qk_nope_head_dim, mla.v_head_dim
        self.weight = nn.Parameter(
            torch.empty(num_heads * (self.nope_dim + self.v_dim), mla.kv_lora_rank, dtype=dtype), requires_grad=False
        )
        self.reset_buffers()

    def reset_buffers(self) -> None:
        """The per-head views, taken again once the checkpoint is in place (the loader calls this)."""
        per_head = self.weight.view(self.num_heads, self.nope_dim + self.v_dim, -1)
        self.w_uk = per_head[:, : self.nope_dim]  # [H, nope, R]: k_nope = w_uk c
        self.w_uv = per_head[:, self.nope_dim :]  # [H, v, R]: v = w_uv c

    def decompress(self, latent: torch.Tensor, k_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """c [C, R], k_pe [C, rope] -> K [C, H, nope + rope], V [C, H, v]."""
        kv = F.linear(latent, self.weight).view(latent.shape[0], self.num_heads, -1)
        k = torch.cat([kv[..., : self.nope_dim], k_pe.unsqueeze(1).expand(-1, self.num_heads, -1)], dim=-1)
        return k, kv[..., self.nope_dim :]


class MlaAttention(AttentionBackend):
    name = "mla-paged"

    def __init__(self, mla: MlaArch) -> None:
        self.rank, self.width = mla.kv_lora_rank, mla.cache_width

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        assert (num_kv_heads, head_dim) == (1, self.width), "an MLA model caches one latent row per token"
        return (1, num_blocks, block_size, 1, head_dim)

    def kv_bytes_per_token(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """One plane: the latent row."""
        return num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    def write_kv(self, kv_cache: torch.Tensor, latent: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """latent [T, cache_width] (c then k_pe) -> the rows of the new tokens' slots (MLA's single plane)."""
        _, num_blocks, block_size, _, width = kv_cache.shape
        kv_cache[0].view(num_blocks * block_size, width).index_copy_(0, slot_mapping, self._encoded(latent))

    def _encoded(self, latent: torch.Tensor) -> torch.Tensor:
        """Latent rows -> cache rows (identity for a cache kept in the model dtype)."""
        return latent

    def _decoded(self, raw: torch.Tensor) -> torch.Tensor:
        """Cache rows -> latent rows in the compute dtype (identity for a cache kept in the model dtype)."""
        return raw

    def _as_cached(self, latent: torch.Tensor) -> torch.Tensor:
        """Latent rows as a read of the cache gives them back (the model dtype's cache: as they are)."""
        return latent

    def _read_slots(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        # (index_select, not advanced indexing: aten::index is ~30x slower here, more with its threads contended)
        _, num_blocks, block_size, _, width = kv_cache.shape
        return self._decoded(kv_cache[0].view(num_blocks * block_size, width).index_select(0, slots))  # [C, W]

    def forward(
        self,
        q_nope: torch.Tensor,  # [T, H, nope]
        q_pe: torch.Tensor,  # [T, H, rope], rotated
        latent: torch.Tensor,  # [T, cache_width]: c then the rotated k_pe
        kv_cache: torch.Tensor,  # [1, blocks, block_size, 1, cache_width]
        meta: AttentionMetadata,
        scale: float,
        kv_up: LatentUpProjection,
    ) -> torch.Tensor:  # [T, H, v]
        """Write the step's latents into the cache, then attend: decodes absorbed, prefills decompressed."""
        fresh = self._store(kv_cache, latent, meta, kv_up)
        t, h, _ = q_nope.shape
        out = q_nope.new_empty((t, h, kv_up.v_dim))
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(q_nope[:nd], q_pe[:nd], kv_cache, meta, scale, kv_up)
        if not meta.prefills:
            return out
        query = torch.cat([q_nope, q_pe], dim=-1)  # [T, H, nope + rope]
        if fresh is None:  # (fresh prompts attend to their latents as the cache holds them, as every later read does)
            latent = self._as_cached(latent)
        for s, g, n in _fresh_runs(meta.prefills):  # g fresh prompts of n tokens each, back to back from s
            if fresh is not None:
                k, v = fresh[0][s : s + g * n], fresh[1][s : s + g * n]
            else:
                k, v = kv_up.decompress(latent[s : s + g * n, : self.rank], latent[s : s + g * n, self.rank :])
            q, k, v = (x.view(g, n, h, -1).transpose(1, 2) for x in (query[s : s + g * n], k, v))
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)  # [g, H, n, v]
            out[s : s + g * n] = o.transpose(1, 2).reshape(g * n, h, -1)
        for chunk in meta.prefills:  # chunks that continue earlier context (prefix-cache hit, chunked prefill)
            if chunk.context_slots is None:  # done above
                continue
            s, n = chunk.query_start, chunk.query_len
            k, v = self._context_kv(kv_cache, chunk.context_slots, kv_up)
            past = chunk.context_len - n
            # Query i sits at absolute position past + i and sees keys 0 .. past + i.
            qpos = torch.arange(past, past + n, device=query.device).unsqueeze(1)
            mask = torch.arange(chunk.context_len, device=query.device).unsqueeze(0) <= qpos  # [n, C]
            q = query[s : s + n].transpose(0, 1)  # [H, n, D]
            o = F.scaled_dot_product_attention(q, k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale)
            out[s : s + n] = o.transpose(0, 1)
        return out

    def _store(self, kv_cache: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata, kv_up):
        """The step's rows into the cache; -> the step's decompressed (K, V) where storing computed them, else None."""
        self.write_kv(kv_cache, latent, meta.slot_mapping)
        return None

    def _context_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor, kv_up) -> tuple[torch.Tensor, torch.Tensor]:
        """K [C, H, nope + rope] and V [C, H, v] of the cached tokens at slots (their latent rows decompressed)."""
        rows = self._read_slots(kv_cache, slots)  # [C, W]
        return kv_up.decompress(rows[:, : self.rank], rows[:, self.rank :])

    def _decode(self, q_nope, q_pe, kv_cache, meta: AttentionMetadata, scale: float, kv_up) -> torch.Tensor:
        """The absorbed decode of B one-token sequences -> [B, H, v]."""
        block_size = kv_cache.shape[2]
        tables = meta.decode_block_tables  # [B, M]
        b, m = tables.shape
        length = m * block_size
        mask = meta.step_cache.get("mla_decode_mask")
        if mask is None:  # the same for every layer of the step: built once
            kpos = torch.arange(length, device=q_nope.device)
            mask = (kpos.unsqueeze(0) < meta.decode_context_lens.unsqueeze(1)).view(b, 1, 1, length)
            meta.step_cache["mla_decode_mask"] = mask
        # the latent rows of the block tables, and nothing else: [B, 1, L, W]
        rows = self._decoded(kv_cache[0].index_select(0, tables.view(-1))).view(b, 1, length, self.width)
        q_lat = torch.einsum("bhn,hnr->bhr", q_nope, kv_up.w_uk)  # W_UK folded into the query: [B, H, R]
        # One latent "head" shared by every query head: the H heads are H query rows against the same rows.
        q = torch.cat([q_lat, q_pe], dim=-1).unsqueeze(1)  # [B, 1, H, W]
        o_lat = F.scaled_dot_product_attention(q, rows, rows[..., : self.rank], attn_mask=mask, scale=scale)
        return torch.einsum("bhr,hvr->bhv", o_lat.squeeze(1), kv_up.w_uv)  # W_UV after attention: [B, H, v]


class Int8MlaAttention(MlaAttention):
    """MLA over an INT8 latent cache: each row is cache_width int8 values and the 4 bytes of its fp32 scale
    (symmetric, amax / 127 over the row), (W + 4) / (2 W) of a bf16 cache: 0.503 at DeepSeek-V3's W = 576.
    Reads dequantize on the fly; a fresh prefill attends to its own latents quantized so (`_as_cached`), as a chunked
    prefill, a prefix-cache hit and a decode read them from the cache: a prompt's tokens do not depend on the chunk
    size or on prefix-cache hits (it attended to its unquantized latents).
    """

    name = "mla-paged-int8"
    cache_dtype = torch.int8
    SCALE_BYTES = 4

    def __init__(self, mla: MlaArch, compute_dtype: torch.dtype) -> None:
        super().__init__(mla)
        self.compute_dtype = compute_dtype

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        (planes, blocks, bs, heads, width) = super().kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)
        return (planes, blocks, bs, heads, width + self.SCALE_BYTES)

    def kv_bytes_per_token(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return num_kv_heads * (head_dim + self.SCALE_BYTES)

    def _encoded(self, latent: torch.Tensor) -> torch.Tensor:
        x32 = latent.float()
        scale = (x32.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-8)  # [T, 1]
        q = torch.round(x32 / scale).clamp(-127, 127).to(torch.int8)
        return torch.cat([q, scale.view(torch.int8)], dim=-1)  # [T, W + 4]

    def _as_cached(self, latent: torch.Tensor) -> torch.Tensor:
        return self._decoded(self._encoded(latent))  # (the stored rows, read back: the same bits)

    def _decoded(self, raw: torch.Tensor) -> torch.Tensor:
        w = raw.shape[-1] - self.SCALE_BYTES
        scale = raw[..., w:].contiguous().view(torch.float32)  # [..., 1]
        return (raw[..., :w].float() * scale).to(self.compute_dtype)


class DecompressedMlaAttention(MlaAttention):
    """MLA over a cache of decompressed K and V, the seeds' starting point (`mla_cache="decompressed"`): per token
    and layer one row of each head's K (nope + rope: k_nope = W_UK c, then the shared rotated k_pe) and V (W_UV c),
    H (nope + rope + v) values, 8.9x the latent row at DeepSeek-V2-Lite's shape (7.1x at V3's). Decode attends to
    them as any per-head cache (no absorption); prefill as the latent backend. For comparison (`infertune ledger`'s
    latent-cache step measures against it): the fused step and INT8 do not take it."""

    name = "mla-decompressed"

    def __init__(self, mla: MlaArch, num_heads: int) -> None:
        super().__init__(mla)
        self.heads, self.qk, self.v = num_heads, mla.qk_nope_head_dim + mla.qk_rope_head_dim, mla.v_head_dim
        self.row = num_heads * (self.qk + self.v)

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        super().kv_cache_shape(num_blocks, block_size, num_kv_heads, head_dim)  # (the model is MLA's)
        return (1, num_blocks, block_size, 1, self.row)

    def kv_bytes_per_token(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return self.row * torch.empty((), dtype=dtype).element_size()

    def _split(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cache rows [..., row] -> K [..., H, nope + rope], V [..., H, v]."""
        lead = rows.shape[:-1]
        k = rows[..., : self.heads * self.qk].reshape(*lead, self.heads, self.qk)
        return k, rows[..., self.heads * self.qk :].reshape(*lead, self.heads, self.v)

    def _store(self, kv_cache: torch.Tensor, latent: torch.Tensor, meta: AttentionMetadata, kv_up):
        """The step's latents decompressed into K / V rows, written to its slots; -> (K, V) for the fresh prompts."""
        t = latent.shape[0]
        k, v = kv_up.decompress(latent[:, : self.rank], latent[:, self.rank :])  # [T, H, qk], [T, H, v]
        _, num_blocks, block_size, _, width = kv_cache.shape
        kv_cache[0].view(num_blocks * block_size, width).index_copy_(
            0, meta.slot_mapping, torch.cat([k.reshape(t, -1), v.reshape(t, -1)], dim=-1)
        )
        return k, v

    def _context_kv(self, kv_cache: torch.Tensor, slots: torch.Tensor, kv_up) -> tuple[torch.Tensor, torch.Tensor]:
        return self._split(self._read_slots(kv_cache, slots))

    def _decode(self, q_nope, q_pe, kv_cache, meta: AttentionMetadata, scale: float, kv_up) -> torch.Tensor:
        """Each sequence's query over its cached K / V (no absorption) -> [B, H, v]."""
        block_size, width = kv_cache.shape[2], kv_cache.shape[-1]
        tables = meta.decode_block_tables  # [B, M]
        b, m = tables.shape
        length = m * block_size
        kpos = torch.arange(length, device=q_nope.device)
        mask = (kpos.unsqueeze(0) < meta.decode_context_lens.unsqueeze(1)).view(b, 1, 1, length)
        kc, vc = self._split(kv_cache[0].index_select(0, tables.view(-1)).view(b, length, width))
        query = torch.cat([q_nope, q_pe], dim=-1).unsqueeze(2)  # [B, H, 1, qk]
        o = F.scaled_dot_product_attention(query, kc.transpose(1, 2), vc.transpose(1, 2), attn_mask=mask, scale=scale)
        return o.squeeze(2)
