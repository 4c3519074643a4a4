"""Hugging Face architecture name -> model class."""

from __future__ import annotations

from torch import nn

from infertune.config import SUPPORTED_ARCHITECTURES
from infertune.models.deepseek import DeepseekForCausalLM
from infertune.models.gemma import GemmaForCausalLM
from infertune.models.llama import LlamaForCausalLM

_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
    "Qwen2MoeForCausalLM": LlamaForCausalLM,
    "Qwen3MoeForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": LlamaForCausalLM,
    "DeepseekV2ForCausalLM": DeepseekForCausalLM,
    "DeepseekV3ForCausalLM": DeepseekForCausalLM,
    "Gemma2ForCausalLM": GemmaForCausalLM,
    "Gemma3ForCausalLM": GemmaForCausalLM,
    "Phi3ForCausalLM": LlamaForCausalLM,  # (its fused checkpoint tensors: ArchConfig.fused_checkpoint, the loader)
}
assert set(_REGISTRY) == set(SUPPORTED_ARCHITECTURES)


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return _REGISTRY[architecture]
    except KeyError:
        raise ValueError(f"architecture {architecture!r} is not supported; supported: {', '.join(_REGISTRY)}") from None
