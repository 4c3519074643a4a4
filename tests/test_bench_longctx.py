"""`infertune bench longctx` and `infertune ledger --longctx`: the KV a sequence holds per configuration (against
the bytes a token's K and V take, computed from the checkpoint's config), the accuracy harness (its full-KV
teacher-forced log-probs against HF transformers' on the same tokens), and clear errors for bad settings."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch

from infertune.bench import longctx


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    s = longctx.Settings(contexts=[200], layers=2, decode=5, block_size=16, chunk=128)
    return s, longctx.model_path(tmp_path_factory.mktemp("longctx"), s)


def _token_bytes(path) -> int:
    """K and V of one token over every layer, fp32: the oracle the engine's blocks are counted against."""
    cfg = json.loads((path / "config.json").read_text())
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 4


def test_kv_per_sequence_follows_each_configuration(tiny):
    s, path = tiny
    configs = {"full": None, "window 64": {"policy": [{"window": 64}]}, "snapkv keep 0.25": longctx.snapkv(0.25)}
    configs |= {"int8 KV": longctx.int8(), "int8 + int4 after 64": longctx.int8(64)}
    rows = {r["config"]: r for r in longctx.speed_rows(path, s, configs, log=lambda m: None, warmup=False)}
    tok, bs, ctx = _token_bytes(path), s.block_size, s.contexts[0]
    # int8: D int8 values and a 4-byte scale per token and KV head instead of D fp32 values, every token kept.
    cfg = json.loads((path / "config.json").read_text())
    tok8 = tok * (cfg["head_dim"] + 4) // (4 * cfg["head_dim"])
    assert (
        math.ceil((ctx + 2) / bs) * bs * tok8 <= rows["int8 KV"]["kv"] <= math.ceil((ctx + s.decode) / bs) * bs * tok8
    )
    # ...and with the int4 tier, each pair of blocks wholly 64 tokens behind the computed ones takes one block.
    lo = math.ceil((ctx + 2) / bs) - (ctx + s.decode - 1 - 64) // bs // 2
    hi = math.ceil((ctx + s.decode) / bs) - (ctx + 1 - 64) // bs // 2
    assert lo * bs * tok8 <= rows["int8 + int4 after 64"]["kv"] <= hi * bs * tok8
    budget = int(s.budget_mib * 2**20)
    # Full attention: every token's K and V, in whole blocks (the prompt plus the tokens decoded while timed).
    assert math.ceil((ctx + 2) / bs) * bs * tok <= rows["full"]["kv"] <= math.ceil((ctx + s.decode) / bs) * bs * tok
    # A window of 64 in every layer: at least the window, at most its blocks plus the one being filled.
    assert 64 * tok <= rows["window 64"]["kv"] <= (math.ceil(64 / bs) + 1) * bs * tok
    # SnapKV keeping a quarter of the prompt: the kept tokens and the decoded ones, in whole blocks.
    kept = int(ctx * 0.25)
    assert kept * tok <= rows["snapkv keep 0.25"]["kv"] <= math.ceil((kept + s.decode) / bs + 1) * bs * tok
    for r in rows.values():
        assert r["seqs"] == budget // r["kv"] and r["tok_s"] > 0 and r["ttft"] > 0
    assert "| 200 | snapkv keep 0.25 |" in longctx.render({"speed": list(rows.values())}, s.budget_mib)


def test_only_picks_configurations_by_their_first_words():
    s = longctx.Settings(int4_after=512)
    speed = longctx.chosen(longctx.speed_configs(s), ["int8", "snapkv"], "speed")
    assert list(speed) == ["full", "snapkv keep 0.25", "int8 KV", "int8 + int4 after 512"]
    assert list(longctx.chosen(longctx.accuracy_configs(s), ["int8 +"], "accuracy")) == [
        "int8 + int4 after 128",
        "int8 + int4 after 0",
    ]
    with pytest.raises(ValueError, match="matches no speed configuration"):
        longctx.chosen(longctx.speed_configs(s), ["int4"], "speed")


def test_full_kv_teacher_forcing_matches_hf_and_a_window_wider_than_the_text_changes_nothing():
    from transformers import AutoModelForCausalLM

    from infertune import LLM
    from infertune.config import default_model_path

    model = default_model_path()
    s = longctx.Settings(acc_prompt=48, acc_cont=6, acc_windows=2)
    w = longctx.heldout_windows(model, s.acc_prompt + s.acc_cont, 1)[0]
    got = longctx.teacher_forced(LLM(model, dtype="float32"), w[: s.acc_prompt], w[s.acc_prompt :])
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([w])).logits[0, s.acc_prompt - 1 : -1]
    torch.testing.assert_close(got, torch.log_softmax(logits.float(), -1), atol=1e-3, rtol=0)

    rows = longctx.accuracy_rows(
        s,
        {"wide window": {"policy": [{"window": 4096}]}, "snapkv keep 0.25": longctx.snapkv(0.25, window_size=8)},
        log=lambda m: None,
    )
    by = {r["config"]: r for r in rows}
    assert by["wide window"]["kl"] == pytest.approx(0.0, abs=1e-6) and by["wide window"]["top1"] == 1.0
    assert by["snapkv keep 0.25"]["kl"] > 1e-4  # three quarters of the prompt evicted: the distributions move
    assert all(r["positions"] == 2 * (s.acc_cont - 1) for r in rows)


def test_ledger_longctx_step_reports_the_policy_beside_full_kv(tmp_path):
    from infertune.tune import ledger

    p = argparse.ArgumentParser()
    ledger.add_arguments(p)
    args = p.parse_args(
        [
            "--longctx",
            "--longctx-context",
            "160",
            "--longctx-decode",
            "4",
            "--longctx-threshold",
            "64",
            "--no-accuracy",
            "--cache-dir",
            str(tmp_path),
        ]
    )
    doc, md = ledger.longctx_step(args, log=lambda m: None)
    full, pol = (next(r for r in doc["speed"] if r["config"] == c) for c in ("full", "policy"))
    assert doc["context"] == 160 and doc["policy"]["policy"][1]["max_length"] == 64
    assert pol["kv"] < full["kv"] and pol["seqs"] > full["seqs"]  # above the threshold the policy compresses
    assert "| + window + compression policy |" in md and "| full KV |" in md
    assert f"{full['kv'] / pol['kv']:.1f}x the sequences" in md


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "longctx", "--keep", "1.5", "--skip-accuracy"], "must lie in (0, 1)"),
        (["bench", "longctx", "--decode", "2", "--skip-accuracy"], "at least 3 decode steps"),
        (["ledger", "--longctx", "--longctx-keep", "0"], "must lie in (0, 1)"),
        # (a budget of 0 or less was measured: 'sequences in 0 MiB', 0 or a negative count of sequences)
        (["bench", "longctx", "--budget-mib", "0", "--skip-accuracy"], "--budget-mib 0: the KV pool must be"),
        (["bench", "longctx", "--budget-mib", "-5", "--skip-accuracy"], "--budget-mib -5: the KV pool must be"),
        (["bench", "longctx", "--window", "0", "--skip-accuracy"], "--window 0: layers, block size"),
    ],
)
def test_bad_settings_are_clear_errors_before_anything_runs(argv, message, capsys):
    from infertune.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("only", ["length", "streaming", "nosuch"])
def test_an_only_one_part_lacks_is_an_error_before_either_part_runs(only, monkeypatch, capsys):
    """'length policy' is a speed configuration only, 'streaming_llm ...' an accuracy one: with both parts on, the
    part that lacks it is named before anything is built or run (the accuracy part failed after the whole speed
    part had run)."""
    from infertune.cli import main

    def must_not_run(*a, **k):
        raise AssertionError("a part ran before --only was checked")

    monkeypatch.setattr(longctx, "model_path", must_not_run)
    monkeypatch.setattr(longctx, "speed_rows", must_not_run)
    monkeypatch.setattr(longctx, "accuracy_rows", must_not_run)
    assert main(["bench", "longctx", "--only", only, "--contexts", "64", "--decode", "3"]) == 2
    part = "speed" if only == "streaming" else "accuracy" if only == "length" else "speed"
    assert f"--only {only!r} matches no {part} configuration" in capsys.readouterr().err


def test_contexts_must_be_positive_token_counts(capsys):
    from infertune.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "longctx", "--contexts", "1024,abc"])
    assert "comma-separated token counts" in capsys.readouterr().err
