"""`infertune ledger` says where its figures were measured (the CPU) and the command that reproduces them."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from infertune.cli import main


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the CPU's name from /proc/cpuinfo (Linux)")
def test_ledger_names_the_cpu_and_the_command_in_markdown_and_json(tmp_path, monkeypatch, capsys):
    from infertune.tune import ledger

    # The steps themselves are measured elsewhere (test_tune.py); here, only what the report says around them.
    row = dict(
        step="eager",
        label="infertune eager",
        lossy=False,
        status="ok",
        output_tok_s=10.0,
        kv_cache_bytes=0,
        rss_growth_mib=1.0,
        ttft_p50_s=0.01,
        gain_vs_previous=None,
        cumulative_vs_hf=None,
    )
    workload = dict(requests=2, input_len=4, output_len=2, batch=1, dtype="float32", greedy=True, ignore_eos=True)
    monkeypatch.setattr(
        ledger,
        "build_ledger",
        lambda args, progress=True: dict(model="m", isolated=False, workload=workload, steps=[row]),
    )
    cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).strip()
    argv = ["ledger", "--input-len", "4", "--output-len", "2", "--batch", "1", "--md", str(tmp_path / "l.md")]
    argv += ["--json", str(tmp_path / "l.json")]
    assert main(argv) == 0
    md = (tmp_path / "l.md").read_text()
    doc = json.loads((tmp_path / "l.json").read_text())
    assert doc["machine"]["cpu"] == cpu and doc["machine"]["cpus"] == os.cpu_count()
    assert doc["command"] == "infertune " + shlex.join(argv)
    assert f"Measured on: {cpu}, {os.cpu_count()} CPUs" in md
    assert f"Command: `infertune {shlex.join(argv)}`" in md
    assert md.strip() in capsys.readouterr().out


def test_ledger_says_when_the_kernels_row_ran_no_kernels(tmp_path, monkeypatch):
    """At --dtype float32 the engine builds no decode kernels (they are bf16): the kernels row timed torch's path
    under the label "+ decode kernels" without a word, and the MoE rows blamed "this machine"."""
    import argparse
    import functools

    from infertune import LLM
    from infertune.tune import ledger, measure
    from tests.conftest import make_checkpoint

    model = make_checkpoint(
        tmp_path / "moe", arch="qwen3_moe", num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32
    )

    @functools.cache
    def engine_kernels(dtype: str, decode_kernels: str):  # the oracle: what the engine itself builds
        runner = LLM(str(model), dtype=dtype, max_model_len=32, decode_kernels=decode_kernels).engine.executor.runner
        return None if runner.decode_kernels is None else runner.decode_kernels.name

    def fake_measure(model, options, prompts, output_lens, warmup_prompts=None, repeats=1):
        kernels = engine_kernels(options["dtype"], options.get("decode_kernels", "off"))
        return dict(status="ok", output_tok_s=1.0, decode_kernels=kernels, kv_cache_bytes=0, rss_growth_mib=0.0)

    monkeypatch.setattr(measure, "measure_infertune", fake_measure)
    p = argparse.ArgumentParser()
    ledger.add_arguments(p)
    args = p.parse_args(["--model", str(model), "--dtype", "float32", "--no-hf", "--no-accuracy", "--in-process"])
    args.input_len, args.output_len, args.batch = 4, 2, 1
    assert engine_kernels("float32", "auto") is None
    rows = {r["step"]: r for r in ledger.build_ledger(args, progress=False)["steps"] if r["step"] != "tuned"}
    assert rows["kernels"]["note"] == "the decode kernels did not run: they are bf16 kernels and --dtype is float32"
    for key in ("moe_router", "moe_experts", "moe_fused"):
        assert rows[key]["note"] == "the decode kernels did not run (see the kernels row)"


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--num-prompts", "0"], "--num-prompts must be >= 1, got 0"),  # (stood for the default silently)
        (["--num-prompts", "-1"], "--num-prompts must be >= 1, got -1"),  # (an IndexError traceback)
        (["--max-batch", "0"], "--max-batch must be >= 1, got 0"),
        (["--repeats", "0"], "--repeats must be >= 1, got 0"),
        (["--quant-group-size", "7"], "--quant-group-size must be one of 32, 64, 128, 256, got 7"),
        (["--accuracy-tokens", "0"], "--accuracy-tokens must be >= 2 (or give --no-accuracy), got 0"),
        (["--pd", "--pd-num-prompts", "0"], "--pd-num-prompts must be >= 1, got 0"),
        (["--longctx", "--longctx-decode", "0"], "--longctx-decode must be >= 3 (the first two are not timed), got 0"),
        (["--longctx", "--longctx-context", "0"], "--longctx-context must be >= 1, got 0"),
        (["--longctx", "--longctx-keep", "1"], "--longctx-keep must lie in (0, 1), got 1.0"),
        (["--longctx", "--longctx-threshold", "0"], "--longctx-threshold must be >= 1, got 0"),
        (["--pd", "--pd-request-rate", "0"], "--pd-request-rate must be > 0, got 0.0"),
    ],
)
def test_ledger_refuses_a_value_no_step_can_use_before_the_first_step(tmp_path, monkeypatch, capsys, flags, said):
    from infertune.tune import ledger

    def no_steps(*a, **k):
        raise AssertionError("a step ran")

    monkeypatch.setattr(ledger, "build_ledger", no_steps)
    assert main(["ledger", "--md", str(tmp_path / "l.md"), *flags]) == 2
    assert capsys.readouterr().err.strip() == f"infertune ledger: error: {said}"
    assert not (tmp_path / "l.md").exists()


def test_ledger_help_gives_every_valued_options_meaning_and_default():
    """(--dtype's help was "(default: bfloat16)" alone, --cache-dir's gave no default)"""
    import argparse

    from infertune.tune import ledger

    p = argparse.ArgumentParser()
    ledger.add_arguments(p)
    for action in p._actions:
        if action.option_strings and action.nargs != 0 and action.default is not None:
            text = action.help or ""
            assert "default" in text and not text.startswith("("), (action.option_strings, text)
