"""KV compression's eviction over the paged cache: score a finished prefill's tokens per layer and KV head, keep the
best and move them to the front of the sequence's slots (kv_compression.py says how many).

The scores are kvpress's (NVIDIA), written again here over our cache layout:
- streaming_llm: the first n_sink tokens and the most recent ones;
- snapkv / pyramidkv: the attention of the prompt's last window_size queries (after rotary, scaled by
  1 / sqrt(head_dim), causal, softmax in fp32) on the earlier keys, averaged over those queries, smoothed by an
  average pool of kernel_size (zero padded), averaged over the query heads of each KV head; the observation window
  itself takes the largest score, so it is always kept. Top-k per KV head.
K is cached after rotary, so a kept key needs no re-rotation. Each head keeps the same count (as kvpress), its own
tokens, in their original order, in the sequence's slots 0 .. kept - 1 of that layer (in place: the i-th kept token
of a head sits at or after slot i, and the gather copies before the scatter writes). An int8 cache (layers/
attention/paged.py Int8PagedAttention) is scored on its dequantized keys and moved as stored, scales included.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from infertune.kv_compression import KVCompressionConfig, Press


def kept_indices(
    press: Press, keys: torch.Tensor, queries: torch.Tensor | None, kept: int, num_heads: int
) -> torch.Tensor:
    """Per KV head, the token indices a press keeps of one layer's n keys [n, Hkv, D] (queries: the prompt's last
    queries [>= window_size, H, D] for SnapKV), ascending: [Hkv, kept]."""
    n, hkv, d = keys.shape
    if press.name == "streaming_llm":
        sinks = min(press.n_sink, kept)
        idx = torch.cat([torch.arange(sinks), torch.arange(n - (kept - sinks), n)]).to(keys.device)
        return idx.unsqueeze(0).expand(hkv, kept)
    scores = snapkv_scores(keys, queries[-press.window_size :], press.window_size, press.kernel_size, num_heads)
    return scores.topk(kept, dim=-1).indices.sort(dim=-1).values


def snapkv_scores(keys: torch.Tensor, queries: torch.Tensor, window: int, kernel: int, num_heads: int) -> torch.Tensor:
    """SnapKV's score of each of n keys per KV head [Hkv, n] from the last `window` queries [window, H, D]."""
    n, hkv, d = keys.shape
    rep = num_heads // hkv
    k = keys.float().repeat_interleave(rep, dim=1)  # [n, H, D]: KV head j serves query heads j * rep ..
    q = queries.float()
    attn = torch.einsum("whd,nhd->hwn", q, k) / d**0.5  # [H, w, n]
    qpos = torch.arange(n - window, n, device=keys.device).unsqueeze(1)
    attn = attn.masked_fill(torch.arange(n, device=keys.device).unsqueeze(0) > qpos, float("-inf"))
    attn = attn.softmax(dim=-1)[..., : n - window]  # [H, w, n - w]
    scores = F.avg_pool1d(attn.mean(dim=1).unsqueeze(0), kernel_size=kernel, padding=kernel // 2, stride=1)[0]
    scores = scores.view(hkv, rep, n - window).mean(dim=1)  # [Hkv, n - w]
    return F.pad(scores, (0, window), value=scores.max().item())  # the window is always kept


class KVPress:
    """The runner's side of kv_compression: compress(...) after the step that computed a sequence's prefill, by the
    engine's config or by the request's own (`config=`, SamplingParams.kv_compression)."""

    def __init__(self, config: KVCompressionConfig, num_layers: int, num_heads: int, attn) -> None:
        self.config = config
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.attn = attn  # reads (dequantizes) cache slots: TorchPagedAttention._read_slots
        self.window = config.observation_window()  # queries kept per layer while a prefill runs (0: none)

    def capture_from(self, prefill_len: int, config: KVCompressionConfig | None = None) -> int | None:
        """The first position whose queries a prefill of prefill_len must keep (None: none needed)."""
        window = self.window if config is None else config.observation_window()
        return max(0, prefill_len - window) if window else None

    @torch.inference_mode()
    def compress(
        self,
        kv_caches: list[torch.Tensor],
        groups,
        tables: list[list[int]],
        kept: list[int],
        n: int,
        queries: dict[int, torch.Tensor] | None,
        block_size: int,
        config: KVCompressionConfig | None = None,
    ) -> None:
        """Evict in every group g that keeps fewer than n (tables[g] its block table) down to kept[g] of the n
        tokens, by config's presses (None: the engine's)."""
        config = config or self.config
        device = kv_caches[0].device
        for g, group in enumerate(groups):
            if group.window is not None or kept[g] >= n:
                continue
            table = torch.tensor(tables[g], dtype=torch.long, device=device)
            pos = torch.arange(n, device=device)
            slots = table[pos // block_size] * block_size + pos % block_size  # [n]
            for layer in group.layers:
                press = config.press_for(layer, n)
                assert press is not None and press.kept_tokens(layer, self.num_layers, n) == kept[g]
                cache = kv_caches[layer]
                keys = self.attn._read_slots(cache, 0, slots)  # [n, Hkv, D]
                q = queries.get(layer) if queries else None
                idx = kept_indices(press, keys, q, kept[g], self.num_heads)  # [Hkv, k]
                move_kept(cache, slots, idx)


def move_kept(kv_cache: torch.Tensor, slots: torch.Tensor, idx: torch.Tensor) -> None:
    """Put each KV head's kept tokens (idx [Hkv, k], ascending token indices into slots) at slots[:k], K and V."""
    _, num_blocks, block_size, hkv, width = kv_cache.shape
    flat = kv_cache.view(2, num_blocks * block_size, hkv, width)
    src = slots[idx].transpose(0, 1)  # [k, Hkv]
    heads = torch.arange(hkv, device=slots.device).unsqueeze(0)  # [1, Hkv]
    flat[:, slots[: idx.shape[1]]] = flat[:, src, heads]  # (advanced indexing gathers a copy first)
