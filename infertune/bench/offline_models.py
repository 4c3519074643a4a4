"""Models for the offline benchmark: presets, the byte-level tokenizer, building the random model, config helpers."""

from __future__ import annotations

import datetime as _dt
import json
import os
import shutil
import sys
import time
from pathlib import Path

from infertune.bench.step_bytes import checkpoint_tensors

VOCAB_SIZE = 32000
SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>"]
MODEL_FORMAT_VERSION = 1  # bump when the built model changes, so stale caches are not reused

# Random-weight model shapes (LlamaForCausalLM unless "family" says otherwise; COMMON_SHAPE fills the rest).
# "386m" is the model of /work/shared/BASELINES.md (Qwen2.5-0.5B's body with a 32k vocabulary);
# "qwen2.5-0.5b" is Qwen2.5-0.5B's shape with its real vocabulary and q/k/v biases (494M); "llama-1b" is
# Llama-3.2-1B's shape (1.24B, 2.5 GB in bf16); "moe" is Qwen3-30B-A3B scaled to fit here (64 experts of 384, top-8,
# renormalised, every layer MoE: 1.3B parameters, 0.2B active a token); "mla" is DeepSeek-V2-Lite scaled the same way
# (its latent attention as shipped: 16 heads, latent 512 + rope 64, q without low rank; 64 experts of 384, top-6, two
# shared, the first layer dense: 1.0B parameters, 12 layers); "mla-v3" is the same body with DeepSeek-V3's attention
# and routing (queries through a low rank of 384, sigmoid scores with a correction bias, top-8 renormalised and
# scaled by 2.5, one shared expert), in one expert group: the shape llama.cpp's deepseek2 also runs (its GGUF export
# refuses V2-Lite's full-rank queries outside 27 layers, and group-limited routing).
# The two MLA presets' common body (a DeepSeek-V2-Lite-like shape scaled to fit here)
_MLA_BODY = dict(
    hidden_size=1024,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=16,
    intermediate_size=2816,  # the first layer's dense MLP
    kv_lora_rank=512,
    qk_rope_head_dim=64,
    qk_nope_head_dim=128,
    v_head_dim=128,
    n_routed_experts=64,
    moe_intermediate_size=384,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
)
PRESETS = {
    "386m": dict(
        hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, intermediate_size=4864
    ),
    "small": dict(
        hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=512
    ),
    "qwen2.5-0.5b": dict(
        family="qwen2",
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
        vocab_size=151936,
    ),
    "llama-1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        rope_theta=5e5,
    ),
    "moe": dict(
        family="qwen3_moe",
        hidden_size=1024,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        intermediate_size=3072,  # (unused: no dense layer)
        moe_intermediate_size=384,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=True,
    ),
    "mla": dict(
        _MLA_BODY,
        family="deepseek_v2",
        q_lora_rank=None,
        num_experts_per_tok=6,
        n_shared_experts=2,
        topk_method="greedy",
        norm_topk_prob=False,
    ),
    "mla-v3": dict(
        _MLA_BODY,
        family="deepseek_v3",
        q_lora_rank=384,
        num_experts_per_tok=8,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        topk_method="noaux_tc",  # (V3's own; vLLM makes room for the correction bias only under it)
    ),
}
COMMON_SHAPE = dict(
    vocab_size=VOCAB_SIZE,
    tie_word_embeddings=True,
    rope_theta=1e6,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    hidden_act="silu",
)
DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float16": 2}
SAFETENSORS_DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1, "BOOL": 1}


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Model building and inspection
# --------------------------------------------------------------------------------------------------
def make_tokenizer(vocab_size: int = VOCAB_SIZE):
    """Byte-level tokenizer (every UTF-8 byte is one token) padded to vocab_size.

    The padding entries are plain vocabulary entries made of two (then three) byte symbols (unreachable by
    encoding, as there are no merges), so any id decodes to real bytes, as with a trained BPE vocabulary.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    target = vocab_size - len(SPECIAL_TOKENS)
    for a in alphabet:
        for b in alphabet:
            if len(vocab) >= target:
                break
            vocab[a + b] = len(vocab)
    for a in alphabet:
        for b in alphabet:
            for c in alphabet:
                if len(vocab) >= target:
                    break
                vocab[a + b + c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=SPECIAL_TOKENS[0])
    fast.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS[1:]})
    assert len(fast) == vocab_size, len(fast)
    return fast


def ensure_model(preset: str, cache_dir: Path) -> Path:
    """Build the random-weight model of `preset` once (bf16, save_pretrained) and return its folder."""
    shape = dict(PRESETS[preset])
    family = shape.pop("family", "llama")
    out = cache_dir / f"{family}-{preset.removeprefix(family + '-')}-random-bf16-v{MODEL_FORMAT_VERSION}"
    if (out / ".complete").is_file():
        log(f"using cached model {out}")
        return out
    import torch
    import transformers

    config_cls, model_cls = (
        getattr(transformers, name)
        for name in {
            "llama": ("LlamaConfig", "LlamaForCausalLM"),
            "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
            "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
            "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
        }[family]
    )
    log(f"building random-weight {model_cls.__name__} '{preset}' into {out} (once) ...")
    t0 = time.perf_counter()
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache_dir / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tok = make_tokenizer(shape.get("vocab_size", VOCAB_SIZE))
    eos = tok.eos_token_id
    config = config_cls(**(COMMON_SHAPE | shape), bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(0)
    model = model_cls(config).to(torch.bfloat16).eval()  # HF's own init (normal, std 0.02)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    n_params = sum(p.numel() for p in model.parameters())
    del model
    (tmp / ".complete").write_text(
        json.dumps({"preset": preset, "params": n_params, "built": _dt.datetime.now().isoformat(timespec="seconds")})
        + "\n"
    )
    shutil.rmtree(out, ignore_errors=True)  # a half-written folder from an interrupted build
    os.replace(tmp, out)
    log(f"built {n_params / 1e6:.1f}M parameters in {time.perf_counter() - t0:.1f} s")
    return out


def checkpoint_param_count(model_dir: Path) -> int:
    """Number of stored weight elements, read from the safetensors headers (no tensor is loaded); DeepSeek's
    multi-token-prediction layers, which the benchmark's systems do not load, are not counted."""
    if not any(model_dir.glob("*.safetensors")):
        raise SystemExit(f"error: {model_dir} has no *.safetensors files")
    return sum(n for name, n in checkpoint_tensors(model_dir, 1) if not name.endswith("rotary_emb.inv_freq"))


def read_model_config(model_dir: Path) -> dict:
    path = model_dir / "config.json"
    if not path.is_file():
        raise SystemExit(f"error: {model_dir} is not a Hugging Face model folder (no config.json)")
    return json.loads(path.read_text())


def kv_bytes_per_token(cfg: dict, dtype: str) -> int:
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    kv_heads = cfg.get("num_key_value_heads") or heads
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * DTYPE_BYTES[dtype]
