"""The tuning tools' answers to what a user gets wrong (from a QA pass over plan, tune, ledger, bench, eval, profile
and quantize): one clear error naming the flag or the file, before the long work, never a traceback after it or a
value silently replaced; and what the tools print is what the engine will do (the serve command for a rate, the
bytes of infertune's own quantized checkpoints).

Oracles: the planner's own arithmetic (WeightFormat bytes of each stored layer) and the split it reports for the
rate; the file system (a path that cannot be written)."""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import make_checkpoint

from infertune.files import check_writable
from infertune.plan.command import main as plan_main


def _gpt2_folder(tmp_path: Path) -> Path:
    """A folder whose config.json names an architecture the engine does not run."""
    folder = tmp_path / "gpt2"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
    return folder


def test_check_writable_names_the_flag(tmp_path):
    check_writable("--json", None)
    check_writable("--json", "-")
    check_writable("--json", tmp_path / "out.json")
    check_writable("--json", tmp_path / "new" / "deeper" / "out.json", make_parents=True)
    with pytest.raises(ValueError, match="--json .*the folder .* does not exist"):
        check_writable("--json", tmp_path / "missing" / "out.json")
    with pytest.raises(ValueError, match="--trace .* is a folder"):
        check_writable("--trace", tmp_path)
    if os.geteuid() != 0:  # (root writes anywhere a mode allows nothing)
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ValueError, match="not writable"):
            check_writable("--md", locked / "x.md")
    with pytest.raises(ValueError, match="--out-config /proc/x.json: /proc is not writable"):
        check_writable("--out-config", "/proc/x.json", make_parents=True)


def test_tune_checks_the_model_and_its_numbers_before_the_sweep(tmp_path, monkeypatch):
    from infertune.tune.command import add_arguments, model_vocab, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*not supported"):
        run(parser.parse_args(["--model", str(_gpt2_folder(tmp_path))]))
    empty = tmp_path / "cfgonly"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="not supported"):  # (was a bare KeyError: 'vocab_size')
        run(parser.parse_args(["--model", str(empty)]))
    for flag in ("--input-len", "--output-len", "--num-prompts", "--repeats"):
        with pytest.raises(ValueError, match=f"{flag} must be at least 1, not 0"):
            run(parser.parse_args([flag, "0"]))
    with pytest.raises(ValueError, match="--out-config /proc/tuned.json"):
        run(parser.parse_args(["--out-config", "/proc/tuned.json"]))
    # the config it writes names the model by an absolute path (LLM(**config) from any folder)
    ckpt = make_checkpoint(tmp_path / "tiny", "llama")
    monkeypatch.chdir(tmp_path)
    model, vocab = model_vocab("tiny")
    assert model == str(ckpt.resolve()) and Path(model).is_absolute() and vocab > 256
    assert model_vocab(None)[0] is None  # (the demo model stays "the default")


def test_bench_refuses_an_unsupported_architecture_in_one_line(tmp_path):
    from infertune.cli import build_parser

    args = build_parser().parse_args(
        ["bench", "latency", "--model", str(_gpt2_folder(tmp_path)), "--systems", "infertune"]
    )
    with pytest.raises(SystemExit, match="error: --model .*gpt2: .*GPT2LMHeadModel.*not supported"):
        args.func(args)
    latency = build_parser().parse_args(["bench", "latency"])
    assert latency.batch == [1]
    top = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    bench = next(a for a in top.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction))
    help_text = bench.choices["latency"].format_help()
    assert "(default: 1)" in help_text and "(default: 1,16)" not in help_text


def test_eval_refuses_values_it_would_replace(tmp_path):
    from infertune.evaluate.command import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for flags, message in [
        (["--stride", "0"], "--stride must be at least 1, not 0"),
        (["--context", "0"], "--context must be at least 2, not 0"),
        (["--num-prompts", "-1"], "--num-prompts must be at least 0, not -1"),
        (["--greedy-tokens", "0"], "--greedy-tokens must be at least 1, not 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            run(parser.parse_args(flags))


def test_plan_pd_serve_command_runs_the_split_for_the_rate(capsys):
    assert plan_main(["--model", "qwen3-8b", "--device", "910b", "--pd", "--rate", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    pd = plan["pd_split"]
    want = f"--pd {pd['prefill_instances_for_rate']}:{pd['decode_instances_for_rate']}"
    assert want in plan["serve_command"] and "--model MODEL_DIR" in plan["serve_command"]
    assert (pd["prefill_instances_for_rate"], pd["decode_instances_for_rate"]) != (
        pd["prefill_instances"],
        pd["decode_instances"],
    )
    if pd["colocated_requests_per_s"] > pd["requests_per_s"]:
        assert "colocated serving of the same" in plan["serve_reason"]
    assert plan_main(["--model", "qwen3-8b", "--device", "910b", "--pd", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (
        f"--pd {plan['pd_split']['prefill_instances']}:{plan['pd_split']['decode_instances']}" in plan["serve_command"]
    )


@pytest.mark.parametrize("method", ["w8a16", "w4a16", "w8a8"])
def test_plan_counts_infertunes_own_quantized_checkpoints(tmp_path, capsys, method):
    """What `infertune quantize` writes (compressed-tensors with an "infertune" entry) is planned at its stored bytes:
    the same figure as planning the source with --weight-dtype (w8a8's int8 weights are w8a16's bytes)."""
    src = make_checkpoint(tmp_path / "src", "llama")
    cfg = json.loads((src / "config.json").read_text())
    out = tmp_path / method
    out.mkdir()
    for f in src.iterdir():
        if f.name != "config.json" and f.is_file():
            shutil.copy(f, out / f.name)
    group = {"weights": {"num_bits": 4, "group_size": 32}} if method == "w4a16" else {"weights": {"num_bits": 8}}
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": group},
        "infertune": {"format_version": 1, "method": method},
    }
    (out / "config.json").write_text(json.dumps(cfg))
    assert plan_main(["--model", str(out), "--device", "h100", "--context", "128", "--json"]) == 0
    stored = json.loads(capsys.readouterr().out)
    as_flag = "w8a16" if method == "w8a8" else method  # (w8a8: the same bytes, and named w8a8 in its plan)
    args = ["--model", str(src), "--device", "h100", "--context", "128", "--json", "--weight-dtype", as_flag]
    assert plan_main(args + (["--group-size", "32"] if method == "w4a16" else [])) == 0
    flagged = json.loads(capsys.readouterr().out)
    assert stored["weights"] == flagged["weights"] and stored["settings"]["weight_dtype"] == method
    assert not any("not modelled" in w for w in stored["warnings"])


def test_an_unknown_flag_is_said_by_the_subcommand(capsys):
    """`infertune bench latency --bogus`: the error and usage are bench latency's, not infertune's top level."""
    from infertune.cli import main

    with pytest.raises(SystemExit):
        main(["bench", "latency", "--bogus"])
    err = capsys.readouterr().err
    assert err.startswith("usage: infertune bench latency") and "unrecognized arguments: --bogus" in err
    with pytest.raises(SystemExit):
        main(["plan", "--nope", "1"])
    assert "infertune plan: error: unrecognized arguments: --nope 1" in capsys.readouterr().err


def test_generate_says_the_weights_quantization(capsys):
    from infertune.cli import main

    assert main(["generate", "--quantization", "w8a16", "--max-tokens", "2", "--dtype", "float32", "def f("]) == 0
    assert ", weights w8a16" in capsys.readouterr().err


def test_flags_that_would_be_dropped_are_errors(capsys):
    from infertune.cli import main

    assert main(["doctor", "--quantization", "w8a16"]) == 2
    assert "--quantization only apply with --consistency" in capsys.readouterr().err
    assert main(["eval", "--keep-fp", "lm_head"]) == 2
    assert "--keep-fp and --quant-group-size shape an on-the-fly --quantization" in capsys.readouterr().err
    assert main(["eval", "--quant-group-size", "64"]) == 2


def test_plan_warns_that_a_float32_checkpoint_runs_in_float32(tmp_path, capsys):
    ckpt = make_checkpoint(tmp_path / "fp32", "llama")  # (saved in float32: config.json says so)
    assert plan_main(["--model", str(ckpt), "--device", "h100", "--context", "128", "--json"]) == 0
    warnings = json.loads(capsys.readouterr().out)["warnings"]
    assert any("float32: the engine's dtype=auto keeps float32" in w for w in warnings)
    import torch

    bf16 = make_checkpoint(tmp_path / "bf16", "llama", dtype=torch.bfloat16)
    assert plan_main(["--model", str(bf16), "--device", "h100", "--context", "128", "--json"]) == 0
    assert not any("float32" in w for w in json.loads(capsys.readouterr().out)["warnings"])


def test_serve_config_may_hold_the_servers_own_settings(tmp_path):
    """vLLM config files hold port / served_model_name / api_key beside engine options: they override the flags, as
    the defaults as the engine options there do (they were passed twice: a TypeError traceback), and a flag written on
    the command line overrides them (vLLM's order)."""
    from unittest import mock

    from infertune.cli import main

    ckpt = make_checkpoint(tmp_path / "tiny", "llama")
    cfg = tmp_path / "serve.json"
    cfg.write_text(json.dumps({"port": 18104, "served_model_name": "x", "graceful_timeout": 3, "max_num_seqs": 2}))
    with mock.patch("infertune.serve.launcher.serve", return_value=0) as serve:
        assert main(["serve", "--model", str(ckpt), "--config", str(cfg), "--port", "9"]) == 0
    kw = serve.call_args.kwargs
    assert (kw["port"], kw["served_model_name"], kw["graceful_timeout_s"], kw["max_num_seqs"]) == (9, "x", 3, 2)
    with mock.patch("infertune.serve.launcher.serve", return_value=0) as serve:  # the file's port, none on the line
        assert main(["serve", "--model", str(ckpt), "--config", str(cfg)]) == 0
    assert serve.call_args.kwargs["port"] == 18104


def test_flags_are_taken_as_written_not_by_prefix(tmp_path):
    """`--tokenizer X` was argparse's prefix of the hidden vLLM flag --tokenizer-mode (ignored with a warning); it is
    the engine's tokenizer option now, and no flag matches by prefix."""
    from infertune.cli import build_parser, engine_kwargs

    args = build_parser().parse_args(["serve", "--tokenizer", "/tmp/tok"])
    assert engine_kwargs(args)["tokenizer"] == "/tmp/tok" and "tokenizer_mode" not in engine_kwargs(args)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-model", "64"])


def test_ported_vllm_serve_lines_and_the_models_route(tmp_path, monkeypatch):
    """`vllm serve` flags that are this engine's defaults or mean nothing here parse (--enable-prefix-caching keeps
    the cache on, --disable-log-requests is one warning); VLLM_API_KEY protects /v1/* as --api-key does;
    GET /v1/models/{id} is the model card (OpenAI's models.retrieve), another name a 404 model_not_found."""
    from unittest import mock

    import openai
    from server_utils import ServerThread

    from infertune.cli import build_parser, engine_kwargs, main

    args = build_parser().parse_args(["serve", "--enable-prefix-caching", "--disable-log-requests"])
    kw = engine_kwargs(args)
    assert kw["enable_prefix_caching"] is True and kw["disable_log_requests"] is True
    assert engine_kwargs(build_parser().parse_args(["serve", "--no-prefix-caching"]))["enable_prefix_caching"] is False
    ckpt = make_checkpoint(tmp_path / "tiny", "llama")
    monkeypatch.setenv("VLLM_API_KEY", "sekret")
    with mock.patch("infertune.serve.launcher.serve", return_value=0) as serve:
        assert main(["serve", "--model", str(ckpt)]) == 0
    assert serve.call_args.kwargs["api_key"] == "sekret"
    with ServerThread(ckpt) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        card = client.models.retrieve("tiny")
        assert card.id == "tiny" and card.created > 0 and client.models.list().data[0].id == "tiny"
        with pytest.raises(openai.NotFoundError, match="model_not_found|does not exist"):
            client.models.retrieve("other")


def test_json_has_one_meaning_in_every_command(tmp_path, capsys):
    """--json [OUT] everywhere: with OUT the JSON goes to that file and the report to stdout as usual; bare, stdout
    holds the JSON alone (parsed here by json.loads) and the report goes to stderr. Every command that takes --json
    takes both forms."""
    from infertune.cli import build_parser, main

    assert main(["plan", "--device", "910b", "--json"]) == 0
    out = capsys.readouterr()
    plan = json.loads(out.out)
    assert plan["device"]["name"] == "910b" and "tokens" in out.err  # (the table, on stderr)
    path = tmp_path / "sub" / "plan.json"
    assert main(["plan", "--device", "910b", "--json", str(path)]) == 0
    out = capsys.readouterr()
    assert json.loads(path.read_text()) == plan and "Ascend 910B" in out.out and not out.out.lstrip().startswith("{")

    def json_flags(parser, trail=()):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from json_flags(sub, (*trail, name))
            elif "--json" in action.option_strings:
                yield trail, action

    found = list(json_flags(build_parser()))
    assert len(found) >= 12
    for trail, action in found:
        assert (action.nargs, action.const, action.default) == ("?", "-", None), trail
