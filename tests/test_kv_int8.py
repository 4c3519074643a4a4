"""INT8 KV cache: the attention it feeds against fp attention, its capacity, and a whole model against HF."""

from __future__ import annotations

import pytest
import torch

from infertune import LLM, SamplingParams
from infertune.config import default_model_path
from infertune.layers.attention import AttentionMetadata, Int8PagedAttention, PrefillChunk, TorchPagedAttention
from infertune.layers.attention.sdpa import reference_causal_attention

H, HKV, D, BS, BLOCKS = 4, 2, 32, 4, 32


def quantize_rows(x: torch.Tensor) -> torch.Tensor:
    """What the cache should hold, dequantized: symmetric int8 per (token, head), scale = amax / 127."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    return torch.round(x / scale).clamp(-127, 127) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_cache_round_trip_and_attention_bounds(dtype):
    torch.manual_seed(0)
    attn = Int8PagedAttention(dtype)
    cache = torch.zeros(attn.kv_cache_shape(BLOCKS, BS, HKV, D), dtype=torch.int8)
    past, new = 13, 1
    table = [7, 3, 11, 0]
    slots = torch.tensor([table[p // BS] * BS + p % BS for p in range(past + new)])
    k, v = torch.randn(past + new, HKV, D).to(dtype), torch.randn(past + new, HKV, D).to(dtype)
    attn.write_kv(cache, k[:past], v[:past], slots[:past])
    # Round trip: every stored row is within half a step of the original, and equals the exact quantization.
    got_k = attn._read_slots(cache, 0, slots[:past]).double()
    exact = quantize_rows(k[:past].double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_k, exact.to(dtype).double(), atol=tol * exact.abs().max().item(), rtol=0)
    step = k[:past].double().abs().amax(-1, keepdim=True) / 127
    assert ((got_k - k[:past].double()).abs() <= step / 2 + tol * 4).all()
    # Decode through the int8 cache vs fp attention over the original K/V.
    q = torch.randn(new, H, D).to(dtype)
    meta = AttentionMetadata(
        slot_mapping=slots[past:],
        num_decode_tokens=1,
        decode_block_tables=torch.tensor([table]),
        decode_context_lens=torch.tensor([past + 1]),
        decode_max_context_len=past + 1,
    )
    out = attn.forward(q, k[past:], v[past:], cache, meta, D**-0.5)
    ref_fp = reference_causal_attention(q.double(), k.double(), v.double(), D**-0.5)
    ref_q = reference_causal_attention(q.double(), quantize_rows(k.double()), quantize_rows(v.double()), D**-0.5)
    torch.testing.assert_close(out.double(), ref_q, atol=0.02 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    assert (out.double() - ref_fp).abs().max() < 0.05  # int8 noise stays small against unit-scale outputs


def test_int8_chunk_with_context_matches_fp_attention_within_bound():
    torch.manual_seed(1)
    attn, fp = Int8PagedAttention(torch.float32), TorchPagedAttention()
    cache8 = torch.zeros(attn.kv_cache_shape(BLOCKS, BS, HKV, D), dtype=torch.int8)
    cache = torch.zeros(fp.kv_cache_shape(BLOCKS, BS, HKV, D))
    past, new = 9, 6
    slots = torch.arange(past + new) + 3 * BS
    k, v, q = torch.randn(past + new, HKV, D), torch.randn(past + new, HKV, D), torch.randn(new, H, D)
    for a, c in ((attn, cache8), (fp, cache)):
        a.write_kv(c, k[:past], v[:past], slots[:past])
    meta = AttentionMetadata(slot_mapping=slots[past:], prefills=[PrefillChunk(0, new, past + new, slots)])
    out8 = attn.forward(q, k[past:], v[past:], cache8, meta, D**-0.5)
    out = fp.forward(q, k[past:], v[past:], cache, meta, D**-0.5)
    ref = reference_causal_attention(q, quantize_rows(k), quantize_rows(v), D**-0.5)
    torch.testing.assert_close(out8, ref, atol=1e-5, rtol=0)
    assert (out8 - out).abs().max() < 0.05


def test_int8_cache_holds_about_twice_the_tokens():
    kw = dict(dtype="bfloat16", max_model_len=256, kv_cache_memory_bytes=4 * 2**20)
    base = LLM(**kw)
    int8 = LLM(kv_cache_dtype="int8", **kw)
    arch = base.config.model.arch
    d, layers, hkv = arch.head_dim, arch.num_hidden_layers, arch.num_key_value_heads
    assert base.engine.executor.kv_cache_info.bytes_per_token == 2 * layers * hkv * d * 2
    assert int8.engine.executor.kv_cache_info.bytes_per_token == 2 * layers * hkv * (d + 4)
    ratio = int8.engine.executor.kv_cache_info.num_tokens / base.engine.executor.kv_cache_info.num_tokens
    assert ratio == pytest.approx(2 * d / (d + 4), rel=0.01)  # 1.78x at the demo model's head_dim 32


def test_int8_cache_greedy_tracks_hf():
    from transformers import AutoModelForCausalLM

    # Chunked prefill (8 tokens a step) makes every chunk after the first read K/V back from the int8 cache.
    llm = LLM(dtype="float32", max_model_len=256, kv_cache_dtype="int8", max_num_batched_tokens=8)
    out = llm.generate("import os\nimport sys\n\ndef main(argv):\n", SamplingParams(temperature=0, max_tokens=24))[0]
    hf = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1 : -1]
    picked = logits.gather(1, torch.tensor(out.outputs[0].token_ids).unsqueeze(1)).squeeze(1)
    gap = logits.max(dim=1).values - picked
    assert (gap <= 0.5).all(), gap  # every pick is at most a hair below HF's best...
    assert (gap == 0).float().mean() >= 0.9  # ...and nearly always HF's best exactly


def test_a_prompts_tokens_do_not_depend_on_the_chunk_size_or_a_prefix_hit(tmp_path):
    """A whole prefill attends to its K/V as the int8 cache holds them, as its later chunks and a prefix-cache hit
    read them back: the log-probs of the first tokens agree across the three (fp32, to rounding). Before, a whole
    prefill attended to its unquantized K/V: ~3e-3 off the chunked run's (doctor --consistency failed its chunked
    and prefix pairs on a correct engine)."""
    from conftest import make_checkpoint
    from parity_utils import assert_int8_cache_reads_agree

    path = make_checkpoint(tmp_path / "llama", "llama", num_hidden_layers=2)
    prompt = torch.randint(3, 250, (47,), generator=torch.Generator().manual_seed(5)).tolist()
    assert_int8_cache_reads_agree(path, prompt, block_size=4, max_model_len=64)
