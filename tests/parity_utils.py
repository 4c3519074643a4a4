"""What the parity tests share (test_model_parity.py, test_moe_models.py): the prompts, the teacher-forcing oracle
against HF transformers, one greedy engine run, and the engine modes that must not change a greedy output."""

from __future__ import annotations

import torch

from infertune import LLM, SamplingParams

BLOCK = 4  # small blocks so short prompts span several
MAX_LEN = 96
NEW_TOKENS = 12


def prompts_for(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    # 1 token, shorter than a block, exactly two blocks, several blocks and a partial one
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 3, 2 * BLOCK, 37)]


def assert_teacher_forced(hf, prompt: list[int], output: list[int], tol: float = 1e-3) -> None:
    """Every token the engine picked is one HF ranks top (within tol in logit) when fed the same prefix."""
    assert output, "expected generated tokens"
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        logits = hf(ids).logits[0, len(prompt) - 1 : -1].double()  # [len(output), V]
    picked = logits.gather(1, torch.tensor(output).unsqueeze(1)).squeeze(1)
    gap = logits.max(dim=1).values - picked
    assert (gap <= tol).all(), f"token {int(gap.argmax())} is {float(gap.max()):.2e} below HF's best logit"


def run(path, prompts, **engine):
    """Greedy NEW_TOKENS for each prompt, batched, in fp32 -> (the LLM, the token ids per prompt)."""
    engine = {"max_model_len": MAX_LEN, **engine}
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, **engine)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def run_one_at_a_time(path, prompts) -> list[list[int]]:
    """The same as run(), each prompt alone in its own generate call."""
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    return [llm.generate({"prompt_token_ids": p}, params)[0].outputs[0].token_ids for p in prompts]


def engine_modes(kv_bytes_per_token: int) -> dict[str, dict]:
    """Engine settings that must give the default run's tokens (prefix caching off), for a model whose KV cache
    takes kv_bytes_per_token (fp32, every layer)."""
    return {
        "prefix-cache-on": dict(enable_prefix_caching=True),
        "tiny-chunked-prefill": dict(max_num_batched_tokens=5),
        "one-seq-at-a-time": dict(max_num_seqs=1),
        # 16 blocks of BLOCK tokens, where the batch of prompts_for needs 24 at its peak
        "preemption": dict(kv_cache_memory_bytes=kv_bytes_per_token * 16 * BLOCK, max_model_len=64),
    }


def assert_mode_matches(llm, mode: str, hf, prompts, outs, reference) -> None:
    """A run in one of engine_modes: HF's greedy tokens, the default run's, preempted where asked, no block leaked."""
    for p, o in zip(prompts, outs):
        assert_teacher_forced(hf, p, o)
    assert outs == reference
    if mode == "preemption":
        assert llm.engine.scheduler.num_preemptions > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks  # nothing leaked


def assert_rerouted_note(hf, report, prompt: list[int], layer: int = 1) -> None:
    """debug-layers' note on layer `layer`'s router after a perturbation that swapped experts 0 and 1 there: it names
    as many rerouted tokens as HF's own router picks say moved (tokens that picked exactly one of the two)."""
    picked: list[torch.Tensor] = []
    hook = hf.model.layers[layer].mlp.gate.register_forward_hook(lambda m, a, out: picked.append(out[2]) and None)
    with torch.no_grad():
        hf(torch.tensor([prompt]))
    hook.remove()
    has0, has1 = (picked[0] == 0).any(dim=1), (picked[0] == 1).any(dim=1)
    moved = int((has0 ^ has1).sum())
    assert moved > 0
    gate = f"model.layers.{layer}.mlp.gate"
    assert [n for n in report.notes if n.startswith(gate + ":")] == [
        f"{gate}: {moved} of {len(prompt)} tokens routed to other experts than in the float32 run "
        "(near-ties in the router's scores); those tokens' expert outputs differ by more than rounding"
    ]


def assert_int8_cache_reads_agree(path, prompt: list[int], **engine) -> None:
    """With an int8 KV (or latent) cache: the first tokens' log-probs of `prompt` (fp32) agree, to rounding, whether it
    is prefilled whole, in chunks of 5 tokens (each chunk reading the earlier ones back from the cache) or after a
    prefix-cache hit on its first 40 tokens: a whole prefill attends to its K/V as the cache holds them."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)

    def logprobs(llm, p):
        out = llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0]
        return out.token_ids, torch.tensor([lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids)])

    kw = dict(dtype="float32", kv_cache_dtype="int8") | engine
    whole_tokens, whole = logprobs(LLM(str(path), enable_prefix_caching=False, **kw), prompt)
    chunked_tokens, chunked = logprobs(
        LLM(str(path), max_num_batched_tokens=5, enable_prefix_caching=False, **kw), prompt
    )
    cached = LLM(str(path), enable_prefix_caching=True, **kw)
    logprobs(cached, prompt[:40] + [7, 7, 7])  # (registers the first 40 tokens' blocks)
    hit_tokens, hit = logprobs(cached, prompt)
    assert cached.engine.block_manager.prefix_hits >= 40  # (the second prompt did hit)
    assert whole_tokens == chunked_tokens == hit_tokens
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    torch.testing.assert_close(hit, whole, atol=1e-5, rtol=0)
