"""infertune: an LLM inference engine and tuning toolkit for constrained accelerators."""

from infertune.engine.outputs import CompletionOutput, RequestOutput
from infertune.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):
    # LLM pulls in torch (and transformers for some tokenizers); import it lazily so `import infertune` and the
    # CLI's --help stay fast.
    if name == "LLM":
        from infertune.llm import LLM

        return LLM
    if name == "EngineConfig":
        from infertune.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "EngineConfig", "__version__"]
