"""The int4 tier for old tokens (CacheConfig.kv_int4_after): two int8 blocks re-stored as one int4 block in the same
bytes, against exact arithmetic (the stored nibbles and fp16 scales, decoded here with numpy from the raw bytes);
attention over a table of int4 and int8 entries against fp64 attention over the K/V the spec says the cache holds;
the blocks a long sequence holds against the tier's arithmetic; end to end against HF transformers and, with the
fused C decode step, against the per-module path. (The block manager's packs under random adds / aborts /
preemptions: tests/test_kv_groups.py's CoordinatorMachine.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import make_checkpoint

from infertune import LLM, SamplingParams
from infertune.config import default_model_path
from infertune.layers.attention import AttentionMetadata, Int8PagedAttention, PrefillChunk
from infertune.layers.attention.sdpa import reference_causal_attention
from infertune.scheduler_output import INT4_SHIFT, int4_entry

H, HKV, D, BS, BLOCKS = 4, 2, 32, 4, 16


def int8_values(x: torch.Tensor) -> torch.Tensor:
    """What an int8 row holds, dequantized in fp32: symmetric per (token, head), scale amax / 127."""
    scale = (x.abs().amax(dim=-1, keepdim=True) / 127.0).clamp(min=1e-8)
    return torch.round(x / scale).clamp(-127, 127) * scale


def int4_of(x8: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The spec's int4 of int8 values x8 [..., D] (fp32): scale = fp16(amax / 7), q = round(x8 / scale) in [-7, 7]."""
    scale = (x8.abs().amax(dim=-1, keepdim=True) / 7.0).clamp(min=2.0**-24, max=65504.0).half().float()
    return torch.round(x8 / scale).clamp(-7, 7), scale


def decode_page_rows(raw: np.ndarray, half: int) -> np.ndarray:
    """Rows [..., D + 4] of an int4 block, read as the docs lay them out, with numpy: half 0 = the first token's
    record (bytes 0 .. D / 2 + 1), half 1 = the second's; a record is D / 2 bytes (value i in the low nibble of
    byte i, value D / 2 + i in its high nibble) and an fp16 scale."""
    rec = raw[..., half * (D // 2 + 2) : (half + 1) * (D // 2 + 2)]
    b = rec[..., : D // 2].astype(np.int16) & 0xFF
    nibbles = np.concatenate([b & 0xF, b >> 4], axis=-1)
    q = np.where(nibbles >= 8, nibbles - 16, nibbles).astype(np.float32)
    scale = np.ascontiguousarray(rec[..., D // 2 :]).view(np.float16).astype(np.float32)  # [..., 1]
    return q * scale


def test_pack_stores_the_exact_int4_of_the_int8_values():
    """Two pairs in one call over two layers' pages, K and V: one packed in place (dst = first), one into a third
    block; each half's nibbles and fp16 scale are the spec's, to the bit, and the untouched blocks stay."""
    torch.manual_seed(0)
    attn = Int8PagedAttention(torch.float32, int4_tier=True)
    pages = torch.zeros(2, *attn.kv_cache_shape(BLOCKS, BS, HKV, D), dtype=torch.int8)
    xs = {}
    for layer in range(2):
        for block in (5, 2, 7, 1, 9):
            slots = torch.arange(block * BS, (block + 1) * BS)
            k, v = 3 * torch.randn(BS, HKV, D), torch.randn(BS, HKV, D) * torch.linspace(0.01, 4, D)
            k[1, 0] = 0.0  # an all-zero row: the smallest scale, nothing but zeros
            attn.write_kv(pages[layer], k, v, slots)
            xs[layer, block] = (int8_values(k), int8_values(v))
    before = pages.clone()
    attn.pack_int4(pages, torch.tensor([5, 7]), torch.tensor([2, 1]), torch.tensor([5, 3]))
    for layer in range(2):
        for first, second, dst in ((5, 2, 5), (7, 1, 3)):
            for which in (0, 1):
                raw = pages[layer, which, dst].numpy()  # [BS, HKV, D + 4]
                for half, src in ((0, first), (1, second)):
                    q, scale = int4_of(xs[layer, src][which])
                    got = decode_page_rows(raw, half)
                    assert np.array_equal(got, (q * scale).numpy()), (layer, which, half)
        assert torch.equal(pages[layer, :, 9], before[layer, :, 9])  # untouched
        assert torch.equal(pages[layer, :, 2], before[layer, :, 2])  # a pair's second block is only read
    # the attention's own reads of the int4 entries' slots: the same values
    for half, src in ((0, 7), (1, 1)):
        entry = int4_entry(3, bool(half))
        slots = torch.tensor([entry * BS + off for off in range(BS)])
        q, scale = int4_of(xs[1, src][1])
        assert torch.equal(attn._read_slots(pages[1], 1, slots), q * scale)


def _tiered_cache(attn, n: int, packs: int):
    """One sequence of n tokens in a shuffled block table; its first 2 * packs entries packed to int4, in place.
    Returns the cache, the table (with int4 entries), K, V, and the K / V the spec says the cache holds."""
    torch.manual_seed(1)
    cache = torch.zeros(attn.kv_cache_shape(BLOCKS, BS, HKV, D), dtype=torch.int8)
    blocks = torch.randperm(BLOCKS)[: -(-n // BS)].tolist()
    slots = torch.tensor([blocks[p // BS] * BS + p % BS for p in range(n)])
    k, v = torch.randn(n, HKV, D), torch.randn(n, HKV, D)
    attn.write_kv(cache, k, v, slots)
    held_k, held_v = int8_values(k), int8_values(v)
    table = list(blocks)
    for i in range(0, 2 * packs, 2):
        first, second = blocks[i], blocks[i + 1]
        attn.pack_int4(cache.unsqueeze(0), torch.tensor([first]), torch.tensor([second]), torch.tensor([first]))
        table[i], table[i + 1] = int4_entry(first, False), int4_entry(first, True)
        for held in (held_k, held_v):
            for j in (i, i + 1):
                q, scale = int4_of(held[j * BS : (j + 1) * BS])
                held[j * BS : (j + 1) * BS] = q * scale
    return cache, table, k, v, held_k, held_v


@pytest.mark.parametrize("packs", [1, 2])
def test_decode_and_chunk_over_int4_entries_match_fp64_attention(packs):
    """A decode row and a chunk of 3 queries over a context of 19 tokens (blocks of 4) whose first 2 * packs entries
    are int4: fp64 attention over what the cache holds (int4 there, int8 after) within fp32 rounding; and the int4
    part matters (attention over int8 values everywhere is measurably off)."""
    attn = Int8PagedAttention(torch.float32, int4_tier=True)
    n = 19
    cache, table, k, v, held_k, held_v = _tiered_cache(attn, n, packs)
    # decode: the last token's query, its KV written now (int8), the rest read through the table
    q = torch.randn(1, H, D)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([(table[(n - 1) // BS]) * BS + (n - 1) % BS]),
        num_decode_tokens=1,
        decode_block_tables=torch.tensor([table]),
        decode_context_lens=torch.tensor([n]),
        decode_max_context_len=n,
    )
    out = attn.forward(q, k[n - 1 :], v[n - 1 :], cache, meta, D**-0.5)
    ref = reference_causal_attention(q.double(), held_k.double(), held_v.double(), D**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=0)
    int8_only = reference_causal_attention(q.double(), int8_values(k).double(), int8_values(v).double(), D**-0.5)
    assert (out.double() - int8_only).abs().max() > 1e-3  # (reading the int4 blocks as int8 would land here)
    # a chunk of the last 3 tokens whose context (the 16 before, int4 first) comes back through its slots
    new = 3
    ctx = torch.tensor([table[p // BS] * BS + p % BS for p in range(n)])
    assert (ctx >> (INT4_SHIFT + 2)).bool().sum() == 2 * packs * BS  # the int4 slots carry their entries' kind
    qs = torch.randn(new, H, D)
    meta = AttentionMetadata(slot_mapping=ctx[n - new :], prefills=[PrefillChunk(0, new, n, ctx)])
    out = attn.forward(qs, k[n - new :], v[n - new :], cache, meta, D**-0.5)
    ref = reference_causal_attention(qs.double(), held_k.double(), held_v.double(), D**-0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-6, rtol=0)


def test_the_option_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype='int8'"):
        LLM(kv_int4_after=64)
    with pytest.raises(ValueError, match="token count"):
        LLM(kv_cache_dtype="int8", kv_int4_after=-1)


def test_a_long_sequence_holds_the_tiers_blocks():
    """A sequence of 200 tokens with int4_after 48, blocks of 16, step by step: before each step its int8 entries
    older than 48 tokens went to int4 in pairs, so it holds (pairs) int4 blocks plus its other entries, the pool's
    free blocks say the same, and after it finishes everything is free again."""
    llm = LLM(dtype="float32", max_model_len=512, kv_cache_dtype="int8", kv_int4_after=48, enable_prefix_caching=False)
    engine = llm.engine
    bm = engine.block_manager
    prompt = list(range(3, 103))
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=100, ignore_eos=True))
    seq = engine.scheduler.waiting[0]
    checked = 0
    while engine.has_unfinished_requests():
        engine.step()
        if seq.is_finished:
            break
        n = seq.num_computed_tokens
        before = n - 1 if n > len(prompt) else 0  # computed before this step (the prompt: one step)
        pairs = max(0, before - 48) // 16 // 2  # its entries wholly 48 behind those, in pairs, went to int4
        (table,) = seq.block_tables
        assert sum(1 for e in table if e >> INT4_SHIFT) == 2 * pairs
        assert bm.blocks_in_use(seq) == [len(table) - pairs]
        assert bm.num_free_blocks == bm.num_blocks - (len(table) - pairs)
        assert len(table) == -(-n // 16)
        checked += pairs > 0
    assert checked > 50
    assert bm.num_free_blocks == bm.num_blocks
    # the start-up line's count with the tier: a 512-token sequence from a short prompt peaks at 32 blocks less its
    # (512 - 48) // 16 // 2 = 14 packed pairs, plus the fresh block a pair may wait a step for: 19
    assert f"up to {bm.num_blocks // 19} sequences of max_model_len at once where the prompts are short" in (
        engine.describe_kv_cache()
    )


def _hf_gaps(llm, prompt: str, max_tokens: int):
    from transformers import AutoModelForCausalLM

    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    hf = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1 : -1]
    picked = logits.gather(1, torch.tensor(out.outputs[0].token_ids).unsqueeze(1)).squeeze(1)
    return out, logits.max(dim=1).values - picked


@pytest.mark.parametrize("age", [16, 0])
def test_greedy_with_the_tier_tracks_hf(age):
    """The demo model, fp32, chunks of 8, int4 after 16 tokens or as soon as two blocks are full (the prompt's old
    blocks go to int4 before its first decode step, the outputs' as they age): its greedy picks against HF's logits
    at the same tokens, held as test_kv_int8 holds the int8 cache."""
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_dtype="int8", kv_int4_after=age, max_num_batched_tokens=8)
    prompt = "import os\nimport sys\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n" * 3
    out, gap = _hf_gaps(llm, prompt, 64)
    assert llm.engine.block_manager.num_int4_packs >= 3  # (the prompt's and the outputs' old blocks went to int4)
    assert (gap <= 0.5).all(), gap
    assert (gap == 0).float().mean() >= 0.9


def test_an_age_past_every_sequence_changes_nothing():
    """int4_after longer than any sequence: no pack, the very tokens of the int8 cache."""
    prompt = "def fibonacci(n):\n    if n < 2:\n        return n\n"
    params = SamplingParams(temperature=0, max_tokens=40)
    outs = []
    for age in (None, 10_000):
        llm = LLM(dtype="float32", max_model_len=256, kv_cache_dtype="int8", kv_int4_after=age)
        outs.append(llm.generate(prompt, params)[0].outputs[0].token_ids)
        if age is not None:
            assert llm.engine.block_manager.num_int4_packs == 0
    assert outs[0] == outs[1]


@pytest.fixture(scope="module")
def llama_long(tmp_path_factory):
    """A tiny Llama with std-0.2 weights (the fused tests' noise level), 512 positions."""
    from conftest import hf_model

    path = make_checkpoint(tmp_path_factory.mktemp("llama_int4"), "llama", std=0.2, max_position_embeddings=512)
    return path, hf_model(path)


def test_the_fused_step_reads_int4_entries(llama_long, monkeypatch):
    """bf16, int8 cache, int4 after 8 tokens (blocks of 4, so packs all through the run), a batch of 3 with a
    chunked prompt: the fused C decode step against the per-module path, both against HF
    (test_sliding_window._fused_against_per_module); packs happened on both engines. A fused step that read the int4
    blocks as int8 is far off (checked by turning kv_rows' int4 branch off)."""

    path, hf = llama_long
    packs = _packs_int4_on_the_fused_step(monkeypatch, path, hf, 1)
    assert len(packs) >= 20


def _packs_int4_on_the_fused_step(monkeypatch, path, hf, groups: int) -> list:
    """The fused step against the per-module path, both against HF (bf16, int8 cache, int4 after 8 tokens, blocks of
    4, a batch of 3 with a chunked prompt: test_sliding_window._fused_against_per_module); the packs both engines
    made, (group, first, second, dst) each."""
    from test_sliding_window import _fused_against_per_module

    from infertune.engine.kv_cache_coordinator import KVCacheCoordinator

    packs = []
    pack = KVCacheCoordinator.pack_int4
    monkeypatch.setattr(KVCacheCoordinator, "pack_int4", lambda self, seq: packs.extend(p := pack(self, seq)) or p)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 200, (n,), generator=g).tolist() for n in (30, 9, 17)]
    _fused_against_per_module(path, hf, prompts, groups, kv_cache_dtype="int8", kv_int4_after=8)
    return packs


def test_the_c_side_reads_the_same_entry_bits():
    """csrc/abi.h's IT_INT4_SHIFT is scheduler_output's INT4_SHIFT (the kernels decode the entries the engine makes)."""
    import re
    from pathlib import Path

    import infertune.kernels

    text = (Path(infertune.kernels.__file__).parent / "csrc" / "abi.h").read_text()
    assert int(re.search(r"#define IT_INT4_SHIFT (\d+)", text).group(1)) == INT4_SHIFT


def test_a_sequence_is_packed_only_once_its_press_ran():
    """The coordinator with a press keeping half of every prefill and the tier after 4 tokens (blocks of 4): while
    the prefill is in chunks nothing is packed (the press reads that KV); once compress() gave back the blocks past
    the kept 20 tokens, the kept slots' old pairs go to int4, counted in slots (positions go on)."""
    from infertune.engine.kv_cache_coordinator import KVCacheCoordinator
    from infertune.engine.sequence import Sequence

    bm = KVCacheCoordinator(64, 4, [None], False, chunk=16, plan=lambda n: [n // 2], int4_after=4)
    seq = Sequence(list(range(40)), 8)
    for end in (16, 32, 40):  # the prefill in chunks
        assert bm.pack_int4(seq) == []
        assert bm.allocate_slots(seq, end)
        seq.num_computed_tokens = end
    assert bm.pack_int4(seq) == [] and seq.kv_kept == [20]
    assert bm.compress(seq) and seq.num_evicted == [20] and len(seq.block_tables[0]) == 5
    packs = bm.pack_int4(seq)  # 20 slots held, those 4 behind the newest: entries 0-3 wholly old -> two pairs
    assert [(g, i) for g, i, *_ in packs] == [(0, 0), (0, 2)]
    assert [e >> INT4_SHIFT for e in seq.block_tables[0]] == [1, 2, 1, 2, 0]
    assert bm.blocks_in_use(seq) == [3]
    bm.free(seq)
    assert bm.num_free_blocks == 64 and bm.int4_blocks_by_group == [0]


def test_the_int4_tier_packs_each_full_group_of_a_cut_model(tmp_path, monkeypatch):
    """A Qwen2 with 4 full and 2 windowed layers (window 8) is 3 KV cache groups of 2 layers, two of them full: the
    int4 tier packs each full group's old blocks (and none of the windowed group's), the fused step as close to HF as
    the per-module path on the packed cache (test_sliding_window._fused_against_per_module)."""
    from conftest import hf_model

    path = make_checkpoint(
        tmp_path / "q",
        "qwen2",
        std=0.2,
        num_hidden_layers=6,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=4,
        max_position_embeddings=512,
    )
    packs = _packs_int4_on_the_fused_step(monkeypatch, path, hf_model(path), 3)
    assert {p[0] for p in packs} == {0, 1}  # (group, first, second, dst): both full groups, never the window's


def test_a_chunked_prefill_is_never_packed_so_its_first_token_is_the_int8_caches():
    """A 300-token prompt in chunks of 32 with int4 after 32 tokens: no pack before its first token (its later chunks
    attend to int8 KV only, so the first token's logprobs are exactly the int8 cache's at the same chunking, and do
    not move with the chunk size more than int8 alone does); then the decode packs the old blocks."""
    prompt = [{"prompt_token_ids": [3 + (i * 7) % 200 for i in range(300)]}]
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)

    def first(**kw):
        llm = LLM(dtype="float32", max_model_len=512, kv_cache_dtype="int8", enable_prefix_caching=False, **kw)
        out = llm.generate(prompt, params)[0].outputs[0]
        return llm, {t: round(lp.logprob, 7) for t, lp in out.logprobs[0].items()}

    tier, got = first(kv_int4_after=32, max_num_batched_tokens=32)
    assert tier.engine.block_manager.num_int4_packs == 0  # (one token: no decode step, so no pack)
    _, plain = first(max_num_batched_tokens=32)
    assert got == plain
    out = tier.generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8 and tier.engine.block_manager.num_int4_packs > 0


def test_the_server_admits_what_the_tier_holds(tmp_path):
    """n=2 x (300 + 600) tokens in a 64-block cache: 57 blocks a sequence at int8, 114 for the two; with the tier a
    sequence holds at most its prompt at int8 (19 blocks when its prefill ends) or 32 at its end: admitted (the check
    counted 114 and refused it), and the server's outputs are the offline engine's; without the tier it is refused
    with the numbers."""
    import httpx
    from server_utils import ServerThread

    ckpt = make_checkpoint(tmp_path / "llama", "llama", max_position_embeddings=1024)
    opts = dict(
        dtype="float32",
        max_model_len=1024,
        kv_cache_dtype="int8",
        kv_int4_after=64,
        max_num_batched_tokens=64,
        block_size=16,
        enable_prefix_caching=False,
    )
    block = 2 * 2 * 2 * (16 + 4) * 16  # layers x (K, V) x KV heads x (head_dim + fp32 scale) x tokens, int8
    opts["kv_cache_memory_bytes"] = 64 * block
    body = {"model": "tiny", "prompt": "a" * 300, "max_tokens": 600, "n": 2, "temperature": 0, "ignore_eos": True}
    offline = LLM(str(ckpt), **opts)
    assert offline.engine.executor.kv_cache_info.num_blocks == 64
    params = SamplingParams(n=2, max_tokens=600, temperature=0, ignore_eos=True)
    want = sorted(c.text for c in offline.generate(body["prompt"], params)[0].outputs)
    assert offline.engine.block_manager.max_blocks_per_seq(900, 300) == 32
    with ServerThread(ckpt, **opts) as s:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert sorted(c["text"] for c in r.json()["choices"]) == want
    del opts["kv_int4_after"]
    with ServerThread(ckpt, **opts) as s:
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 400 and "needs 114 KV-cache blocks" in r.json()["error"]["message"]
