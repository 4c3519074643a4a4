"""Phi-3 (Phi3ForCausalLM: Phi-3-mini, Phi-4, Phi-4-mini) against Hugging Face transformers on tiny random checkpoints:
its fused qkv_proj / gate_up_proj tensors loaded into the engine's packed shards, partial rotary (Phi-4-mini's
partial_rotary_factor), LongRoPE up to the original context, its sliding window, tied or untied embeddings; the fused
C decode step where it runs, and the configs the engine refuses, by name."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import hf_model, make_checkpoint
from parity_utils import BLOCK, MAX_LEN, assert_teacher_forced, prompts_for, run

from infertune import LLM
from infertune.config import ArchConfig

HEAD_DIM = 16  # hidden 64 over 4 heads (make_checkpoint)


def _longrope(rotary_dim: int) -> dict:
    pairs = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.5 * i for i in range(pairs)],
        "long_factor": [2.0 + i for i in range(pairs)],
    }


VARIANTS = {
    # Phi-3-mini's shape: untied, every head rotated, GQA
    "phi3": dict(),
    # Phi-4-mini's: tied embeddings, rotary on the first 3/4 of each head
    "phi3-partial-tied": dict(partial_rotary_factor=0.75, tie_word_embeddings=True),
    # LongRoPE (short_factor, its attention factor from max_position_embeddings / original) over half of each head,
    # and a sliding window of 7 keys on every layer (the prompts run past it)
    "phi3-longrope-window": dict(
        partial_rotary_factor=0.5,
        rope_scaling=_longrope(HEAD_DIM // 2),
        original_max_position_embeddings=MAX_LEN,
        sliding_window=7,
    ),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), "phi3", **VARIANTS[request.param])
    return request.param, path, hf_model(path)


def test_config_reads_as_transformers(variant):
    name, path, hf = variant
    arch = ArchConfig.from_model_dir(str(path))
    c = hf.config
    rotary = int(HEAD_DIM * c.rope_parameters["partial_rotary_factor"])
    assert (arch.rotary_dim or arch.head_dim) == rotary
    assert arch.tie_word_embeddings == c.tie_word_embeddings
    assert arch.layer_windows == ((c.sliding_window,) * 2 if c.sliding_window else None)
    assert (arch.rope_scaling or {}).get("rope_type", "default") == c.rope_parameters["rope_type"]


def test_prompt_logits_match_hf(variant):
    name, path, hf = variant
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    runner = llm.engine.executor.runner
    for prompt in prompts_for(hf.config.vocab_size):
        ours = runner.prompt_logits(prompt, list(range(-(-len(prompt) // BLOCK))))
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_greedy_batch_with_prefix_cache_and_tiny_chunks_matches_hf(variant):
    """Mixed prompt lengths batched, prompts in chunks of 5 tokens, then the same prompts again (prefix-cache hits):
    every greedy token is HF's top pick for the same prefix."""
    name, path, hf = variant
    prompts = prompts_for(hf.config.vocab_size)
    llm, outs = run(path, prompts, enable_prefix_caching=True, max_num_batched_tokens=5)
    for p, o in zip(prompts, outs):
        assert_teacher_forced(hf, p, o)
    from parity_utils import NEW_TOKENS

    from infertune import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert sum(o.metrics.num_cached_tokens for o in again) > 0
    assert [o.outputs[0].token_ids for o in again] == outs


@pytest.mark.parametrize("kv,quant", [("auto", None), ("int8", None), ("auto", "w8a16")])
def test_fused_step_runs_phi3(tmp_path, kv, quant):
    """The fused C decode step takes a Phi-3 whose rotary turns whole heads (a Llama decoder once its fused tensors
    are loaded), LongRoPE's table and the sliding window included, with a bf16 or int8 KV cache, bf16 or W8A16
    weights, as close to HF (fp32) as the per-module path in bf16 (test_sliding_window._fused_against_per_module)."""
    from test_sliding_window import MAX_LEN as FUSED_LEN
    from test_sliding_window import _fused_against_per_module, _prompts

    path = make_checkpoint(
        tmp_path,
        "phi3",
        std=0.2,
        rope_scaling=_longrope(HEAD_DIM),
        original_max_position_embeddings=FUSED_LEN,
        sliding_window=6,
    )
    hf = hf_model(path)
    _fused_against_per_module(path, hf, _prompts(hf.config.vocab_size), 1, kv_cache_dtype=kv, quantization=quant)


def test_fused_step_is_bypassed_for_partial_rotary_with_its_reason(tmp_path, caplog):
    """Partial rotary pairs dim i with i + rotary_dim / 2, the fused step's kernel with i + head_dim / 2: the runner
    keeps the per-module path and logs why (the bf16 run still tracks HF)."""
    path = make_checkpoint(tmp_path, "phi3", partial_rotary_factor=0.75)
    with caplog.at_level(logging.INFO):
        llm = LLM(str(path), dtype="bfloat16", max_model_len=MAX_LEN, block_size=BLOCK, decode_kernels="auto")
    assert llm.engine.executor.runner.fused is None
    assert "partial rotary (12 of 16 dims" in caplog.text


def _phi3_dict(**change) -> dict:
    cfg = dict(
        architectures=["Phi3ForCausalLM"],
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=1024,
    )
    cfg.update(change)
    return cfg


def test_hub_style_phi4_mini_config_reads_as_transformers():
    """Phi-4-mini's config.json form (top-level partial_rotary_factor, rope_scaling of type longrope, the original
    context at the top level) and Phi-3's older names for LongRoPE ('su', 'yarn'), read as Phi3Config reads them."""
    from transformers import Phi3Config

    for kind in ("longrope", "su", "yarn"):
        d = _phi3_dict(
            partial_rotary_factor=0.75,
            original_max_position_embeddings=256,
            rope_scaling={"type": kind, "short_factor": [1.0] * 6, "long_factor": [4.0] * 6},
        )
        arch = ArchConfig.from_dict(d)
        hf = Phi3Config(**{k: v for k, v in d.items() if k != "architectures"}).rope_parameters
        assert arch.rope_scaling["rope_type"] == hf["rope_type"] == "longrope"
        assert arch.rotary_dim == int(HEAD_DIM * hf["partial_rotary_factor"]) == 12
        # transformers' attention factor: sqrt(1 + ln(1024 / 256) / ln(256)) = sqrt(1.25)
        assert arch.rope_scaling["attention_factor"] == pytest.approx(1.25**0.5)


@pytest.mark.parametrize(
    "change,match",
    [
        # a long_factor / short_factor list of the wrong length for the rotated pairs
        (
            dict(
                partial_rotary_factor=0.5,
                original_max_position_embeddings=256,
                rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
            ),
            "longrope short_factor has 8 entries; the rotary dims need 4",
        ),
        (dict(rope_scaling={"type": "longrope", "short_factor": [1.0] * 8}), "'longrope' needs short_factor"),
        (dict(hidden_act="gelu"), "hidden_act 'gelu' is not supported"),
    ],
)
def test_what_phi3_does_not_run_is_named(change, match):
    with pytest.raises(ValueError, match=match):
        ArchConfig.from_dict(_phi3_dict(**change))


def test_partial_rotary_is_refused_outside_phi3():
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not supported for LlamaForCausalLM"):
        ArchConfig.from_dict(_phi3_dict(architectures=["LlamaForCausalLM"], partial_rotary_factor=0.5))


def test_longrope_past_its_original_context_is_refused_by_name(tmp_path):
    """transformers switches every position to long_factor once a sequence passes the original context: the engine
    does not implement that switch, so a max_model_len past it is refused, naming longrope and the limit (never run
    with the short factors where transformers would use the long ones)."""
    path = make_checkpoint(
        tmp_path,
        "phi3",
        rope_scaling=_longrope(HEAD_DIM),
        original_max_position_embeddings=32,
        max_position_embeddings=128,
    )
    with pytest.raises(ValueError, match=r"'longrope' is applied only up to .*=32.*set max_model_len=32"):
        LLM(str(path), dtype="float32", max_model_len=64)
    with pytest.raises(ValueError, match="longrope"):  # the default, max_position_embeddings, too
        LLM(str(path), dtype="float32")


def test_fused_checkpoint_tensor_of_another_shape_is_named(tmp_path):
    """A qkv_proj whose rows do not match config.json's heads is refused, naming the tensor and the split."""
    import json

    path = make_checkpoint(tmp_path, "phi3")
    cfg = json.loads((path / "config.json").read_text())
    cfg["num_key_value_heads"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"qkv_proj.weight' has 128 rows; config.json's shape needs 96"):
        LLM(str(path), dtype="float32", max_model_len=MAX_LEN)


def test_longrope_is_refused_outside_phi3():
    d = _phi3_dict(
        architectures=["LlamaForCausalLM"],
        rope_scaling={"type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
    )
    with pytest.raises(ValueError, match="'longrope' is supported for Phi3ForCausalLM only, not LlamaForCausalLM"):
        ArchConfig.from_dict(d)


@pytest.mark.parametrize("tied", [False, True])
def test_plan_counts_phi3_weights_as_transformers(tied):
    """infertune plan's parameter count (fused qkv / gate_up, tied or untied head) against the transformers model."""
    import transformers

    from infertune.plan import ModelSpec, weight_breakdown

    cfg = transformers.Phi3Config(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        pad_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):
        model = transformers.Phi3ForCausalLM(cfg)
    named = dict(model.named_parameters())  # the tied lm_head once
    w = weight_breakdown(ModelSpec.from_dict({**cfg.to_dict(), "architectures": ["Phi3ForCausalLM"]}, "phi3"))
    assert w.total_params == sum(p.numel() for p in named.values())


def test_fp8_block_scaled_phi3_matches_hf_on_its_dequantized_weights(tmp_path):
    """A block-scaled fp8 Phi-3 (Phi-4's fp8 releases): each fused qkv_proj / gate_up_proj is dequantized with its
    own weight_scale_inv (blocks across the q / k / v boundary) before it is split into the packed shards; the logits
    are HF's on the dequantized weights."""
    from test_fp8_checkpoint import hf_logits, infertune_logits, to_fp8

    src = make_checkpoint(tmp_path / "src", "phi3", intermediate_size=80)
    weights = to_fp8(src, tmp_path / "fp8", (32, 32))
    hf = hf_model(src)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(weights[name])
    ours, _ = infertune_logits(tmp_path / "fp8")
    for a, b in zip(ours, hf_logits(hf)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
