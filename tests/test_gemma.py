"""Gemma 2 and Gemma 3 (text) against HF transformers (eager, fp32) on tiny random checkpoints with short windows:
prompt logits, each Gemma knob shown to matter to HF's logits and matched, teacher-forced greedy decodes five
windows past the prompt, in every engine mode that must not change them, and the INT8 KV cache within its bound."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_model, make_tokenizer
from parity_utils import assert_mode_matches, assert_teacher_forced

from infertune import LLM, SamplingParams
from infertune.config import ArchConfig

WINDOW = 6
BLOCK = 4
MAX_LEN = 64
NEW_TOKENS = 30
HEAD_DIM = 16

VARIANTS = {
    # 4 layers alternating sliding / full; a softmax scale that is not head_dim's; both soft-caps tight enough to bite
    "gemma2": dict(
        cls="Gemma2",
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    ),
    # 2 of 4 layers sliding, with their own rope base; the full layers' rope linearly scaled; q / k norms; an
    # attn_logit_softcapping that Gemma 3 ignores (transformers' attention never passes it)
    "gemma3": dict(
        cls="Gemma3Text",
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        rope_local_base_freq=100.0,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "linear", "factor": 4.0},
        attn_logit_softcapping=2.0,
    ),
}


def make_gemma(path, cls: str, **overrides):
    """A tiny random Gemma (tied embeddings, as Gemma's are) with every weight from N(0, 0.2), norms included (their
    scale is 1 + w)."""
    import transformers

    tok = make_tokenizer()
    cfg = getattr(transformers, f"{cls}Config")(
        **{
            "vocab_size": len(tok),
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": HEAD_DIM,
            "max_position_embeddings": 256,
            "eos_token_id": tok.eos_token_id,
            "bos_token_id": tok.eos_token_id,
            "pad_token_id": tok.eos_token_id,
            **overrides,
        }
    )
    torch.manual_seed(0)
    model = getattr(transformers, f"{cls.removesuffix('Text')}ForCausalLM")(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 13, 24, 34)]


def _generate(path, prompts, **engine):
    engine = {"max_model_len": MAX_LEN, **engine}
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, **engine)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module", params=list(VARIANTS))
def gemma(request, tmp_path_factory):
    path = make_gemma(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    hf = hf_model(path)
    prompts = _prompts(hf.config.vocab_size)
    _, reference = _generate(path, prompts, enable_prefix_caching=False)
    return request.param, path, hf, prompts, reference


def _hf_logits(hf, prompt) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([prompt]), use_cache=False).logits[0]


def _without_each_feature(name: str, hf):
    """Undo each Gemma feature in HF's model in turn, yielding its name while it is undone."""
    cfg, attns = hf.config, [layer.self_attn for layer in hf.model.layers]
    edits = {  # feature -> (object, attribute, value without it)
        "query_pre_attn_scalar": [(a, "scaling", HEAD_DIM**-0.5) for a in attns],
        "sliding window": [(cfg, "layer_types", ["full_attention"] * cfg.num_hidden_layers)],
    }
    if name == "gemma2":
        edits["attn_logit_softcapping"] = [(a, "attn_logit_softcapping", None) for a in attns]
        edits["final_logit_softcapping"] = [(cfg, "final_logit_softcapping", None)]
    else:
        rotary = hf.model.rotary_emb
        edits["local rope base"] = [(rotary, "sliding_attention_inv_freq", rotary.full_attention_inv_freq)]
    for feature, changes in edits.items():
        kept = [getattr(obj, attr) for obj, attr, _ in changes]
        for obj, attr, value in changes:
            setattr(obj, attr, value)
        try:
            yield feature
        finally:
            for (obj, attr, _), value in zip(changes, kept):
                setattr(obj, attr, value)


def test_prompt_logits_match_hf_and_every_knob_matters(gemma):
    name, path, hf, prompts, _ = gemma
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    assert llm.config.model.arch.layer_windows == (WINDOW, None, WINDOW, None)
    runner = llm.engine.executor.runner
    for prompt in prompts:
        ours = runner.prompt_logits(prompt, list(range(-(-len(prompt) // BLOCK))))
        torch.testing.assert_close(ours, _hf_logits(hf, prompt), atol=1e-4, rtol=0)
    # The oracle is sensitive to each feature: undoing any one moves HF's logits well past the tolerance.
    prompt = prompts[-1]
    ref = _hf_logits(hf, prompt)
    for feature in _without_each_feature(name, hf):
        assert (_hf_logits(hf, prompt) - ref).abs().max() > 0.05, feature
    torch.testing.assert_close(_hf_logits(hf, prompt), ref, atol=0, rtol=0)  # every feature restored


def test_greedy_batch_decodes_past_the_window_like_hf(gemma):
    _, path, hf, prompts, reference = gemma
    for p, o in zip(prompts, reference):
        assert len(o) == NEW_TOKENS
        assert_teacher_forced(hf, p, o)


# fp32 KV per token: 4 layers x (K and V) x 2 KV heads x 16 x 4 bytes
KV_BYTES_PER_TOKEN = 4 * 2 * 2 * HEAD_DIM * 4
# Engine settings that must give the reference run's tokens; each runs with the prefix cache on (the engine's
# default), the reference without.
MODES = {
    "tiny-chunked-prefill": dict(max_num_batched_tokens=5),
    "one-seq-at-a-time": dict(max_num_seqs=1),
    "preemption": dict(kv_cache_memory_bytes=KV_BYTES_PER_TOKEN * 24 * BLOCK),  # the batch needs 50 blocks
}


@pytest.mark.parametrize("mode", list(MODES))
def test_engine_modes_match_hf(gemma, mode):
    name, path, hf, prompts, reference = gemma
    if mode == "one-seq-at-a-time" and name != "gemma3":
        pytest.skip("batch 1 runs on the Gemma 3 model only (the slowest mode; the batching is the family's same)")
    llm, outs = _generate(path, prompts, **MODES[mode])
    assert_mode_matches(llm, mode, hf, prompts, outs, reference)


def test_prefix_cache_hit_past_the_window(gemma):
    _, path, hf, _, _ = gemma
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, hf.config.vocab_size, (3 * BLOCK + 1,), generator=g).tolist()
    prompts = [shared + torch.randint(0, hf.config.vocab_size, (k,), generator=g).tolist() for k in (1, 7)]
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = llm.generate({"prompt_token_ids": prompts[0]}, params, use_tqdm=False)[0]
    second = llm.generate({"prompt_token_ids": prompts[1]}, params, use_tqdm=False)[0]
    assert second.metrics.num_cached_tokens == 3 * BLOCK
    for p, out in zip(prompts, (first, second)):
        assert_teacher_forced(hf, p, out.outputs[0].token_ids)


def test_local_layers_hold_only_their_window(gemma):
    """Two KV cache groups (full: layers 1, 3; sliding: 0, 2): decoding a 34-token prompt 28 tokens on, the full
    group holds every block and the sliding one the ceil((6 - 1) / 4) + 1 = 3 its window can touch; HF's tokens."""
    _, path, hf, prompts, reference = gemma
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    engine, bm = llm.engine, llm.engine.block_manager
    assert [g.layers for g in engine.executor.kv_cache_info.groups] == [(1, 3), (0, 2)]
    params = SamplingParams(temperature=0, max_tokens=28, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": prompts[-1]}, params)
    held, tokens = [], None
    while engine.has_unfinished_requests():
        held += [(len(s), bm.blocks_in_use(s)) for s in engine.scheduler.running]
        tokens = next((o.outputs[0].token_ids for o in engine.step() if o.finished), tokens)
    assert all(full == -(-(n - 1) // BLOCK) for n, (full, _) in held)
    assert max(w for n, (_, w) in held if n > len(prompts[-1]) + 1) == 3
    assert list(tokens) == reference[-1][:28] and bm.num_free_blocks == bm.num_blocks


def test_int8_kv_cache_tracks_hf(gemma):
    """Within tests/test_kv_int8.py's bound: every pick at most 0.5 below HF's best logit, nearly all exactly it."""
    _, path, hf, prompts, _ = gemma
    _, outs = _generate(path, prompts, kv_cache_dtype="int8", max_num_batched_tokens=8)
    gaps = []
    for p, o in zip(prompts, outs):
        logits = _hf_logits(hf, p + o)[len(p) - 1 : -1]
        gaps.append(logits.max(dim=1).values - logits.gather(1, torch.tensor(o).unsqueeze(1)).squeeze(1))
    gaps = torch.cat(gaps)
    assert (gaps <= 0.5).all(), gaps.max()
    assert (gaps == 0).float().mean() >= 0.9


def test_hub_style_gemma3_config_reads_as_transformers_does():
    """An older Gemma 3 config.json (rope_theta, rope_local_base_freq, rope_scaling, sliding_window_pattern; no
    layer_types or rope_parameters): each layer's window and rope as transformers' Gemma3TextConfig makes them."""
    from transformers import Gemma3TextConfig

    old = dict(
        architectures=["Gemma3ForCausalLM"],
        model_type="gemma3_text",
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=16,
        rope_theta=1_000_000.0,
        rope_local_base_freq=10_000.0,
        rope_scaling={"rope_type": "linear", "factor": 8.0},
        sliding_window=512,
        sliding_window_pattern=4,
        query_pre_attn_scalar=16,
    )
    arch = ArchConfig.from_dict(old)
    hf = Gemma3TextConfig(**{k: v for k, v in old.items() if k not in ("architectures", "model_type")})
    assert arch.layer_windows == tuple(512 if t == "sliding_attention" else None for t in hf.layer_types)
    full, local = hf.rope_parameters["full_attention"], hf.rope_parameters["sliding_attention"]
    assert (arch.rope_theta, arch.rope_scaling["rope_type"], arch.rope_scaling["factor"]) == (
        full["rope_theta"],
        full["rope_type"],
        full["factor"],
    )
    assert (arch.local_rope_theta, arch.local_rope_scaling) == (local["rope_theta"], None)
    assert local["rope_type"] == "default"
    assert arch.tie_word_embeddings and arch.hidden_act == "gelu_pytorch_tanh" and arch.qk_norm
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (None, None)


def test_gemma2_defaults_are_transformers():
    """Keys left out of a Gemma 2 config take transformers' defaults: both soft-caps, the window, tied embeddings."""
    from transformers import Gemma2Config

    minimal = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4)
    arch = ArchConfig.from_dict({"architectures": ["Gemma2ForCausalLM"], **minimal})
    hf = Gemma2Config(**minimal)
    assert (arch.attn_logit_softcapping, arch.final_logit_softcapping) == (
        hf.attn_logit_softcapping,
        hf.final_logit_softcapping,
    )
    assert arch.layer_windows == tuple(hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types)
    assert arch.query_pre_attn_scalar == hf.query_pre_attn_scalar
    assert arch.tie_word_embeddings == hf.tie_word_embeddings


@pytest.mark.parametrize("name", list(VARIANTS))
def test_plan_counts_gemma_weights_as_transformers(name):
    """infertune plan's parameter count (four norms a layer, tied embeddings) against the transformers model itself."""
    import transformers

    from infertune.plan import ModelSpec, weight_breakdown

    kw = {k: v for k, v in VARIANTS[name].items() if k != "cls"}
    cls = VARIANTS[name]["cls"]
    cfg = getattr(transformers, f"{cls}Config")(
        vocab_size=1000, hidden_size=64, intermediate_size=176, num_hidden_layers=4, head_dim=HEAD_DIM, **kw
    )
    with torch.device("meta"):
        model = getattr(transformers, f"{cls.removesuffix('Text')}ForCausalLM")(cfg)
    named = dict(model.named_parameters())  # the tied lm_head once
    d = {**cfg.to_dict(), "architectures": [type(model).__name__]}
    w = weight_breakdown(ModelSpec.from_dict(d, name))
    assert w.total_params == sum(p.numel() for p in named.values())
    assert w.params_norms == sum(p.numel() for n, p in named.items() if "norm" in n)


def test_norm_and_embedding_round_as_transformers_in_bf16():
    """Bit for bit in bf16, where the rounding order shows: (1 + w) applied in fp32 before the one rounding (Llama's
    norm rounds first), and sqrt(hidden) rounded to bf16 (55.5 at hidden 3072) before it scales the embeddings."""
    from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm, Gemma2TextScaledWordEmbedding

    from infertune.layers.norm import GemmaRMSNorm, RMSNorm
    from infertune.models.gemma import ScaledEmbedding

    torch.manual_seed(0)
    hidden = 3072
    x = (torch.randn(8, hidden) * 3).bfloat16()
    w = (torch.randn(hidden) * 0.5).bfloat16()
    ours, theirs = GemmaRMSNorm(hidden, 1e-6, torch.bfloat16), Gemma2RMSNorm(hidden, eps=1e-6).bfloat16()
    llama = RMSNorm(hidden, 1e-6, torch.bfloat16)
    with torch.no_grad():
        ours.weight.copy_(w), theirs.weight.copy_(w), llama.weight.copy_(1 + w)
        assert torch.equal(ours(x), theirs(x))
        assert not torch.equal(llama(x), theirs(x))  # the same scale, Llama's rounding: not the same bits
        emb = ScaledEmbedding(10, hidden, torch.bfloat16)
        hf_emb = Gemma2TextScaledWordEmbedding(10, hidden, 0, embed_scale=hidden**0.5).bfloat16()
        table = torch.randn(10, hidden).bfloat16()
        emb.weight.copy_(table), hf_emb.weight.copy_(table)
        ids = torch.arange(10)
        assert emb.scale == 55.5
        assert torch.equal(emb(ids), hf_emb(ids))


def test_smoothquant_is_refused_for_gemma(gemma, tmp_path):
    """SmoothQuant divides norm weights by its factors, which (1 + w) norms do not take: a clear error, no output."""
    from infertune.tools.quantizer import quantize

    _, path, _, _, _ = gemma
    with pytest.raises(ValueError, match="--smoothquant"):
        quantize(str(path), "w8a8", str(tmp_path / "out"), smoothquant=0.5, show_progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(hidden_activation="gelu"), "hidden_activation"),
        (dict(use_bidirectional_attention=True), "bidirectional"),
    ],
)
def test_what_gemma_does_not_run_is_named(change, match):
    cfg = dict(architectures=["Gemma3ForCausalLM"], vocab_size=300, hidden_size=64, intermediate_size=128)
    cfg.update(num_hidden_layers=2, num_attention_heads=4, **change)
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_dict(cfg)


@pytest.mark.parametrize("kv,quant", [("auto", None), ("int8", None), ("auto", "w8a16")])
def test_fused_step_runs_gemma(gemma, kv, quant):
    """The fused C decode step takes Gemma (the (1 + w) norms in fp32, four a layer; GeLU-tanh; the scaled embeddings;
    Gemma 3's q / k norms and its sliding layers' own rotary table; Gemma 2's soft-capped scores) as exactly as the
    per-module path, both against HF transformers in fp32 (test_sliding_window._fused_against_per_module: every
    decode step fused, and the prompts' step where the kernels take prompts). A step without the soft-cap, with SiLU,
    without the embedding scale, without the MLP's output norm, or with one rotary table for every layer is far off
    (each checked by breaking it)."""
    from test_sliding_window import _fused_against_per_module

    _, path, hf, prompts, _ = gemma
    _fused_against_per_module(path, hf.float(), prompts, 2, kv_cache_dtype=kv, quantization=quant)


def test_gemma3_cut_into_equal_kv_groups_matches_hf_and_counts_its_blocks(tmp_path):
    """Gemma 3 with 7 sliding to 3 full layers: the engine cuts the kinds into KV cache groups of 3 layers (1 full, 3
    windowed, the last of one layer: 2 of its 3 pages a block empty). Teacher-forced greedy decodes past the window
    against HF transformers (fp32, with preemption in a pool too small for the batch); the fused step (bf16) as close
    to HF as the per-module path; /metrics' blocks and tokens by kind are the coordinator's own counts, each kind
    named once. (Reading a group's metadata by window here gives every windowed group the first one's tables.)"""
    from types import SimpleNamespace

    from test_sliding_window import _fused_against_per_module

    from infertune.serve.metrics import _EngineCollector

    kinds = (["sliding_attention"] * 2 + ["full_attention"]) * 3 + ["sliding_attention"]
    path = make_gemma(tmp_path / "g", **{**VARIANTS["gemma3"], "num_hidden_layers": 10, "layer_types": kinds})
    hf = hf_model(path)
    prompts = _prompts(hf.config.vocab_size)
    llm, outs = _generate(path, prompts, enable_prefix_caching=False)
    groups = llm.engine.executor.runner.kv_groups
    assert [(g.window, g.layers) for g in groups] == [
        (None, (2, 5, 8)),
        (WINDOW, (0, 1, 3)),
        (WINDOW, (4, 6, 7)),
        (WINDOW, (9,)),
    ]
    for p, o in zip(prompts, outs):
        assert_teacher_forced(hf, p, list(o))
    # preempted: 40 blocks (a sequence of 64 tokens holds 16 + 3 x 4 with chunks of 8; the batch ~90)
    block_bytes = llm.engine.executor.kv_cache_info.bytes_per_token * BLOCK
    small, preempted = _generate(path, prompts, kv_cache_memory_bytes=40 * block_bytes, max_num_batched_tokens=8)
    assert small.engine.executor.kv_cache_info.max_blocks_per_seq == 16 + 3 * 4
    assert small.engine.scheduler.num_preemptions > 0 and preempted == outs
    _fused_against_per_module(path, hf.float(), prompts, 4)

    # /metrics mid-generation: a sequence past its window holds the window's blocks in each windowed group
    engine = llm.engine
    engine.add_request("m", {"prompt_token_ids": prompts[3]}, SamplingParams(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    seq = engine.scheduler.running[0]
    held = engine.block_manager.blocks_in_use(seq)
    stats = engine.stats()
    assert stats["kv_groups"] == [("full", held[0]), (f"window_{WINDOW}", held[1] + held[2] + held[3])]
    assert stats["kv_group_counts"] == [1, 3] and held[1] == held[2] == held[3]
    # (the collector's families from the engine's stats, up to the by-group ones: the rest read the server's engine)
    families = _EngineCollector(SimpleNamespace(stats=stats)).collect()
    by_group = next(m for m in families if m.name == "infertune_kv_tokens_by_group")
    tokens = {s.labels["group"]: s.value for s in by_group.samples}
    assert tokens == {"full": held[0] * BLOCK, f"window_{WINDOW}": held[1] * BLOCK}
    while engine.has_unfinished_requests():
        engine.step()
