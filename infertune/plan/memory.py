"""Memory model: exact weight bytes, KV-cache bytes and the sequences that fit, all from a model's config.json.

Pure integer arithmetic on `ArchConfig` (no torch). Every count here is exact for the Llama / Qwen2 / Mistral
layer layout that infertune runs; the tests check it against `sum(p.numel())` of a real transformers model.

Conventions:
- bytes are exact integers; a "GB" in a message is 1e9 bytes;
- W8A16 = int8 weights + one scale per output channel; W4A16 = int4 weights + a scale and a zero point per group
  of `group_size` input elements of each output row (the `scales_and_zeros` layout of aten's int4 kernels, which
  infertune's quant/int4.py uses; zero_bytes=0 models a scale-only format). Scales and zeros are bf16 (2 bytes).
  Only the seven linear layers of each decoder layer are quantized unless `quantize_lm_head` (infertune keeps the
  lm_head in full precision by default too); embeddings, norms and biases stay in bf16;
- INT8 KV stores one scale per token, per layer, per KV head, for K and for V (`kv_scale_bytes`, fp16: 2), so a
  token costs 2 x layers x kv_heads x (head_dim + kv_scale_bytes) bytes: a factor (head_dim + 2) / (2 x head_dim)
  of the 16-bit cache (0.5078 for head_dim 128). With kv_scale_bytes=0 (one scale per tensor) it is exactly half.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from infertune.config import ArchConfig

WEIGHT_DTYPES = ("bf16", "bf16-12bit", "w8a16", "w4a16")
KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "int8")


@dataclass(frozen=True)
class ModelSpec:
    """An ArchConfig plus what the planner needs beyond it: which layers use a sliding window."""

    name: str
    arch: ArchConfig
    num_windowed_layers: int  # layers whose KV is capped at arch.sliding_window tokens

    @classmethod
    def from_dict(cls, cfg: dict, name: str = "model", where: str = "config.json") -> ModelSpec:
        arch = ArchConfig.from_dict(cfg, where=where)
        layers = arch.num_hidden_layers
        windowed = 0
        if arch.sliding_window is not None:
            if cfg.get("layer_types"):
                windowed = sum(1 for t in cfg["layer_types"] if t == "sliding_attention")
            elif arch.architecture == "Qwen2ForCausalLM":
                # Qwen2 windows the layers from max_window_layers on (transformers' Qwen2Config.layer_types).
                windowed = layers - int(cfg.get("max_window_layers", layers))
            else:
                windowed = layers
        return cls(name=name, arch=arch, num_windowed_layers=max(0, min(layers, windowed)))

    @classmethod
    def load(cls, path: str | Path) -> ModelSpec:
        """A Hugging Face model folder or a config.json file."""
        p = Path(path)
        file = p / "config.json" if p.is_dir() else p
        if not file.is_file():
            raise FileNotFoundError(
                f"{path!r}: no config.json there; pass a Hugging Face model folder or its config.json"
            )
        try:
            cfg = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from e
        name = (p if p.is_dir() else p.parent).name or "model"
        return cls.from_dict(cfg, name=name, where=str(file))


# ---------------------------------------------------------------------------------------------- weights


@dataclass(frozen=True)
class WeightFormat:
    name: str = "bf16"
    group_size: int = 128  # W4A16 only
    scale_bytes: int = 2  # bf16 scales
    zero_bytes: int = 2  # W4A16 only: bf16 zero point per group
    quantize_lm_head: bool = False

    def __post_init__(self) -> None:
        if self.name not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype {self.name!r} is unknown; choose one of {', '.join(WEIGHT_DTYPES)}")
        if self.group_size <= 0:
            raise ValueError(f"group_size must be positive (got {self.group_size})")

    @property
    def bits(self) -> int:
        return {"bf16": 16, "bf16-12bit": 12, "w8a16": 8, "w4a16": 4}[self.name]

    def linear_bytes(self, out_features: int, in_features: int) -> tuple[int, int]:
        """(weight bytes, scale bytes) of one [out, in] matrix in this format.

        bf16-12bit is the CPU kernels' lossless layout (kernels/cpu.py pack_bf16c, on by default on CPUs with AMX):
        12 bits a weight in tiles of 64 output features (padded) x 32, a 16-byte table and one 4-byte escape index
        per tile. The escapes themselves (weights whose high byte is not among the layer's 16 commonest, 4 bytes
        each) depend on the values and are not counted: ~0.01% of the weights on a random or trained model."""
        if self.name == "bf16":
            return out_features * in_features * 2, 0
        if self.name == "bf16-12bit":
            tiles = -(-out_features // 64) * (in_features // 32)
            return tiles * 64 * 48 + 16 + (tiles + 1) * 4, 0
        data = (out_features * in_features * self.bits + 7) // 8
        if self.name == "w8a16":
            return data, out_features * self.scale_bytes
        groups = out_features * math.ceil(in_features / self.group_size)
        return data, groups * (self.scale_bytes + self.zero_bytes)


@dataclass(frozen=True)
class WeightBreakdown:
    """Exact parameter counts and bytes. `params_*` are element counts of the unquantized model."""

    params_embedding: int
    params_lm_head: int  # 0 when tied (the embedding matrix is the lm_head)
    params_attention: int  # q/k/v/o weights and biases, all layers
    params_mlp: int  # gate/up/down weights and biases, all layers
    params_norms: int  # per-layer norms and the final norm
    params_layer_linear_weights: int  # the seven matrices per layer, all layers (what matmuls touch)
    bytes_embedding: int
    bytes_lm_head: int  # a separate lm_head copy (untied, or tied but quantized); 0 when it is the embedding
    bytes_layers: int  # attention + mlp + per-layer norms incl. quant scales
    bytes_final_norm: int
    bytes_quant_scales: int  # scales (and W4A16 zero points), included in bytes_layers / bytes_lm_head
    tied: bool

    @property
    def total_params(self) -> int:
        return self.params_embedding + self.params_lm_head + self.params_attention + self.params_mlp + self.params_norms

    @property
    def total_bytes(self) -> int:
        return self.bytes_embedding + self.bytes_lm_head + self.bytes_layers + self.bytes_final_norm

    @property
    def streamed_bytes_per_step(self) -> int:
        """Bytes one forward step reads at least once: every layer, the final norm and the lm_head matrix.

        The input embedding is a row lookup (a few KB per token), so an untied embedding table is not streamed;
        a tied one is, because it is also the lm_head.
        """
        head = self.bytes_lm_head if self.bytes_lm_head else (self.bytes_embedding if self.tied else 0)
        return self.bytes_layers + self.bytes_final_norm + head

    @property
    def lm_head_matmul_params(self) -> int:
        return self.params_lm_head or self.params_embedding

    @property
    def replicated_bytes(self) -> int:
        """Norm weights: copied to every tensor-parallel rank (everything else is sharded)."""
        return self.params_norms * 2


def weight_breakdown(spec: ModelSpec, fmt: WeightFormat = WeightFormat()) -> WeightBreakdown:
    a = spec.arch
    h, layers, hd = a.hidden_size, a.num_hidden_layers, a.head_dim
    q_out, kv_out = a.num_attention_heads * hd, a.num_key_value_heads * hd
    # Qwen2: bias on q/k/v only; Llama/Mistral `attention_bias`: bias on q/k/v and o.
    qkv_bias = a.attention_bias
    o_bias = a.attention_bias and a.architecture != "Qwen2ForCausalLM"
    attn_mats = [(q_out, h), (kv_out, h), (kv_out, h), (h, q_out)]
    attn_bias = (q_out + 2 * kv_out if qkv_bias else 0) + (h if o_bias else 0)
    mlp_mats = [(a.intermediate_size, h), (a.intermediate_size, h), (h, a.intermediate_size)]
    mlp_bias = 2 * a.intermediate_size + h if a.mlp_bias else 0

    def mats_bytes(mats):
        data = scales = 0
        for out_f, in_f in mats:
            d, s = fmt.linear_bytes(out_f, in_f)
            data, scales = data + d, scales + s
        return data, scales

    attn_w = sum(o * i for o, i in attn_mats)
    mlp_w = sum(o * i for o, i in mlp_mats)
    (ad, asc), (md, msc) = mats_bytes(attn_mats), mats_bytes(mlp_mats)
    layer_norms = 2 * h
    per_layer_bytes = ad + asc + md + msc + (attn_bias + mlp_bias + layer_norms) * 2
    vocab_h = a.vocab_size * h
    if a.tie_word_embeddings and not fmt.quantize_lm_head:
        head_bytes = head_scales = 0
    elif fmt.quantize_lm_head:
        head_bytes, head_scales = fmt.linear_bytes(a.vocab_size, h)
    else:
        head_bytes, head_scales = vocab_h * 2, 0
    return WeightBreakdown(
        params_embedding=vocab_h,
        params_lm_head=0 if a.tie_word_embeddings else vocab_h,
        params_attention=layers * (attn_w + attn_bias),
        params_mlp=layers * (mlp_w + mlp_bias),
        params_norms=layers * layer_norms + h,
        params_layer_linear_weights=layers * (attn_w + mlp_w),
        bytes_embedding=vocab_h * 2,
        bytes_lm_head=head_bytes + head_scales,
        bytes_layers=layers * per_layer_bytes,
        bytes_final_norm=h * 2,
        bytes_quant_scales=layers * (asc + msc) + head_scales,
        tied=a.tie_word_embeddings,
    )


# ---------------------------------------------------------------------------------------------- KV cache


@dataclass(frozen=True)
class KVFormat:
    name: str = "auto"
    scale_bytes: int = 2  # int8 only: one fp16 scale per token, layer, KV head, for K and for V

    def __post_init__(self) -> None:
        if self.name not in KV_DTYPES:
            raise ValueError(f"KV dtype {self.name!r} is unknown; choose one of {', '.join(KV_DTYPES)}")

    @property
    def element_bytes(self) -> int:
        # auto = the activation dtype, 16-bit for every weight format here (W8A16 / W4A16 keep bf16 activations).
        return {"auto": 2, "bf16": 2, "fp16": 2, "fp32": 4, "int8": 1}[self.name]


def kv_bytes_per_token_per_layer(spec: ModelSpec, kv: KVFormat = KVFormat()) -> int:
    a = spec.arch
    scale = kv.scale_bytes if kv.name == "int8" else 0
    return 2 * a.num_key_value_heads * (a.head_dim * kv.element_bytes + scale)


def kv_bytes_per_token(spec: ModelSpec, kv: KVFormat = KVFormat()) -> int:
    """2 (K and V) x layers x kv_heads x head_dim x dtype bytes (+ INT8 scales); ignores any sliding window."""
    return spec.arch.num_hidden_layers * kv_bytes_per_token_per_layer(spec, kv)


def kv_token_layers(spec: ModelSpec, context: int) -> int:
    """Sum over layers of the tokens each layer keeps for a sequence of `context` tokens."""
    window = spec.arch.sliding_window
    full = spec.arch.num_hidden_layers - spec.num_windowed_layers
    capped = min(context, window) if window is not None else context
    return full * context + spec.num_windowed_layers * capped


def kv_bytes_per_sequence(spec: ModelSpec, context: int, kv: KVFormat = KVFormat()) -> int:
    return kv_token_layers(spec, context) * kv_bytes_per_token_per_layer(spec, kv)


def kv_bytes(spec: ModelSpec, context: int, batch: int, kv: KVFormat = KVFormat()) -> int:
    """KV cache of `batch` sequences of `context` tokens each (sliding-window layers capped at the window)."""
    return batch * kv_bytes_per_sequence(spec, context, kv)


# ---------------------------------------------------------------------------------------------- budget


def check_tensor_parallel(spec: ModelSpec, tp: int) -> None:
    a = spec.arch
    if tp < 1:
        raise ValueError(f"--tp must be >= 1 (got {tp})")
    if a.num_attention_heads % tp:
        raise ValueError(f"--tp {tp} does not divide num_attention_heads={a.num_attention_heads}; pick a divisor")
    kv = a.num_key_value_heads
    if kv % tp and tp % kv:
        raise ValueError(f"--tp {tp} and num_key_value_heads={kv}: one must divide the other")


def kv_shard_fraction(spec: ModelSpec, tp: int) -> float:
    """Share of a sequence's KV each rank stores: kv_heads/tp heads, or one replicated head when tp > kv_heads."""
    kv = spec.arch.num_key_value_heads
    return max(1, kv // tp) / kv


def weight_bytes_per_card(w: WeightBreakdown, tp: int) -> int:
    sharded = w.total_bytes - w.replicated_bytes
    return math.ceil(sharded / tp) + w.replicated_bytes


def activation_reserve_bytes(spec: ModelSpec, tokens_per_step: int, batch: int, tp: int = 1) -> int:
    """Peak activation workspace of one step, per card.

    Per token in flight, a decoder layer holds at most: the residual and normed hidden (2 x hidden), the q/k/v
    projection ((heads + 2 kv_heads) x head_dim) and the MLP's gate, up and product (3 x intermediate), 2 bytes
    each, /tp for the sharded parts. Plus fp32 logits for the rows that sample (batch x vocab x 4). Attention
    scores are not materialized (flash / paged attention).
    """
    a = spec.arch
    per_token = (
        2 * a.hidden_size
        + ((a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim + 3 * a.intermediate_size) // tp
    )
    return tokens_per_step * per_token * 2 + batch * a.vocab_size * 4


@dataclass(frozen=True)
class MemoryBudget:
    device_bytes: int
    usable_bytes: int  # device_bytes x memory_utilization
    weights_bytes: int  # per card
    activation_bytes: int  # per card
    kv_budget_bytes: int  # per card; negative when the weights do not fit
    kv_bytes_per_sequence: int  # per card, at the planned context
    max_concurrent_sequences: int  # at the planned context; 0 when not even one fits

    @property
    def fits(self) -> bool:
        return self.max_concurrent_sequences > 0


def memory_budget(
    spec: ModelSpec,
    fmt: WeightFormat,
    kv: KVFormat,
    device_bytes: int,
    context: int,
    tp: int = 1,
    memory_utilization: float = 0.90,
    tokens_per_step: int = 2048,
    batch_for_logits: int = 256,
) -> MemoryBudget:
    """What is left for the KV cache on each card, and how many `context`-token sequences it holds.

    Reserve: (1 - memory_utilization) of the card (runtime context, allocator slack, graphs; vLLM's default
    gpu_memory_utilization is 0.90) plus `activation_reserve_bytes` for a step of `tokens_per_step` tokens.
    """
    if not 0 < memory_utilization <= 1:
        raise ValueError(f"memory_utilization must be in (0, 1] (got {memory_utilization})")
    check_tensor_parallel(spec, tp)
    w = weight_breakdown(spec, fmt)
    usable = int(device_bytes * memory_utilization)
    weights = weight_bytes_per_card(w, tp)
    act = activation_reserve_bytes(spec, tokens_per_step, batch_for_logits, tp)
    budget = usable - weights - act
    per_seq = math.ceil(kv_bytes_per_sequence(spec, context, kv) * kv_shard_fraction(spec, tp))
    max_seqs = max(0, budget // per_seq) if per_seq else 0
    return MemoryBudget(device_bytes, usable, weights, act, budget, per_seq, int(max_seqs))
