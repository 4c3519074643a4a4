"""Paged attention in plain PyTorch: SDPA over KV gathered from the block table (works on any device).

Decode rows are batched: their blocks are gathered into a padded [B, Hkv, L, D] view with a length mask.
A fresh prefill attends to its own K/V with a causal SDPA (flash kernel where the device has one); a
chunk with earlier context (prefix-cache hit, chunked prefill) gathers that context from the cache.

A layer with a sliding window W (key j seen from query i iff i - W < j <= i, as transformers masks it) reads only
the keys its window can reach: a decode row the blocks that hold its last W positions, a chunk the slots from its
first query's window on; a fresh prefill takes a banded mask. So a windowed layer never reads a block-table entry
below its window: the engine frees those blocks (engine/kv_cache_coordinator.py), and the entries may hold any id. With a softcap (Gemma 2) the scores are capped before
the softmax, which SDPA cannot do: those layers run a plain matmul-softmax.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infertune.layers.attention.base import AttentionBackend, AttentionMetadata
from infertune.scheduler_output import BLOCK_ID_MASK, INT4_SHIFT


def _attend(q, k, v, mask: torch.Tensor | None, scale: float, softcap: float | None) -> torch.Tensor:
    """softmax(q k^T * scale, masked) v over [..., H, n, D] queries and [..., Hkv, C, D] keys / values; mask (True:
    seen) broadcasts to [..., n, C], None is causal. A softcap runs transformers' eager order: scores in q's dtype,
    capped, masked, softmax in fp32, rounded back to q's dtype."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
        )
    if mask is None:
        n, c = q.shape[-2], k.shape[-2]
        mask = torch.ones(n, c, dtype=torch.bool, device=q.device).tril(c - n)
    rep = q.shape[-3] // k.shape[-3]
    k, v = k.repeat_interleave(rep, dim=-3), v.repeat_interleave(rep, dim=-3)  # each KV head serves rep heads
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1, dtype=torch.float32).to(q.dtype), v)


def _band(qpos: torch.Tensor, kpos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[n, C] True where the query at qpos [n] sees the key at kpos [C]: causal, and within the window if any."""
    seen = kpos.unsqueeze(0) <= qpos.unsqueeze(1)
    if window is not None:
        seen &= kpos.unsqueeze(0) > qpos.unsqueeze(1) - window
    return seen


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

    def forward(
        self,
        query,
        key,
        value,
        kv_cache,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        meta = meta.for_window(window)  # this layer's KV cache group: its slots and block tables
        self.write_kv(kv_cache, key, value, meta.slot_mapping)
        out = torch.empty_like(query)
        nd = meta.num_decode_tokens
        if nd:
            out[:nd] = self._decode(query[:nd], kv_cache, meta, scale, window, softcap)
        if meta.prefills:  # (fresh prompts attend to their K / V as the cache holds them, as every later read does)
            key, value = self._as_cached(key), self._as_cached(value)
        for s, g, n in _fresh_runs(meta.prefills):  # g fresh prompts of n tokens each, back to back from s
            q, k, v = (t[s : s + g * n].view(g, n, *t.shape[1:]).transpose(1, 2) for t in (query, key, value))
            pos = torch.arange(n, device=query.device)
            mask = _band(pos, pos, window) if window is not None and window < n else None  # None: causal
            o = _attend(q, k, v, mask, scale, softcap)  # [g, H, n, D]
            out[s : s + g * n] = o.transpose(1, 2).reshape(g * n, *query.shape[1:])
        for chunk in meta.prefills:  # chunks that continue earlier context (prefix-cache hit, chunked prefill)
            if chunk.context_slots is None:  # done above
                continue
            s, n = chunk.query_start, chunk.query_len
            past = chunk.context_len - n
            # Query i sits at absolute position past + i and sees keys 0 .. past + i (the last `window` of them):
            # only keys from the first query's window on are read.
            first = 0 if window is None else max(0, past - window + 1)
            slots = chunk.context_slots[first:]
            q = query[s : s + n].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
            k = self._read_slots(kv_cache, 0, slots).transpose(0, 1).unsqueeze(0)  # [1, Hkv, C, D]
            v = self._read_slots(kv_cache, 1, slots).transpose(0, 1).unsqueeze(0)
            qpos = torch.arange(past, past + n, device=query.device)
            mask = _band(qpos, torch.arange(first, chunk.context_len, device=query.device), window)  # [n, C]
            o = _attend(q, k, v, mask, scale, softcap)
            out[s : s + n] = o.squeeze(0).transpose(0, 1)
        return out

    def _as_cached(self, x: torch.Tensor) -> torch.Tensor:
        """K or V [T, Hkv, D] as a read of the cache gives them back (the model dtype's cache: as they are)."""
        return x

    def _read_slots(self, kv_cache: torch.Tensor, which: int, slots: torch.Tensor) -> torch.Tensor:
        """K (0) or V (1) of the given cache slots: [len(slots), Hkv, D] in the compute dtype."""
        _, num_blocks, block_size, hkv, width = kv_cache.shape
        # (index_select, not advanced indexing: measured 2-3x faster for these gathers on CPU)
        return self._decoded(kv_cache[which].view(num_blocks * block_size, hkv, width).index_select(0, slots))

    def _read_blocks(self, kv_cache: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        """K and V of the blocks of the given block-table entries: [2, len(entries), block, Hkv, D], compute dtype."""
        return self._decoded(kv_cache.index_select(1, entries))

    def _decoded(self, raw: torch.Tensor) -> torch.Tensor:
        """Cache entries -> values in the compute dtype (identity for a cache kept in the model dtype)."""
        return raw

    def _decode(
        self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window, softcap
    ) -> torch.Tensor:
        _, _, block_size, hkv, _ = kv_cache.shape
        view = meta.step_cache.get(("decode", window))
        if view is None:  # the same for every layer of the step with this window: built once
            view = meta.step_cache[("decode", window)] = _decode_view(meta, block_size, window)
        tables, mask = view  # [B, M], [B, 1, 1, M * block]
        b, m = tables.shape
        kv = self._read_blocks(kv_cache, tables.view(-1))  # K and V in one gather: [2, B * M, block, ...]
        kv = kv.view(2, b, m * block_size, hkv, -1).transpose(2, 3)  # [2, B, Hkv, L, D]
        return _attend(q.unsqueeze(2), kv[0], kv[1], mask, scale, softcap).squeeze(2)  # [B, H, D]


def _decode_view(meta: AttentionMetadata, block_size: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The decode rows' block tables [B, M'] and key mask [B, 1, 1, M' * block]: the whole tables with a window of
    None; with a window W, only the blocks that can hold a row's last W positions (at most ceil(W / block) + 1)."""
    tables, lens = meta.decode_block_tables, meta.decode_context_lens  # [B, M], [B] (the new token included)
    b, m = tables.shape
    first = torch.zeros_like(lens)  # [B] the first block read, per row
    span = m if window is None else -(-window // block_size) + 1  # blocks W positions can touch
    if span < m:
        first = (lens - window).clamp(min=0) // block_size
        idx = first.unsqueeze(1) + torch.arange(span, device=lens.device)
        tables = tables.gather(1, idx.clamp(max=m - 1))  # past a row's last block: masked out below
    length = tables.shape[1] * block_size
    kpos = first.unsqueeze(1) * block_size + torch.arange(length, device=lens.device)  # [B, L] absolute positions
    seen = kpos < lens.unsqueeze(1)
    if window is not None:
        seen &= kpos >= (lens - window).unsqueeze(1)
    return tables, seen.view(b, 1, 1, length)


class Int8PagedAttention(TorchPagedAttention):
    """The same attention over an INT8 KV cache with one fp32 scale per token and KV head.

    Each cache row is D int8 values followed by the 4 bytes of its scale, so one int8 tensor per layer
    holds both ([2, blocks, block_size, Hkv, D + 4]): (D + 4) / (2 D) of a bf16 cache, 0.53 at D = 64.
    New K/V are quantized as they are written (symmetric, amax / 127); reads dequantize on the fly. A fresh
    prefill attends to its own K/V quantized so (`_as_cached`), as a chunked prefill, a prefix-cache hit and the
    fused C step read them from the cache: the tokens do not depend on the chunk size or on prefix-cache hits (it
    attended to its unquantized K/V, ~3e-3 in log-probs off those paths).

    The int4 tier (CacheConfig.kv_int4_after): `pack_int4` re-stores two blocks as one in the same bytes (symmetric
    per token and KV head, scale amax / 7 in fp16, values rounded to the nearest in [-7, 7]): row t (D + 4 bytes) of
    the int4 block holds token t of the first block, then token t of the second, each as D / 2 bytes (byte i: value
    i in its low nibble, value D / 2 + i in its high nibble) and its 2-byte scale. So reading an int4 token reads
    half the bytes of an int8 one. A block-table entry (slot) with INT4_LO / INT4_HI set reads the first or second
    (scheduler_output.py); the values are q * scale in fp32, rounded to the compute dtype, as the int8 ones.
    """

    name = "torch-paged-int8"
    cache_dtype = torch.int8
    SCALE_BYTES = 4

    def __init__(self, compute_dtype: torch.dtype, int4_tier: bool = False) -> None:
        """int4_tier: the tables may hold int4 entries (CacheConfig.kv_int4_after); else no read looks for them."""
        self.compute_dtype = compute_dtype
        self.int4_tier = int4_tier

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_dim + self.SCALE_BYTES)

    def kv_bytes_per_token(self, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_kv_heads * (head_dim + self.SCALE_BYTES)

    @staticmethod
    def _quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, Hkv, D] -> its int8 values (as fp32) and fp32 scales [T, Hkv, 1], as a cache row stores them."""
        x32 = x.float()
        scale = (x32.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-8)
        return torch.round(x32 / scale).clamp(-127, 127), scale

    def _as_cached(self, x: torch.Tensor) -> torch.Tensor:
        q, scale = self._quantize(x)
        return (q * scale).to(self.compute_dtype)  # (what _decoded gives back for the stored row, to the bit)

    def write_kv(self, kv_cache, key, value, slot_mapping) -> None:
        _, num_blocks, block_size, hkv, width = kv_cache.shape
        for which, x in ((0, key), (1, value)):  # x [T, Hkv, D]
            q, scale = self._quantize(x)
            q = q.to(torch.int8)
            row = torch.cat([q, scale.view(torch.int8)], dim=-1)  # [T, Hkv, D + 4]
            kv_cache[which].view(num_blocks * block_size, hkv, width).index_copy_(0, slot_mapping, row)

    def _decoded(self, raw: torch.Tensor) -> torch.Tensor:
        d = raw.shape[-1] - self.SCALE_BYTES
        scale = raw[..., d:].contiguous().view(torch.float32)  # [..., 1]
        return (raw[..., :d].float() * scale).to(self.compute_dtype)

    def _decoded_kinds(self, raw: torch.Tensor, kinds: torch.Tensor) -> torch.Tensor:
        """raw's rows read as their entries' kinds say (broadcast against raw; 0 int8, 1 / 2 an int4 block's low /
        high half), in the compute dtype."""
        d = raw.shape[-1] - self.SCALE_BYTES
        int8 = raw[..., :d].float() * raw[..., d:].contiguous().view(torch.float32)
        first, second = (self._int4_values(raw[..., h * (d // 2 + 2) : (h + 1) * (d // 2 + 2)]) for h in (0, 1))
        return torch.where(kinds == 0, int8, torch.where(kinds == 1, first, second)).to(self.compute_dtype)

    @staticmethod
    def _int4_values(record: torch.Tensor) -> torch.Tensor:
        """[..., D / 2 + 2] int4 token records (pack_int4's) -> their D values times their scale, fp32."""
        half = record.shape[-1] - 2
        b = record[..., :half]
        low = (b & 15) - ((b & 8) << 1)  # the low nibble, sign-extended
        scale = record[..., half:].contiguous().view(torch.float16).float()
        return torch.cat([low, b >> 4], dim=-1).float() * scale

    def _read_blocks(self, kv_cache: torch.Tensor, entries: torch.Tensor) -> torch.Tensor:
        kinds = entries >> INT4_SHIFT if self.int4_tier else None
        if kinds is None or not bool(kinds.any()):
            return super()._read_blocks(kv_cache, entries)
        raw = kv_cache.index_select(1, entries & BLOCK_ID_MASK)
        return self._decoded_kinds(raw, kinds.view(1, -1, 1, 1, 1))

    def _read_slots(self, kv_cache: torch.Tensor, which: int, slots: torch.Tensor) -> torch.Tensor:
        _, num_blocks, block_size, hkv, width = kv_cache.shape
        shift = INT4_SHIFT + block_size.bit_length() - 1  # (a slot is its entry * block_size + offset)
        kinds = slots >> shift if self.int4_tier else None
        if kinds is None or not bool(kinds.any()):
            return super()._read_slots(kv_cache, which, slots)
        raw = kv_cache[which].view(num_blocks * block_size, hkv, width).index_select(0, slots & ((1 << shift) - 1))
        return self._decoded_kinds(raw, kinds.view(-1, 1, 1))

    @torch.inference_mode()
    def pack_int4(self, pages: torch.Tensor, first: torch.Tensor, second: torch.Tensor, dst: torch.Tensor) -> None:
        """Re-store int8 blocks first[i] and second[i] as int4 block dst[i] (which may be first[i]) in every page of
        `pages` ([P, 2, blocks, block_size, Hkv, D + 4]: the layers of one KV cache group); all read before any is
        written."""
        d = pages.shape[-1] - self.SCALE_BYTES
        raw = torch.stack([pages.index_select(2, first), pages.index_select(2, second)], dim=3)  # [P, 2, N, 2, ...]
        x = raw[..., :d].float() * raw[..., d:].contiguous().view(torch.float32)
        scale = (x.abs().amax(dim=-1, keepdim=True) / 7.0).clamp(min=2.0**-24, max=65504.0).half()
        q = torch.round(x / scale.float()).clamp(-7, 7).to(torch.int8)
        nibbles = (q[..., : d // 2] & 15) | (q[..., d // 2 :] << 4)  # [P, 2, N, 2, block, Hkv, D / 2]
        records = torch.cat([nibbles, scale.view(torch.int8)], dim=-1)  # [..., D / 2 + 2]
        pages.index_copy_(2, dst, torch.cat([records[:, :, :, 0], records[:, :, :, 1]], dim=-1))
