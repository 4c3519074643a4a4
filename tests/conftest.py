"""Fixtures: tiny random Hugging Face checkpoints (saved with save_pretrained) and a byte-level tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

VOCAB_SPECIALS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def make_tokenizer():
    """Byte-level BPE with no merges: every UTF-8 byte is one token, so any text round-trips exactly."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": VOCAB_SPECIALS[1:]})
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_byte_fallback_tokenizer():
    """A SentencePiece-style BPE as Llama 2 / Mistral ship it: "▁" for spaces, the 256 byte tokens <0x00>..<0xFF>
    for characters outside the vocabulary (byte fallback; here every CJK character and emoji), a decoder that strips
    the leading space, and <s> added in front."""
    from tokenizers import Tokenizer, decoders, models, normalizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["▁", "h", "e", "l", "o", "k", "w", "r", "d", "。", "▁h", "▁he", "ll", "▁hell", "▁hello"]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    vocab.update({w: 259 + i for i, w in enumerate(words)})
    merges = [("▁", "h"), ("▁h", "e"), ("l", "l"), ("▁he", "ll"), ("▁hell", "o")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def make_checkpoint(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    shard_size: str | None = None,
    dtype: torch.dtype = torch.float32,
    std: float = 0.1,
    **overrides,
) -> Path:
    """Save a tiny random model of the given family (plus tokenizer) to path and return path. Every matrix is
    drawn from N(0, std) (MoE tests take a wider one, so that the routers' weights are far from uniform)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Phi3Config,
        Phi3ForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    tok = make_tokenizer()
    base = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.eos_token_id,
    )
    if arch == "phi3":  # (Phi3Config's default pad id, 32000, is past the tiny vocabulary)
        base["pad_token_id"] = tok.eos_token_id
    base.update(overrides)
    cfg_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
        "qwen3": (Qwen3Config, Qwen3ForCausalLM),
        "qwen2_moe": (Qwen2MoeConfig, Qwen2MoeForCausalLM),
        "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM),
        "mixtral": (MixtralConfig, MixtralForCausalLM),
        "phi3": (Phi3Config, Phi3ForCausalLM),
    }[arch]
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**base)).to(dtype)
    # HF's init (std 0.02, unit norms, zero biases) gives near-uniform logits and would not exercise the
    # loading of norms and biases; random values everywhere make every tensor matter and greedy picks clear.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, std)
    kw = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, safe_serialization=True, **kw)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")


# ---- an OpenAI server on the tiny Llama, for the server tests' modules (tests/server_utils.py) -----------------
@pytest.fixture(scope="module")
def server(tiny_llama):
    """uvicorn in a thread serving the tiny Llama, one per test module (a module may define its own server)."""
    from server_utils import ServerThread

    with ServerThread(tiny_llama) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def offline(tiny_llama):
    """The offline LLM API on the server's checkpoint and options: the server tests' oracle."""
    from server_utils import ENGINE

    from infertune import LLM

    return LLM(str(tiny_llama), **ENGINE)


def hf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def read_config(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())
