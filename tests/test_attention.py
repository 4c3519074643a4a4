"""The paged attention backend against the plain reference attention (no cache, no paging, fp64 softmax)."""

from __future__ import annotations

import random

import pytest
import torch

from infertune.layers.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention
from infertune.layers.attention.paged import _fresh_runs
from infertune.layers.attention.sdpa import reference_causal_attention

H, HKV, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 64


def _slots(table: list[int], positions) -> list[int]:
    return [table[p // BS] * BS + p % BS for p in positions]


@pytest.mark.parametrize("seed", range(4))
def test_mixed_decode_and_prefill_match_reference(seed):
    """Decodes, fresh prefills and chunks with earlier context in one step, over scattered blocks."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    attn = TorchPagedAttention()
    cache = torch.zeros(attn.kv_cache_shape(NUM_BLOCKS, BS, HKV, D))
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)  # non-contiguous block tables
    # (tokens already in the cache, new tokens this step)
    # Three fresh 5-token prompts back to back run as one batched SDPA call; the fresh one after the chunk with
    # context, and the 7-token one, start runs of their own.
    shapes = [(5, 1), (12, 1), (0, 1), (0, 9), (7, 6), (4, 4), (0, 5), (0, 5), (0, 5), (3, 5), (0, 5), (0, 7)]
    seqs = []
    for past, new in shapes:
        total = past + new
        table = [free.pop() for _ in range(-(-total // BS))]
        k = torch.randn(total, HKV, D)
        v = torch.randn(total, HKV, D)
        q = torch.randn(new, H, D)
        if past:  # earlier KV, written by previous steps
            attn.write_kv(cache, k[:past], v[:past], torch.tensor(_slots(table, range(past))))
        seqs.append((past, new, table, q, k, v))
    seqs.sort(key=lambda s: s[1] != 1)  # decodes first, the layout the metadata expects

    qs, ks, vs, slots, prefills, dec_tables, dec_lens = [], [], [], [], [], [], []
    offset = 0
    for past, new, table, q, k, v in seqs:
        qs.append(q), ks.append(k[past:]), vs.append(v[past:])
        slots += _slots(table, range(past, past + new))
        if new == 1:
            dec_tables.append(table), dec_lens.append(past + 1)
        else:
            ctx = torch.tensor(_slots(table, range(past + new))) if past else None
            prefills.append(PrefillChunk(offset, new, past + new, ctx))
        offset += new
    width = max(len(t) for t in dec_tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(dec_lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in dec_tables]),
        decode_context_lens=torch.tensor(dec_lens),
        decode_max_context_len=max(dec_lens),
        prefills=prefills,
    )
    assert [(g, n) for _, g, n in _fresh_runs(prefills)] == [(1, 9), (3, 5), (1, 5), (1, 7)]
    scale = D**-0.5
    out = attn.forward(torch.cat(qs), torch.cat(ks), torch.cat(vs), cache, meta, scale)
    offset = 0
    for _past, new, _table, q, k, v in seqs:
        ref = reference_causal_attention(q, k, v, scale)
        torch.testing.assert_close(out[offset : offset + new], ref, atol=1e-5, rtol=1e-5)
        offset += new
    # And the new KV landed in the cache at the mapped slots.
    for past, new, table, _q, k, _v in seqs:
        got = cache[0].view(-1, HKV, D)[torch.tensor(_slots(table, range(past + new)))]
        torch.testing.assert_close(got, k)


def test_reference_is_causal():
    """The oracle itself: the first query of a fresh prefill sees only the first key, so it returns v[0]."""
    q, k, v = torch.randn(3, H, D), torch.randn(3, HKV, D), torch.randn(3, HKV, D)
    out = reference_causal_attention(q, k, v, 1.0)
    torch.testing.assert_close(out[0], v[0].repeat_interleave(H // HKV, dim=0))
