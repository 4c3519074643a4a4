"""`infertune tune` (recommendation on synthetic tables, a tiny real sweep) and `infertune ledger` end to end."""

from __future__ import annotations

import argparse
import json
import math

import pytest

from infertune.tune.recommend import knee, parse_slo, recommend, slo_violations


def row(b, tok_s, ttft_ms=10.0, tpot_ms=5.0, status="ok", tokens=2048):
    r = dict(max_num_seqs=b, max_num_batched_tokens=tokens, status=status)
    if status == "ok":
        r.update(
            output_tok_s=tok_s,
            ttft_p50_s=ttft_ms / 2e3,
            ttft_p90_s=ttft_ms / 1e3,
            ttft_p99_s=ttft_ms / 1e3,
            tpot_p50_s=tpot_ms / 2e3,
            tpot_p90_s=tpot_ms / 1e3,
            tpot_p99_s=tpot_ms / 1e3,
        )
    else:
        r.update(output_tok_s=None, error="ValueError: the KV-cache budget ...")
    return r


# A seeds-style batch table: throughput rises, then flattens; latency grows with the batch; the largest OOMs.
TABLE = [
    row(1, 100, 20, 10),
    row(2, 190, 30, 11),
    row(4, 350, 60, 12),
    row(8, 600, 90, 20),
    row(16, 620, 150, 40),
    row(32, None, status="oom"),
]


def test_parse_slo_units_and_errors():
    assert parse_slo("ttft_p90=100ms,tpot_p90=0.05s") == {
        "ttft_p90": pytest.approx(0.1),
        "tpot_p90": pytest.approx(0.05),
    }
    assert parse_slo("ttft_p50=250") == {"ttft_p50": pytest.approx(0.25)}  # bare numbers are ms
    assert parse_slo(None) == {} and parse_slo("") == {}
    for bad in ("ttft=100ms", "ttft_p90", "ttft_p90=fast", "ttft_p90=-3ms"):
        with pytest.raises(ValueError):
            parse_slo(bad)


def test_slo_picks_the_fastest_row_that_meets_it():
    rec = recommend(TABLE, parse_slo("ttft_p90=100ms,tpot_p90=25ms"))
    assert rec.online["max_num_seqs"] == 8  # 16 is faster but breaks both terms
    assert rec.offline["max_num_seqs"] == 16
    tight = recommend(TABLE, parse_slo("ttft_p90=50ms"))
    assert tight.online["max_num_seqs"] == 2
    assert slo_violations(TABLE[4], parse_slo("ttft_p90=100ms")) == ["ttft_p90 150.0 ms > 100 ms"]


def test_oom_and_failed_rows_are_never_picked():
    rows = [row(1, 100), row(2, 150), row(4, math.inf, status="oom"), row(8, 1e9, status="error")]
    rows[2]["output_tok_s"] = 1e12  # even a (bogus) throughput figure on an OOM row must not win
    rec = recommend(rows, parse_slo("ttft_p90=1s"))
    assert rec.online["max_num_seqs"] == 2 and rec.offline["max_num_seqs"] == 2
    none = recommend([row(1, None, status="oom"), row(2, None, status="oom")], {})
    assert none.online is None and none.offline is None and "OOM" in none.messages[0]


def test_no_row_meets_the_slo_gives_a_clear_message():
    rec = recommend(TABLE, parse_slo("ttft_p90=1ms"))
    assert rec.online is None
    assert rec.offline["max_num_seqs"] == 16  # the offline pick does not depend on the SLO
    assert "no measured setting meets the SLO" in rec.messages[0] and "max_num_seqs=1" in rec.messages[0]


def test_ties_prefer_the_smaller_batch_and_knee_marks_the_plateau():
    rec = recommend([row(4, 500), row(8, 500)], {})
    assert rec.offline["max_num_seqs"] == 4
    assert knee(TABLE) == {2048: 8}  # 8 -> 16 gains 3 %, under the 5 % threshold
    assert knee([row(1, 10), row(2, 20), row(4, None, status="oom")]) == {2048: 2}
    assert knee([row(1, 10), row(2, 20)]) == {2048: None}  # still rising at the end of the sweep


def _args(module, argv):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p.parse_args(argv)


def test_tune_tiny_sweep_writes_a_config_llm_accepts(tmp_path, capsys):
    from infertune import LLM, SamplingParams
    from infertune.tune import command

    out = tmp_path / "cfg.json"
    args = _args(
        command,
        [
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--max-batch",
            "2",
            "--batched-tokens",
            "64",
            "--slo",
            "ttft_p90=60s",
            "--out-config",
            str(out),
        ],
    )
    assert command.run(args) == 0
    text = capsys.readouterr().out
    assert "| variant | batch | batched tokens | tokens/s | TTFT" in text and "online: base, max_num_seqs=" in text
    cfg = json.loads(out.read_text())
    assert cfg["max_num_seqs"] in (1, 2) and cfg["max_num_batched_tokens"] == 64
    # the written options are engine options, and they serve prompts longer than the sweep's (12 tokens a request)
    assert "max_model_len" not in cfg
    out_long = LLM(**cfg).generate([list(range(3, 43))], SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert out_long.error is None and len(out_long.outputs[0].token_ids) == 2

    # A KV budget too small for one sequence: every setting is an OOM row and nothing is recommended.
    args = _args(
        command,
        [
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--max-batch",
            "2",
            "--batched-tokens",
            "64",
            "--kv-cache-memory-bytes",
            "64",
            "--json",
        ],
    )
    assert command.run(args) == 1
    doc = json.loads(capsys.readouterr().out)
    assert {r["status"] for r in doc["rows"]} == {"oom"} and doc["offline"] is None


def test_tune_sweeps_kv_dtype_quantization_and_dynamic_batch(capsys):
    from infertune.tune import command

    args = _args(
        command,
        [
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--max-batch",
            "2",
            "--batched-tokens",
            "64",
            "--kv-cache-dtype",
            "auto,int8",
            "--quantization",
            "none,w8a16",
            "--max-running-tokens",
            "none,12",
            "--json",
        ],
    )
    assert command.run(args) == 0
    doc = json.loads(capsys.readouterr().out)
    rows = doc["rows"]
    assert len(rows) == 2 * 2 * 2 * 2  # variants x batches 1, 2
    assert {r["variant"] for r in rows} == {
        "",
        "kv int8",
        "w8a16",
        "dynamic <= 12 tok",
        "kv int8, w8a16",
        "kv int8, dynamic <= 12 tok",
        "w8a16, dynamic <= 12 tok",
        "kv int8, w8a16, dynamic <= 12 tok",
    }
    for r in rows:
        assert r["status"] == "ok" and r["output_tok_s"] > 0
        assert r["options"].get("kv_cache_dtype", "auto") == ("int8" if "kv int8" in r["variant"] else "auto")
        assert r["options"].get("quantization") == ("w8a16" if "w8a16" in r["variant"] else None)
    # The same KV budget holds more tokens with int8: its rows report fewer KV bytes per setting.
    kv = {(r["variant"], r["max_num_seqs"]): r["kv_cache_bytes"] for r in rows}
    assert kv[("kv int8", 2)] < kv[("", 2)]
    assert doc["offline"]["model"] is None and "max_num_seqs" in doc["offline"]


def test_ledger_end_to_end_on_the_demo_model(tmp_path, capsys):
    from infertune.tune import ledger

    out_json, out_md = tmp_path / "ledger.json", tmp_path / "ledger.md"
    args = _args(
        ledger,
        [
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--batch",
            "2",
            "--accuracy-tokens",
            "512",
            "--in-process",
            "--json",
            str(out_json),
            "--md",
            str(out_md),
        ],
    )
    assert ledger.run(args) == 0
    doc = json.loads(out_json.read_text())
    steps = {s["step"]: s for s in doc["steps"]}
    assert list(steps) == [
        "hf",
        "eager",
        "batching",
        "prepack",
        "compiled",
        "kernels",
        "int8_kv",
        "w8a16",
        "w8a8",
        "w4a16",
        "tuned",
    ]
    for s in steps.values():
        assert s["status"] == "ok", s
        assert s["output_tok_s"] > 0 and s["ttft_p50_s"] > 0
        assert s["cumulative_vs_hf"] > 0
    assert steps["hf"]["cumulative_vs_hf"] == pytest.approx(1.0)
    assert steps["eager"]["options"]["max_num_seqs"] == 1 and steps["eager"]["options"]["prepack_weights"] is False
    assert steps["batching"]["options"]["max_num_seqs"] == 2
    assert steps["prepack"]["options"]["prepack_weights"] is True and steps["prepack"]["options"]["compile"] == "off"
    assert steps["compiled"]["options"]["compile"] == "on" and steps["compiled"]["options"]["decode_kernels"] == "off"
    assert steps["kernels"]["options"]["decode_kernels"] == "auto" and steps["w8a16"]["options"]["compile"] == "off"
    assert (
        steps["w4a16"]["options"]["quantization"] == "w4a16" and steps["w4a16"]["options"]["kv_cache_dtype"] == "int8"
    )
    assert steps["w8a8"]["options"]["quantization"] == "w8a8"
    for key in (
        "int8_kv",
        "w8a16",
        "w8a8",
        "w4a16",
    ):  # lossy steps carry a measured perplexity on the trained demo model
        acc = steps[key]["accuracy"]
        assert acc["perplexity"] > 0 and acc["ref_perplexity"] > 0
    assert steps["tuned"]["tuner_rows"]
    md = out_md.read_text()
    assert "| + compiled decode (torch.compile) |" in md and "| + decode kernels, fused decode step" in md
    assert "HF transformers generate" in md and md in capsys.readouterr().out


def test_isolated_measurement_reports_its_own_peak_rss():
    from infertune.tune.measure import run_isolated

    row = run_isolated(
        "measure_infertune",
        threads=1,
        model=None,
        options=dict(dtype="bfloat16", max_model_len=12, max_num_seqs=2, enable_prefix_caching=False),
        prompts=[[5, 6, 7, 8], [9, 10, 11, 12]],
        output_lens=[4, 4],
        timeout=120,
    )
    assert row["status"] == "ok" and row["output_tok_s"] > 0 and row["peak_rss_mib"] > 0
    oom = run_isolated(
        "measure_infertune",
        threads=1,
        model=None,
        options=dict(max_model_len=12, kv_cache_memory_bytes=8),
        prompts=[[5]],
        output_lens=[2],
    )
    assert oom["status"] == "oom" and "KV-cache budget" in oom["error"]


def test_plot_without_matplotlib_is_a_clear_error(tmp_path):
    try:
        import matplotlib  # noqa: F401

        pytest.skip("matplotlib is installed")
    except ImportError:
        pass
    from infertune.tune import command

    args = _args(command, ["--max-batch", "1", "--plot", str(tmp_path / "p.png")])
    with pytest.raises(ValueError, match="pip install matplotlib"):
        command.run(args)


def test_tune_plot_is_written(tmp_path, capsys):
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib (the [plot] / [test] extras install it)")
    from infertune.tune import command

    out = tmp_path / "tune.png"
    args = _args(
        command,
        [
            "--input-len",
            "8",
            "--output-len",
            "4",
            "--max-batch",
            "2",
            "--batched-tokens",
            "64",
            "--kv-cache-dtype",
            "auto,int8",
            "--plot",
            str(out),
        ],
    )
    assert command.run(args) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_ledger_accuracy_runs_w4a16_at_the_steps_group_size(tiny_llama):
    """hidden 64: the default group of 128 does not divide it; the step's own group size (64) must reach the
    accuracy engine (it used to fall back to 128 there and fail)."""
    from infertune.tune import ledger

    args = _args(ledger, ["--accuracy-tokens", "256", "--dtype", "float32"])
    got = ledger.accuracy_delta(str(tiny_llama), {"quantization": "w4a16", "quant_group_size": 64}, args)
    assert got["tokens"] > 0 and got["perplexity"] > 0 and 0 < got["top1_agreement"] <= 1


def test_tune_kv_threshold_lengths_past_the_model_fail_before_the_sweep(tiny_llama, monkeypatch):
    from infertune.tune import command

    monkeypatch.setattr(command, "sweep", lambda *a, **k: pytest.fail("the sweep ran"))
    args = _args(
        command,
        ["--model", str(tiny_llama), "--input-len", "8", "--output-len", "4", "--max-batch", "1"]
        + ["--kv-compression", '{"press": "snapkv", "compression_ratio": 0.5}'],
    )
    with pytest.raises(ValueError, match="kv-threshold-lengths"):
        command.run(args)
