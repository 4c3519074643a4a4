"""`infertune profile` counts a step that runs prefill chunks next to decodes as its own phase, "mixed".

Oracles: the attention metadata the runner built for each step (prefill chunks and decode rows, what the model
actually ran), read by a spy on the runner independent of the profiler's own bookkeeping; and the scheduler's
token-budget arithmetic for a workload chosen to overlap: two 12-token prompts under a 16-token step budget.
"""

from __future__ import annotations

import argparse
import json

import pytest
from conftest import make_checkpoint

from infertune.llm import LLM
from infertune.profile import profile_cmd
from infertune.profile.timeline import profile_workload
from infertune.sampling_params import SamplingParams

INPUT_LEN, OUTPUT_LEN, BATCH, BUDGET = 12, 4, 2, 16
GREEDY = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)
# Step 1: prompt A whole (12) + the first 4 of prompt B; step 2: A's first decode + B's other 8 (mixed); then both
# decode until A is done (steps 3..OUTPUT_LEN), and B's last decode alone.
EXPECTED = {"prefill": 1, "mixed": 1, "decode": OUTPUT_LEN - 1}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("profile-mixed"), "llama")


def test_a_step_of_prefill_chunks_and_decodes_is_a_mixed_step(ckpt):
    llm = LLM(
        str(ckpt),
        device="cpu",
        max_model_len=64,
        max_num_seqs=BATCH,
        max_num_batched_tokens=BUDGET,
        kv_cache_memory_bytes=2**20,
    )
    runner = llm.engine.executor.runner
    real = runner._prepare
    ran: list[tuple[bool, bool]] = []  # per model step: (had prefill chunks, had decode rows)

    def spy(entries):
        out = real(entries)
        meta = out[2]
        ran.append((bool(meta.prefills), meta.num_decode_tokens > 0))
        return out

    runner._prepare = spy
    try:
        result = profile_workload(llm, INPUT_LEN, OUTPUT_LEN, BATCH, GREEDY, warmup=False)
    finally:
        del runner._prepare
    oracle = ["mixed" if p and d else "prefill" if p else "decode" for p, d in ran]
    steps = [r for r in result.records if r.phase != "empty"]
    assert [r.phase for r in steps] == oracle
    assert {p: oracle.count(p) for p in EXPECTED} == EXPECTED
    assert {name: ph.steps for name, ph in result.phases.items()} == EXPECTED
    mixed = next(r for r in steps if r.phase == "mixed")
    assert (mixed.num_prefill_tokens, mixed.num_decode_tokens, mixed.num_tokens) == (INPUT_LEN - 4, 1, INPUT_LEN - 3)
    assert result.phases["prefill"].tokens == BUDGET  # the prefill phase holds only the all-prefill step


def test_the_report_and_json_show_the_mixed_phase(ckpt, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    profile_cmd.add_arguments(parser)
    out_json, out_trace = tmp_path / "s.json", tmp_path / "t.json"
    args = parser.parse_args(
        [
            "--model",
            str(ckpt),
            "--device",
            "cpu",
            "--input-len",
            str(INPUT_LEN),
            "--output-len",
            str(OUTPUT_LEN),
            "--batch",
            str(BATCH),
            "--max-num-batched-tokens",
            str(BUDGET),
            "--greedy",
            "--json",
            str(out_json),
            "--trace",
            str(out_trace),
        ]
    )
    assert profile_cmd.run(args) == 0
    summary = json.loads(out_json.read_text())
    assert list(summary["phases"]) == ["prefill", "mixed", "decode"]
    assert {p: ph["steps"] for p, ph in summary["phases"].items()} == EXPECTED
    mixed = summary["phases"]["mixed"]
    assert (mixed["prefill_tokens_per_step"], mixed["decode_tokens_per_step"]) == (INPUT_LEN - 4, 1)
    assert summary["phases"]["prefill"]["decode_tokens_per_step"] == 0
    assert summary["phases"]["decode"]["prefill_tokens_per_step"] == 0
    for ph in summary["phases"].values():
        assert sum(ph["share"].values()) == pytest.approx(1.0, abs=1e-9)
    assert [s["phase"] for s in summary["steps"]].count("mixed") == 1
    report = capsys.readouterr().out
    header = next(line for line in report.splitlines() if line.strip().startswith("category"))
    assert header.split() == ["category", "prefill", "mixed", "decode"]
    assert f"  mixed: 1 step(s), {INPUT_LEN - 3} tokens ({INPUT_LEN - 4} prefill + 1 decode" in report
    names = {e["name"] for e in json.loads(out_trace.read_text())["traceEvents"]}
    assert any(" mixed (2 seqs, 9 tokens: 8 prefill + 1 decode)" in n for n in names)
