"""Sampling: seeded reproducibility, greedy equivalences, exact sampler arithmetic, logprobs, n, stops, lengths."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import hf_model

from infertune import LLM, SamplingParams
from infertune.runner.sampler import Sampler, SampleRequest, apply_penalties, apply_top_k_top_p_min_p

PROMPTS = ["hello world", "The quick brown fox", "a", "Sampling is fun, isn't it?"]
INF = float("-inf")


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", max_model_len=128)


def _ids(outputs) -> list[list[int]]:
    return [list(c.token_ids) for o in outputs for c in o.outputs]


def _all_blocks_free(llm: LLM) -> bool:
    bm = llm.engine.block_manager
    return bm.num_free_blocks == bm.num_blocks and not llm.engine.has_unfinished_requests()


@pytest.fixture(scope="module")
def greedy30(llm) -> list:
    """Greedy, EOS ignored, 30 tokens for every prompt in PROMPTS."""
    return llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))


# ---- seeds --------------------------------------------------------------------------------------------
def test_seeded_sampling_reproducible_across_calls(llm):
    sp = SamplingParams(temperature=1.0, seed=1234, max_tokens=20, ignore_eos=True)
    a = llm.generate("hello world", sp)[0].outputs[0]
    b = llm.generate("hello world", sp)[0].outputs[0]
    assert a.token_ids == b.token_ids
    assert a.text == b.text
    assert len(a.token_ids) == 20


def test_seeded_sampling_independent_of_batch_composition(llm):
    seeded = SamplingParams(temperature=1.0, seed=77, max_tokens=20, ignore_eos=True)
    alone = llm.generate("The quick brown fox", seeded)[0].outputs[0].token_ids
    others = [
        SamplingParams(temperature=1.0, max_tokens=25, ignore_eos=True),  # unseeded: uses the engine generator
        seeded,
        SamplingParams(temperature=0.7, seed=5, max_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
    ]
    mixed = llm.generate(["Sampling is fun, isn't it?", "The quick brown fox", "a", "hello world"], others)
    assert mixed[1].outputs[0].token_ids == alone
    # The same seeded prompt twice in one batch: both streams equal the solo run.
    twice = llm.generate(
        ["The quick brown fox", "xyz", "The quick brown fox"],
        [seeded, SamplingParams(temperature=1.0, max_tokens=5), seeded],
    )
    assert twice[0].outputs[0].token_ids == alone
    assert twice[2].outputs[0].token_ids == alone
    assert _all_blocks_free(llm)


def test_seeded_request_joining_a_running_batch(llm):
    """A seeded request added while others are mid-decode samples the same tokens as when it runs alone."""
    seeded = SamplingParams(temperature=1.0, seed=4242, max_tokens=15, ignore_eos=True)
    alone = llm.generate("hello world", seeded)[0].outputs[0].token_ids
    eng = llm.engine
    eng.add_request("bg-0", "a much longer background prompt " * 2, SamplingParams(temperature=1.0, max_tokens=30))
    eng.add_request("bg-1", "another one", SamplingParams(temperature=0.5, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        eng.step()
    eng.add_request("late", "hello world", seeded)
    final = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            if out.finished:
                final[out.request_id] = out
    assert final["late"].outputs[0].token_ids == alone
    assert _all_blocks_free(llm)


def test_different_seeds_give_different_outputs(llm):
    outs = [
        llm.generate("hello world", SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True))[0]
        .outputs[0]
        .token_ids
        for s in (1, 2, 3)
    ]
    assert outs[0] != outs[1] and outs[1] != outs[2] and outs[0] != outs[2]


def test_unseeded_runs_differ_across_calls(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    a = llm.generate("hello world", sp)[0].outputs[0].token_ids
    b = llm.generate("hello world", sp)[0].outputs[0].token_ids
    assert a != b  # the engine's generator advanced
    # Two identical unseeded prompts in one batch draw independently as well.
    c, d = _ids(llm.generate(["hello world", "hello world"], sp))
    assert c != d


def test_unseeded_runs_reproducible_from_engine_seed(tiny_llama):
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    runs = []
    for seed in (11, 11, 12):
        eng = LLM(str(tiny_llama), dtype="float32", max_model_len=128, seed=seed)
        runs.append(_ids(eng.generate(["hello world", "The quick brown fox"], sp)))
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


# ---- greedy equivalences --------------------------------------------------------------------------------
@pytest.mark.parametrize("temperature", [1.0, 0.7, 2.5])
def test_top_k_1_equals_greedy(llm, greedy30, temperature):
    sp = SamplingParams(temperature=temperature, top_k=1, max_tokens=30, ignore_eos=True)
    assert _ids(llm.generate(PROMPTS, sp)) == _ids(greedy30)


def test_top_k_1_equals_greedy_in_a_mixed_batch(llm, greedy30):
    """top_k=1 rows stay greedy when sampled rows share the step (the non-all-greedy sampler path)."""
    params = [
        SamplingParams(temperature=1.3, top_k=1, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, max_tokens=30, ignore_eos=True),
    ]
    out = llm.generate(PROMPTS, params)
    greedy = _ids(greedy30)
    assert out[0].outputs[0].token_ids == greedy[0]
    assert out[2].outputs[0].token_ids == greedy[2]


def test_greedy_is_deterministic(llm, greedy30):
    again = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert _ids(again) == _ids(greedy30)
    assert [o.outputs[0].text for o in again] == [o.outputs[0].text for o in greedy30]


# ---- sampler unit tests: exact arithmetic ----------------------------------------------------------------
# A known distribution, deliberately not sorted: probabilities 0.05, 0.5, 0.15, 0.3 for tokens 0..3.
KNOWN_P = torch.tensor([0.05, 0.5, 0.15, 0.3])
KNOWN_LOGITS = KNOWN_P.log()


def _kept(logits_row: torch.Tensor) -> set[int]:
    return {i for i, v in enumerate(logits_row.tolist()) if v != INF}


def _filter(logits: torch.Tensor, **kw) -> torch.Tensor:
    return apply_top_k_top_p_min_p(logits.clone().unsqueeze(0), [SamplingParams(**kw)])[0]


def test_top_k_keeps_exactly_k_highest():
    logits = torch.tensor([0.3, -1.0, 2.0, 5.0, 0.0, 1.5, -3.0, 4.0])
    order = logits.argsort(descending=True).tolist()
    for k in range(1, 8):
        out = _filter(logits, top_k=k)
        assert _kept(out) == set(order[:k])
        kept = sorted(_kept(out))
        assert torch.equal(out[kept], logits[kept])  # survivors untouched
    for k in (0, -1, 8, 100):  # disabled or >= vocab: nothing masked
        assert torch.equal(_filter(logits, top_k=k), logits)


@pytest.mark.parametrize(
    "top_p, kept",
    [
        (0.3, {1}),  # 0.5 alone reaches 0.3
        (0.49, {1}),
        (0.6, {1, 3}),  # 0.5 + 0.3 = 0.8
        (0.79, {1, 3}),
        (0.85, {1, 3, 2}),  # 0.95
        (0.94, {1, 3, 2}),
        (0.97, {0, 1, 2, 3}),
        (1.0, {0, 1, 2, 3}),
    ],
)
def test_top_p_keeps_smallest_set_reaching_the_mass(top_p, kept):
    out = _filter(KNOWN_LOGITS, top_p=top_p)
    assert _kept(out) == kept
    idx = sorted(kept)
    assert torch.equal(out[idx], KNOWN_LOGITS[idx])


def test_top_p_applies_after_top_k_on_renormalised_mass():
    # Top-3 renormalised: 0.5/0.95, 0.3/0.95, 0.15/0.95 -> the first two hold 0.842 >= 0.83.
    assert _kept(_filter(KNOWN_LOGITS, top_p=0.83)) == {1, 3, 2}
    assert _kept(_filter(KNOWN_LOGITS, top_k=3, top_p=0.83)) == {1, 3}


@pytest.mark.parametrize(
    "min_p, kept",
    [(0.05, {0, 1, 2, 3}), (0.2, {1, 2, 3}), (0.35, {1, 3}), (0.61, {1}), (1.0, {1})],
)
def test_min_p_threshold_relative_to_top_probability(min_p, kept):
    # threshold = min_p * 0.5: 0.025, 0.1, 0.175, 0.305, 0.5
    out = _filter(KNOWN_LOGITS, min_p=min_p)
    assert _kept(out) == kept
    idx = sorted(kept)
    assert torch.equal(out[idx], KNOWN_LOGITS[idx])


def test_filters_apply_per_row():
    logits = torch.stack([KNOWN_LOGITS, KNOWN_LOGITS, KNOWN_LOGITS, KNOWN_LOGITS])
    params = [SamplingParams(top_k=2), SamplingParams(top_p=0.6), SamplingParams(min_p=0.35), SamplingParams()]
    out = apply_top_k_top_p_min_p(logits.clone(), params)
    assert [_kept(r) for r in out] == [{1, 3}, {1, 3}, {1, 3}, {0, 1, 2, 3}]
    assert torch.equal(out[3], KNOWN_LOGITS)


def _rows(params_list, prompt, output):
    return [SampleRequest(p, list(prompt), list(output)) for p in params_list]


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0, -2.0]])
    rows = _rows([SamplingParams(repetition_penalty=2.0)], prompt=[0, 1], output=[2, 2, 3])
    out = apply_penalties(logits.clone(), rows)
    expected = torch.tensor([[1.0, -2.0, 0.25, -1.0, 3.0, 0.0, -2.0]])  # tokens 0..3 seen; 4..6 untouched
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-7)
    # A penalty below 1 rewards repetition: the opposite direction.
    rows = _rows([SamplingParams(repetition_penalty=0.5)], prompt=[4], output=[6])
    out = apply_penalties(logits.clone(), rows)
    expected = torch.tensor([[2.0, -1.0, 0.5, -0.5, 6.0, 0.0, -1.0]])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-7)


def test_presence_and_frequency_penalties_subtract_exact_amounts():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    # Output counts: token 2 x3, token 3 x1, token 5 x2. Prompt tokens (0, 1) are not penalised.
    output = [2, 5, 2, 3, 2, 5]
    rows = _rows([SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)], prompt=[0, 1, 0], output=output)
    out = apply_penalties(logits.clone(), rows)
    expected = torch.tensor([[2.0, -1.0, 0.5 - 0.5 - 0.75, -0.5 - 0.5 - 0.25, 3.0, 0.0 - 0.5 - 0.5]])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)
    # Negative penalties add.
    rows = _rows([SamplingParams(presence_penalty=-1.0, frequency_penalty=-2.0)], prompt=[], output=[4, 4])
    out = apply_penalties(logits.clone(), rows)
    expected = logits.clone()
    expected[0, 4] = 3.0 + 1.0 + 4.0
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-6)


def test_penalties_combine_and_stay_per_row():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]] * 3)
    rows = [
        SampleRequest(SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.1), [0], [2, 2]),
        SampleRequest(SamplingParams(), [0, 1], [2, 3]),  # no penalties: unchanged
        SampleRequest(SamplingParams(frequency_penalty=1.0), [3], [1]),
    ]
    out = apply_penalties(logits.clone(), rows)
    # Row 0: repetition first (token 0 from the prompt, token 2 from the output), then presence/frequency.
    torch.testing.assert_close(out[0], torch.tensor([1.0, -1.0, 0.25 - 0.5 - 0.2, 1.0]), rtol=0, atol=1e-6)
    torch.testing.assert_close(out[1], logits[1], rtol=0, atol=0)
    torch.testing.assert_close(out[2], torch.tensor([2.0, -2.0, 0.5, 1.0]), rtol=0, atol=1e-6)


def _draw_counts(logits_row: torch.Tensor, params: SamplingParams, n: int = 4000, seed: int = 2024) -> torch.Tensor:
    sampler = Sampler(seed=seed)
    logits = logits_row.unsqueeze(0).repeat(n, 1)
    rows = [SampleRequest(params, [0], []) for _ in range(n)]
    out = sampler(logits, rows)
    return torch.bincount(torch.tensor(out.token_ids), minlength=logits_row.numel()).double()


def _assert_matches(counts: torch.Tensor, probs: torch.Tensor, sigmas: float = 4.5) -> None:
    n = counts.sum().item()
    freq = counts / n
    for i, p in enumerate(probs.double().tolist()):
        if p == 0.0:
            assert counts[i] == 0, f"token {i} has probability 0 but was drawn {int(counts[i])} times"
            continue
        se = math.sqrt(p * (1 - p) / n)
        assert abs(freq[i].item() - p) < sigmas * se, f"token {i}: frequency {freq[i]:.4f} vs p={p:.4f} (se {se:.4f})"


def test_logit_bias_goes_before_the_repetition_penalty_as_in_transformers(llm, tiny_llama):
    """logit_bias is added before the repetition penalty divides or multiplies, as transformers' sequence_bias (and
    vLLM's logit_bias) is: (l + b) / rp, not l / rp + b. The bias is chosen from HF's logits so that the two orders
    pick different first tokens; the whole greedy output then follows HF's generate with the same processors."""
    model = hf_model(tiny_llama)
    prompt = llm.get_tokenizer().encode("hello world")
    rp = 2.0
    with torch.no_grad():
        first = model(torch.tensor([prompt])).logits[0, -1].double()
    seen = torch.zeros_like(first, dtype=torch.bool)
    seen[prompt] = True
    penalised = torch.where(seen, torch.where(first > 0, first / rp, first * rp), first)
    x = max(set(prompt), key=lambda t: first[t].item())  # a prompt token, so the penalty applies to it
    best_other = max(penalised[t].item() for t in range(len(first)) if t != x)
    assert best_other > 0  # (then the orders differ for a bias in (best_other - l / rp, rp * best_other - l))
    bias = (best_other - first[x].item() / rp + rp * best_other - first[x].item()) / 2
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=rp, logit_bias={x: bias})
    got = llm.generate({"prompt_token_ids": prompt}, sp)[0].outputs[0].token_ids
    want = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=8,
        min_new_tokens=8,
        do_sample=False,
        repetition_penalty=rp,
        sequence_bias={(x,): bias},
        pad_token_id=0,
    )[0, len(prompt) :].tolist()
    assert got == want and got[0] != x  # (l / rp + b would have picked x)


def test_sampler_draws_from_softmax():
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log() + 3.0  # any offset: softmax is shift-invariant
    counts = _draw_counts(logits, SamplingParams(temperature=1.0))
    _assert_matches(counts, torch.tensor([0.1, 0.2, 0.3, 0.4]))


def test_sampler_respects_temperature_and_top_k_statistically():
    logits = torch.tensor([0.1, 0.2, 0.3, 0.4]).log()
    # temperature 0.5 squares the probabilities before renormalising
    sq = torch.tensor([0.01, 0.04, 0.09, 0.16])
    _assert_matches(_draw_counts(logits, SamplingParams(temperature=0.5)), sq / sq.sum())
    # top_k=2 renormalises the two best
    _assert_matches(
        _draw_counts(logits, SamplingParams(temperature=1.0, top_k=2)), torch.tensor([0.0, 0.0, 3 / 7, 4 / 7])
    )


def test_sampler_greedy_rows_take_argmax_and_seeded_rows_are_reproducible():
    logits = torch.tensor([[0.0, 1.0, 0.5, 0.9]] * 3)
    rows = [
        SampleRequest(SamplingParams(temperature=0.0), [0], []),
        SampleRequest(SamplingParams(temperature=1.0, seed=3), [0], [1, 2]),
        SampleRequest(SamplingParams(temperature=2.0, top_k=1), [0], []),
    ]
    a = Sampler(seed=0)(logits, rows).token_ids
    b = Sampler(seed=999)(logits, rows).token_ids  # the engine seed does not matter to seeded rows
    assert a[0] == 1 and a[2] == 1
    assert a[1] == b[1]


@pytest.mark.parametrize("temperature", [0.0, 1e-3, 1.0])
def test_overflowing_or_nan_logits_never_pick_a_masked_token(temperature):
    """A grammar masks tokens to -inf; the model's allowed logits may be huge (overflowing to inf once divided by a
    tiny temperature, so softmax gives NaN) or NaN. The sampler must still pick an allowed token: the best one."""
    inf = float("inf")
    rows = [SampleRequest(SamplingParams(temperature=temperature, seed=1), [0], [])]
    overflow = torch.tensor([[-inf, 3e38, 1e38, -inf, -inf]])
    assert Sampler(seed=0)(overflow, rows).token_ids == [1]
    nan = torch.tensor([[-inf, float("nan"), 2.0, -inf, -inf]])
    assert Sampler(seed=0)(nan, rows).token_ids == [2]


# ---- logprobs --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "k, sp_kw", [(5, dict(temperature=1.0, seed=3)), (3, dict(temperature=0.0)), (1, dict(temperature=1.0, seed=8))]
)
def test_logprobs_match_hf_transformers(llm, tiny_llama, k, sp_kw):
    sp = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=k, **sp_kw)
    outs = llm.generate(["hello world", "The quick brown fox"], sp)
    model = hf_model(tiny_llama)
    for out in outs:
        comp = out.outputs[0]
        assert comp.logprobs is not None and len(comp.logprobs) == len(comp.token_ids) == 12
        ids = out.prompt_token_ids + comp.token_ids
        with torch.no_grad():
            ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        p = len(out.prompt_token_ids)
        for j, (tok, lp) in enumerate(zip(comp.token_ids, comp.logprobs)):
            row = ref[p - 1 + j]
            assert lp.token_id == tok
            assert abs(lp.logprob - row[tok].item()) < 1e-4, (j, lp.logprob, row[tok].item())
            assert len(lp.top) == k
            top_lps = [v for _, v in lp.top]
            assert top_lps == sorted(top_lps, reverse=True)
            ref_vals, ref_ids = row.topk(k)
            assert [t for t, _ in lp.top] == ref_ids.tolist()
            for (_, v), rv in zip(lp.top, ref_vals.tolist()):
                assert abs(v - rv) < 1e-4
            if sp_kw["temperature"] == 0.0:
                assert lp.top[0][0] == tok and abs(lp.top[0][1] - lp.logprob) < 1e-6


def _rank_bounds(row: torch.Tensor, tok: int, tol: float = 1e-4) -> tuple[int, int]:
    """1 + the tokens more likely than tok in the oracle's row, counting those within tol of it or not."""
    return int((row > row[tok] + tol).sum()) + 1, int((row > row[tok] - tol).sum())


def test_logprobs_read_as_vllms_dicts(llm, tiny_llama):
    """Code written for vLLM's offline API (`output.logprobs[i]` a dict token id -> Logprob(logprob, rank,
    decoded_token)) runs unchanged: each position's dict holds the top k and the sampled token, each entry's logprob
    and rank as HF transformers' fp32 log_softmax has them (rank = 1 + the tokens more likely), decoded_token the
    tokenizer's text; prompt_logprobs the same shape. Pickled (a worker process's outputs) the entries keep their
    values."""
    import pickle

    sp = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=2, temperature=1.0, seed=5)
    out = llm.generate(["The quick brown fox"], sp)[0]
    model = hf_model(tiny_llama)
    ids = out.prompt_token_ids + out.outputs[0].token_ids
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    p = len(out.prompt_token_ids)
    outside = 0
    for j, (tok, pos) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs)):
        row = ref[p - 1 + j]
        assert set(pos) == {t for t, _ in pos.top} | {tok} and len(pos) in (3, 4)
        assert abs(pos[tok].logprob - row[tok].item()) < 1e-4
        assert pos[tok].rank == pos.rank and _rank_bounds(row, tok)[0] <= pos.rank <= _rank_bounds(row, tok)[1]
        assert pos[tok].decoded_token == llm.get_tokenizer().decode([tok])
        for i, t in enumerate(row.topk(3).indices.tolist()):
            assert pos[t].rank == i + 1 and abs(pos[t].logprob - row[t].item()) < 1e-4
        outside += tok not in dict(pos.top)
    assert outside > 0  # (sampled at temperature 1: some token outside the top 3, its rank computed, not its place)
    plp = out.prompt_logprobs
    assert plp[0] is None
    for q in range(1, p):
        t = out.prompt_token_ids[q]
        assert abs(plp[q][t].logprob - ref[q - 1, t].item()) < 1e-4
        lo, hi = _rank_bounds(ref[q - 1], t)
        assert lo <= plp[q][t].rank <= hi
    back = pickle.loads(pickle.dumps(out.outputs[0].logprobs))
    assert back == out.outputs[0].logprobs
    assert all(
        b[t].logprob == a[t].logprob and b[t].rank == a[t].rank
        for a, b in zip(out.outputs[0].logprobs, back)
        for t in a
    )
    # vLLM's idiom: the chosen token's logprob at each position
    chosen = [pos[tok].logprob for tok, pos in zip(out.outputs[0].token_ids, out.outputs[0].logprobs)]
    assert chosen == [pos.logprob for pos in out.outputs[0].logprobs]


def test_logprobs_zero_and_none(llm):
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=0))[0].outputs[0]
    assert len(out.logprobs) == 4
    assert all(lp.top == [] and lp.logprob <= 0.0 for lp in out.logprobs)
    out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert out.logprobs is None


# ---- n ---------------------------------------------------------------------------------------------------
def test_n_returns_n_indexed_completions(llm):
    out = llm.generate("hello world", SamplingParams(n=3, temperature=1.0, max_tokens=10, ignore_eos=True))
    assert len(out) == 1 and out[0].finished
    comps = out[0].outputs
    assert [c.index for c in comps] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 and c.finish_reason == "length" for c in comps)
    assert len({tuple(c.token_ids) for c in comps}) > 1  # independent samples
    assert _all_blocks_free(llm)


def test_n_with_seed_is_reproducible(llm):
    sp = SamplingParams(n=3, temperature=1.0, seed=21, max_tokens=10, ignore_eos=True)
    a = llm.generate("The quick brown fox", sp)[0].outputs
    b = llm.generate(["xyz", "The quick brown fox"], [SamplingParams(max_tokens=3), sp])[1].outputs
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.text for c in a] == [c.text for c in b]
    assert len({tuple(c.token_ids) for c in a}) == 3  # the samples do not share one seed


def test_n_greedy_gives_identical_completions(llm, greedy30):
    comps = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=0, max_tokens=30, ignore_eos=True))[0].outputs
    assert [c.token_ids for c in comps] == [greedy30[0].outputs[0].token_ids] * 3


# ---- stop conditions -------------------------------------------------------------------------------------
def _pick_stop(text: str, length: int = 2) -> tuple[int, str]:
    """A substring from the middle of text, free of replacement characters, whose first occurrence is there."""
    for i in range(len(text) // 3, len(text) - length - 3):
        s = text[i : i + length]
        if "\ufffd" not in s and text.find(s) == i:
            return i, s
    pytest.skip("no usable stop string in the greedy text")


@pytest.mark.parametrize("prompt_index", [0, 1])
@pytest.mark.parametrize("include", [False, True])
def test_stop_string_cuts_text(llm, greedy30, prompt_index, include):
    ref = greedy30[prompt_index].outputs[0]
    idx, stop = _pick_stop(ref.text)
    sp = SamplingParams(
        temperature=0, max_tokens=30, ignore_eos=True, stop=[stop, "\x00never\x00"], include_stop_str_in_output=include
    )
    out = llm.generate(PROMPTS[prompt_index], sp)[0].outputs[0]
    assert out.text == (ref.text[: idx + len(stop)] if include else ref.text[:idx])
    assert out.finish_reason == "stop"
    assert out.stop_reason == stop
    assert len(out.token_ids) < len(ref.token_ids)
    assert out.token_ids == ref.token_ids[: len(out.token_ids)]
    assert _all_blocks_free(llm)


def test_stop_token_ids_end_output_at_that_token(llm, greedy30):
    ref = greedy30[1].outputs[0].token_ids
    k = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    out = llm.generate(
        PROMPTS[1], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[ref[k]])
    )[0].outputs[0]
    assert out.token_ids == ref[: k + 1]
    assert out.finish_reason == "stop"
    assert out.stop_reason == ref[k]
    # The stop token's own text is left out, as with stop strings, unless asked for.
    full = greedy30[1].outputs[0].text
    assert full.startswith(out.text) and len(out.text) < len(full)
    assert out.text == llm.tokenizer.decode(ref[:k])
    kept = llm.generate(
        PROMPTS[1],
        SamplingParams(
            temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[ref[k]], include_stop_str_in_output=True
        ),
    )[0].outputs[0]
    assert kept.text == llm.tokenizer.decode(ref[: k + 1])


def test_detokenize_false_gives_the_same_ids_and_no_text(llm, greedy30):
    """vLLM's detokenize=False: the very tokens, stop token ids still honoured, the text left empty."""
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, detokenize=False))
    for o, ref in zip(outs, greedy30):
        assert o.outputs[0].token_ids == ref.outputs[0].token_ids
        assert o.outputs[0].text == "" and ref.outputs[0].text != ""
        assert o.outputs[0].finish_reason == "length"
    ref = greedy30[1].outputs[0].token_ids
    k = next(i for i in range(3, len(ref)) if ref[i] not in ref[:i])
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=[ref[k]], detokenize=False)
    out = llm.generate(PROMPTS[1], sp)[0].outputs[0]
    assert out.token_ids == ref[: k + 1] and out.finish_reason == "stop" and out.text == ""
    assert _all_blocks_free(llm)


def test_detokenize_false_refuses_stop_strings():
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(detokenize="no")


@pytest.mark.parametrize("max_tokens", [1, 7, 30])
def test_max_tokens_finishes_with_length(llm, max_tokens):
    outs = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True))
    for o in outs:
        assert o.finished
        c = o.outputs[0]
        assert len(c.token_ids) == max_tokens
        assert c.finish_reason == "length"
        assert c.stop_reason is None
    assert _all_blocks_free(llm)


def test_max_tokens_none_runs_to_max_model_len(llm):
    prompt = {"prompt_token_ids": list(range(100))}
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0].outputs[0]
    assert len(out.token_ids) == 128 - 100
    assert out.finish_reason == "length"


# ---- the candidate fast path and the CDF draw ---------------------------------------------------------------
def _reference_kept(row: torch.Tensor, p: SamplingParams) -> set[int]:
    """Top-k, then the smallest top-p prefix of the renormalized mass, by a full float64 sort of one row."""
    vals, order = row.double().sort(descending=True)
    k = p.top_k if 0 < p.top_k < row.numel() else row.numel()
    if p.top_p >= 1.0:
        return set(order[:k].tolist())
    probs = vals[:k].softmax(dim=0)
    mass, n = 0.0, 0
    for q in probs.tolist():
        mass += q
        n += 1
        if mass >= p.top_p:
            break
    return set(order[:n].tolist())


@pytest.mark.parametrize("spread", [6.0, 0.01])  # peaked (the 256 candidates hold the mass) / flat (full sort)
def test_top_k_top_p_over_candidates_equal_a_full_sort(spread):
    from infertune.runner.sampler import CANDIDATES, _top_k_top_p

    gen = torch.Generator().manual_seed(5)
    vocab = 5000
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_k=40),
        SamplingParams(top_k=300, top_p=0.8),
        SamplingParams(),
        SamplingParams(top_p=0.5, min_p=0.01),
        SamplingParams(top_k=3, top_p=0.99),
    ]
    logits = torch.randn(len(params), vocab, generator=gen) * spread
    out = apply_top_k_top_p_min_p(logits.clone(), params)
    for i, p in enumerate(params):
        kept = _kept(out[i])
        if p.min_p == 0:
            assert kept == _reference_kept(logits[i], p), i
        else:  # min_p after top-p: a subset of top-p's set holding every token within min_p of the best
            probs = logits[i].softmax(dim=0)
            survivors = {j for j in _reference_kept(logits[i], p) if probs[j] >= p.min_p * probs.max()}
            assert kept == survivors, i
        assert torch.equal(out[i, sorted(kept)], logits[i, sorted(kept)])  # survivors untouched
    fast = _top_k_top_p(logits, params, CANDIDATES + 44)  # 300: the largest top_k
    assert (fast is None) == (spread < 1.0)  # a flat row's 300 best hold less than 0.9 of the mass


@pytest.mark.parametrize("spread", [6.0, 0.01])  # the other row's top-p over candidates / over a full sort
def test_rows_without_top_p_keep_hf_s_set_beside_a_top_p_row(spread):
    """A row that asks for no top-p, batched with one that does, keeps what HF's warpers keep. Its fp32 cumulative
    mass rounds to 1.0 before a confident row's tail, and `before >= 1.0` dropped that tail: a plain row kept 2 of
    1000 tokens, a top_k=80 row 3, depending on what else was in the batch."""
    from transformers.generation.logits_process import TopKLogitsWarper

    gen = torch.Generator().manual_seed(0)
    vocab = 1000
    confident = torch.randn(2, vocab, generator=gen) * 30  # most tokens far below fp32's eps of the best
    other = torch.randn(1, vocab, generator=gen) * spread
    params = [SamplingParams(), SamplingParams(top_k=80), SamplingParams(top_p=0.9)]
    out = apply_top_k_top_p_min_p(torch.cat([confident, other]), params)
    ids = torch.zeros(1, 1, dtype=torch.long)
    assert torch.equal(out[0], confident[0])  # HF applies no warper at all
    want = TopKLogitsWarper(80)(ids, confident[1:2].clone())[0]
    assert _kept(out[1]) == _kept(want) and len(_kept(want)) == 80
    assert torch.equal(out[1, sorted(_kept(want))], confident[1, sorted(_kept(want))])


def test_inverse_cdf_draws_only_tokens_with_mass():
    from infertune.runner.sampler import inverse_cdf

    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]] * 5)
    u = torch.tensor([[0.0], [0.2499], [0.25], [0.9999999], [1.0 - 2.0**-53]], dtype=torch.float64)
    assert inverse_cdf(probs, u).tolist() == [1, 1, 3, 3, 3]


def test_a_vllm_script_ported_as_is(llm, tiny_llama):
    """What vLLM offline scripts do that this engine ignored or refused: a SamplingParams field set after the object
    is built (vLLM's own examples: `sp = llm.get_default_sampling_params(); sp.temperature = 0.5`) takes effect and
    is checked; cumulative_logprob is the sum of the sampled logprobs; num_cached_tokens on the output; dtype
    "float" / torch dtypes; multimodal data on a text-only model and unknown prompt keys are errors, not dropped;
    `with LLM(...)` shuts the engine down."""
    import torch

    from infertune.sampling_params import ParamError

    free = llm.generate("hello world", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0]
    stop = free.text[3:5]
    assert len(stop) == 2
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sp.stop = [stop]  # (set afterwards: the stop string was ignored, the text ran to max_tokens)
    out = llm.generate("hello world", sp)[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop and out.text == free.text[: free.text.index(stop)]
    sp.temperature = -1.0
    with pytest.raises(ParamError, match="temperature"):
        llm.generate("hello world", sp)
    sp = SamplingParams(max_tokens=3, logprobs=1, temperature=0)
    sp.stop_token_ids = None
    sp.structured_outputs = {"choice": ["yes", "no"]}
    done = llm.generate("hello", sp)[0]
    c = done.outputs[0]
    assert c.text in ("yes", "no") and c.cumulative_logprob == pytest.approx(sum(lp.logprob for lp in c.logprobs))
    assert done.num_cached_tokens == done.metrics.num_cached_tokens
    assert llm.generate("hi", SamplingParams(max_tokens=2))[0].outputs[0].cumulative_logprob is None
    for bad, says in (
        ({"prompt": "x", "multi_modal_data": {"image": 1}}, "text-only"),
        ({"prompt": "x", "foo": 1}, "foo"),
    ):
        with pytest.raises(ValueError, match=says):
            llm.generate(bad, SamplingParams(max_tokens=2))
    assert LLM(str(tiny_llama), dtype="float", max_model_len=64).engine.config.model.dtype == "float32"
    # a tensor-parallel engine's worker processes end with the block (they lived until the interpreter exited)
    with LLM(str(tiny_llama), dtype=torch.float32, max_model_len=64, tensor_parallel_size=2) as other:
        procs = list(other.engine.executor._procs)
        assert len(procs) == 2 and all(p.is_alive() for p in procs)
        assert other.generate("hi", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    assert not any(p.is_alive() for p in procs)
