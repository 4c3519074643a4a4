"""Speculative decoding (n-gram drafts verified in one forward): the proposer against a brute-force search, the
scheduler / block manager / worker state with drafts against a fake model, the sampler's rejection step against
exact arithmetic and a chi-square, and the engine's output with drafts against the engine's output without them."""

from __future__ import annotations

import json
import pickle

import pytest
import torch
from conftest import make_checkpoint
from hypothesis import given, settings
from hypothesis import strategies as st

from infertune import LLM, SamplingParams
from infertune.config import EngineConfig, SchedulerConfig, SpeculativeConfig
from infertune.engine.block_manager import BlockManager
from infertune.engine.scheduler import Scheduler
from infertune.engine.sequence import Sequence, SequenceStatus
from infertune.engine.spec_decode import AdaptiveK, NgramProposer
from infertune.runner.request_state import RequestStates
from infertune.runner.sampler import Sampler, SampleRequest, apply_top_k_top_p_min_p, inverse_cdf, verify_drafts

SPEC = {"method": "ngram", "num_speculative_tokens": 4}
BS = 4


# ---- the proposer ----------------------------------------------------------------------------------------------
def brute_force_drafts(tokens: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The longest suffix of n_min..n_max tokens that occurred before; what followed its earliest occurrence."""
    for n in range(n_max, n_min - 1, -1):
        suffix = tokens[len(tokens) - n :]
        for end in range(n - 1, len(tokens) - 1):  # an occurrence ending before the last token, earliest first
            if n <= len(tokens) - 1 and tokens[end + 1 - n : end + 1] == suffix:
                return tokens[end + 1 : end + 1 + k]
    return []


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=1, max_size=60),
    grow=st.lists(st.integers(1, 5), min_size=1, max_size=12),
    k=st.integers(1, 6),
    n_min=st.integers(1, 3),
    extra=st.integers(0, 3),
)
def test_proposer_matches_brute_force_as_the_sequence_grows(tokens, grow, k, n_min, extra):
    n_max = n_min + extra
    proposer = NgramProposer(SpeculativeConfig(k, prompt_lookup_max=n_max, prompt_lookup_min=n_min))
    seq = Sequence(tokens[:1], max_tokens=100)
    cut = 1
    for step in grow:  # the index is grown by what was appended since the last call, several tokens at a time
        cut = min(cut + step, len(tokens))
        seq.token_ids = tokens[:cut]
        assert proposer.propose(seq, k) == brute_force_drafts(seq.token_ids, k, n_min, n_max)
        assert seq.ngram_index.num_indexed == cut - 1


def test_proposer_examples():
    proposer = NgramProposer(SpeculativeConfig(3, prompt_lookup_max=3, prompt_lookup_min=2))
    seq = Sequence([1, 2, 3, 4, 5, 9, 2, 3], 10)
    assert proposer.propose(seq, 3) == [4, 5, 9]  # "2 3" occurred at 1..2
    seq.token_ids += [4]
    assert proposer.propose(seq, 3) == [5, 9, 2]  # the longer "2 3 4" wins
    assert proposer.propose(seq, 1) == [5]
    seq.token_ids += [7]
    assert proposer.propose(seq, 3) == []  # "4 7" never occurred
    seq = Sequence([6, 6, 6], 10)
    assert proposer.propose(seq, 3) == [6]  # "6 6" first ended at 1: one token follows it


# ---- config ----------------------------------------------------------------------------------------------------
def test_speculative_config_is_checked():
    config = EngineConfig.create(None, speculative_config={**SPEC, "prompt_lookup_max": 3})
    # (a max given alone is the min too, as vLLM's SpeculativeConfig sets it: vllm/config/speculative.py)
    assert config.scheduler.speculative_config == SpeculativeConfig(4, "ngram", 3, 3)
    assert SpeculativeConfig.from_dict(pickle.loads(pickle.dumps(SPEC))) == SpeculativeConfig(4)
    assert eval(repr(SpeculativeConfig(4)), {"SpeculativeConfig": SpeculativeConfig}) == SpeculativeConfig(4)
    for bad, says in (
        ({"method": "ngram"}, 'needs "num_speculative_tokens"'),
        ({**SPEC, "drafter": "x"}, "unknown keys \\['drafter'\\]"),
        ({**SPEC, "method": "medusa"}, "method='medusa' is not one of"),
        ({**SPEC, "model": "x"}, '"model" is for method "draft_model", not \'ngram\''),
        ({**SPEC, "method": "draft_model"}, 'method "draft_model" needs "model"'),
        ({**SPEC, "method": "draft_model", "model": "/no/such/dir"}, "the draft model's folder \\(got '/no/such/dir'"),
        ({**SPEC, "draft_cost": -1}, "draft_cost=-1 must be a number >= 0"),
        ({**SPEC, "acceptance_decay": 0}, "acceptance_decay=0 must be in \\(0, 1\\]"),
        ({**SPEC, "probe_interval": 0}, "probe_interval=0 must be an integer >= 1"),
        ({**SPEC, "adaptive": "yes"}, "adaptive='yes' must be true or false"),
        ({**SPEC, "num_speculative_tokens": 0}, "num_speculative_tokens=0 must be"),
        (
            {**SPEC, "prompt_lookup_min": 5, "prompt_lookup_max": 4},
            "prompt_lookup_min=5 must be <= prompt_lookup_max=4",
        ),
        (json.dumps(SPEC), "must be a dict such as"),
    ):
        with pytest.raises(ValueError, match=says):
            SchedulerConfig(speculative_config=bad)


def test_speculative_config_takes_vllms_forms(tiny_llama):
    """vLLM's spellings: a "model" without a "method" is a draft model (vLLM's canonical
    {"model": DIR, "num_speculative_tokens": K}, which was refused as 'drop it'), the model "[ngram]" / "ngram" and
    the method "[ngram]" are prompt lookup, draft_tensor_parallel_size 1 is what runs; vLLM's other keys are refused
    by name with the reason."""
    draft = SpeculativeConfig(3, "draft_model", model=str(tiny_llama))
    assert SpeculativeConfig.from_dict({"model": str(tiny_llama), "num_speculative_tokens": 3}) == draft
    for form in ({"model": "[ngram]"}, {"model": "ngram"}, {"method": "[ngram]"}, {"draft_tensor_parallel_size": 1}):
        assert SpeculativeConfig.from_dict({"num_speculative_tokens": 3, **form}) == SpeculativeConfig(3)
    config = EngineConfig.create(None, speculative_config={"model": str(tiny_llama), "num_speculative_tokens": 3})
    assert config.scheduler.speculative_config == draft
    # one n-gram bound given alone sets both, as vLLM's SpeculativeConfig does (min 5 alone was refused: > max 4)
    assert SpeculativeConfig.from_dict({**SPEC, "prompt_lookup_min": 5}) == SpeculativeConfig(
        SPEC["num_speculative_tokens"], prompt_lookup_max=5, prompt_lookup_min=5
    )
    assert SpeculativeConfig.from_dict({**SPEC, "prompt_lookup_max": 2}) == SpeculativeConfig(
        SPEC["num_speculative_tokens"], prompt_lookup_max=2, prompt_lookup_min=2
    )
    for key, value, says in (
        ("draft_tensor_parallel_size", 2, "runs whole in each worker"),
        ("disable_by_batch_size", 4, "no batch-size cutoff"),
        ("disable_logprobs", True, "logprobs are not speculated"),
        ("max_model_len", 64, "runs to the engine's max_model_len"),
    ):
        with pytest.raises(ValueError, match=f"{key}.*{says}.*drop it"):
            SchedulerConfig(speculative_config={**SPEC, key: value})


def test_speculative_config_flag_takes_json(capsys):
    from infertune.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "--speculative-config", str(SpeculativeConfig(2))])
    assert EngineConfig.create(None, **engine_kwargs(args)).scheduler.speculative_config == SpeculativeConfig(2)
    for text, says in (("{nope", "is not JSON"), ("[1]", "is not a JSON object")):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["serve", "--speculative-config", text])
        assert says in capsys.readouterr().err


# ---- scheduler + block manager + worker state, with a fake model -------------------------------------------------
def fake_next(tokens: list[int]) -> int:
    """A deterministic 'model': mostly repeats what came 3 tokens back (so n-gram drafts are often right)."""
    return tokens[-3] if len(tokens) >= 3 and len(tokens) % 7 else (tokens[-1] * 5 + len(tokens)) % 9


def drive(sched: Scheduler, seqs: list[Sequence]) -> int:
    """Run seqs to the end with fake_next, checking the step, the KV and the worker's mirror; returns the steps."""
    bm = sched.block_manager
    worker = RequestStates()
    kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> the tokens whose last one's KV it holds
    for seq in seqs:
        sched.add(seq)
    steps = 0
    while sched.has_unfinished():
        batch = sched.schedule()
        steps += 1
        assert batch.seqs and batch.total_tokens <= sched.config.max_num_batched_tokens
        out = pickle.loads(pickle.dumps(sched.scheduler_output(batch)))
        wstep = worker.begin_step(out)
        sampled, accepted = [], []
        for (state, n, samples), seq, num, sample, drafts in zip(
            wstep, batch.seqs, batch.num_scheduled_tokens, batch.sample, batch.draft_token_ids
        ):
            assert (state.token_ids, state.block_table) == (seq.token_ids, seq.block_table)
            assert (state.num_computed_tokens, n, samples) == (seq.num_computed_tokens, num, sample)
            assert out.scheduled_spec_decode_tokens.get(str(seq.seq_id), []) == drafts
            if drafts:  # only a decode carries drafts, and never more than max_tokens leaves room for
                assert num == 1 + len(drafts) and seq.num_computed_tokens == len(seq) - 1
                assert seq.num_output_tokens + len(drafts) + 1 <= seq.max_tokens
            # every computed position holds the KV of exactly this sequence's prefix (rejected drafts never count)
            for pos in range(seq.num_computed_tokens):
                assert kv[seq.block_table[pos // BS], pos % BS] == tuple(seq.token_ids[: pos + 1])
            known = seq.token_ids + drafts
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + num):
                block = bm.blocks[seq.block_table[pos // BS]]
                assert block.ref_count == 1 and block.hash is None, "KV written into a shared or cached block"
                kv[block.block_id, pos % BS] = tuple(known[: pos + 1])
            if not sample:
                sampled.append(None)
                accepted.append(0)
                continue
            a, token = verify_drafts([fake_next(known[: len(seq) + t]) for t in range(len(drafts) + 1)], drafts)
            sampled.append(token)
            accepted.append(a)
        worker.end_step(wstep, sampled, batch.draft_token_ids, accepted)
        sched.update(batch, sampled, accepted)
        for seq, new in zip(batch.seqs, batch.new_token_ids):
            assert seq.num_output_tokens <= seq.max_tokens
            if new and not seq.is_finished:  # the blocks past the next token's were given back
                assert len(seq.block_table) <= bm.blocks_needed(len(seq))
    assert bm.num_free_blocks == bm.num_blocks, "a KV block leaked"
    return steps


SHARED = [1, 2, 3, 1, 2, 3, 4, 1, 2]


@settings(max_examples=80, deadline=None)
@given(
    prompts=st.lists(st.lists(st.integers(0, 8), min_size=1, max_size=20), min_size=1, max_size=6),
    shared=st.lists(st.booleans(), min_size=6, max_size=6),
    max_tokens=st.lists(st.integers(1, 24), min_size=6, max_size=6),
    stop=st.booleans(),
    # (at least the 13 blocks of the longest sequence drawn, 9 shared + 20 prompt + 23 more tokens: the engine
    # refuses a larger one before the scheduler sees it, and Scheduler.add asserts so)
    num_blocks=st.integers(13, 40),
    budget=st.integers(2, 24),
    max_num_seqs=st.integers(1, 6),
    prefix=st.booleans(),
    k=st.integers(1, 5),
)
def test_scheduler_with_drafts_gives_the_tokens_of_plain_decoding(
    prompts, shared, max_tokens, stop, num_blocks, budget, max_num_seqs, prefix, k
):
    def run(spec):
        cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, speculative_config=spec)
        sched = Scheduler(cfg, BlockManager(num_blocks, BS, enable_prefix_caching=prefix))
        seqs = []
        for p, s, m in zip(prompts, shared, max_tokens):
            seq = Sequence((SHARED + p) if s else p, m)
            seq.stop_token_ids = frozenset({8} if stop else ())
            seq.spec_decode = True
            seqs.append(seq)
        return sched, seqs, drive(sched, seqs)

    plain, plain_seqs, _ = run(None)
    spec, spec_seqs, _ = run(SpeculativeConfig(k, prompt_lookup_max=3))
    assert [s.output_token_ids for s in spec_seqs] == [s.output_token_ids for s in plain_seqs]
    assert [s.status for s in spec_seqs] == [s.status for s in plain_seqs]
    assert spec.num_accepted_tokens <= spec.num_draft_tokens
    assert plain.num_draft_tokens == 0


def test_drafts_are_accepted_and_save_steps():
    def run(spec):
        cfg = SchedulerConfig(max_num_batched_tokens=64, speculative_config=spec)
        sched = Scheduler(cfg, BlockManager(64, BS))
        seq = Sequence([5, 1, 2, 5, 1, 2, 5], 30)
        seq.spec_decode = True
        return sched, seq, drive(sched, [seq])

    plain, plain_seq, plain_steps = run(None)
    spec, spec_seq, spec_steps = run(SpeculativeConfig(4))
    assert spec_seq.output_token_ids == plain_seq.output_token_ids
    assert plain_steps == 30 and spec_steps < 20 and spec.num_accepted_tokens > 10


def test_a_stop_token_inside_accepted_drafts_ends_the_output_there():
    sched = Scheduler(SchedulerConfig(speculative_config=SpeculativeConfig(4)), BlockManager(16, BS))
    seq = Sequence([1, 2, 3, 4, 1, 2], 10)
    seq.stop_token_ids = frozenset({4})
    seq.spec_decode = True
    sched.add(seq)
    batch = sched.schedule()
    sched.update(batch, [3])  # the prefill samples 3
    batch = sched.schedule()
    assert batch.draft_token_ids == [[4, 1, 2, 3]]  # "1 2 3" occurred at 0..2: 4 1 2 3 followed
    assert batch.num_scheduled_tokens == [5] and len(seq.block_table) == 3  # slots for positions 6..10
    sched.update(batch, [9], [4])  # every draft accepted, then 9
    assert seq.output_token_ids == [3, 4] and seq.status is SequenceStatus.FINISHED_STOPPED
    assert batch.new_token_ids == [[4]]
    assert sched.block_manager.num_free_blocks == 16
    assert (sched.num_drafts, sched.num_draft_tokens, sched.num_accepted_tokens) == (1, 4, 4)


def test_drafts_never_take_a_block_another_running_sequence_needs():
    sched = Scheduler(SchedulerConfig(speculative_config=SpeculativeConfig(4)), BlockManager(5, BS))
    a, b = Sequence([1, 2, 1, 2, 1, 2, 1, 2], 8), Sequence([7, 7, 7, 7], 8)
    for seq in (a, b):
        seq.spec_decode = True
        sched.add(seq)
    batch = sched.schedule()
    sched.update(batch, [1, 7])  # a: 9 tokens, 8 in 2 blocks; b: 5, 4 in 1 block; 2 blocks free
    batch = sched.schedule()
    # a's drafts (positions 9..12) would take both free blocks, leaving none for b's next token at position 4;
    # b's one draft fits in the block its token takes anyway
    assert batch.draft_token_ids == [[], [7]]
    assert not batch.preempted and sched.block_manager.num_free_blocks == 0


# ---- the sampler's rejection step ---------------------------------------------------------------------------
LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, 1.5, -3.0, 0.2]])
PARAMS = SamplingParams(temperature=0.8, top_k=6, seed=None)
DRAFT = 1


def target_probs() -> torch.Tensor:
    """p of the row as sampling applies PARAMS: temperature, then the top 6 kept, in fp64."""
    scaled = LOGITS[0].double() / PARAMS.temperature
    keep = scaled.topk(6).indices
    p = torch.zeros_like(scaled)
    p[keep] = scaled[keep].softmax(0)
    return p


def test_rejection_step_exact_over_the_uniform_draws():
    """Every u of a fine grid through the sampler's inverse CDF: the draft is accepted on exactly p(draft) of them,
    and a rejected row's token covers each other token on exactly p(token) of them (p without the draft)."""
    p = target_probs()
    probs = apply_top_k_top_p_min_p(LOGITS / PARAMS.temperature, [PARAMS]).softmax(dim=-1)
    n = 20_000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n
    tokens = inverse_cdf(probs.expand(n, -1), u.unsqueeze(1)).tolist()
    counts = torch.zeros(8, dtype=torch.float64)
    accepted = 0
    for t in tokens:
        a, token = verify_drafts([t, 99], [DRAFT])
        accepted += a
        counts[t if a else token] += 1  # the first token emitted: the draft if accepted, else the row's token
    assert abs(accepted / n - p[DRAFT].item()) <= 2 / n
    assert (counts / n - p).abs().max().item() <= 2 / n
    rejected = counts.clone()
    rejected[DRAFT] = 0
    residual = p.clone()
    residual[DRAFT] = 0
    assert (rejected / rejected.sum() - residual / residual.sum()).abs().max().item() <= 3 / n


@pytest.mark.parametrize("seeded", [False, True])
def test_rejection_step_distribution_chi_square(seeded):
    """The sampler over many rows of one logits row, each verifying the same draft: the first emitted token is
    distributed as p (chi-square at p > 1e-4), and the draft is accepted p(draft) of the time."""
    from scipy.stats import chisquare

    p = target_probs()
    n = 20_000
    rows = [
        SampleRequest(SamplingParams(temperature=0.8, top_k=6, seed=i if seeded else None), [], [], 0) for i in range(n)
    ]
    out = Sampler(seed=1).__call__(LOGITS.expand(n, -1).clone(), rows)
    first = []
    for token in out.token_ids:
        a, after = verify_drafts([token, 99], [DRAFT])
        first.append(DRAFT if a else after)
    counts = torch.bincount(torch.tensor(first), minlength=8).double()
    kept = p > 0
    assert counts[~kept].sum() == 0
    assert chisquare(counts[kept].numpy(), (p[kept] * n).numpy()).pvalue > 1e-4
    accept_rate = (counts[DRAFT] / n).item()
    sd = (p[DRAFT] * (1 - p[DRAFT]) / n).sqrt().item()
    assert abs(accept_rate - p[DRAFT].item()) < 5 * sd


# ---- the engine on a tiny model: with drafts as without ---------------------------------------------------------
MAX_LEN = 128
NEW = 40
# Prompts the tiny model loops on (drafts accepted), one it does not, a long one, and one token.
PROMPTS = [[10] * 8, [145, 178] * 5, [206, 10] * 4, list(range(40, 60)) * 3, [77]]


def generate(path, prompts, params, **engine):
    llm = LLM(str(path), dtype="float32", block_size=BS, **{"max_model_len": MAX_LEN, **engine})
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, outs


def greedy(max_tokens=NEW, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(tiny_llama):
    """Greedy tokens without speculation, prefix caching off (the parity tests' reference setting)."""
    return tokens(generate(tiny_llama, PROMPTS, greedy(), enable_prefix_caching=False)[1])


# per mode: engine options; the parity tests' modes (parity_utils.engine_modes) with speculation on
MODES = {
    "prefix-cache-off": dict(enable_prefix_caching=False),
    "prefix-cache-on": dict(enable_prefix_caching=True),
    "tiny-chunked-prefill": dict(max_num_batched_tokens=5),
    "one-seq-at-a-time": dict(max_num_seqs=1),
    # 28 blocks of BS tokens (fp32 KV of 2 layers x 2 heads x 16 x K and V: 512 bytes a token), where the batch
    # needs ~75 at its peak
    "preemption": dict(kv_cache_memory_bytes=512 * 28 * BS, max_model_len=104),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_greedy_tokens_identical_with_speculation(tiny_llama, reference, mode):
    llm, outs = generate(tiny_llama, PROMPTS, greedy(), speculative_config=SPEC, **MODES[mode])
    assert tokens(outs) == reference
    stats = llm.engine.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 0
    if mode == "preemption":
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]  # rejected drafts' blocks came back


def test_a_worker_process_follows_the_drafts_and_the_blocks_given_back(tiny_llama, reference):
    """With the model in a worker process, which knows each request only from the pickled SchedulerOutputs (the
    drafts, the blocks kept after rejected drafts) and its own sampled tokens: the same tokens, under preemption."""
    llm, outs = generate(
        tiny_llama,
        PROMPTS,
        greedy(),
        speculative_config=SPEC,
        distributed_executor_backend="mp",
        **MODES["preemption"],
    )
    try:
        assert tokens(outs) == reference
        stats = llm.engine.stats()
        assert stats["spec_decode_num_accepted_tokens"] > 0 and stats["num_preemptions"] > 0
    finally:
        llm.engine.shutdown()


def test_prefix_cache_reuses_the_kv_of_accepted_drafts(tiny_llama, reference):
    """Prompts that continue the first round's outputs hit the blocks those outputs filled (KV computed as drafts
    where they were accepted), and continue as a fresh engine without the cache does."""
    llm, outs = generate(tiny_llama, PROMPTS, greedy(), speculative_config=SPEC)
    assert tokens(outs) == reference
    longer = [p + out[:24] for p, out in zip(PROMPTS, reference)]
    bm = llm.engine.block_manager
    hits = bm.prefix_hits
    outs = llm.generate([{"prompt_token_ids": p} for p in longer], greedy(16), use_tqdm=False)
    _, fresh = generate(tiny_llama, longer, greedy(16), enable_prefix_caching=False)
    assert tokens(outs) == tokens(fresh)
    assert bm.prefix_hits - hits > sum(len(p) for p in PROMPTS)  # blocks of output tokens were hit


def test_fewer_forward_passes_than_tokens(tiny_llama, reference):
    llm, outs = generate(tiny_llama, PROMPTS[:1], greedy(), speculative_config=SPEC)
    assert tokens(outs) == reference[:1]
    stats = llm.engine.stats()
    assert llm.engine.num_steps < 0.7 * NEW  # one prefill step, then under one step a token
    assert stats["spec_decode_num_accepted_tokens"] >= 10


def test_seeded_sampling_gives_the_same_tokens_with_speculation(tiny_llama):
    """The draw at every output position is the one sampling makes without drafts (same uniform, penalties over
    the tokens accepted before it), so a seeded request's tokens do not change. (Low temperatures: the tiny random
    model's distributions are flat, and drafts must be accepted for the test to mean something.)"""
    params = [
        SamplingParams(temperature=0.2, top_p=0.95, seed=7, max_tokens=NEW, ignore_eos=True),
        SamplingParams(temperature=0.3, top_k=20, min_p=0.05, seed=3, max_tokens=NEW, ignore_eos=True),
        SamplingParams(
            temperature=0.2,
            repetition_penalty=1.1,
            presence_penalty=0.2,
            frequency_penalty=0.1,
            seed=11,
            max_tokens=NEW,
            ignore_eos=True,
        ),
        SamplingParams(temperature=0.25, n=2, seed=5, max_tokens=NEW, ignore_eos=True),
    ]
    prompts = PROMPTS[:1] + PROMPTS[1:3] + PROMPTS[:1]
    _, plain = generate(tiny_llama, prompts, params)
    llm, spec = generate(tiny_llama, prompts, params, speculative_config=SPEC)
    assert [[c.token_ids for c in o.outputs] for o in spec] == [[c.token_ids for c in o.outputs] for o in plain]
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0


@pytest.mark.parametrize(
    "penalties", [dict(repetition_penalty=1.05), dict(presence_penalty=0.1, frequency_penalty=0.05)]
)
def test_penalties_see_the_drafts_accepted_before_them(tiny_llama, penalties):
    """A draft row's penalties count the drafts before it (accepted if that row is reached): greedy tokens under
    penalties are those of decoding without drafts, on a prompt where drafts are accepted."""
    params = greedy(**penalties)
    _, plain = generate(tiny_llama, PROMPTS[:2], params)
    llm, spec = generate(tiny_llama, PROMPTS[:2], params, speculative_config=SPEC)
    assert tokens(spec) == tokens(plain)
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] >= 5


def test_stops_and_max_tokens_inside_accepted_drafts(tiny_llama, reference):
    """Stop tokens, stop strings and max_tokens that land inside a step's run of accepted drafts end the output at
    that token, as without speculation."""
    llm = LLM(str(tiny_llama), dtype="float32", block_size=BS, max_model_len=MAX_LEN, speculative_config=SPEC)
    runs: list[list[int]] = []  # per step, the tokens the first sequence got
    update = llm.engine.scheduler.update

    def record(batch, sampled, num_accepted=None):
        finished = update(batch, sampled, num_accepted)
        runs.append(batch.new_token_ids[0])
        return finished

    llm.engine.scheduler.update = record
    assert tokens(llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(), use_tqdm=False)) == reference[:1]
    del llm.engine.scheduler.update
    out, inside, at = reference[0], [], 0
    for run in runs:  # output indices that are not the last token of their step
        inside += list(range(at, at + len(run) - 1))
        at += len(run)
    assert len(inside) >= 5
    text = llm.get_tokenizer().decode
    cases = []
    for i in inside:
        cases.append(greedy(max_tokens=i + 1))
        cases.append(greedy(stop_token_ids=[out[i]]))
        if i >= 1:  # a stop string made of two tokens' text, kept in the output or not
            stop = text(out[i - 1 : i + 1])
            cases.append(greedy(stop=[stop], include_stop_str_in_output=i % 2 == 0))
    prompts = PROMPTS[:1] * len(cases)
    _, plain = generate(tiny_llama, prompts, cases, max_num_seqs=64)
    llm, spec = generate(tiny_llama, prompts, cases, speculative_config=SPEC, max_num_seqs=64)
    for p, s in zip(plain, spec):
        assert (s.outputs[0].token_ids, s.outputs[0].text) == (p.outputs[0].token_ids, p.outputs[0].text)
        assert (s.outputs[0].finish_reason, s.outputs[0].stop_reason) == (
            p.outputs[0].finish_reason,
            p.outputs[0].stop_reason,
        )
    assert llm.engine.stats()["kv_blocks_free"] == llm.engine.stats()["kv_blocks_total"]


def test_requests_with_logprobs_or_a_grammar_do_not_speculate(tiny_llama, reference):
    from infertune.sampling_params import StructuredOutputsParams

    llm, outs = generate(tiny_llama, PROMPTS[:1], greedy(logprobs=2), speculative_config=SPEC)
    assert tokens(outs) == reference[:1] and len(outs[0].outputs[0].logprobs) == NEW
    assert llm.engine.stats()["spec_decode_num_drafts"] == 0
    params = greedy(structured_outputs=StructuredOutputsParams(regex="[ab]+"))
    llm.engine.add_request("g", {"prompt_token_ids": PROMPTS[0]}, params)
    llm.engine.add_request("p", {"prompt_token_ids": PROMPTS[0]}, greedy())
    assert [s.seq.spec_decode for r in ("g", "p") for s in llm.engine.requests[r].samples] == [False, True]


def _family_checkpoint(path, family):
    if family == "gemma2":  # windowed layers (their blocks freed out of the window) and soft-caps
        from test_gemma import VARIANTS, make_gemma

        return make_gemma(path, **VARIANTS["gemma2"])
    if family == "deepseek-v3":  # the latent (MLA) cache and sigmoid routing
        from test_deepseek import VARIANTS, make_deepseek_checkpoint

        return make_deepseek_checkpoint(path, **VARIANTS["v3"])
    return make_checkpoint(path, family)


@pytest.mark.parametrize("family", ["qwen3", "mixtral", "gemma2", "deepseek-v3"])
def test_greedy_tokens_identical_with_speculation_on_other_families(tmp_path, family):
    path = _family_checkpoint(tmp_path / family, family)
    prompts = PROMPTS[:2]
    _, plain = generate(path, prompts, greedy(20))
    llm, spec = generate(path, prompts, greedy(20), speculative_config=SPEC)
    assert tokens(spec) == tokens(plain)
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_fused_decode_step_verifies_drafts(tiny_llama):
    """In bf16 on a CPU with the fused step, a step with drafts is still decode-only (1 + d decode rows a
    sequence): the fused step runs it, and a lone sequence gets the tokens it gets without drafts."""
    plain = LLM(str(tiny_llama), dtype="bfloat16", block_size=BS, max_model_len=MAX_LEN)
    if plain.engine.executor.runner.fused is None:
        pytest.skip("no fused decode step on this machine (needs x86 AVX-512 BF16 kernels)")
    llm = LLM(str(tiny_llama), dtype="bfloat16", block_size=BS, max_model_len=MAX_LEN, speculative_config=SPEC)
    runner = llm.engine.executor.runner
    fused = runner.fused
    rows: list[int] = []  # the rows of each step the fused step ran

    class Counting:
        applicable = staticmethod(fused.applicable)

        def __call__(self, input_ids, *rest):
            rows.append(input_ids.shape[0])
            return fused(input_ids, *rest)

    runner.fused = Counting()
    for p in PROMPTS[:3]:
        want = plain.generate({"prompt_token_ids": p}, greedy(), use_tqdm=False)
        assert tokens(llm.generate({"prompt_token_ids": p}, greedy(), use_tqdm=False)) == tokens(want)
    assert max(rows) > 1 and llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_server_streams_speculated_tokens_and_counts_them(tiny_llama):
    import httpx
    from server_utils import ServerThread, metric

    body = {"model": "tiny", "prompt": "abcabcabcabcabc", "max_tokens": 30, "temperature": 0}
    want = LLM(str(tiny_llama), dtype="float32", max_model_len=64, block_size=4).generate(
        "abcabcabcabcabc", SamplingParams(temperature=0, max_tokens=30)
    )[0]
    with ServerThread(tiny_llama, speculative_config=SPEC) as s:
        whole = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
        streamed = ""
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    streamed += json.loads(line[6:])["choices"][0]["text"]
        drafts = metric(s.url, "infertune_spec_decode_num_draft_tokens_total")
        accepted = metric(s.url, "infertune_spec_decode_num_accepted_tokens_total")
        steps = metric(s.url, "infertune_spec_decode_num_drafts_total")
        # vLLM's names carry the same counts (a dashboard made for vLLM reads them)
        vllm = [metric(s.url, f"vllm:spec_decode_num_{n}_total") for n in ("draft_tokens", "accepted_tokens", "drafts")]
        generated = metric(s.url, "infertune_generation_tokens_total")
    assert whole == streamed == want.outputs[0].text
    assert drafts > 0 and 0 < accepted <= drafts and steps > 0
    assert vllm == [drafts, accepted, steps]
    # two requests of 30 tokens: each made one at its prefill, one a decode step, and its accepted drafts besides
    assert generated == 60 and accepted <= 60 - 2 - steps


# ---- adaptive K: the policy on synthetic acceptance sequences ---------------------------------------------------
def tokens_per_cost(a: float, d: int, cost: float) -> float:
    """By enumeration of the outcomes: m < d drafts accepted with probability a^m (1 - a), all d with a^d; a step
    gives m + 1 tokens for 1 + cost * d of a plain step's cost."""
    expected = sum((m + 1) * a**m * (1 - a) for m in range(d)) + (d + 1) * a**d
    return expected / (1 + cost * d)


@pytest.mark.parametrize("cost", [0.01, 0.05, 0.3])
def test_adaptive_k_takes_the_number_of_drafts_with_the_most_tokens_per_cost(cost):
    policy = AdaptiveK(SpeculativeConfig(6, draft_cost=cost))
    for i in range(101):
        a = i / 100
        values = [tokens_per_cost(a, d, cost) for d in range(7)]
        k = policy.best_k(a)
        assert values[k] >= max(values) * (1 - 1e-9), (a, k, values)
        # no number of drafts pays while a draft is accepted less often than its row costs
        assert (k == 0) == (a <= cost), (a, k)


def decisions(spec: SpeculativeConfig, accepted, steps: int) -> list[int]:
    """The drafts the policy gives a sequence at each of `steps` decode steps, where accepted(step, d) of them are."""
    policy, seq = AdaptiveK(spec), Sequence([1], 10**6)
    out = []
    for i in range(steps):
        d = policy.num_drafts(seq)
        out.append(d)
        policy.record(seq, d, accepted(i, d))
    return out


def test_adaptive_k_stops_drafting_where_nothing_is_accepted_and_probes_now_and_then():
    spec = SpeculativeConfig(4)  # the defaults: draft_cost 0.05, acceptance_decay 0.8, probe_interval 16
    ks = decisions(spec, lambda i, d: 0, 300)
    assert ks[0] == 4  # a new sequence starts at K
    off = ks.index(0)
    assert off <= 10 and ks[:off] == sorted(ks[:off], reverse=True)
    probes = [i for i in range(off, 300) if ks[i]]
    assert all(ks[i] == 1 for i in probes)
    assert probes[0] == off + 16 and all(b - a == 17 for a, b in zip(probes, probes[1:]))  # 16 steps off, then one
    assert sum(ks) <= sum(ks[:off]) + 300 // 17
    # fixed K (adaptive off) drafts K every step, whatever is accepted
    assert decisions(SpeculativeConfig(4, adaptive=False), lambda i, d: 0, 50) == [4] * 50


def test_adaptive_k_keeps_k_while_drafts_are_accepted_and_resumes_when_they_are_again():
    assert decisions(SpeculativeConfig(4), lambda i, d: d, 100) == [4] * 100
    ks = decisions(SpeculativeConfig(4), lambda i, d: 0 if i < 100 else d, 200)
    assert ks[99] == 0
    first_probe = next(i for i in range(100, 200) if ks[i])
    # one accepted probe brings drafts back, and a few accepted steps K
    assert first_probe <= 117 and 0 < ks[first_probe + 1] <= ks[first_probe + 2] <= ks[first_probe + 3] == 4
    assert ks[first_probe + 3 :] == [4] * (200 - first_probe - 3)


def test_adaptive_k_estimates_the_acceptance_of_each_next_draft():
    """Outcomes drawn as a draft accepted with probability a given the one before was: the decayed-count estimate
    (without decay) converges to a, whatever the number of drafts (accepted / proposed would not)."""
    import random

    rng = random.Random(0)
    for a in (0.3, 0.6, 0.9):
        policy, seq = AdaptiveK(SpeculativeConfig(4, acceptance_decay=1.0)), Sequence([1], 10**6)
        for i in range(4000):
            d = 1 + i % 4
            m = 0
            while m < d and rng.random() < a:
                m += 1
            policy.record(seq, d, m)
        assert abs(AdaptiveK.acceptance(seq.spec_state) - a) < 0.03


def test_adaptive_k_in_the_scheduler_drafts_little_where_every_draft_is_rejected():
    """A proposer whose drafts the fake model never gives: the same tokens as plain decoding, and after a few steps
    only a probe every 16 steps (fixed K drafts K every step)."""

    def run(spec):
        cfg = SchedulerConfig(max_num_batched_tokens=64, speculative_config=spec)
        sched = Scheduler(cfg, BlockManager(64, BS))
        if spec is not None:
            sched.proposer.propose = lambda seq, k: [99] * k  # fake_next never gives 99
        seq = Sequence([5, 1, 2, 5, 1, 2, 5], 120)
        seq.spec_decode = True
        return sched, seq, drive(sched, [seq])

    plain, plain_seq, plain_steps = run(None)
    fixed, fixed_seq, _ = run(SpeculativeConfig(4, adaptive=False))
    adaptive, adaptive_seq, adaptive_steps = run(SpeculativeConfig(4))
    assert adaptive_seq.output_token_ids == fixed_seq.output_token_ids == plain_seq.output_token_ids
    assert adaptive_steps == plain_steps == 120 and adaptive.num_accepted_tokens == 0
    assert fixed.num_draft_tokens >= 4 * 110
    assert adaptive.num_draft_tokens <= 16 + 120 // 17


def test_greedy_tokens_identical_with_fixed_k(tiny_llama, reference):
    llm, outs = generate(tiny_llama, PROMPTS, greedy(), speculative_config={**SPEC, "adaptive": False})
    assert tokens(outs) == reference
    stats = llm.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0


# ---- a draft model ----------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def noisy_draft(tiny_llama, tmp_path_factory):
    """The tiny target with every weight perturbed: a draft model that agrees with it on some tokens, not all."""
    from conftest import hf_model
    from transformers import AutoTokenizer

    model = hf_model(tiny_llama)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01 * torch.randn(p.shape, generator=gen))
    path = tmp_path_factory.mktemp("noisy-draft")
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama).save_pretrained(path)
    return path


def draft_spec(path, **kw) -> dict:
    return {"method": "draft_model", "model": str(path), "num_speculative_tokens": 4, **kw}


@pytest.mark.parametrize("draft, mode", [("target", "prefix-cache-on"), ("noisy", "preemption")])
def test_draft_model_greedy_tokens_identical(tiny_llama, noisy_draft, reference, draft, mode):
    """Greedy output is the target's without speculation; the target drafting for itself has every draft accepted;
    the rejected drafts' blocks come back, under preemption too."""
    path = tiny_llama if draft == "target" else noisy_draft
    llm, outs = generate(tiny_llama, PROMPTS, greedy(), speculative_config=draft_spec(path), **MODES[mode])
    assert tokens(outs) == reference
    stats = llm.engine.stats()
    drafted, accepted = stats["spec_decode_num_draft_tokens"], stats["spec_decode_num_accepted_tokens"]
    if draft == "target":
        assert drafted == accepted > 2 * len(PROMPTS) * NEW / 3
    else:
        assert drafted > accepted > 0
        assert stats["num_preemptions"] > 0
    assert stats["kv_blocks_free"] == stats["kv_blocks_total"]
    # the draft model's own blocks: each held by one request the worker still knows (it learns of the finished ones
    # at its next step), none lost
    runner = llm.engine.executor.runner
    drafter = runner.drafter
    held = [b for state in drafter.states.values() for b in state.block_table]
    assert set(drafter.states) <= set(runner.requests.requests)
    num_blocks = runner.kv_info.num_blocks + llm.engine.config.scheduler.max_num_seqs
    assert sorted(held + drafter.free_blocks) == list(range(num_blocks))


def test_draft_model_seeded_sampling_gives_the_same_tokens(tiny_llama, noisy_draft):
    params = [
        SamplingParams(temperature=0.3, top_p=0.9, seed=7, max_tokens=NEW, ignore_eos=True),
        SamplingParams(temperature=0.2, repetition_penalty=1.1, seed=11, max_tokens=NEW, ignore_eos=True),
    ]
    _, plain = generate(tiny_llama, PROMPTS[1:3], params)
    llm, spec = generate(tiny_llama, PROMPTS[1:3], params, speculative_config=draft_spec(noisy_draft))
    assert tokens(spec) == tokens(plain)
    assert llm.engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_draft_model_sampling_distribution_chi_square(tiny_llama, noisy_draft):
    """Unseeded samples of the first two tokens (top-2, temperature 1), the second verified against the draft
    model's draft: their joint distribution is the target's, computed with HF transformers (chi-square)."""
    from conftest import hf_model
    from scipy.stats import chisquare

    prompt, n = [77], 1200  # one token: each sample's prefill is a decode row, so the samples batch cheaply
    hf = hf_model(tiny_llama)

    def top2(ids: list[int]) -> tuple[list[int], torch.Tensor]:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0, -1].double()
        vals, idx = logits.topk(2)
        return idx.tolist(), vals.softmax(0)

    expected, cells = [], []
    first, p_first = top2(prompt)
    for t0, p0 in zip(first, p_first):
        second, p_second = top2(prompt + [t0])
        for t1, p1 in zip(second, p_second):
            cells.append((t0, t1))
            expected.append((p0 * p1).item() * n)
    params = SamplingParams(temperature=1.0, top_k=2, n=100, max_tokens=3, ignore_eos=True)
    llm, outs = generate(
        tiny_llama, [prompt] * (n // 100), params, speculative_config=draft_spec(noisy_draft), max_num_seqs=128
    )
    pairs = [tuple(c.token_ids[:2]) for o in outs for c in o.outputs]
    assert set(pairs) <= set(cells)
    counts = [pairs.count(c) for c in cells]
    assert chisquare(counts, expected).pvalue > 1e-4
    stats = llm.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > stats["spec_decode_num_accepted_tokens"] > 0.1 * n


def test_draft_model_with_another_vocabulary_is_refused(tiny_llama, tmp_path):
    path = make_checkpoint(tmp_path / "other-vocab", "llama", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the target 2[0-9][0-9]: a draft model must use"):
        LLM(str(tiny_llama), dtype="float32", max_model_len=MAX_LEN, speculative_config=draft_spec(path))


def test_draft_model_with_another_tokenizer_of_the_same_size_is_refused(tiny_llama, tmp_path):
    """A draft whose tokenizer has the target's size but maps ids to other text (here: the same bytes, numbered
    the other way round) is refused at start-up, naming a token that differs; it was taken, and drafted ids that
    stand for other text than the target's."""
    from conftest import VOCAB_SPECIALS, hf_model
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    target = AutoTokenizer.from_pretrained(tiny_llama)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(sorted(alphabet, reverse=True))}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    other = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    other.add_special_tokens({"additional_special_tokens": VOCAB_SPECIALS[1:]})
    assert len(other) == len(target) and other.encode("a") != target.encode("a")
    path = tmp_path / "other-tokenizer"
    hf_model(tiny_llama).save_pretrained(path)  # the target's own weights: only the tokenizer differs
    other.save_pretrained(path)
    with pytest.raises(ValueError, match="has another tokenizer than the target's \\([0-9]+ tokens with other ids"):
        LLM(str(tiny_llama), dtype="float32", max_model_len=MAX_LEN, speculative_config=draft_spec(path))
    # the same weights with the target's tokenizer are taken (the check reads the ids, not the files)
    target.save_pretrained(path)
    LLM(str(tiny_llama), dtype="float32", max_model_len=MAX_LEN, speculative_config=draft_spec(path))


def test_draft_model_drafts_only_within_its_own_positions(tiny_llama, reference, tmp_path):
    """A draft model made for fewer positions than the engine's max_model_len drafts only within them (vLLM's draft
    max_model_len): past them its rotary would run beyond its context and every draft would be noise; it drafted at
    any position. The target's weights with a 24-position config: drafts all accepted up to there, none after, and
    the greedy output is the target's."""
    import shutil

    path = tmp_path / "short-draft"
    shutil.copytree(tiny_llama, path)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 24}))
    llm = LLM(
        str(tiny_llama), dtype="float32", block_size=BS, max_model_len=MAX_LEN, speculative_config=draft_spec(path)
    )
    steps: list[tuple[int, int]] = []  # per step of the request: (its tokens before the step, the drafts it carried)
    update = llm.engine.scheduler.update

    def record(batch, sampled, num_accepted=None):
        steps.extend((len(seq), len(drafts or ())) for seq, drafts in zip(batch.seqs, batch.draft_token_ids))
        return update(batch, sampled, num_accepted)

    llm.engine.scheduler.update = record
    out = llm.generate({"prompt_token_ids": PROMPTS[0]}, greedy(), use_tqdm=False)
    assert tokens(out) == reference[:1]
    drafted = [(n, d) for n, d in steps if d]
    assert drafted and all(n + d <= 24 for n, d in drafted)  # every drafted token's position is one the draft knows
    assert len(PROMPTS[0]) + NEW > 30  # (the request runs well past them)
    stats = llm.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] == stats["spec_decode_num_accepted_tokens"] > 0
