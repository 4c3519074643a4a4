"""Parity with Hugging Face transformers on tiny random checkpoints of every supported family and variant.

Two oracles: HF's logits at every prompt position (within 1e-4), and teacher forcing: every token the
engine picks greedily must be one HF ranks top (within 1e-3 in logit) when fed the same prefix.
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_model, make_checkpoint
from parity_utils import (
    BLOCK,
    MAX_LEN,
    assert_mode_matches,
    assert_teacher_forced,
    engine_modes,
    prompts_for,
    run,
    run_one_at_a_time,
)

from infertune import LLM, SamplingParams

VARIANTS = {
    "llama-gqa": dict(arch="llama"),
    "llama-mha": dict(arch="llama", num_key_value_heads=4),
    "llama-tied": dict(arch="llama", tie_word_embeddings=True),
    "llama-head-dim-32": dict(arch="llama", head_dim=32),
    "llama-bias": dict(arch="llama", attention_bias=True),
    "llama-rope-linear": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama3-rope": dict(
        arch="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "qwen2": dict(arch="qwen2"),
    "qwen2-tied-mha": dict(arch="qwen2", tie_word_embeddings=True, num_key_value_heads=4),
    "mistral": dict(arch="mistral", sliding_window=MAX_LEN),
    "llama-sharded": dict(arch="llama", shard_size="40KB"),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    kw = dict(VARIANTS[request.param])
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), **kw)
    return request.param, path, hf_model(path)


def test_prompt_logits_match_hf(variant):
    name, path, hf = variant
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    runner = llm.engine.executor.runner
    for prompt in prompts_for(hf.config.vocab_size):
        table = list(range(-(-len(prompt) // BLOCK)))
        ours = runner.prompt_logits(prompt, table)
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_greedy_batch_matches_hf(variant):
    name, path, hf = variant
    prompts = prompts_for(hf.config.vocab_size)
    _, outs = run(path, prompts)
    for p, o in zip(prompts, outs):
        assert len(o) == 12
        assert_teacher_forced(hf, p, o)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("llama-modes"), "llama")
    hf = hf_model(path)
    prompts = prompts_for(hf.config.vocab_size)
    _, reference = run(path, prompts, enable_prefix_caching=False)
    return path, hf, prompts, reference


# 512 bytes of fp32 KV per token in this model (2 layers x K and V x 2 heads x 16 x 4 bytes)
ENGINE_MODES = engine_modes(512)


@pytest.mark.parametrize("mode", list(ENGINE_MODES))
def test_engine_modes_match_hf(llama, mode):
    path, hf, prompts, reference = llama
    llm, outs = run(path, prompts, **ENGINE_MODES[mode])
    assert_mode_matches(llm, mode, hf, prompts, outs, reference)


def test_batch_of_one_equals_batched(llama):
    path, hf, prompts, reference = llama
    assert run_one_at_a_time(path, prompts) == reference


def test_prefix_cache_hits_keep_outputs_exact(llama):
    path, hf, _, _ = llama
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, hf.config.vocab_size, (3 * BLOCK + 2,), generator=g).tolist()
    prompts = [shared + torch.randint(0, hf.config.vocab_size, (k,), generator=g).tolist() for k in (1, 5, 9)]
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params)[0]
    assert first.metrics.num_cached_tokens == 0
    later = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params)
    for out in later:
        assert out.metrics.num_cached_tokens == 3 * BLOCK  # the shared full blocks
    for p, out in zip(prompts, [first, *later]):
        assert_teacher_forced(hf, p, out.outputs[0].token_ids)
    # Same prompt again: every full block but the one holding the last token is reused.
    again = llm.generate([{"prompt_token_ids": prompts[2]}], params)[0]
    assert again.metrics.num_cached_tokens == (len(prompts[2]) - 1) // BLOCK * BLOCK
    assert again.outputs[0].token_ids == later[1].outputs[0].token_ids


def test_long_prompt_runs_the_mlp_in_blocks_and_matches_hf(tmp_path, monkeypatch):
    """A prompt longer than MLP_CHUNK_ROWS runs the MLP a block of rows at a time; the logits of every position
    still match HF transformers (fp32). A smaller block size keeps the test model and prompt tiny."""
    from infertune.models import llama

    calls = []
    real = llama.LlamaMLP._mlp
    monkeypatch.setattr(llama, "MLP_CHUNK_ROWS", 16)
    monkeypatch.setattr(llama.LlamaMLP, "_mlp", lambda self, x: calls.append(x.shape[0]) or real(self, x))
    path = make_checkpoint(tmp_path, arch="llama")
    hf = hf_model(path)
    prompt = torch.randint(0, hf.config.vocab_size, (41,), generator=torch.Generator().manual_seed(3)).tolist()
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    calls.clear()
    ours = llm.engine.executor.runner.prompt_logits(prompt, list(range(-(-len(prompt) // BLOCK))))
    assert calls[:3] == [16, 16, 9]  # the first layer's blocks
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
