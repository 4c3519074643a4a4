"""infertune: an LLM inference engine and tuning toolkit for constrained accelerators."""

from infertune.engine.outputs import CompletionOutput, RequestOutput
from infertune.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM and AsyncLLM pull in torch (and transformers for some tokenizers); import it lazily so `import infertune` and the
    # CLI's --help stay fast.
    if name in ("LLM", "TextPrompt", "TokensPrompt"):
        import infertune.llm

        return getattr(infertune.llm, name)
    if name in ("AsyncLLM", "AsyncLLMEngine"):  # (AsyncLLMEngine: vLLM's older name of its async engine)
        from infertune.async_llm import AsyncLLM

        return AsyncLLM
    if name == "LLMEngine":
        from infertune.engine.llm_engine import LLMEngine

        return LLMEngine
    if name in ("EngineArgs", "AsyncEngineArgs"):
        from infertune.engine_args import EngineArgs

        return EngineArgs
    if name == "EngineConfig":
        from infertune.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)


__all__ = [
    "LLM",
    "TextPrompt",
    "TokensPrompt",
    "AsyncLLM",
    "AsyncLLMEngine",
    "LLMEngine",
    "EngineArgs",
    "AsyncEngineArgs",
    "SamplingParams",
    "RequestOutputKind",
    "StructuredOutputsParams",
    "RequestOutput",
    "CompletionOutput",
    "EngineConfig",
    "__version__",
]
