"""Every engine option is declared once (infertune/config.py, _opt); the CLI flags, engine_kwargs and the README's
options table are made from the declarations, and these tests hold them to it."""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
from dataclasses import fields
from pathlib import Path

import pytest

from infertune.cli import build_parser, engine_kwargs, engine_table
from infertune.config import (
    OPTION_GROUPS,
    EngineConfig,
    SpeculativeConfig,
    default_model_path,
    engine_choices,
    engine_flag,
    engine_option_kwargs,
    option_fields,
)
from infertune.kv_compression import KVCompressionConfig

README = Path(__file__).resolve().parents[1] / "README.md"
ENGINE_GROUPS = ("model", "device", "scheduler", "cache", "quant", "parallel")  # the groups of the "engine" flags
# vLLM's options accepted with their default only (anything else a clear error), so that vLLM commands that spell the
# default out run: no other value exists to round-trip
ONLY_THE_DEFAULT = {"pipeline_parallel_size"}

# A value for every flagged option without a fixed set of choices: (flag text, the value the config must then hold).
# Each differs from the option's default, so a flag that is dropped or mis-wired shows. A new option needs a row.
SAMPLES = {
    "max_model_len": ("32", 32),
    "seed": ("7", 7),
    "max_num_seqs": ("3", 3),
    "tensor_parallel_size": ("2", 2),
    "kv_connector": ("p2p", "p2p"),
    "max_num_batched_tokens": ("512", 512),
    "kv_int4_after": ("1024", 1024),
    "max_running_tokens": ("100", 100),
    "speculative_config": ('{"method": "ngram", "num_speculative_tokens": 2}', SpeculativeConfig(2)),
    "kv_compression": (
        '{"press": "snapkv", "compression_ratio": 0.5}',
        KVCompressionConfig.from_dict({"press": "snapkv", "compression_ratio": 0.5}),
    ),
    "block_size": ("8", 8),
    "kv_cache_memory_bytes": ("64Mi", 64 * 2**20),
    "kv_cache_memory_fraction": ("0.25", 0.25),
    "max_n": ("7", 7),
    "max_prompts": ("5", 5),
    "max_stop": ("3", 3),
    "max_stop_len": ("9", 9),
    "max_stop_token_ids": ("11", 11),
    "max_waiting": ("40", 40),
    "max_request_share": ("0.25", 0.25),
    "request_timeout": ("2.5", 2.5),
    "memory_limit": ("1.5Gi", 3 * 2**29),
    "kv_connector_config": ('{"path": "/tmp/kv", "lease_s": 5}', {"path": "/tmp/kv", "lease_s": 5}),
    "generation_config": ("vllm", "vllm"),
    "tokenizer": ("/tmp/some-tokenizer", "/tmp/some-tokenizer"),
    "override_generation_config": ('{"temperature": 0.5}', {"temperature": 0.5}),
}
# options that are only valid beside another (the config refuses them alone): the flags that go with them
COMPANIONS = {"quantize_lm_head": ["--quantization", "w8a16"], "kv_int4_after": ["--kv-cache-dtype", "int8"]}


def _subparser(name: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _group_actions(parser: argparse.ArgumentParser, title: str) -> list[argparse.Action]:
    return next(g for g in parser._action_groups if g.title == title)._group_actions


def _group_of(name: str) -> str:
    return next(g for g in OPTION_GROUPS if any(f.name == name for f in option_fields(g)))


def _value(config: EngineConfig, name: str):
    return getattr(getattr(config, _group_of(name)), name)


@pytest.fixture()
def model_dir(tmp_path) -> str:
    """A model folder other than the default: the config alone (EngineConfig reads no weights)."""
    shutil.copy(Path(default_model_path()) / "config.json", tmp_path / "config.json")
    return str(tmp_path)


def test_every_config_field_is_a_declared_option():
    for group, cls in OPTION_GROUPS.items():
        declared = {f.name for f in option_fields(group)}
        assert declared == {f.name for f in fields(cls)} - {"arch"}, f"{cls.__name__}: a field without _opt(help=)"
        for f in option_fields(group):
            assert f.metadata["help"].strip(), f"{f.name} has no help"
    assert {f.metadata.get("flag") for f in option_fields() if "flag" in f.metadata} >= {"--no-prefix-caching"}


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_every_flag_maps_to_an_option_and_round_trips(command, model_dir):
    parser = _subparser(command)
    groups, titles = (
        (ENGINE_GROUPS + ("limits",), ("engine", "request limits"))
        if command == "serve"
        else (ENGINE_GROUPS, ("engine",))
    )
    assert {g.title for g in parser._action_groups} >= set(titles)
    actions = [a for title in titles for a in _group_actions(parser, title)]
    flagged = {f.name: f for f in option_fields(*groups) if engine_flag(f.name)}
    assert {a.dest for a in actions} == set(flagged), "a flag without a declared option, or an option without its flag"
    assert {a.option_strings[0] for a in actions} == {engine_flag(n) for n in flagged}
    prefix = ["x"] if command == "generate" else []
    for action in actions:
        name, f = action.dest, flagged[action.dest]
        if name == "model":
            args = parser.parse_args([*prefix, "--model", model_dir])
            assert EngineConfig.create(args.model, **engine_kwargs(args)).model.model == model_dir
            continue
        if engine_choices(name):
            value = next(c for c in reversed(engine_choices(name)) if c != f.default)
            argv, expected = [action.option_strings[0], str(value)], value
        elif str(f.type) == "bool":
            argv, expected = [action.option_strings[0]], not f.default
        elif name in ONLY_THE_DEFAULT:  # (no other value to send: the default spelled out must reach the config)
            argv, expected = [action.option_strings[0], str(f.default)], f.default
            config = EngineConfig.create(None, **engine_kwargs(parser.parse_args([*prefix, *argv])))
            assert _value(config, name) == expected, name
            continue
        else:
            assert name in SAMPLES, f"add a sample value for the new option {name} to SAMPLES"
            text, expected = SAMPLES[name]
            argv = [action.option_strings[0], text]
        assert expected != f.default, name
        args = parser.parse_args([*prefix, *argv, *COMPANIONS.get(name, [])])
        kwargs = engine_kwargs(args)
        assert "model" not in kwargs  # the commands pass --model as LLM's first argument
        config = EngineConfig.create(args.model, **kwargs)
        assert _value(config, name) == expected, f"{' '.join(argv)} gave {name}={_value(config, name)!r}"
        if name not in ("max_model_len", "tokenizer"):  # None there means the model's positions / its folder
            plain = EngineConfig.create(None, **engine_kwargs(parser.parse_args(prefix)))
            assert _value(plain, name) == f.default, f"{name}: the flag's default is not the declared one"


def test_flat_python_keywords_are_unchanged():
    config = EngineConfig.create(
        None,
        max_num_seqs=3,
        quantization="w8a16",
        kv_cache_dtype="int8",
        device="cpu",
        enable_prefix_caching=False,
        decode_kernels="off",
        distributed_executor_backend="mp",
        max_n=2,
        keep_fp=["lm_head", "model.layers.0.*"],
    )
    assert (config.scheduler.max_num_seqs, config.quant.quantization) == (3, "w8a16")
    assert (config.cache.kv_cache_dtype, config.cache.enable_prefix_caching) == ("int8", False)
    assert (config.device.device, config.model.decode_kernels) == ("cpu", "off")
    assert (config.parallel.distributed_executor_backend, config.limits.max_n) == ("mp", 2)
    assert config.quant.keep_fp == ("lm_head", "model.layers.0.*")
    with pytest.raises(TypeError, match="unknown engine option 'max_num_seq'"):
        EngineConfig.create(None, max_num_seq=3)


CHOICE_OPTIONS = [f.name for f in option_fields(*ENGINE_GROUPS) if engine_choices(f.name)]


@pytest.mark.parametrize("name", CHOICE_OPTIONS)
def test_parser_choices_are_the_values_the_config_accepts(name, capsys):
    assert set(CHOICE_OPTIONS) >= {
        "dtype",
        "device",
        "decode_kernels",
        "compress_weights",
        "compile",
        "kv_cache_dtype",
        "quantization",
        "quant_group_size",
        "distributed_executor_backend",
    }
    parser = _subparser("serve")
    action = next(a for a in _group_actions(parser, "engine") if a.dest == name)
    assert tuple(action.choices) == engine_choices(name)
    for value in engine_choices(name):
        assert _value(EngineConfig.create(None, **{name: value}), name) == value
    bad = 48 if isinstance(engine_choices(name)[0], int) else "bogus"
    with pytest.raises(ValueError, match=f"{name}={bad!r} is not one of"):
        EngineConfig.create(None, **{name: bad})
    with pytest.raises(SystemExit):
        parser.parse_args([engine_flag(name), str(bad)])
    err = capsys.readouterr().err  # argparse quotes a bad str choice ('bogus'), not a bad int (48)
    assert f"argument {engine_flag(name)}: invalid choice: {bad!r}" in err


def test_options_without_choices_take_any_value_of_their_type(capsys):
    for f in option_fields(*ENGINE_GROUPS):
        if engine_flag(f.name) and not engine_choices(f.name):
            action = next(a for a in _group_actions(_subparser("serve"), "engine") if a.dest == f.name)
            assert action.choices is None, f.name
    with pytest.raises(SystemExit):
        _subparser("serve").parse_args(["--kv-cache-memory-bytes", "lots"])
    assert "'lots' is not a size in bytes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="block_size=12 must be a positive power of two"):
        EngineConfig.create(None, **engine_kwargs(_subparser("serve").parse_args(["--block-size", "12"])))


def test_every_tool_offers_only_values_the_engine_takes():
    """profile, audit, debug-layers, eval, tune, bench ...: a flag named like an engine option that has choices
    offers a subset of the declared ones (they take them from engine_option_kwargs)."""
    flags = {engine_flag(f.name): f.name for f in option_fields(*ENGINE_GROUPS) if engine_choices(f.name)}

    def walk(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, child in action.choices.items():
                    yield from walk(child, f"{path} {name}")
            for flag in action.option_strings:
                if flag in flags and action.choices is not None:
                    yield path, flag, action.choices

    seen = list(walk(build_parser(), "infertune"))
    assert {p for p, _, _ in seen} >= {
        "infertune profile",
        "infertune audit",
        "infertune debug-layers",
        "infertune eval",
        "infertune bench throughput",
    }
    for path, flag, choices in seen:
        assert set(choices) <= set(engine_choices(flags[flag])), f"{path} {flag} offers {choices}"
    with pytest.raises(ValueError, match="not among its declared"):
        engine_option_kwargs("dtype", choices=("float32", "int8"))


def test_help_says_the_default_and_keeps_the_groups():
    text = _subparser("serve").format_help()
    assert "\nengine:\n" in text and "\nrequest limits:\n" in text
    for f in option_fields(*ENGINE_GROUPS, "limits"):
        if engine_flag(f.name):
            assert len(re.findall(rf"^  {engine_flag(f.name)}(?=[ \n])", text, re.M)) == 1, f.name
    assert "(default: auto)" in engine_option_kwargs("decode_kernels")["help"]
    assert "25%% fewer bytes" in engine_option_kwargs("compress_weights")["help"]  # argparse shows it as 25%
    assert "25% fewer bytes" in text
    assert engine_option_kwargs("dtype", default="bfloat16")["help"].endswith("(default: bfloat16)")


def test_readme_engine_table_is_the_one_made_from_the_config():
    readme = README.read_text()
    block = readme.split("<!-- engine-options:begin -->\n", 1)[1].split("\n<!-- engine-options:end -->", 1)[0]
    assert block == engine_table(), "README's engine options table is stale; paste infertune.cli.engine_table() there"
    for f in option_fields(*ENGINE_GROUPS):
        assert f"| `{f.name}` |" in block
    links = re.findall(r"\]\(([^)#]*)#([^)]+)\)", block)
    assert {path for path, _ in links} >= {"docs/kernels.md", "docs/tools.md", ""}, links
    for path, anchor in links:  # every link lands on a heading (GitHub's slug of it)
        page = (README.parent / path).read_text() if path else readme
        slugs = {
            re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.+)$", page, re.M)
        }
        assert anchor in slugs, (path, anchor)


def test_options_take_sizes_and_name_wrong_types_and_misspellings(tiny_llama):
    from infertune.config import EngineConfig

    cfg = EngineConfig.create(str(tiny_llama), kv_cache_memory_bytes="4Mi", memory_limit="2G")
    assert cfg.cache.kv_cache_memory_bytes == 4 * 2**20 and cfg.limits.memory_limit == 2 * 10**9
    cfg = EngineConfig.create(str(tiny_llama), kv_cache_memory_bytes=8e6, max_model_len=64.0)  # whole floats
    assert cfg.cache.kv_cache_memory_bytes == 8_000_000 and cfg.model.max_model_len == 64
    for bad, fragment in (
        (dict(max_model_len=1.5), "max_model_len=1.5 must be an integer"),
        (dict(max_num_seqs="4"), "max_num_seqs='4' must be an integer"),
        (dict(kv_cache_memory_bytes="lots"), "kv_cache_memory_bytes"),
        (dict(max_num_seq=4), "did you mean 'max_num_seqs'"),
    ):
        with pytest.raises(ValueError, match=re.escape(fragment)):
            EngineConfig.create(str(tiny_llama), **bad)
        with pytest.raises(TypeError):  # (also a TypeError: an unknown or wrongly typed keyword argument)
            EngineConfig.create(str(tiny_llama), **bad)


def test_serve_config_with_a_misspelled_key_is_a_one_line_error(tiny_llama, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text('{"max_num_seq": 4}')
    r = subprocess.run(
        [sys.executable, "-m", "infertune.cli", "serve", "--model", str(tiny_llama), "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0 and "Traceback" not in r.stderr and "did you mean 'max_num_seqs'" in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "infertune.cli", "serve", "--port", "99999"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 2 and "not a port number" in r.stderr
