"""vLLM's EngineArgs / AsyncEngineArgs, for ported scripts that build their engine from them:

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())   # --model and the engine flags of `serve`
    engine = LLMEngine.from_engine_args(EngineArgs.from_cli_args(parser.parse_args()))
    engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model="path/to/hf-folder", max_model_len=2048))
    llm = LLM(**vars(EngineArgs(model=..., ...)))

The options are LLM(...)'s (the README's table, vLLM's own names taken as LLM takes them); they are checked by name
here and by value when the engine is built.
"""

from __future__ import annotations

import argparse
import difflib


class EngineArgs:
    """The model and the engine options, as attributes (vars(args) is LLM's keyword arguments)."""

    def __init__(self, model: str | None = None, **options) -> None:
        from infertune.config import VLLM_GPU_OPTIONS, VLLM_PORTED_OPTIONS, OptionError, option_fields

        known = [f.name for f in option_fields() if f.name != "model"]
        known += [*VLLM_GPU_OPTIONS, *VLLM_PORTED_OPTIONS, "chat_template", "show_progress"]
        for name in options:
            if name not in known:
                close = difflib.get_close_matches(name, known, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise OptionError(f"EngineArgs: unknown engine option {name!r}{hint}")
        self.model = model
        self.__dict__.update(options)

    def options(self) -> dict:
        """The engine options given (the model left out)."""
        return {k: v for k, v in vars(self).items() if k != "model"}

    def create_engine_config(self):
        """The EngineConfig these arguments make (vLLM's name); a bad value is an error naming the option."""
        from infertune.config import EngineConfig

        options = {k: v for k, v in self.options().items() if k not in ("chat_template", "show_progress")}
        return EngineConfig.create(self.model, **options)

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        """Add --model and the engine flags (`infertune serve --help`'s engine group, vLLM's hidden GPU flags) to
        parser, and return it (vLLM's)."""
        from infertune.engine_flags import add_engine_args

        add_engine_args(parser)
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """The arguments of a parser that add_cli_args made (vLLM's)."""
        from infertune.engine_flags import engine_kwargs

        options = {k: v for k, v in engine_kwargs(args).items() if k in _engine_option_names()}
        return cls(args.model, **options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in vars(self).items())})"


def _engine_option_names() -> set[str]:
    from infertune.config import VLLM_GPU_OPTIONS, option_fields

    return {f.name for f in option_fields()} | set(VLLM_GPU_OPTIONS)


# vLLM's name for the arguments of its async engine: the same options here
AsyncEngineArgs = EngineArgs
