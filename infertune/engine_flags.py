"""The engine's command-line flags, made from the options' declarations in infertune/config.py (help, choices,
default, flag): added to a parser (`infertune generate` / `serve` and the tools, vLLM's EngineArgs.add_cli_args) and
read back as LLM(...)'s keyword arguments. Imports config alone (the CLI and engine_args share it without importing
each other)."""

from __future__ import annotations

import argparse


def _engine_groups() -> tuple[str, ...]:
    """The config groups of the engine flags: every option group but the request limits (they have their own)."""
    from infertune.config import OPTION_GROUPS

    return tuple(g for g in OPTION_GROUPS if g != "limits")


def _flagged(*groups: str) -> list:
    """The declared options of these config groups that have a CLI flag, in order."""
    from infertune.config import engine_flag, option_fields

    return [f for f in option_fields(*groups) if engine_flag(f.name)]


def _add_flags(g, groups: tuple[str, ...]) -> None:
    from infertune.config import engine_flag, engine_option_kwargs

    for f in _flagged(*groups):
        g.add_argument(engine_flag(f.name), dest=f.name, **engine_option_kwargs(f.name))


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's flags, made from the option declarations of infertune/config.py (ModelConfig ... ParallelConfig)."""
    _add_flags(
        p.add_argument_group(
            "engine", "how the model is loaded, batched and cached (the LLM(...) options of the same names)"
        ),
        _engine_groups(),
    )
    from infertune.config import VLLM_GPU_OPTIONS

    # vLLM's --enable-prefix-caching: the default here (--no-prefix-caching turns it off); hidden, a no-op
    p.add_argument(
        "--enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_true",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    # and vLLM's spelling of turning it off (BooleanOptionalAction's --no- form): --no-prefix-caching's, hidden
    p.add_argument(
        "--no-enable-prefix-caching",
        dest="enable_prefix_caching",
        action="store_false",
        default=argparse.SUPPRESS,
        help=argparse.SUPPRESS,
    )
    for name, (kind, _) in VLLM_GPU_OPTIONS.items():  # (ported `vllm serve` lines: taken with a warning, unlisted)
        flag = "--" + name.replace("_", "-")
        if kind == "switch":
            p.add_argument(flag, dest=name, action="store_const", const=True, default=None, help=argparse.SUPPRESS)
        else:
            p.add_argument(flag, dest=name, default=None, help=argparse.SUPPRESS)


def add_limits_args(p: argparse.ArgumentParser) -> None:
    """The request limits' flags, made from LimitsConfig's fields (their help, types and defaults live there)."""
    _add_flags(
        p.add_argument_group("request limits", "what one request may cost, checked before it is queued"), ("limits",)
    )


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The LLM(...) options the engine and request-limit flags of `args` give, by their declared names; --model is
    left out, the commands pass it as LLM's first argument."""
    from infertune.config import VLLM_GPU_OPTIONS

    engine = {f.name: getattr(args, f.name) for f in _flagged(*_engine_groups()) if f.name != "model"}
    engine |= {k: getattr(args, k) for k in VLLM_GPU_OPTIONS if getattr(args, k, None) is not None}
    return {f.name: getattr(args, f.name) for f in _flagged("limits") if hasattr(args, f.name)} | engine
