"""Admission control (engine/admission.py) in exact arithmetic, the limits' config, and the measured host cost
of a request against what the engine really holds (tracemalloc over a real run)."""

from __future__ import annotations

import tracemalloc

import pytest

from infertune.config import LimitsConfig, parse_size
from infertune.engine.admission import Admission, HostCost, NeverFits, Overloaded

HOST = HostCost(per_seq=1000, per_token=10, per_logprob=100)


def admission(rss=lambda: 0, ceiling=10**6, baseline=0, kv_blocks=100, block_size=4, **limits):
    return Admission(LimitsConfig(**limits), kv_blocks, block_size, HOST, ceiling, baseline, rss)


def test_host_cost_is_linear_in_sequences_tokens_and_logprob_entries():
    assert HOST.bytes(1, 0, None) == 1000
    assert HOST.bytes(3, 50, None) == 3 * (1000 + 50 * 10)
    # logprobs=k keeps the sampled token's entry and k alternatives: 1 + k entries a token
    assert HOST.bytes(2, 50, 4) == 2 * (1000 + 50 * (10 + 5 * 100))
    assert HOST.bytes(2, 50, 0) == 2 * (1000 + 50 * (10 + 100))


def test_a_request_over_its_share_of_the_queue_never_fits_and_says_the_numbers():
    a = admission(max_waiting=10, max_request_share=0.5)
    assert a.cost([5], [5], n=5, logprobs=None).seqs == 5
    with pytest.raises(NeverFits) as e:
        a.cost([5, 5], [5, 5], n=3, logprobs=None)  # 2 prompts x n=3 = 6 > 5
    assert e.value.param == "n"
    assert all(s in str(e.value) for s in ("6 sequences", "2 prompt(s) x n=3", "at most 5", "max_waiting=10"))


def test_n_copies_that_the_kv_cache_cannot_hold_at_once_never_fit():
    a = admission(kv_blocks=20, block_size=4)
    assert a.cost([7], [9], n=5, logprobs=None).seqs == 5  # 5 x ceil(16 / 4) = 20 blocks: exactly the cache
    with pytest.raises(NeverFits) as e:
        a.cost([7], [10], n=5, logprobs=None)  # 5 x ceil(17 / 4) = 25 blocks
    assert all(
        s in str(e.value)
        for s in ("n=5", "prompt 7", "max_tokens 10", "25 KV-cache blocks", "holds 20", "5 sequences side by side")
    )
    with pytest.raises(NeverFits) as e:
        a.cost([50], [31], n=1, logprobs=None)  # one sequence of 81 tokens: 21 blocks
    assert e.value.param == "max_tokens"
    # Only as many samples as may run at once must be held side by side: 4 x ceil(17 / 4) = 20 blocks.
    narrow = Admission(LimitsConfig(), 20, 4, HOST, 10**6, 0, lambda: 0, max_num_seqs=4)
    assert narrow.cost([7], [10], n=50, logprobs=None).seqs == 50


def test_a_request_larger_than_the_memory_budget_never_fits():
    a = admission(ceiling=100_000, baseline=60_000)  # 40,000 bytes for requests
    assert a.budget_bytes == 40_000
    assert a.cost([10], [10], n=2, logprobs=None).host_bytes == 2 * (1000 + 20 * 10)
    with pytest.raises(NeverFits) as e:
        a.cost([10], [10], n=2, logprobs=20)  # 2 x (1000 + 20 x (10 + 21 x 100)) = 86,400
    assert "84.4 KiB" not in str(e.value) and "0.1 MiB" in str(e.value) and "logprobs=20" in str(e.value)


def test_reserve_queue_memory_and_rss_refusals_and_release():
    rss = [0]
    a = admission(rss=lambda: rss[0], ceiling=100_000, baseline=60_000, max_waiting=8, max_request_share=1.0)
    with pytest.raises(NeverFits):  # 9 sequences > 8 waiting: could never be queued
        a.cost([10], [10], n=9, logprobs=None)
    small = a.cost([10], [10], n=4, logprobs=None)  # 4,800 bytes
    a.reserve("a", small, num_waiting=0)
    with pytest.raises(Overloaded) as e:
        a.reserve("b", small, num_waiting=5)  # 5 + 4 > 8
    assert e.value.reason == "queue_full" and "5 of 8" in str(e.value)
    for key in "bcdefgh":  # 7 more: 8 x 4,800 = 38,400 of the 40,000 budget
        a.reserve(key, small, num_waiting=0)
    assert a.reserved_bytes == 8 * 4_800 and a.num_held == 8
    with pytest.raises(Overloaded) as e:
        a.reserve("i", small, num_waiting=0)  # a 9th would take 43,200
    assert e.value.reason == "memory" and "this one needs" in str(e.value)
    a.release("a")
    a.release("a")  # twice is harmless
    assert a.reserved_bytes == 7 * 4_800
    rss[0] = 100_001
    with pytest.raises(Overloaded) as e:
        a.reserve("i", small, num_waiting=0)
    assert e.value.reason == "memory_rss" and e.value.retry_after == 5.0
    rss[0] = 99_999
    a.reserve("i", small, num_waiting=0)
    for key in "bcdefghi":
        a.release(key)
    assert a.reserved_bytes == 0 and a.num_held == 0


def test_limits_config_validates_and_sizes_parse():
    assert LimitsConfig().max_seqs_per_request == 256
    assert LimitsConfig(max_waiting=1, max_request_share=0.1).max_seqs_per_request == 1
    for bad in (
        dict(max_n=0),
        dict(max_request_share=0.0),
        dict(max_request_share=1.5),
        dict(request_timeout=0),
        dict(memory_limit=-1),
        dict(max_waiting=2.5),
    ):
        with pytest.raises(ValueError, match=next(iter(bad))):
            LimitsConfig(**bad)
    assert parse_size("1000000") == 10**6
    assert parse_size("8G") == 8 * 10**9 and parse_size("512Mi") == 512 * 2**20 and parse_size("1.5GiB") == 3 * 2**29
    for bad in ("", "lots", "-5M", "5X", "0"):
        with pytest.raises(ValueError, match="size in bytes"):
            parse_size(bad)


def test_measured_host_cost_matches_what_a_real_request_holds(tiny_llama):
    """The oracle: tracemalloc around real requests run through the engine (samples, logprobs, block tables and
    each step's output, at the step they hold the most), against the linear estimate measured on synthetic
    samples. A one-token request's run is subtracted, so a step's own transient objects cancel out."""
    from infertune.config import EngineConfig
    from infertune.engine.llm_engine import LLMEngine
    from infertune.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig.create(str(tiny_llama), dtype="float32", max_model_len=256, block_size=4))
    cost = engine.measure_host_cost()
    prompt = list(range(10, 30))

    def held(n: int, max_tokens: int, logprobs: int | None) -> int:
        engine.step()  # nothing queued
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            engine.add_request(
                "r",
                {"prompt_token_ids": prompt},
                SamplingParams(n=n, max_tokens=max_tokens, logprobs=logprobs, ignore_eos=True, temperature=1.0, seed=1),
            )
            peak, final = 0, None
            while engine.has_unfinished_requests():
                for out in engine.step():
                    final = out
                peak = max(peak, tracemalloc.get_traced_memory()[0] - before)
        finally:
            tracemalloc.stop()
        assert final.finished and all(len(c.token_ids) == max_tokens for c in final.outputs)
        return peak

    for n, max_tokens, logprobs in ((8, 120, None), (4, 120, 5), (2, 200, 20)):
        # (run once untimed: what the engine keeps per batch shape the first time it meets one, e.g. the fused decode
        # step's per-row-count arguments, is the engine's, not the request's)
        held(n, max_tokens, logprobs)
        # (each the least of two runs: an allocation the process makes once, at some step of some run (a cache,
        # a lazily built object), is not the request's either; one such, ~70 KB, doubled a run's figure in a full
        # suite once in a while)
        measured = min(held(n, max_tokens, logprobs) for _ in range(2)) - min(held(1, 1, logprobs) for _ in range(2))
        estimate = cost.bytes(n, len(prompt) + max_tokens, logprobs) - cost.bytes(1, len(prompt) + 1, logprobs)
        assert 0.5 * measured <= estimate <= 2.0 * measured, (n, logprobs, estimate, measured)


def test_offline_engine_applies_the_same_request_bounds(tiny_llama):
    from infertune import LLM, SamplingParams

    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, block_size=4, max_n=2, max_stop=1)
    with pytest.raises(ValueError, match="n=3 is more than the engine.s limit of 2"):
        llm.generate("x", SamplingParams(n=3, max_tokens=2))
    with pytest.raises(ValueError, match="2 stop strings is more than the limit of 1"):
        llm.generate("x", SamplingParams(stop=["a", "b"], max_tokens=2))
    out = llm.generate("x", SamplingParams(n=2, max_tokens=2, ignore_eos=True))[0]
    assert [len(c.token_ids) for c in out.outputs] == [2, 2]


def test_readme_limits_table_is_the_one_made_from_the_config():
    from pathlib import Path

    from infertune.cli import build_parser, limits_table

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("<!-- limits-options:begin -->\n", 1)[1].split("\n<!-- limits-options:end -->", 1)[0]
    assert block == limits_table(), "README's limits table is stale; paste infertune.cli.limits_table() there"
    serve = build_parser().parse_args(["serve", "--max-n", "7", "--memory-limit", "1.5Gi", "--request-timeout", "2"])
    assert (serve.max_n, serve.memory_limit, serve.request_timeout) == (7, 3 * 2**29, 2.0)
