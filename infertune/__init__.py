"""infertune: an LLM inference engine and tuning toolkit for constrained accelerators."""

from infertune.engine.outputs import CompletionOutput, RequestOutput
from infertune.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM and AsyncLLM pull in torch (and transformers for some tokenizers); import it lazily so `import infertune` and the
    # CLI's --help stay fast.
    if name == "LLM":
        from infertune.llm import LLM

        return LLM
    if name == "AsyncLLM":
        from infertune.async_llm import AsyncLLM

        return AsyncLLM
    if name == "EngineConfig":
        from infertune.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)


__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "RequestOutputKind",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineConfig",
    "__version__",
]
