"""DeepSeek-V2 / V3 (MLA + DeepSeek MoE) against Hugging Face transformers, and the latent KV cache behind them.

Oracles: HF's fp32 logits (within 1e-4) and teacher forcing (every greedy pick within 1e-3 of HF's top) on tiny
random checkpoints; an fp64 decompressed attention for the absorbed decode; HF's rope init for YaRN; a count of the
bytes a decode step reads from the cache storage against the latent rows of its block tables.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import hf_model, make_checkpoint, make_tokenizer
from parity_utils import (
    BLOCK,
    MAX_LEN,
    NEW_TOKENS,
    assert_rerouted_note,
    assert_teacher_forced,
    engine_modes,
    prompts_for,
    run,
    run_one_at_a_time,
)
from safetensors.torch import load_file, save_file
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from infertune import LLM, SamplingParams
from infertune.config import ArchConfig, MlaArch
from infertune.layers.attention import (
    AttentionMetadata,
    DecompressedMlaAttention,
    Int8MlaAttention,
    LatentUpProjection,
    MlaAttention,
    PrefillChunk,
)
from infertune.layers.attention.sdpa import reference_causal_attention
from infertune.layers.rotary import rope_attention_factor, rope_inv_freq

LAYERS = 3
MLA_DIMS = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24)
YARN = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64, rope_theta=10000.0)

VARIANTS = {
    # q_lora_rank set; sigmoid + noaux_tc with a non-zero correction bias over 4 groups (2 kept); renormalised and
    # scaled weights; the first layer dense; YaRN with mscale != mscale_all_dim (a cos/sin factor and a softmax one)
    "v3": dict(
        v3=True,
        q_lora_rank=48,
        n_group=4,
        topk_group=2,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 0.707},
    ),
    # V2-Lite's shape: one q_proj, softmax greedy top-k, two shared experts, YaRN as V2-Lite ships it
    "v2-lite": dict(
        v3=False,
        q_lora_rank=None,
        topk_method="greedy",
        n_shared_experts=2,
        rope_parameters={**YARN, "mscale": 0.707, "mscale_all_dim": 0.707},
    ),
    # V2's group-limited greedy routing, scaled, default rope
    "v2-group": dict(
        v3=False, q_lora_rank=48, topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5
    ),
}


def make_deepseek_checkpoint(path, v3: bool, seed: int = 0, **overrides):
    """A tiny random DeepSeek-V3 (or V2) saved with save_pretrained; weights N(0, 0.2) so routing is not degenerate,
    norms around 1 and (V3) a correction bias that changes which experts win."""
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config, DeepseekV3ForCausalLM

    tok = make_tokenizer()
    cfg = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=3,
        first_k_dense_replace=1,
        max_position_embeddings=256,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
        **MLA_DIMS,
    )
    cfg.update(overrides)
    torch.manual_seed(seed)
    if v3:
        model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg))
    else:
        model = DeepseekV2ForCausalLM(DeepseekV2Config(**cfg))
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p)) if "norm" in name else p.normal_(0.0, 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    kw = dict(VARIANTS[request.param])
    path = make_deepseek_checkpoint(tmp_path_factory.mktemp(request.param), **kw)
    return request.param, path, hf_model(path)


def kv_bytes_per_token(path, elem: int = 4) -> int:
    arch = ArchConfig.from_model_dir(str(path))
    return arch.num_hidden_layers * arch.mla.cache_width * elem


def test_prompt_logits_match_hf(variant):
    name, path, hf = variant
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    runner = llm.engine.executor.runner
    assert runner.model.model.layers[0].self_attn.scale == pytest.approx(hf.model.layers[0].self_attn.scaling, 1e-12)
    for prompt in prompts_for(hf.config.vocab_size):
        ours = runner.prompt_logits(prompt, list(range(-(-len(prompt) // BLOCK))))
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_greedy_matches_hf_in_every_engine_mode(variant):
    """Mixed prompt lengths decoded together (absorbed decode over the latent cache) give HF's greedy tokens, and
    the same tokens whatever the engine does to the cache: prefix caching on, chunks of 5 tokens reading earlier
    latents back, one sequence at a time, preemption; and each prompt alone. (V2's group-limited routing: the batch
    only; its attention is V3's.)"""
    name, path, hf = variant
    prompts = prompts_for(hf.config.vocab_size)
    _, reference = run(path, prompts, enable_prefix_caching=False)
    for p, o in zip(prompts, reference):
        assert len(o) == NEW_TOKENS
        assert_teacher_forced(hf, p, o)
    if name == "v2-group":
        return
    for mode, opts in engine_modes(kv_bytes_per_token(path)).items():
        llm, outs = run(path, prompts, **opts)
        assert outs == reference, mode  # and so HF's greedy tokens, as checked above
        if mode == "preemption":
            assert llm.engine.scheduler.num_preemptions > 0
        bm = llm.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks  # nothing leaked
    assert run_one_at_a_time(path, prompts) == reference


def test_prefix_cache_hits_read_latents_back_exactly(variant):
    name, path, hf = variant
    if name == "v2-group":
        pytest.skip("the same latent attention as v3: its prefix-cache reads are covered there")
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, hf.config.vocab_size, (3 * BLOCK + 2,), generator=g).tolist()
    prompts = [shared + torch.randint(0, hf.config.vocab_size, (k,), generator=g).tolist() for k in (1, 5)]
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0]
    later = llm.generate([{"prompt_token_ids": prompts[1]}], params)[0]
    assert later.metrics.num_cached_tokens == 3 * BLOCK
    for p, out in zip(prompts, (first, later)):
        assert_teacher_forced(hf, p, out.outputs[0].token_ids)


# ---- the backend ------------------------------------------------------------------------------------------------

H, BLOCKS = 4, 32
MLA = MlaArch(q_lora_rank=None, **MLA_DIMS)
R, ROPE, NOPE, V, W = MLA.kv_lora_rank, MLA.qk_rope_head_dim, MLA.qk_nope_head_dim, MLA.v_head_dim, MLA.cache_width


def _up(dtype) -> LatentUpProjection:
    up = LatentUpProjection(H, MLA, dtype)
    up.weight.data.normal_(0.0, 0.3)
    up.reset_buffers()
    return up


def _decompressed_reference(q_nope, q_pe, latents, up: LatentUpProjection, scale: float) -> torch.Tensor:
    """What MLA means, in fp64 and written out: K = [W_UK c, k_pe], V = W_UV c per head, causal softmax(QK^T)V for
    queries at the last positions of the context. latents [C, W]; q_* [n, H, .]."""
    w = up.weight.double().view(H, NOPE + V, R)
    c, k_pe = latents[:, :R].double(), latents[:, R:].double()
    k = torch.cat([torch.einsum("hdr,cr->chd", w[:, :NOPE], c), k_pe.unsqueeze(1).expand(-1, H, -1)], dim=-1)
    v = torch.einsum("hdr,cr->chd", w[:, NOPE:], c)
    return reference_causal_attention(torch.cat([q_nope, q_pe], dim=-1).double(), k, v, scale)


def _step(seed: int, dtype):
    """A mixed step over scattered blocks: 3 decodes, a fresh prefill, a chunk continuing earlier context.
    Returns (latents per sequence, AttentionMetadata, new-token rows, query start per sequence, tables)."""
    g = torch.Generator().manual_seed(seed)
    free = torch.randperm(BLOCKS, generator=g).tolist()
    # (tokens already cached, new tokens): decodes first, then prefills, as AttentionMetadata lays them out
    seqs = [(6, 1), (13, 1), (1, 1), (0, 7), (9, 5)]
    tables, lat = [], []
    for past, new in seqs:
        n_blocks = -(-(past + new) // BLOCK)
        tables.append([free.pop() for _ in range(n_blocks)])
        lat.append(torch.randn(past + new, W, generator=g, dtype=torch.float64).to(dtype))

    def slots(i, positions):
        return [tables[i][p // BLOCK] * BLOCK + p % BLOCK for p in positions]

    new_slots, prefills, q_start = [], [], []
    for i, (past, new) in enumerate(seqs):
        q_start.append(len(new_slots))
        new_slots += slots(i, range(past, past + new))
        if new > 1:
            ctx = torch.tensor(slots(i, range(past + new))) if past else None
            prefills.append(PrefillChunk(q_start[-1], new, past + new, ctx))
    decodes = [i for i, (_, new) in enumerate(seqs) if new == 1]
    width = max(len(tables[i]) for i in decodes)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(new_slots),
        num_decode_tokens=len(decodes),
        decode_block_tables=torch.tensor([tables[i] + [0] * (width - len(tables[i])) for i in decodes]),
        decode_context_lens=torch.tensor([sum(seqs[i]) for i in decodes]),
        decode_max_context_len=max(sum(seqs[i]) for i in decodes),
        prefills=prefills,
    )
    return seqs, lat, meta, q_start, slots


@pytest.mark.parametrize("seed", range(3))
def test_absorbed_decode_and_decompressed_prefill_match_fp64_mla(seed):
    """The backend in fp64 against MLA written out (decompressed K/V): decodes (absorbed, reading only the cached
    latents), a fresh prefill and a chunk with earlier context (decompressed), all in one step."""
    dtype = torch.float64
    attn, up = MlaAttention(MLA), _up(dtype)
    cache = torch.zeros(attn.kv_cache_shape(BLOCKS, BLOCK, 1, W), dtype=dtype)
    seqs, lat, meta, q_start, slots = _step(seed, dtype)
    for i, (past, _) in enumerate(seqs):  # what earlier steps left in the cache
        if past:
            attn.write_kv(cache, lat[i][:past], torch.tensor(slots(i, range(past))))
    new_latent = torch.cat([lat[i][past:] for i, (past, _) in enumerate(seqs)])
    t = new_latent.shape[0]
    g = torch.Generator().manual_seed(100 + seed)
    q_nope = torch.randn(t, H, NOPE, generator=g, dtype=dtype)
    q_pe = torch.randn(t, H, ROPE, generator=g, dtype=dtype)
    scale = (NOPE + ROPE) ** -0.5
    out = attn.forward(q_nope, q_pe, new_latent, cache, meta, scale, up)
    assert out.shape == (t, H, V)
    for i, (_, new) in enumerate(seqs):
        s = q_start[i]
        ref = _decompressed_reference(q_nope[s : s + new], q_pe[s : s + new], lat[i], up, scale)
        torch.testing.assert_close(out[s : s + new], ref, atol=1e-12, rtol=0)


def test_int8_latent_cache_is_within_its_bound():
    """Each cached row is int8 with one fp32 scale (amax / 127): rows round-trip within half a step, a fresh prefill
    attends to its rows as the cache holds them, and attention over them stays within 0.02 of the fp32 cache's on
    unit-scale latents (measured: ~5e-3)."""
    attn8, attn = Int8MlaAttention(MLA, torch.float32), MlaAttention(MLA)
    assert attn8.kv_cache_shape(BLOCKS, BLOCK, 1, W) == (1, BLOCKS, BLOCK, 1, W + 4)
    assert attn8.kv_bytes_per_token(1, W, torch.float32) == W + 4
    up = _up(torch.float32)
    seqs, lat, meta, q_start, slots = _step(0, torch.float32)
    caches = {}
    for backend in (attn8, attn):
        cache = torch.zeros(backend.kv_cache_shape(BLOCKS, BLOCK, 1, W), dtype=backend.cache_dtype or torch.float32)
        for i, (past, _) in enumerate(seqs):
            if past:
                backend.write_kv(cache, lat[i][:past], torch.tensor(slots(i, range(past))))
        caches[backend.name] = cache
    # round trip
    i = 1
    got = attn8._read_slots(caches[attn8.name], torch.tensor(slots(i, range(seqs[i][0]))))
    x = lat[i][: seqs[i][0]]
    step = x.abs().amax(-1, keepdim=True) / 127
    assert ((got - x).abs() <= step / 2 + 1e-6).all()
    new_latent = torch.cat([lat[i][past:] for i, (past, _) in enumerate(seqs)])
    g = torch.Generator().manual_seed(5)
    q_nope = torch.randn(len(new_latent), H, NOPE, generator=g)
    q_pe = torch.randn(len(new_latent), H, ROPE, generator=g)
    scale = (NOPE + ROPE) ** -0.5
    fp32_cache = caches[attn.name].clone()
    out8 = attn8.forward(q_nope, q_pe, new_latent, caches[attn8.name], meta, scale, up)
    out = attn.forward(q_nope, q_pe, new_latent, caches[attn.name], meta, scale, up)
    # a fresh prefill attends to its latents as the int8 cache holds them (what a later chunk reads back): the fp32
    # backend's attention on those rows, to the bit
    read_back = attn8._read_slots(caches[attn8.name], meta.slot_mapping)
    assert torch.equal(attn8._as_cached(new_latent), read_back)
    out_q = attn.forward(q_nope, q_pe, read_back, fp32_cache, meta, scale, up)
    fresh = slice(q_start[3], q_start[3] + seqs[3][1])
    torch.testing.assert_close(out8[fresh], out_q[fresh], atol=0, rtol=0)
    assert not torch.equal(out8[fresh], out[fresh])
    err = (out8 - out).abs().max().item()
    assert 0 < err < 0.02 * out.abs().max().item(), err


class _CacheReads(TorchDispatchMode):
    """Counts the bytes that operators copy out of one storage (the KV cache), and which operators touch it."""

    VIEWS = {"view", "select", "slice", "_unsafe_view", "unbind", "alias", "as_strided", "expand", "unsqueeze"}

    def __init__(self, storage: torch.Tensor) -> None:
        super().__init__()
        self.ptr = storage.untyped_storage().data_ptr()
        self.read_bytes = 0
        self.ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        leaves = tree_leaves((args, kwargs))
        if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.ptr for a in leaves):
            name = func.overloadpacket.__name__
            self.ops.add(name)
            if name not in self.VIEWS and name != "index_copy_":  # a read: what it copies out of the cache
                self.read_bytes += out.nbytes
        return out


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_cache_holds_one_latent_row_and_decode_reads_only_it(tmp_path, kv_cache_dtype):
    """The cache is one plane of cache_width values a token (plus the int8 scale), never decompressed K/V; the
    bytes one decode step copies out of the cache equal the latent rows of its block tables, layer by layer."""
    path = make_deepseek_checkpoint(tmp_path, **VARIANTS["v3"])
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK, kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.executor.runner
    int8 = kv_cache_dtype == "int8"
    row = W + 4 if int8 else W * 4  # bytes of one token's row in one layer
    assert runner.kv_caches[0].shape == (1, runner.kv_info.num_blocks, BLOCK, 1, W + 4 if int8 else W)
    assert runner.kv_info.bytes_per_token == LAYERS * row
    # Decompressed K and V would be H * (nope + rope + v) values a token: 4x the latent row here, 7x in DeepSeek-V3.
    assert H * (NOPE + ROPE + V) > 3 * W
    g = torch.Generator().manual_seed(3)
    contexts = [5, 9, 14]  # tokens each sequence holds, the new one included
    entries, first = [], 0
    for n in contexts:
        blocks = list(range(first, first + -(-n // BLOCK)))
        first += len(blocks)
        entries.append((torch.randint(0, 200, (n,), generator=g).tolist(), n - 1, 1, blocks))
    with torch.inference_mode():
        input_ids, positions, meta, _ = runner._prepare(entries)
        counter = _CacheReads(runner._kv_storage)
        with counter:
            runner._forward(input_ids, positions, meta)
    table_entries = meta.decode_block_tables.numel()  # padded to the longest table: 3 x 4
    assert counter.read_bytes == LAYERS * table_entries * BLOCK * row
    assert counter.ops - _CacheReads.VIEWS == {"index_copy_", "index_select"}  # the latent write and the gather


INT8_LOGPROB_TOL = 0.15  # measured on this model: at most 0.05 (picks) and 0.085 (scored tokens)


def test_int8_latent_cache_a_prompts_tokens_do_not_depend_on_the_chunk_size_or_a_prefix_hit(tmp_path):
    """A whole prefill attends to its latents as the int8 cache holds them, as its later chunks and a prefix-cache hit
    read them back: the log-probs of the first tokens agree across the three (fp32, to rounding). Before, a whole
    prefill attended to its unquantized latents (as the int8 K / V cache did until a QA pass found it there)."""
    from parity_utils import assert_int8_cache_reads_agree

    path = make_deepseek_checkpoint(tmp_path, **{**VARIANTS["v3"], "first_k_dense_replace": LAYERS})
    prompt = torch.randint(3, 250, (47,), generator=torch.Generator().manual_seed(5)).tolist()
    assert_int8_cache_reads_agree(path, prompt, block_size=BLOCK, max_model_len=MAX_LEN)


def test_int8_latent_cache_tracks_the_fp32_one(tmp_path):
    """A whole model over the int8 latent cache. Dense MLPs: the MoE's routing would turn the cache's small noise
    into jumps (an expert swapped), which says nothing of the cache. Generation (absorbed decode over dequantized
    rows): every pick within INT8_LOGPROB_TOL of HF's best logit. Scoring the fp32 cache's greedy path in chunks of 5
    (each chunk reads the earlier latents back): every logprob within INT8_LOGPROB_TOL of the fp32 cache's, and the
    same top token wherever the fp32 cache's top two are more than twice that apart (where greedy is robust)."""
    path = make_deepseek_checkpoint(tmp_path, **{**VARIANTS["v3"], "first_k_dense_replace": LAYERS})
    hf = hf_model(path)
    prompts = prompts_for(hf.config.vocab_size)
    _, outs8 = run(path, prompts, kv_cache_dtype="int8")
    for p, o in zip(prompts, outs8):
        assert_teacher_forced(hf, p, o, tol=INT8_LOGPROB_TOL)
    _, ref = run(path, prompts)
    scored = {}
    for kv in ("auto", "int8"):
        llm = LLM(
            str(path),
            dtype="float32",
            block_size=BLOCK,
            max_model_len=MAX_LEN,
            kv_cache_dtype=kv,
            max_num_batched_tokens=5,
        )
        params = SamplingParams(max_tokens=1, prompt_logprobs=2)
        scored[kv] = llm.generate([{"prompt_token_ids": p + o} for p, o in zip(prompts, ref)], params, use_tqdm=False)
    robust = 0
    for p, fp, q in zip(prompts, scored["auto"], scored["int8"]):
        for a, b in zip(fp.prompt_logprobs[len(p) :], q.prompt_logprobs[len(p) :]):
            assert abs(a.logprob - b.logprob) <= INT8_LOGPROB_TOL
            if a.top[0][1] - a.top[1][1] > 2 * INT8_LOGPROB_TOL:
                robust += 1
                assert b.top[0][0] == a.top[0][0]
    assert robust >= 10  # the check above ran on enough positions to mean something


def test_mtp_layers_are_skipped_with_one_log_line(tmp_path, caplog):
    """DeepSeek-V3 checkpoints carry num_nextn_predict_layers extra layers (model.layers.{num_hidden_layers}.*):
    the loader skips them and says so once; the logits are those of the model without them."""
    path = make_deepseek_checkpoint(tmp_path, **VARIANTS["v3"])
    hf = hf_model(path)
    tensors = load_file(path / "model.safetensors")
    mtp = {
        k.replace(f"model.layers.{LAYERS - 1}.", f"model.layers.{LAYERS}."): v.clone()
        for k, v in tensors.items()
        if k.startswith(f"model.layers.{LAYERS - 1}.")
    }
    mtp[f"model.layers.{LAYERS}.eh_proj.weight"] = torch.randn(64, 128)
    mtp[f"model.layers.{LAYERS}.enorm.weight"] = torch.ones(64)
    save_file({**tensors, **mtp}, path / "model.safetensors", metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="infertune"):
        llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    skipped = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(skipped) == 1 and skipped[0].startswith(f"skipped {len(mtp)} checkpoint tensors of layers {LAYERS} and")
    prompt = prompts_for(hf.config.vocab_size)[3]
    ours = llm.engine.executor.runner.prompt_logits(prompt, list(range(-(-len(prompt) // BLOCK))))
    with torch.no_grad():
        torch.testing.assert_close(ours, hf(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=0)


# ---- YaRN rotary ------------------------------------------------------------------------------------------------

YARN_CASES = {
    # DeepSeek-V3's shipped rope: 64 rotary dims, factor 40 over 4096, mscale = mscale_all_dim = 1
    "deepseek-v3": dict(
        head_dim=64,
        rope_theta=10000.0,
        max_position_embeddings=163840,
        rope=dict(
            factor=40.0,
            original_max_position_embeddings=4096,
            beta_fast=32,
            beta_slow=1,
            mscale=1.0,
            mscale_all_dim=1.0,
        ),
    ),
    # DeepSeek-V2-Lite's: mscale = mscale_all_dim = 0.707
    "deepseek-v2-lite": dict(
        head_dim=64,
        rope_theta=10000.0,
        max_position_embeddings=163840,
        rope=dict(factor=40.0, original_max_position_embeddings=4096, mscale=0.707, mscale_all_dim=0.707),
    ),
    # Qwen3's long-context recipe: factor 4 over 32768, attention factor from factor alone
    "qwen3-long": dict(
        head_dim=128,
        rope_theta=1000000.0,
        max_position_embeddings=131072,
        rope=dict(factor=4.0, original_max_position_embeddings=32768),
    ),
    "given-attention-factor-no-truncate": dict(
        head_dim=32,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        rope=dict(
            factor=8.0,
            original_max_position_embeddings=1024,
            attention_factor=1.3,
            truncate=False,
            beta_fast=16,
            beta_slow=2,
        ),
    ),
}


@pytest.mark.parametrize("case", list(YARN_CASES))
def test_yarn_matches_hf_rope_init(case):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    c = YARN_CASES[case]
    rope = {"rope_type": "yarn", "rope_theta": c["rope_theta"], **c["rope"]}
    hf_cfg = LlamaConfig(
        hidden_size=c["head_dim"] * 4,
        num_attention_heads=4,
        head_dim=c["head_dim"],
        max_position_embeddings=c["max_position_embeddings"],
        rope_parameters=dict(rope),
    )
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    arch = ArchConfig.from_dict(
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=32,
            hidden_size=c["head_dim"] * 4,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=4,
            head_dim=c["head_dim"],
            max_position_embeddings=c["max_position_embeddings"],
            rope_parameters=dict(rope),
        )
    )
    ours = rope_inv_freq(c["head_dim"], arch.rope_theta, arch.rope_scaling)
    torch.testing.assert_close(ours, ref_inv_freq.float(), rtol=2e-6, atol=0)
    assert rope_attention_factor(arch.rope_scaling) == pytest.approx(ref_factor, rel=1e-12)


def test_yarn_llama_matches_hf(tmp_path):
    """A Llama-family model with YaRN (as Qwen3 long-context configs have it): HF's logits, past the original
    context, with the scaled cos/sin table."""
    rope = dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=16, rope_theta=10000.0)
    path = make_checkpoint(tmp_path, arch="llama", rope_parameters=rope)
    hf = hf_model(path)
    assert hf.model.rotary_emb.attention_scaling != 1.0
    prompt = prompts_for(hf.config.vocab_size)[3]  # 37 tokens, over twice the original 16
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    ours = llm.engine.executor.runner.prompt_logits(prompt, list(range(-(-len(prompt) // BLOCK))))
    with torch.no_grad():
        torch.testing.assert_close(ours, hf(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=0)


def test_cli_generate_runs_a_deepseek_checkpoint(tmp_path, capsys):
    """`infertune generate --model DIR` on a DeepSeek-V3 checkpoint prints the engine's greedy completion."""
    from infertune.cli import main

    path = make_deepseek_checkpoint(tmp_path, **VARIANTS["v3"])
    args = ["--max-tokens", "6", "--dtype", "float32", "--ignore-eos", "--max-model-len", str(MAX_LEN)]
    assert main(["generate", "The latent cache", "--model", str(path), *args]) == 0
    out, err = capsys.readouterr()
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate("The latent cache", params, use_tqdm=False)[0].outputs[0].text
    assert out == expected + "\n"
    assert "output 6 tok (length)" in err


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_fused_step_runs_latent_attention(variant, kv):
    """The fused C decode step takes DeepSeek's layers (MLA: the projections, the latent's norm, de-interleaved
    rotary, the row written to the cache, the absorbed query, attention over the latent rows, W_UV, o_proj; the fp32
    router with every routing rule of VARIANTS; the shared experts; the dense first layer) as exactly as the
    per-module path, both against HF transformers in fp32 (test_sliding_window._fused_against_per_module: every
    decode step fused), with a bf16 and an int8 latent cache; a batch (a task per row), one sequence alone (its
    keys split over the threads, the shares merged) and two (the one- and two-row paths of W_UK and W_UV)."""
    from test_sliding_window import _fused_against_per_module

    _, path, hf = variant
    prompts = prompts_for(hf.config.vocab_size)
    # (one of 30 tokens and NEW_TOKENS more: the keys of two shares; two: W_UV's two-row path)
    for batch in (prompts, [prompts[-1][:30]], prompts[1:3]):
        _fused_against_per_module(path, hf.float(), batch, 1, kv_cache_dtype=kv)


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_the_fused_step_reads_each_latent_row_once(tmp_path, kv):
    """bf16, the fused C step: the cache bytes its latent attention reads in one decode step (counted by the kernels
    as they read them, `infertune profile`'s KV-read line) are the sequences' latent rows, each once: 1.00x the
    rows their tokens hold (the per-module gather reads the padded tables' whole blocks), at batch 1 (a row's keys
    split over the threads) and at batch 3."""
    from test_kernels import needs_fused

    from infertune.profile.kv_bytes import measure_decode_kv_reads

    if needs_fused.args[0]:
        pytest.skip(needs_fused.kwargs["reason"])
    path = make_deepseek_checkpoint(tmp_path, **VARIANTS["v3"])
    llm = LLM(str(path), dtype="bfloat16", max_model_len=MAX_LEN, block_size=BLOCK, kv_cache_dtype=kv)
    assert llm.engine.executor.runner.fused is not None
    row = W + 4 if kv == "int8" else 2 * W  # one token's row in one layer
    g = torch.Generator().manual_seed(5)
    for batch, input_len in ((1, 21), (3, 10)):
        prompts = [torch.randint(0, 200, (input_len,), generator=g).tolist() for _ in range(batch)]
        got = measure_decode_kv_reads(llm, input_len, batch, prompts)
        assert got.read_bytes == batch * (input_len + 1) * LAYERS * row == got.context_bytes, got


def test_the_decompressed_cache_holds_each_heads_k_and_v(variant):
    """mla_cache="decompressed" (the seeds' starting point, which `infertune ledger` measures the latent cache
    against): the cache keeps H (nope + rope + v) values a token and layer, not the latent row; it gives HF's greedy
    tokens (teacher-forced) and the latent cache's in every engine mode (prefix caching, 5-token chunks reading
    earlier K / V back, one sequence at a time, preemption), nothing leaked; it runs the per-module path (the fused
    step reads latent rows only); INT8 is refused."""
    from parity_utils import assert_mode_matches

    name, path, hf = variant
    if name == "v2-group":
        pytest.skip("the same attention as v3")
    prompts = prompts_for(hf.config.vocab_size)
    _, reference = run(path, prompts, enable_prefix_caching=False)
    row = LAYERS * 4 * hf.config.num_attention_heads * (NOPE + ROPE + V)  # fp32, every layer
    assert row > 3 * kv_bytes_per_token(path)
    llm, outs = run(path, prompts, enable_prefix_caching=False, mla_cache="decompressed")
    runner = llm.engine.executor.runner
    assert isinstance(runner.attn, DecompressedMlaAttention) and runner.kv_info.bytes_per_token == row
    assert_mode_matches(llm, "default", hf, prompts, outs, reference)
    for mode, opts in engine_modes(row).items():
        llm, outs = run(path, prompts, mla_cache="decompressed", **opts)
        assert_mode_matches(llm, mode, hf, prompts, outs, reference)
    bf16 = LLM(str(path), dtype="bfloat16", max_model_len=MAX_LEN, block_size=BLOCK, mla_cache="decompressed")
    assert bf16.engine.executor.runner.fused is None
    with pytest.raises(ValueError, match="drop kv_cache_dtype"):
        LLM(str(path), dtype="float32", max_model_len=MAX_LEN, mla_cache="decompressed", kv_cache_dtype="int8")


# ---- config.json and checkpoint layouts -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, key, value, supported",
    [
        ("v3", "scoring_func", "tanh", "('softmax', 'sigmoid')"),
        ("v2-lite", "scoring_func", "tanh", "('softmax', 'sigmoid')"),
        ("v3", "topk_method", "bogus", "('greedy', 'group_limited_greedy', 'noaux_tc')"),
        ("v2-lite", "topk_method", "bogus", "('greedy', 'group_limited_greedy', 'noaux_tc')"),
    ],
)
def test_an_unknown_routing_rule_is_refused_naming_the_supported_ones(tmp_path, name, key, value, supported):
    """A scoring_func or topk_method infertune does not implement is a ValueError that names config.json, the key,
    the value and every value it implements, raised when the engine's config is built (before any weight loads);
    the same checkpoint with the key as saved loads."""
    import json
    import re

    from infertune.config import EngineConfig

    path = make_deepseek_checkpoint(tmp_path, **VARIANTS[name])
    EngineConfig.create(str(path), dtype="float32", max_model_len=MAX_LEN)  # as saved: accepted
    cfg_file = path / "config.json"
    cfg_file.write_text(json.dumps({**json.loads(cfg_file.read_text()), key: value}))
    expected = f"{cfg_file}: {key} '{value}' is not supported; infertune implements {supported}"
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        EngineConfig.create(str(path), dtype="float32", max_model_len=MAX_LEN)
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$"):
        LLM(str(path), dtype="float32", max_model_len=MAX_LEN)


@pytest.mark.parametrize("name", ["v3", "v2-lite"])
def test_fused_and_sharded_expert_layouts_give_identical_logits(name, tmp_path):
    """transformers v5's fused 3-D experts (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I], written here
    from the HF model's own state, the V3 router's e_score_correction_bias beside them) and a sharded per-expert
    checkpoint load the very same weights as the per-expert file: identical logits, and HF's."""
    from test_moe_models import copy_without_weights

    per_expert = make_deepseek_checkpoint(tmp_path / "per-expert", **VARIANTS[name])
    assert any(".mlp.experts.0.gate_proj.weight" in k for k in load_file(per_expert / "model.safetensors"))
    hf = hf_model(per_expert)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    moe_layers = range(1, LAYERS)  # first_k_dense_replace=1
    e, inter, hidden = hf.config.n_routed_experts, hf.config.moe_intermediate_size, hf.config.hidden_size
    for i in moe_layers:  # HF keeps them fused in memory
        assert state[f"model.layers.{i}.mlp.experts.gate_up_proj"].shape == (e, 2 * inter, hidden)
        assert state[f"model.layers.{i}.mlp.experts.down_proj"].shape == (e, hidden, inter)
    assert not any(".experts.0." in k for k in state)
    fused = copy_without_weights(per_expert, tmp_path / "fused")
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    sharded = copy_without_weights(per_expert, tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="60KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    prompt = prompts_for(hf.config.vocab_size)[-1]
    table = list(range(-(-len(prompt) // BLOCK)))
    logits = []
    for path in (per_expert, fused, sharded):
        llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
        logits.append(llm.engine.executor.runner.prompt_logits(prompt, table))
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    with torch.no_grad():
        torch.testing.assert_close(logits[0], hf(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=0)


# ---- the tools on a DeepSeek checkpoint -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def v3_checkpoint(tmp_path_factory):
    """The V3 variant (q_lora_rank, sigmoid + noaux_tc over groups, shared expert, dense first layer, YaRN) and its
    HF model."""
    path = make_deepseek_checkpoint(tmp_path_factory.mktemp("tools-v3"), **VARIANTS["v3"])
    return path, hf_model(path)


def test_serve_answers_a_chat_request_with_hf_greedy_tokens(v3_checkpoint):
    """`serve`'s /v1/chat/completions on a DeepSeek-V3 checkpoint: the chat template's prompt, and HF's greedy
    tokens (a full HF forward per token) as the answer."""
    from test_moe_models import chat_through_server, hf_greedy

    path, hf = v3_checkpoint
    tok = make_tokenizer()
    r, ids = chat_through_server(path, tok, [{"role": "user", "content": "Route me through the latent cache"}], 8)
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == 8
    assert r.choices[0].message.content == tok.decode(hf_greedy(hf, ids, 8), skip_special_tokens=True)


def test_debug_layers_on_a_deepseek_model(v3_checkpoint):
    """debug-layers (fp32 against fp32) over MLA and DeepSeek MoE: every MLA projection, the router, the experts and
    the shared experts are compared, and nothing diverges; a NaN planted in layer 1's experts is found there; layer
    1's router with experts 0 and 1 swapped (weight rows and correction bias: the same group, so the group scores
    do not move) reroutes exactly the tokens HF's router sends to one of the two, and the note counts them."""
    from infertune.profile.debug_layers import debug_layers

    path, hf = v3_checkpoint
    prompt = prompts_for(hf.config.vocab_size)[-1]
    clean = debug_layers(str(path), prompt, dtype="float32")
    names = set(m.module for m in clean.modules)
    for layer in (1, 2):
        assert {f"model.layers.{layer}.mlp.{m}" for m in ("gate", "experts", "shared_experts")} <= names
    attn = ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj")
    assert {f"model.layers.0.self_attn.{m}" for m in attn} <= names and "model.layers.0.mlp.experts" not in names
    assert clean.first_divergent is None and clean.first_nonfinite is None and clean.notes == []
    assert clean.verdict().startswith("no divergence")

    def nan_in_experts(model) -> None:  # every expert of layer 1: whichever a token picks goes NaN
        with torch.no_grad():
            model.model.layers[1].mlp.experts.gate_up_proj[:, 0, 0] = float("nan")

    broken = debug_layers(str(path), prompt, dtype="float32", perturb=nan_in_experts)
    assert broken.first_nonfinite["module"] == "model.layers.1.mlp.experts"
    assert broken.verdict().startswith("FIRST NON-FINITE MODULE: model.layers.1.mlp.experts")

    def swap_experts(model) -> None:
        gate = model.model.layers[1].mlp.gate
        with torch.no_grad():
            gate.weight[[0, 1]] = gate.weight[[1, 0]].clone()
            gate.e_score_correction_bias[[0, 1]] = gate.e_score_correction_bias[[1, 0]].clone()

    rerouted = debug_layers(str(path), prompt, dtype="float32", perturb=swap_experts)
    assert_rerouted_note(hf, rerouted, prompt)
