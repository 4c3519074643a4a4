"""EngineConfig tree: what to load (model), how to cache (cache), how to batch (scheduler), where to run (device).

Every engine option is declared once, as a dataclass field made by _opt: its default, help, and where it has a
fixed set its choices; __post_init__ checks the choices given there, and the CLI flags (infertune.cli
add_engine_args, and the tools through engine_option_kwargs) and the README's options tables are made from them.
Every dataclass validates itself in __post_init__ and raises ValueError naming the field to change.
This module imports no torch, so the engine core and its tests stay pure Python.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import numbers
import os
from dataclasses import MISSING, Field, dataclass, field, fields, replace
from pathlib import Path

from infertune.kv_compression import KVCompressionConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "npu")
DECODE_KERNELS = ("auto", "linear", "off")
COMPRESS_WEIGHTS = ("auto", "off")
COMPILE_MODES = ("auto", "on", "off")
KV_CACHE_DTYPES = ("auto", "int8")
QUANT_METHODS = ("w8a16", "w4a16", "w8a8")
QUANT_GROUP_SIZES = (32, 64, 128, 256)
EXECUTOR_BACKENDS = ("uni", "mp", "ray")
KV_ROLES = ("producer", "consumer")
KV_CONNECTORS = ("local", "p2p")
KV_LOAD_FAILURE_POLICIES = ("recompute", "fail")
SPECULATIVE_METHODS = ("ngram", "draft_model")
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "MistralForCausalLM",
    "Qwen3ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Phi3ForCausalLM",
)
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_SCORING = ("softmax", "sigmoid")
MOE_TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "longrope")


def default_model_path() -> str:
    """The small model that ships inside the package, used when no --model is given."""
    return str(Path(__file__).parent / "assets" / "demo-model")


def _opt(default=MISSING, help: str = "", *, factory=MISSING, **kw) -> Field:
    """One engine option, declared once: a dataclass field whose metadata the CLI flags and README tables are made of.

    help: what it does, in plain text ("(default: ...)" at its end says the default in words where the value does
    not); choices: the values it takes (checked by _check_choices, offered by the flag; None also passes where it
    is the default); flag: the CLI flag when it is not --the-name (for a bool that is on by default a --no-...
    flag that turns it off), or None for an option with no flag (Python and --config only); size: a byte count
    that the flag also takes as 8G / 512Mi; json: a dict that the flag takes as JSON text; see: the README
    section the options table links to.
    """
    return field(default=default, default_factory=factory, metadata={"help": help, **kw})


def _check_choices(config) -> None:
    """ValueError naming the field whose value is not one of its declared choices (None passes where it is the
    default)."""
    for f in fields(config):
        choices = f.metadata.get("choices")
        value = getattr(config, f.name)
        if choices is None or value in choices or (value is None and f.default is None):
            continue
        raise ValueError(f"{f.name}={value!r} is not one of {choices}" + (" (or None)" if f.default is None else ""))


@dataclass(slots=True, frozen=True)
class MoeArch:
    """A mixture-of-experts MLP: which layers have one, the router, and the experts' shape."""

    num_experts: int
    top_k: int
    intermediate_size: int  # of one routed expert
    layers: tuple[int, ...]  # decoder layers whose MLP is the MoE (the others are dense)
    norm_topk_prob: bool  # renormalise the top-k weights to sum to 1
    scoring: str = "softmax"  # router score: softmax over experts, or a per-expert sigmoid (DeepSeek-V3)
    # greedy: top-k of the scores; group_limited_greedy (DeepSeek-V2): top-k within the topk_group groups of
    # highest max score; noaux_tc (DeepSeek-V3): groups ranked by the sum of their top-2 biased scores, experts
    # picked by biased score, weighted by the unbiased one.
    topk_method: str = "greedy"
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    correction_bias: bool = False  # e_score_correction_bias: added to the scores for selection only
    shared_intermediate_size: int = 0  # a shared expert every token runs (0: none)
    shared_gate: bool = False  # Qwen2-MoE: the shared expert's output is scaled by sigmoid(shared_expert_gate(x))
    router_fp32: bool = False  # DeepSeek: the router's weight and matmul are fp32 whatever the model dtype

    def active_experts(self) -> int:
        return self.top_k


@dataclass(slots=True, frozen=True)
class MlaArch:
    """DeepSeek's multi-head latent attention: K/V come from a per-token latent of kv_lora_rank values plus one
    rotary key of qk_rope_head_dim shared by every head; the KV cache keeps only those."""

    q_lora_rank: int | None  # None: q is one projection of the hidden state (DeepSeek-V2-Lite)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool = True  # the rotary dims of the checkpoint are interleaved pairs (DeepSeek's layout)

    @property
    def cache_width(self) -> int:
        """Values one token keeps per layer: the latent plus the shared rotary key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(slots=True)
class ArchConfig:
    """The parts of a Hugging Face config.json that the model code needs, parsed without transformers."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    sliding_window: int | None  # the longest window of a windowed layer (None: every layer attends to all it has)
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k before rotary
    moe: MoeArch | None = None
    mla: MlaArch | None = None
    # Checkpoint tensors of layers the engine does not run (DeepSeek's multi-token-prediction layers): skipped.
    skip_layers_from: int | None = None
    # Per decoder layer, the sliding window it attends within (None: its whole context); None where no layer has one.
    # A window of W keeps the last W keys, the query's own included (transformers' masking_utils).
    layer_windows: tuple[int | None, ...] | None = None
    query_pre_attn_scalar: float | None = None  # Gemma: the softmax scale is its ** -0.5 (None: head_dim's)
    attn_logit_softcapping: float | None = None  # Gemma 2: attention scores -> cap * tanh(scores / cap)
    final_logit_softcapping: float | None = None  # Gemma 2 / 3: the same on the logits
    # Gemma 3: the rope of the sliding layers (base rope_local_base_freq), where it is not the other layers'
    local_rope_theta: float | None = None
    local_rope_scaling: dict | None = None
    # The dims of each head that rotary turns: the first rotary_dim (partial_rotary_factor; None: all head_dim).
    rotary_dim: int | None = None
    # Checkpoint projections stored fused that the engine loads as its packed shards (Phi-3's qkv_proj and
    # gate_up_proj): fused name -> ((the per-shard name the loader maps, its rows in the checkpoint), ...), the
    # checkpoint's whole shape (tensor parallel keeps it: each shard is then sliced as its own tensor would be).
    fused_checkpoint: dict[str, tuple[tuple[str, int], ...]] | None = None

    def for_tensor_parallel(self, size: int, expert_parallel: bool = False) -> ArchConfig:
        """The shape one of `size` tensor-parallel ranks builds: its share of the attention heads, of the KV heads
        (one replica each where there are fewer KV heads than ranks), of the MLP's and each expert's features. The
        vocabulary, hidden size and expert count stay whole (layers/parallel.py splits the embedding and the head's
        rows itself, and with expert_parallel the experts: each rank keeps num_experts / size of them whole, so
        their features are not split). A shape that does not split evenly is a ValueError that says which."""
        if size == 1:
            return self

        def split(what: str, n: int) -> int:
            if n % size:
                raise ValueError(
                    f"tensor_parallel_size={size} does not divide {what} ({n}) of {self.architecture}; "
                    f"choose a size that divides it"
                )
            return n // size

        heads = split("num_attention_heads", self.num_attention_heads)
        kv = self.num_key_value_heads
        if self.mla is None and kv % size and size % kv:
            raise ValueError(
                f"tensor_parallel_size={size} neither divides nor is a multiple of num_key_value_heads ({kv}) of "
                f"{self.architecture}"
            )
        moe = self.moe
        if moe is not None and expert_parallel:
            split("num_experts (enable_expert_parallel keeps whole experts on each rank)", moe.num_experts)
        if moe is not None:
            moe = replace(
                moe,
                intermediate_size=moe.intermediate_size
                if expert_parallel
                else split("moe_intermediate_size", moe.intermediate_size),
                shared_intermediate_size=split("the shared experts' intermediate size", moe.shared_intermediate_size)
                if moe.shared_intermediate_size
                else 0,
            )
        dense = moe is None or len(moe.layers) < self.num_hidden_layers
        return replace(
            self,
            num_attention_heads=heads,
            # (MLA's one latent per token is every head's: each rank keeps it whole)
            num_key_value_heads=kv if self.mla is not None else max(1, kv // size),
            intermediate_size=split("intermediate_size", self.intermediate_size) if dense else self.intermediate_size,
            moe=moe,
        )

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "config.json") -> ArchConfig:
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{where}: architecture {arch!r} is not supported; infertune runs {', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        gemma = arch in GEMMA_ARCHITECTURES
        # transformers >= 5 nests rope_theta inside rope_parameters (Gemma 3's keyed by layer type); older configs
        # keep rope_theta + rope_scaling (and Gemma 3 its rope_local_base_freq).
        params = cfg.get("rope_parameters") or {}
        by_type = "full_attention" in params
        global_theta = 1_000_000.0 if arch == "Gemma3ForCausalLM" else 10000.0
        rope_theta, rope = _rope(
            params["full_attention"] if by_type else params or cfg.get("rope_scaling"),
            cfg.get("rope_theta"),
            global_theta,
            cfg,
            where,
            arch,
        )
        local_theta, local_rope = None, None
        if arch == "Gemma3ForCausalLM":
            local = params.get("sliding_attention") if by_type else None
            local_theta, local_rope = _rope(local, cfg.get("rope_local_base_freq"), 10000.0, cfg, where, arch)
        # The MLP's activation: Gemma's GeLU (tanh approximation, named in hidden_activation), SiLU elsewhere.
        act_key, allowed = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
        act = cfg.get(act_key, allowed)
        if act != allowed:
            raise ValueError(f"{where}: {act_key} {act!r} is not supported for {arch}; only {allowed!r} is.")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"{where}: use_bidirectional_attention (an encoder) is not supported; infertune decodes.")
        layers = int(cfg["num_hidden_layers"])
        windows = _layer_windows(cfg, arch, layers, where)
        head_dim = int(cfg.get("head_dim") or hidden // heads)
        kv_heads = int(cfg.get("num_key_value_heads") or heads)
        rotary_dim = _rotary_dim(cfg, params, arch, head_dim, rope, where)
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        mla = _mla_arch(cfg, arch)
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            # MLA caches one latent "head" of kv_lora_rank + qk_rope_head_dim values a token.
            num_key_value_heads=1 if mla else kv_heads,
            head_dim=mla.cache_width if mla else head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-5 if arch == "Phi3ForCausalLM" else 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            # Qwen2 always has q/k/v bias and no flag for it; Qwen2-MoE's flag is qkv_bias (transformers: True).
            attention_bias=bool(cfg.get("qkv_bias", True))
            if arch == "Qwen2MoeForCausalLM"
            else bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act=act,
            sliding_window=max((w for w in windows or () if w is not None), default=None),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
            moe=_moe_arch(cfg, arch, layers, where),
            mla=mla,
            skip_layers_from=layers if int(cfg.get("num_nextn_predict_layers") or 0) else None,
            layer_windows=windows,
            query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)) if gemma else None,
            attn_logit_softcapping=_float_or_none(cfg.get("attn_logit_softcapping", 50.0))
            if arch == "Gemma2ForCausalLM"  # Gemma 3's attention ignores it, as transformers' does
            else None,
            final_logit_softcapping=_float_or_none(
                cfg.get("final_logit_softcapping", 30.0 if arch == "Gemma2ForCausalLM" else None)
            )
            if gemma
            else None,
            local_rope_theta=local_theta,
            local_rope_scaling=local_rope,
            rotary_dim=rotary_dim,
            fused_checkpoint=_phi3_fused(heads, kv_heads, head_dim, int(cfg["intermediate_size"]))
            if arch == "Phi3ForCausalLM"
            else None,
        )

    @classmethod
    def from_model_dir(cls, model: str) -> ArchConfig:
        path = Path(model) / "config.json"
        if not Path(model).is_dir():
            raise FileNotFoundError(
                f"model path {model!r} is not a directory; pass a Hugging Face model folder "
                "(with config.json, *.safetensors and tokenizer files), or omit --model to use the built-in model."
            )
        if not path.is_file():
            raise FileNotFoundError(f"{model!r} has no config.json; is it a Hugging Face model folder?")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(cfg, where=str(path))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        planes = 1 if self.mla else 2  # MLA keeps one latent per token, not a K and a V
        return planes * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


_MODEL_TYPES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "deepseek_v2": "DeepseekV2ForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


def _arch_from_model_type(model_type: str | None) -> str:
    return _MODEL_TYPES.get(model_type or "", f"model_type={model_type!r}")


def _float_or_none(value) -> float | None:
    return None if value is None else float(value)


def _rope(
    params: dict | None, theta, default_theta: float, cfg: dict, where: str, arch: str = ""
) -> tuple[float, dict | None]:
    """(rope_theta, its frequency scaling: None for plain rope) from one rope_parameters / rope_scaling dict and the
    older top-level base `theta` (which wins where both are given)."""
    rope_theta = float(theta or (params or {}).get("rope_theta") or default_theta)
    if not params:
        return rope_theta, None
    rope = dict(params)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if arch == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):  # Phi3Config's own renaming: both are LongRoPE
        rope_type = "longrope"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{where}: rope type {rope_type!r} is not supported; infertune implements {', '.join(SUPPORTED_ROPE_TYPES)}."
        )
    rope["rope_type"] = rope_type
    if rope_type == "yarn":  # Hugging Face's defaults: the pretrained context is max_position_embeddings
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        original = rope.get("original_max_position_embeddings") or max_pos
        rope["original_max_position_embeddings"] = original
        rope["factor"] = float(rope.get("factor") or max_pos / original)
    if rope_type == "longrope" and arch != "Phi3ForCausalLM":
        raise ValueError(f"{where}: rope type 'longrope' is supported for Phi3ForCausalLM only, not {arch}")
    if rope_type == "longrope":  # transformers' _compute_longrope_parameters
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        original = rope.get("original_max_position_embeddings") or cfg.get("original_max_position_embeddings")
        if not original or "short_factor" not in rope or "long_factor" not in rope:
            raise ValueError(
                f"{where}: rope type 'longrope' needs short_factor, long_factor and original_max_position_embeddings"
            )
        rope["original_max_position_embeddings"] = int(original)
        factor = float(rope.get("factor") or max_pos / int(original))
        if rope.get("attention_factor") is None:
            rope["attention_factor"] = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(int(original)))
    return rope_theta, None if rope_type == "default" else rope


def _rotary_dim(cfg: dict, params: dict, arch: str, head_dim: int, rope: dict | None, where: str) -> int | None:
    """How many leading dims of each head rotary turns (Phi-3's partial_rotary_factor, top level or in
    rope_parameters; None: the whole head). LongRoPE's factor lists must have one entry per rotated pair."""
    factor = float(params.get("partial_rotary_factor") or cfg.get("partial_rotary_factor") or 1.0)
    if factor != 1.0 and arch != "Phi3ForCausalLM":
        raise ValueError(f"{where}: partial_rotary_factor {factor} is not supported for {arch} (only for Phi-3)")
    dim = int(head_dim * factor)
    if dim % 2 or not 0 < dim <= head_dim:
        raise ValueError(f"{where}: partial_rotary_factor {factor} turns {dim} of {head_dim} dims; need an even count")
    for key in ("short_factor", "long_factor"):
        if rope is not None and rope["rope_type"] == "longrope" and len(rope[key]) != dim // 2:
            raise ValueError(f"{where}: longrope {key} has {len(rope[key])} entries; the rotary dims need {dim // 2}")
    return None if dim == head_dim else dim


def _phi3_fused(heads: int, kv_heads: int, head_dim: int, inter: int) -> dict[str, tuple[tuple[str, int], ...]]:
    """Phi-3's fused checkpoint projections, as the per-shard names the Llama family's packed layers load."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "qkv_proj": (("q_proj", q), ("k_proj", kv), ("v_proj", kv)),
        "gate_up_proj": (("gate_proj", inter), ("up_proj", inter)),
    }


# Families whose config's sliding_window applies only with use_sliding_window true (transformers sets it to None,
# or 0 for Qwen2-MoE, otherwise).
_OPT_IN_WINDOW = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
# Families that window every layer whenever sliding_window is set (their modeling ignores layer_types).
_EVERY_LAYER_WINDOWED = ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM", "Phi3ForCausalLM")


def _layer_windows(cfg: dict, arch: str, layers: int, where: str) -> tuple[int | None, ...] | None:
    """Each decoder layer's sliding window (None: full attention), as transformers reads each family's config: its
    layer_types where the config has them, else the family's own rule; None where no layer is windowed."""
    # (a key left out takes transformers' default: None for Mixtral and Phi-3, 4096 for the others)
    window = cfg.get("sliding_window", None if arch in ("MixtralForCausalLM", "Phi3ForCausalLM") else 4096) or None
    if arch in _OPT_IN_WINDOW and not cfg.get("use_sliding_window", False):
        window = None
    if window is None or arch.startswith(("Llama", "Deepseek")):  # Llama and DeepSeek always attend in full
        return None
    if arch in _EVERY_LAYER_WINDOWED:
        kinds = ["sliding_attention"] * layers
    elif cfg.get("layer_types"):
        kinds = list(cfg["layer_types"])
        if len(kinds) != layers:
            raise ValueError(f"{where}: layer_types names {len(kinds)} layers, num_hidden_layers is {layers}")
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):  # the layers from max_window_layers on
        first = int(cfg.get("max_window_layers", 28))
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    elif arch == "Qwen2MoeForCausalLM":  # every other layer below max_window_layers
        below = int(cfg.get("max_window_layers", 28))
        kinds = ["sliding_attention" if (i + 1) % 2 and i < below else "full_attention" for i in range(layers)]
    else:  # Gemma 2 alternates sliding and full from layer 0; Gemma 3 has one full layer in every `pattern`
        pattern = 2 if arch == "Gemma2ForCausalLM" else int(cfg.get("sliding_window_pattern", 6))
        kinds = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    windows = tuple(int(window) if kind == "sliding_attention" else None for kind in kinds)
    return windows if any(w is not None for w in windows) else None


def _moe_arch(cfg: dict, arch: str, layers: int, where: str) -> MoeArch | None:
    """The MoE part of a config.json, each family's knobs read under their own names (None for a dense model)."""
    if arch == "MixtralForCausalLM":
        return MoeArch(
            num_experts=int(cfg.get("num_local_experts", 8)),
            top_k=int(cfg.get("num_experts_per_tok", 2)),
            intermediate_size=int(cfg["intermediate_size"]),
            layers=tuple(range(layers)),
            norm_topk_prob=True,
        )
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)
        step = int(cfg.get("decoder_sparse_step", 1) or 1)
        dense = set(cfg.get("mlp_only_layers") or ())
        moe_layers = tuple(i for i in range(layers) if experts > 0 and i not in dense and (i + 1) % step == 0)
        shared = int(cfg.get("shared_expert_intermediate_size") or 0) if arch == "Qwen2MoeForCausalLM" else 0
        return MoeArch(
            num_experts=experts,
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            layers=moe_layers,
            norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),  # transformers' default for both
            shared_intermediate_size=shared,
            shared_gate=shared > 0,
        )
    if arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        experts = int(cfg.get("n_routed_experts") or 0)
        if not experts:
            return None
        v3 = arch == "DeepseekV3ForCausalLM"
        scoring = cfg.get("scoring_func", "sigmoid" if v3 else "softmax")
        if scoring not in MOE_SCORING:
            raise ValueError(f"{where}: scoring_func {scoring!r} is not supported; infertune implements {MOE_SCORING}")
        method = cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
        if method not in MOE_TOPK_METHODS:
            raise ValueError(
                f"{where}: topk_method {method!r} is not supported; infertune implements {MOE_TOPK_METHODS}"
            )
        first_dense = int(cfg.get("first_k_dense_replace", 0) or 0)
        freq = int(cfg.get("moe_layer_freq", 1) or 1)
        n_group, topk_group = int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1)
        if experts % n_group or topk_group > n_group:
            raise ValueError(f"{where}: n_group={n_group}, topk_group={topk_group} do not fit {experts} experts")
        return MoeArch(
            num_experts=experts,
            top_k=int(cfg["num_experts_per_tok"]),
            intermediate_size=int(cfg["moe_intermediate_size"]),
            layers=tuple(i for i in range(layers) if i >= first_dense and i % freq == 0),
            norm_topk_prob=bool(cfg.get("norm_topk_prob", v3)),
            scoring=scoring,
            topk_method=method,
            n_group=n_group if method != "greedy" else 1,
            topk_group=topk_group if method != "greedy" else 1,
            routed_scaling_factor=float(cfg.get("routed_scaling_factor", 1.0) or 1.0),
            correction_bias=method == "noaux_tc",
            shared_intermediate_size=int(cfg.get("n_shared_experts") or 0) * int(cfg["moe_intermediate_size"]),
            router_fp32=True,
        )
    return None


def _mla_arch(cfg: dict, arch: str) -> MlaArch | None:
    if arch not in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        return None
    q_lora = cfg.get("q_lora_rank")
    return MlaArch(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=int(cfg["qk_nope_head_dim"]),
        qk_rope_head_dim=int(cfg["qk_rope_head_dim"]),
        v_head_dim=int(cfg["v_head_dim"]),
        # DeepSeek-V2 always rotates interleaved pairs (its config has no such field); V3 says which.
        rope_interleave=arch == "DeepseekV2ForCausalLM" or bool(cfg.get("rope_interleave", True)),
    )


@dataclass(slots=True)
class ModelConfig:
    model: str = _opt(
        factory=default_model_path,
        help="Hugging Face model folder (config.json, *.safetensors and "
        "tokenizer files) (default: the built-in demo model)",
    )
    tokenizer: str | None = _opt(None, "tokenizer folder (default: the model folder)")
    dtype: str = _opt(
        "auto", "weights and activations dtype; auto = the checkpoint's, as the device supports", choices=DTYPES
    )
    max_model_len: int | None = _opt(
        None, "longest prompt + output, in tokens (default: the model's max_position_embeddings)"
    )
    seed: int = _opt(0, "engine seed for unseeded sampling")
    # Reorder plain weights once into the backend's fastest matmul layout (oneDNN blocked bf16 on CPU).
    prepack_weights: bool = _opt(
        True,
        "where the decode kernels are off or unavailable: reorder bf16 weights once into oneDNN's blocked "
        "layout on CPUs with native bf16 (faster decode); False keeps plain weights",
        flag=None,
    )
    # The backend's own small-batch linear kernels for decode steps (infertune/kernels on CPU).
    decode_kernels: str = _opt(
        "auto",
        "infertune's own decode kernels, on x86 CPUs with AVX-512 BF16 and VNNI (built with the system C "
        "compiler on first use and cached): auto = GEMV / AMX kernels (bf16, W8A16 and W4A16) for steps of up to "
        "16 rows plus the fused decode step (every layer of a step in one call: decode-only steps of up to 16 "
        "sequences, and, with a bf16 cache, steps of fresh prompts: with bf16 weights up to the kernels' prompt rows, "
        "with 12-bit weights, W8A8, W8A16 and W4A16 ones whole steps); "
        "linear = the linear "
        "kernels only, under the per-op PyTorch forward; off = torch's matmuls",
        choices=DECODE_KERNELS,
        see="Decode kernels",
    )
    # Plain bf16 weights under the decode kernels kept losslessly in 12 bits a weight (layers/linear.py
    # CompressedMethod, layers/moe.py CompressedExperts).
    compress_weights: str = _opt(
        "auto",
        "auto = where the decode kernels run on a CPU with AVX-512 VBMI, AMX or not (and compile is not on), keep "
        "plain bf16 projections and MoE experts losslessly in 12 bits a weight, and a tied LM head as a 12-bit copy "
        "beside the embedding's table (bit-identical outputs; decode steps read 25% fewer bytes, the weights take "
        "0.76x the memory, load takes ~2-4 ms more per million weights); off = keep them as loaded",
        choices=COMPRESS_WEIGHTS,
        see="Decode kernels",
    )
    # torch.compile the dense stages of each decoder layer; see runner/compiled.py.
    compile: str = _opt(
        "auto",
        "torch.compile (Inductor) the decoder's dense stages (norms, projections, rotary, MLP, residuals; "
        "attention stays eager) in a warm-up before serving, so no request waits on a compile: fewer, fused ops per "
        "step for a start-up cost of seconds to tens of seconds; on = always; off = eager, instant start; auto = on "
        "only for models of >= 100M parameters on backends where it measured faster (none yet: on CPU it measured "
        "slower, so auto runs eager)",
        choices=COMPILE_MODES,
        see="Compiled decode",
    )
    # The sampling defaults of requests that leave a field unset (vLLM's generation_config / override_...).
    generation_config: str = _opt(
        "auto",
        "sampling defaults for requests that leave them unset: auto = the model folder's generation_config.json "
        "(its temperature, top_p, top_k, min_p, repetition_penalty, and max_new_tokens as max_tokens, as vLLM "
        "takes them); vllm = neutral defaults (temperature 1, no top-p / top-k); or a folder holding a "
        "generation_config.json",
    )
    override_generation_config: dict | None = _opt(
        None,
        'sampling defaults that win over generation_config\'s, e.g. {"temperature": 0.5} (same keys)',
        json=True,
    )
    arch: ArchConfig | None = None

    def __post_init__(self) -> None:
        self.model = os.fspath(self.model)
        _check_choices(self)
        self.generation_config = os.fspath(self.generation_config)
        if (
            self.generation_config not in ("auto", "vllm")
            and not (Path(self.generation_config) / "generation_config.json").is_file()
        ):
            raise ValueError(
                f"generation_config={self.generation_config!r}: expected 'auto', 'vllm' or a folder holding a "
                "generation_config.json"
            )
        if self.arch is None:
            self.arch = ArchConfig.from_model_dir(self.model)
        if self.tokenizer is None:
            self.tokenizer = self.model
        limit = self.arch.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len <= 0:
            raise ValueError(f"max_model_len={self.max_model_len} must be positive")
        elif self.max_model_len > limit and (self.arch.rope_scaling is None):
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}; "
                "lower max_model_len."
            )
        rope = self.arch.rope_scaling or {}
        original = rope.get("original_max_position_embeddings")
        if rope.get("rope_type") == "longrope" and self.max_model_len > original:
            # transformers turns every position with long_factor once a sequence passes the original context (and
            # with short_factor below it): a switch of the whole sequence's rotation that a KV cache of keys
            # rotated once cannot follow. infertune applies short_factor, exactly as transformers does, up to it.
            raise ValueError(
                f"max_model_len={self.max_model_len}: rope_scaling 'longrope' is applied only up to its "
                f"original_max_position_embeddings={original} (short_factor; its long_factor beyond is not "
                f"implemented); set max_model_len={original} or lower."
            )

    def sampling_defaults(self) -> dict:
        """What a request that leaves a sampling field unset gets (SamplingParams' names): generation_config.json's
        temperature, top_p, top_k, min_p, repetition_penalty and max_new_tokens (as max_tokens), as vLLM's
        generation_config="auto" takes them, then override_generation_config; {} with generation_config="vllm" or
        none of these keys. Checked here: a bad value is a ValueError naming the file and the key."""
        folder = self.model if self.generation_config == "auto" else self.generation_config
        path = Path(folder) / "generation_config.json"
        found: dict = {}
        if self.generation_config != "vllm" and path.is_file():
            try:
                found = json.loads(path.read_text())
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
        overrides = dict(self.override_generation_config or {})
        unknown = sorted(set(overrides) - set(SAMPLING_DEFAULT_KEYS))
        if unknown:
            raise ValueError(f"override_generation_config takes {list(SAMPLING_DEFAULT_KEYS)}, not {unknown}")
        picked = {k: v for k, v in (found | overrides).items() if k in SAMPLING_DEFAULT_KEYS and v is not None}
        defaults = {SAMPLING_DEFAULT_KEYS[k]: v for k, v in picked.items()}
        from infertune.sampling_params import SamplingParams

        try:
            SamplingParams(**defaults)
        except (TypeError, ValueError) as e:
            where = "override_generation_config" if set(overrides) & set(picked) else str(path)
            raise ValueError(f"the sampling defaults of {where}: {e}") from None
        return defaults


# generation_config.json's keys that are sampling defaults (vLLM's list) -> SamplingParams' names.
SAMPLING_DEFAULT_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(slots=True)
class CacheConfig:
    block_size: int = _opt(16, "tokens per KV-cache block (a power of two)")
    # An absolute budget wins over the fraction; None means "fraction of the memory free after loading".
    kv_cache_memory_bytes: int | None = _opt(
        None,
        "KV-cache budget in bytes (suffixes K, M, G, Ki, Mi, Gi allowed); wins over the fraction (default: "
        "kv_cache_memory_fraction of the free memory)",
        size=True,
    )
    kv_cache_memory_fraction: float = _opt(
        0.5,
        "share of the memory free after loading that the KV cache may take when no byte budget is given "
        "(capped at what max_num_seqs full-length sequences can use)",
    )
    enable_prefix_caching: bool = _opt(
        True,
        "reuse the KV of shared prompt prefixes (full blocks); --no-prefix-caching turns this automatic prefix "
        "cache off",
        flag="--no-prefix-caching",
    )
    kv_cache_dtype: str = _opt(
        "auto",
        "KV-cache storage: auto = the model dtype; int8 = K/V as int8 with one fp32 scale per token and "
        "head, (D + 4) / 2D of a bf16 cache at head_dim D, so about twice the tokens in the same budget",
        choices=KV_CACHE_DTYPES,
    )
    kv_int4_after: int | None = _opt(
        None,
        "the int4 tier for old tokens (needs kv_cache_dtype int8): once a sequence's newest N tokens lie after "
        "them, two full blocks of its oldest int8 tokens are re-stored as one int4 block (one fp16 scale per token "
        "and head), so its KV past N tokens takes about half the int8 bytes; full-attention layers only (default: "
        "off)",
        see="KV compression",
    )
    mla_cache: str = _opt(
        "latent",
        "DeepSeek (MLA) models' KV cache: latent = the compressed latent and the shared rotary key of each token "
        "(kv_lora_rank + qk_rope_head_dim values a layer), decode absorbed; decompressed = each head's K and V, as "
        "a plain cache keeps them (7-9x the bytes; the seeds' starting point, for comparison: `infertune ledger` "
        "measures the latent cache against it; runs the per-module path, no INT8); other models' caches hold each "
        "head's K / V already (no effect there)",
        choices=("latent", "decompressed"),
        see="KV compression",
    )
    kv_compression: KVCompressionConfig | None = _opt(
        None,
        "KV compression at the end of each prefill, kvpress's presses and parameters: "
        '{"press": "snapkv", "compression_ratio": 0.5, "window_size": 16, "kernel_size": 5}, '
        '{"press": "streaming_llm", "compression_ratio": 0.5, "n_sink": 4}, "pyramidkv" (+ "beta"), '
        '"layer_ratios": [...] per layer; or a policy by layer and prompt length: {"policy": [{"layers": "0-1", '
        '"window": 128}, {"max_length": 4096, "press": "none"}, {"press": "snapkv", "compression_ratio": 0.25}]}; '
        "the freed blocks go back to the pool; compressed sequences skip the prefix cache; set (even to "
        '{"press": "none"}), it lets each request ask for its own press (SamplingParams / body field kv_compression) '
        "(default: off)",
        json=True,
        see="KV compression",
    )

    def default_kv_budget(self, free_bytes: int, ranks: int, max_seqs: int, seq_bytes: int) -> int:
        """The KV bytes a rank takes without kv_cache_memory_bytes: kv_cache_memory_fraction of the memory free after
        loading, its share among `ranks` on one host, at most what max_seqs full sequences of seq_bytes can use."""
        budget = int(self.kv_cache_memory_fraction * free_bytes) // ranks
        return min(budget, max_seqs * seq_bytes) if seq_bytes else budget

    def __post_init__(self) -> None:
        if isinstance(self.kv_compression, dict):
            self.kv_compression = KVCompressionConfig.from_dict(self.kv_compression)
        elif not isinstance(self.kv_compression, (KVCompressionConfig, type(None))):
            raise ValueError(
                f"kv_compression={self.kv_compression!r} must be a dict such as "
                '{"press": "snapkv", "compression_ratio": 0.5} (or None)'
            )
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two (e.g. 16)")
        if self.kv_int4_after is not None:
            age = self.kv_int4_after
            if isinstance(age, bool) or not isinstance(age, int) or age < 0:
                raise ValueError(f"kv_int4_after={self.kv_int4_after!r} must be a token count >= 0 (e.g. 1024)")
            if self.kv_cache_dtype != "int8":
                raise ValueError(
                    f"kv_int4_after needs kv_cache_dtype='int8' (the int4 blocks take the place of int8 ones), "
                    f"not {self.kv_cache_dtype!r}"
                )
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be positive")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction={self.kv_cache_memory_fraction} must be in (0, 1]")
        _check_choices(self)


# vLLM's speculative_config keys without a counterpart here, and why (SpeculativeConfig.from_dict refuses them by name)
_VLLM_SPECULATIVE_KEYS = {
    "disable_by_batch_size": 'there is no batch-size cutoff; adaptive K ("adaptive": true) stops each sequence '
    "drafting where its drafts are not accepted",
    "disable_logprobs": "requests with logprobs are not speculated (each decodes a token a step)",
    "quantization": "the draft model loads as its folder stores it (infertune quantize writes a quantized one)",
    "max_model_len": "the draft model runs to the engine's max_model_len",
    "revision": "the draft model is a local folder",
    "code_revision": "the draft model is a local folder",
    "tokenizer": "the draft model uses the target's tokenizer",
    "speculative_token_tree": "drafts are one chain, not a tree",
    "enforce_eager": "the draft model runs eagerly",
    "disable_padded_drafter_batch": "the draft model's batch is never padded",
}


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """Speculative decoding, vLLM's speculative_config: each decode step proposes up to num_speculative_tokens draft
    tokens, by n-gram prompt lookup (method "ngram": the last prompt_lookup_min .. prompt_lookup_max tokens found
    earlier in the sequence, and what followed them there) or by a small draft model with the target's vocabulary
    (method "draft_model", model = its folder), and verifies them in the step's forward (docs/server.md). With
    adaptive (the default) each sequence drafts only as many tokens as its acceptance pays for, down to none
    (engine/spec_decode.py)."""

    num_speculative_tokens: int
    method: str = "ngram"
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    model: str | None = None  # the draft model's folder (method "draft_model")
    adaptive: bool = True
    # The cost of one draft row as a share of a decode step without drafts (adaptive K's cost model). Measured with
    # benchmarks/bench_spec_decode.py: 0.01-0.02 on the 386M model, 0.05-0.12 on the 1.3M built-in one.
    draft_cost: float = 0.05
    acceptance_decay: float = 0.8  # the weight an older step's acceptance keeps at each new one
    probe_interval: int = 16  # decode steps without drafts before a sequence that stopped drafting tries one

    @classmethod
    def from_dict(cls, value: dict) -> SpeculativeConfig:
        """From vLLM's dict form; ValueError naming the key to change. As vLLM's: without a "method", a "model"
        folder is a draft model and the model "ngram" / "[ngram]" is prompt lookup; draft_tensor_parallel_size 1 (the
        draft model runs whole in each worker) is taken; one of prompt_lookup_min / _max given alone sets both;
        vLLM's other keys are refused, each saying why."""
        value = dict(value)
        if value.get("method") == "[ngram]":
            value["method"] = "ngram"
        if value.get("model") in ("ngram", "[ngram]") and value.get("method", "ngram") == "ngram":
            del value["model"]
            value["method"] = "ngram"
        elif "method" not in value and value.get("model") is not None:
            value["method"] = "draft_model"
        # vLLM's rule where one n-gram bound is given: the other takes its value (a ported {"prompt_lookup_min": 5})
        lookup = ("prompt_lookup_min", "prompt_lookup_max")
        given = [k for k in lookup if value.get(k) is not None]
        if len(given) == 1:
            value[lookup[1 - lookup.index(given[0])]] = value[given[0]]
        if value.get("draft_tensor_parallel_size", 1) in (None, 1):
            value.pop("draft_tensor_parallel_size", None)
        else:
            raise ValueError(
                f"speculative_config draft_tensor_parallel_size={value['draft_tensor_parallel_size']!r}: the draft "
                "model runs whole in each worker (1); drop it"
            )
        for key, why in _VLLM_SPECULATIVE_KEYS.items():
            if key in value:
                raise ValueError(f"speculative_config {key!r} (vLLM's) is not taken here: {why}; drop it")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        if "num_speculative_tokens" not in value:
            raise ValueError('speculative_config needs "num_speculative_tokens" (the drafts a step proposes, e.g. 3)')
        return cls(**value)

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method={self.method!r} is not one of {SPECULATIVE_METHODS}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "probe_interval"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative_config {name}={value!r} must be an integer >= 1")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(
                f"speculative_config prompt_lookup_min={self.prompt_lookup_min} must be <= "
                f"prompt_lookup_max={self.prompt_lookup_max}"
            )
        if self.method == "draft_model":
            if not isinstance(self.model, str) or not Path(self.model).is_dir():
                raise ValueError(
                    f'speculative_config method "draft_model" needs "model": the draft model\'s folder (got '
                    f"{self.model!r}), a small model with the target's tokenizer"
                )
        elif self.model is not None:
            raise ValueError(f'speculative_config "model" is for method "draft_model", not {self.method!r}; drop it')
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive={self.adaptive!r} must be true or false")
        if isinstance(self.draft_cost, bool) or not isinstance(self.draft_cost, (int, float)) or self.draft_cost < 0:
            raise ValueError(f"speculative_config draft_cost={self.draft_cost!r} must be a number >= 0 (e.g. 0.1)")
        decay = self.acceptance_decay
        if isinstance(decay, bool) or not isinstance(decay, (int, float)) or not 0 < decay <= 1:
            raise ValueError(f"speculative_config acceptance_decay={decay!r} must be in (0, 1] (e.g. 0.8)")

    def __str__(self) -> str:
        """The JSON the --speculative-config flag takes."""
        return json.dumps({f.name: getattr(self, f.name) for f in fields(self)})


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = _opt(64, "sequences decoded together")
    max_num_batched_tokens: int = _opt(2048, "token budget of one step; long prompts are prefilled in chunks of it")
    enable_chunked_prefill: bool = _opt(
        True,
        "split long prompts across steps (False: a prompt must fit one step, so max_num_batched_tokens must "
        "be >= max_model_len)",
        flag=None,
    )
    # Dynamic batch by input length (the seeds' policy): the running sequences' lengths, its own included.
    # None: only max_num_seqs and the KV blocks limit the batch.
    max_running_tokens: int | None = _opt(
        None,
        "dynamic batch by input length: admit sequences only while their lengths sum to at most this many "
        "tokens, so short inputs batch wider than long ones (default: off)",
    )
    speculative_config: SpeculativeConfig | None = _opt(
        None,
        'speculative decoding, as vLLM\'s speculative_config: {"method": "ngram", "num_speculative_tokens": K, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1} drafts up to K tokens a decode step from where the '
        'sequence\'s last tokens occurred before, {"method": "draft_model", "model": DIR, '
        '"num_speculative_tokens": K} by a small model with the same tokenizer; verified in one forward, K adapting '
        "to each sequence's acceptance; greedy output is unchanged and sampled output keeps its distribution "
        "(default: off)",
        json=True,
        see="Speculative decoding",
    )

    def __post_init__(self) -> None:
        if isinstance(self.speculative_config, dict):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        elif not isinstance(self.speculative_config, (SpeculativeConfig, type(None))):
            raise ValueError(
                f"speculative_config={self.speculative_config!r} must be a dict such as "
                '{"method": "ngram", "num_speculative_tokens": 4} (or None)'
            )
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be positive")
        if self.max_running_tokens is not None and self.max_running_tokens <= 0:
            raise ValueError(f"max_running_tokens={self.max_running_tokens} must be positive (or None)")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be positive")


@dataclass(slots=True)
class QuantConfig:
    """Weight (and activation) quantization applied on the fly after loading; None keeps the model dtype."""

    quantization: str | None = _opt(
        None,
        "quantize linear weights after loading: int8 per output channel (w8a16), int4 per group (w4a16), or "
        "int8 weights and dynamic per-token int8 activations (w8a8: int8 x int8 GEMMs, the compute-bound prompts' "
        "fastest on AVX-512 VNNI CPUs); norms, rotary and logits stay full precision (default: none)",
        choices=QUANT_METHODS,
        see="Quantization",
    )
    quant_group_size: int = _opt(128, "w4a16 group size along the input dim", choices=QUANT_GROUP_SIZES)
    quant_symmetric: bool = _opt(False, "w4a16: symmetric groups (-8..7) instead of [min, max] -> 0..15", flag=None)
    keep_fp: tuple[str, ...] = _opt(
        ("lm_head",),
        'layers left in full precision: fnmatch patterns or module prefixes (e.g. "model.layers.0.*")',
        flag=None,
    )
    quantize_lm_head: bool = _opt(
        False,
        "with a quantization: the LM head too, in int8 per output channel (W8A16 whatever the quantization), also "
        "when it is tied to the embedding (the embedding keeps its full-precision copy); a batch-1 decode step reads "
        "the head whole (vocab x hidden), so this cuts its bytes by half (default: off, the head stays in full "
        "precision)",
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        self.keep_fp = tuple(self.keep_fp)
        if self.quantize_lm_head and self.quantization is None:
            raise ValueError("quantize_lm_head needs a quantization (w8a16, w4a16 or w8a8): none is set")

    @property
    def method(self) -> str | None:
        return self.quantization

    @property
    def group_size(self) -> int:
        return self.quant_group_size

    @property
    def symmetric(self) -> bool:
        return self.quant_symmetric


@dataclass(slots=True)
class DeviceConfig:
    device: str = _opt(
        "auto",
        "where to run: auto prefers cuda, then npu, then cpu (from Python also with an index, e.g. cuda:1)",
        choices=DEVICES,
    )

    def __post_init__(self) -> None:
        kind, _, index = self.device.partition(":")
        if kind not in DEVICES or (index and (kind == "auto" or not index.isdigit())):
            raise ValueError(
                f"device={self.device!r} is not one of {DEVICES} (optionally with an index, e.g. 'cuda:1')"
            )


@dataclass(slots=True)
class ParallelConfig:
    """Where the model runner lives: "uni" in the engine's own process, "mp" in a worker process of its own that
    gets each step's SchedulerOutput pickled over a pipe (the seam tensor parallel and Ray workers build on)."""

    distributed_executor_backend: str = _opt(
        "uni",
        "where the model runs: uni = in this process; mp = in worker processes, one per tensor-parallel rank, "
        "reached by each step's pickled SchedulerOutput (spawned: a script that builds the engine keeps its top "
        'level under `if __name__ == "__main__":`; start-up takes a few seconds more); the profile, eval and '
        "quantize tools need uni. A tensor_parallel_size above 1 with uni runs mp; ray = the ranks as Ray actors "
        "on the nodes of a Ray cluster (RAY_ADDRESS, the one `ray start` began here, or a local one; pip install "
        "'infertune[ray]')",
        choices=EXECUTOR_BACKENDS,
    )
    tensor_parallel_size: int = _opt(
        1,
        "ranks the model is split over (attention heads, MLP and expert features, vocabulary), one worker process "
        "each, joined by torch.distributed (gloo on CPU); each rank gets its share of the CPU cores. It must "
        "divide the attention heads, the KV heads (or be a multiple of them: KV heads are then replicated) and "
        "the MLP widths",
    )
    pipeline_parallel_size: int = _opt(
        1,
        "vLLM's pipeline stages (the layers split over processes): only 1 here, accepted so that vLLM commands and "
        "configs that spell out the default run as they are; split a model over processes with "
        "tensor_parallel_size",
    )
    enable_expert_parallel: bool = _opt(
        False,
        "with tensor_parallel_size N, split a MoE model's routed experts over the ranks whole (expert parallel: "
        "each rank keeps num_experts / N experts and runs the tokens routed to them) instead of splitting every "
        "expert's features; attention, shared experts and dense layers stay tensor-parallel. N must divide "
        "num_experts",
    )
    # Prefill/decode disaggregation (docs/distributed.md#prefilldecode-disaggregation): infertune/kv_transfer/.
    kv_role: str | None = _opt(
        None,
        "prefill/decode disaggregation: producer = a prefill instance that keeps each finished prompt's KV blocks "
        "for a consumer (requests with kv_transfer_params do_remote_decode); consumer = a decode instance that "
        "loads them instead of computing the prompt (kv_transfer_params do_remote_prefill, as the producer "
        "returned them); put `infertune router` in front (default: neither)",
        choices=KV_ROLES,
    )
    kv_connector: str | None = _opt(
        None,
        "how KV blocks move between the instances: local = one host, the producer's KV cache in a shared-memory "
        "file that the consumer copies blocks from; p2p = across hosts, the consumer pulls the blocks from the "
        "producer over torch.distributed (a TCPStore the producer hosts, gloo point-to-point); or pkg.module:NAME, "
        "another transport's KVConnectorSpec (infertune/kv_transfer/base.py) "
        "(default: local where kv_role is set; unused without it)",
    )
    kv_connector_config: dict | None = _opt(
        None,
        'the connector\'s settings as JSON. local: {"path": directory both sides share (default '
        '/dev/shm/infertune-kv), "lease_s": seconds a producer keeps unconfirmed blocks (30), "margin_s": the least '
        'lease a consumer starts a copy with (1)}. p2p: {"host", "port": the producer\'s store, the address '
        "consumers reach it at (127.0.0.1, 29650; on a consumer, optional: its producer, checked at start-up), "
        '"timeout_s": the longest wait for the producer (5), "lease_s", "margin_s"}; read only with kv_role '
        "(default: those)",
        json=True,
    )
    kv_load_failure_policy: str = _opt(
        "recompute",
        "a consumer's answer to a transfer that cannot be used at admission (the prefill failed, the producer is "
        "gone, its lease ran out): recompute = prefill the prompt here; fail = refuse the request with a 503 that "
        "names the cause",
        choices=KV_LOAD_FAILURE_POLICIES,
    )

    def __post_init__(self) -> None:
        _check_choices(self)
        if not isinstance(self.tensor_parallel_size, int) or self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size!r} must be an integer >= 1")
        if self.pipeline_parallel_size != 1:
            raise ValueError(
                f"pipeline_parallel_size={self.pipeline_parallel_size!r}: pipeline parallel is not supported (1 is the "
                "only value); split the model over processes with tensor_parallel_size instead"
            )
        if self.tensor_parallel_size > 1 and self.distributed_executor_backend == "uni":
            self.distributed_executor_backend = "mp"  # one process per rank
        if self.kv_connector_config is not None and not isinstance(self.kv_connector_config, dict):
            raise ValueError(f"kv_connector_config={self.kv_connector_config!r} must be a dict (JSON object)")
        if self.kv_connector is not None and self.kv_connector not in KV_CONNECTORS:
            module, sep, attr = self.kv_connector.partition(":")
            if not (sep and module and attr):
                raise ValueError(
                    f"kv_connector={self.kv_connector!r}: choose one of {', '.join(KV_CONNECTORS)}, or name another "
                    "transport's KVConnectorSpec as pkg.module:NAME"
                )
        if self.kv_role is not None:
            self.kv_connector = self.kv_connector or "local"
            # One id per engine, made here in the driver so every rank (spawned with this config) shares it.
            cfg = dict(self.kv_connector_config or {})
            if not cfg.get("engine_id"):
                import uuid

                cfg["engine_id"] = uuid.uuid4().hex[:12]
            self.kv_connector_config = cfg


@dataclass(slots=True)
class LimitsConfig:
    """What one request may cost, checked before it is queued, and what the server holds at most.

    The per-request bounds (max_n, stops) apply offline too; the queue, memory and deadline limits are enforced
    by the server's AsyncLLMEngine.
    """

    max_n: int = _opt(128, "most samples (n) one request may ask for; OpenAI's limit is 128")
    max_prompts: int = _opt(128, "most prompts in one /v1/completions request (a list of strings or of token lists)")
    max_stop: int = _opt(16, "most stop strings in one request")
    max_stop_len: int = _opt(256, "longest stop string, in characters")
    max_stop_token_ids: int = _opt(256, "most stop_token_ids in one request")
    max_waiting: int = _opt(512, "sequences (a request counts n per prompt) queued before new requests get 429")
    max_request_share: float = _opt(
        0.5, "largest share of --max-waiting that one request's sequences may take; a larger request is a 400"
    )
    request_timeout: float | None = _opt(
        None,
        "seconds from arrival after which a request is aborted and answered with a timeout error (408) "
        "(default: no deadline)",
    )
    memory_limit: int | None = _opt(
        None,
        "host-memory ceiling in bytes (suffixes K, M, G, Ki, Mi, Gi allowed); requests that would take the "
        "process past it are refused with 429 / 503 and Retry-After (default: 90% of the memory available at "
        "start-up plus what the process holds, within any cgroup limit)",
        size=True,
    )

    def __post_init__(self) -> None:
        for name in ("max_n", "max_prompts", "max_stop", "max_stop_len", "max_stop_token_ids", "max_waiting"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if not 0.0 < self.max_request_share <= 1.0:
            raise ValueError(f"max_request_share={self.max_request_share} must be in (0, 1]")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout={self.request_timeout} must be a positive number of seconds (or None)")
        if self.memory_limit is not None and (not isinstance(self.memory_limit, int) or self.memory_limit <= 0):
            raise ValueError(f"memory_limit={self.memory_limit!r} must be a positive number of bytes (or None)")

    @property
    def max_seqs_per_request(self) -> int:
        """The most sequences one request may put in the waiting queue."""
        return max(1, int(self.max_waiting * self.max_request_share))


# The option groups, in the order the CLI flags and the README tables list them; EngineConfig.create maps each flat
# option name to the group that declares it.
OPTION_GROUPS = {
    "model": ModelConfig,
    "device": DeviceConfig,
    "scheduler": SchedulerConfig,
    "cache": CacheConfig,
    "quant": QuantConfig,
    "parallel": ParallelConfig,
    "limits": LimitsConfig,
}


# vLLM engine options a ported script or `vllm serve` command line passes that mean nothing to this engine: taken
# with one warning each (not an unknown-option error), with what does that job here. Their flags are `serve`'s too,
# hidden (cli.add_engine_args); enforce_eager also turns compile off where compile is left at auto.
VLLM_GPU_OPTIONS = {
    "gpu_memory_utilization": (
        "value",
        "the KV cache's size is kv_cache_memory_bytes, or kv_cache_memory_fraction of the memory free after loading",
    ),
    "enforce_eager": ("switch", "no CUDA graphs here; it turns compile off (the eager default on CPU)"),
    "swap_space": ("value", "a preempted request's KV is recomputed, not swapped"),
    "cpu_offload_gb": ("value", "the weights are loaded once where the engine runs"),
    "max_seq_len_to_capture": ("value", "no CUDA graphs here"),
    "disable_custom_all_reduce": ("switch", "tensor parallelism reduces through torch.distributed"),
    "trust_remote_code": ("switch", "no code is run from the model folder; the architectures are built in"),
    "disable_log_stats": ("switch", "the server's statistics are on /metrics"),
    "tokenizer_mode": ("value", "the folder's tokenizer is loaded with transformers' AutoTokenizer"),
    "disable_log_requests": ("switch", "requests are not logged one by one here"),
}


# More of vLLM's LLM(...) / EngineArgs keywords that ported scripts spell out (often at their defaults, e.g.
# `revision=None`, `enable_lora=False`, or every field of an EngineArgs): name -> (vLLM's values that mean what this
# engine does anyway, taken silently; "warn": another value is taken with one warning that it has no effect here, or
# "refuse": another value would change the answers, so it is a ValueError; why). Python only (LLM, AsyncLLM).
VLLM_PORTED_OPTIONS = {
    "revision": ((None,), "warn", "the model is the local folder as it is (no Hub downloads here)"),
    "tokenizer_revision": ((None,), "warn", "the tokenizer is the local folder's as it is (no Hub downloads here)"),
    "code_revision": ((None,), "warn", "no code is run from the model folder"),
    "download_dir": ((None,), "warn", "the model is a local folder; nothing is downloaded"),
    "hf_token": ((None, False), "warn", "the model is a local folder; nothing is downloaded"),
    "load_format": (("auto", "safetensors"), "refuse", "the weights are read from the folder's *.safetensors files"),
    "max_logprobs": ((20,), "warn", "a request may ask for up to 20 logprobs (vLLM's default)"),
    "task": (("auto", "generate"), "refuse", "this engine serves generative models only (text generation)"),
    "runner": (("auto", "generate"), "refuse", "this engine serves generative models only (text generation)"),
    "convert": (("auto", "none"), "refuse", "this engine serves generative models only (text generation)"),
    "hf_overrides": ((None, {}), "refuse", "config overrides are not applied: edit the folder's config.json"),
    "enable_lora": ((False, None), "refuse", "LoRA adapters are not supported (merge the adapter into the weights)"),
    "skip_tokenizer_init": ((False,), "refuse", "the engine needs the tokenizer (stop strings, chat, text output)"),
    "served_model_name": ((None,), "warn", "it names the model in the server's responses: serve --served-model-name"),
    "compilation_config": ((None, {}), "warn", "torch.compile is this engine's compile option ('auto', 'on', 'off')"),
    "async_scheduling": ((None, False), "warn", "each step is scheduled after the last one's tokens are sampled"),
    "disable_async_output_proc": ((False,), "warn", "outputs are processed in the engine's step"),
    "num_scheduler_steps": ((1,), "warn", "one scheduling decision a step"),
    "limit_mm_per_prompt": ((None, {}), "warn", "this engine serves text-only models"),
    "mm_processor_kwargs": ((None, {}), "warn", "this engine serves text-only models"),
    "model_impl": (("auto",), "warn", "the architectures are built in (no transformers backend)"),
    "max_parallel_loading_workers": ((None,), "warn", "the weights are loaded by the engine's own process(es)"),
    "enable_sleep_mode": ((False,), "warn", "the weights stay loaded: LLM.sleep() / wake_up() are not supported"),
    "disable_sliding_window": ((False,), "refuse", "layers attend within the windows the model's config gives"),
    "scheduling_policy": (("fcfs",), "refuse", "requests are served first come first served"),
    "logits_processors": ((None, []), "refuse", "no custom logits processors (SamplingParams has the built-in ones)"),
    "structured_outputs_config": ((None, {}), "warn", "structured output uses the engine's own grammar compiler"),
    "guided_decoding_backend": (
        ("auto", "xgrammar", "guidance"),
        "warn",
        "structured output uses the engine's own grammar compiler",
    ),
    "data_parallel_size": ((1,), "refuse", "one engine per LLM; replicas: infertune serve --data-parallel-size"),
}


def _without_vllm_gpu_options(kwargs: dict) -> dict:
    """kwargs less vLLM's options that mean nothing here (VLLM_GPU_OPTIONS), each given one named warning, and less
    the other vLLM keywords of VLLM_PORTED_OPTIONS: at a value that means what this engine does, silently; at
    another, a named warning or (where it would change the answers) a ValueError naming the option and why."""
    rest = dict(kwargs)
    for name, (_, instead) in VLLM_GPU_OPTIONS.items():
        if name not in rest:
            continue
        value = rest.pop(name)
        if value is None or value is False:
            continue
        logging.getLogger(__name__).warning("vLLM's %s=%r is ignored: %s", name, value, instead)
        if name == "enforce_eager" and rest.get("compile", "auto") == "auto":
            rest["compile"] = "off"
    for name, (neutral, action, why) in VLLM_PORTED_OPTIONS.items():
        if name not in rest:
            continue
        value = rest.pop(name)
        if value is None or any(value == v and type(value) is type(v) for v in neutral):  # (None: not set)
            continue
        if action == "refuse":
            raise OptionError(f"vLLM's {name}={value!r} is not supported: {why}")
        logging.getLogger(__name__).warning("vLLM's %s=%r is ignored: %s", name, value, why)
    return rest


def option_fields(*groups: str) -> list[Field]:
    """The declared options of the named groups (all when none are named), in order; ModelConfig.arch is none."""
    return [f for g in (groups or OPTION_GROUPS) for f in fields(OPTION_GROUPS[g]) if "help" in f.metadata]


def engine_option(name: str) -> Field:
    """The declaration of option `name` (KeyError naming the known ones when there is none)."""
    for f in option_fields():
        if f.name == name:
            return f
    raise KeyError(f"no engine option {name!r}; known: {', '.join(f.name for f in option_fields())}")


def engine_flag(name: str) -> str | None:
    """The CLI flag of option `name`: --the-name unless the declaration names another one, or None for no flag."""
    return engine_option(name).metadata.get("flag", "--" + name.replace("_", "-"))


def engine_choices(name: str) -> tuple:
    """The values option `name` takes (its declared choices; () where it has no fixed set)."""
    return tuple(engine_option(name).metadata.get("choices", ()))


def port_number(text: str) -> int:
    """argparse type of a TCP port: an integer in 0..65535 (a clear usage error, not bind()'s OverflowError)."""
    import argparse

    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (0-65535)")
    return port


def _size_arg(text: str) -> int:
    import argparse

    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _list_arg(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _json_arg(text: str) -> dict:
    import argparse

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({e})") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object")
    return value


def _value_parser(f: Field):
    """What turns the flag's text into the field's value (the annotations are strings here, see __future__)."""
    if f.metadata.get("size"):
        return _size_arg
    if f.metadata.get("json"):
        return _json_arg
    kind = str(f.type)
    return next(
        (parse for prefix, parse in (("int", int), ("float", float), ("tuple", _list_arg)) if kind.startswith(prefix)),
        None,
    )


def engine_option_kwargs(name: str, **overrides) -> dict:
    """argparse add_argument keywords for option `name`, from its declaration: type (a store_true / store_false
    action for a bool), default, choices, and help that says the default. Keywords given replace those; a tool's
    choices= may only narrow the declared ones, so no tool offers a value the engine refuses."""
    f = engine_option(name)
    declared = engine_choices(name)
    narrowed = overrides.get("choices")
    if narrowed is not None and not set(narrowed) <= set(declared):
        raise ValueError(f"choices {tuple(narrowed)} for {name} are not among its declared {declared}")
    help_ = f.metadata["help"].replace("%", "%%")  # argparse formats help with %
    if str(f.type) == "bool":
        return {"action": "store_false" if f.default else "store_true", "help": help_, **overrides}
    kw = {"type": _value_parser(f), "default": None if f.default is MISSING else f.default, "help": help_}
    if declared:
        kw["choices"] = declared
    kw.update(overrides)
    if "help" not in overrides and ("default" in overrides or "(default:" not in help_):
        kw["help"] = help_.split(" (default: ")[0] + f" (default: {kw['default']})"
    return kw


# Other engines' names for an option (llama.cpp, transformers, TGI, older vLLM): the hint of an unknown option
_OTHER_NAMES = {
    "max_seq_len": "max_model_len",
    "max_length": "max_model_len",
    "max_context_len": "max_model_len",
    "context_length": "max_model_len",
    "n_ctx": "max_model_len",
    "max_total_tokens": "max_model_len",
    "max_batch_size": "max_num_seqs",
    "max_batch_total_tokens": "max_num_batched_tokens",
    "torch_dtype": "dtype",
    "model_path": "model",
    "tokenizer_path": "tokenizer",
    "tp": "tensor_parallel_size",
    "kv_cache_size": "kv_cache_memory_bytes",
}


def _option_hint(key: str, known: list[str]) -> str:
    """What an unknown engine option may have meant: a SamplingParams field (a per-request setting), another
    engine's name for an option, or the closest option name (vLLM's taken-and-ignored ones among them)."""
    from infertune.sampling_params import SamplingParams

    if key in SamplingParams.__dataclass_fields__:
        return f"{key} is a per-request setting: pass SamplingParams({key}=...) to generate(); "
    if key in _OTHER_NAMES:
        return f"did you mean {_OTHER_NAMES[key]!r}? "
    close = difflib.get_close_matches(key, [*known, *VLLM_GPU_OPTIONS, *VLLM_PORTED_OPTIONS], n=1)
    return f"did you mean {close[0]!r}? " if close else ""


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """A warning logged once a process (engines built again for the same options say it once)."""
    if message not in _WARNED:
        _WARNED.add(message)
        logging.getLogger(__name__).warning("%s", message)


class OptionError(ValueError, TypeError):
    """An engine option that does not exist or whose value has the wrong type (a TypeError, as for any unknown
    keyword argument, and a ValueError, which the CLI reports as a one-line error)."""


_DTYPE_ALIASES = {"half": "float16", "float": "float32"}


def _coerced(f: Field, value):
    """An option's value as its field takes it: a byte count may be written as a size ("8G", "512Mi", as the flag
    takes it, in --config files and LLM(...) too); an integer option must be an integer, a number option a
    number (an OptionError naming it, not a failure deep in the engine)."""
    if f.name == "dtype":  # (vLLM's spellings: "half", "float", a torch.dtype)
        value = _DTYPE_ALIASES.get(str(value).removeprefix("torch."), str(value).removeprefix("torch."))
    if f.metadata.get("size") and isinstance(value, str):
        try:
            return parse_size(value)
        except ValueError as e:
            raise OptionError(f"{f.name}: {e}") from None
    kind = str(f.type).replace(" ", "")
    if value is None and kind.endswith("|None"):
        return value
    if kind == "bool":  # (a string such as "false" would read as True)
        if isinstance(value, numbers.Integral) and value in (0, 1):
            return bool(value)
        raise OptionError(f"{f.name}={value!r} must be True or False")
    if kind.removesuffix("|None") == "int":
        if isinstance(value, float) and value.is_integer():  # (8e9 bytes, 4096.0: whole numbers written as floats)
            return int(value)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise OptionError(f"{f.name}={value!r} must be an integer")
        return int(value)
    if kind.removesuffix("|None") == "float":
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise OptionError(f"{f.name}={value!r} must be a number")
        return float(value)
    return value


def parse_size(text: str) -> int:
    """'8G', '512Mi', '1000000' -> bytes (K/M/G are powers of 1000, Ki/Mi/Gi of 1024)."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    s = str(text).strip().lower().removesuffix("b")
    number = s.rstrip("kmgti")
    unit = s[len(number) :]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not value > 0:
        raise ValueError(f"{text!r} is not a size in bytes (examples: 8G, 512Mi, 1000000)")
    return int(value * units[unit])


def _take_stored_quantization(model: str, quant: dict) -> None:
    """A checkpoint already quantized (by `infertune quantize`, or an int8 compressed-tensors one) says its own
    quantization, as vLLM takes a checkpoint's quantization_config: quantization=None becomes its method (so
    `quantize_lm_head=True` works on it without naming the method again) and its groups the ones it was quantized
    in; what would be dropped silently is refused: another method, a keep_fp."""
    path = Path(model) / "config.json"
    try:
        qc = json.loads(path.read_text()).get("quantization_config") if path.is_file() else None
    except (OSError, json.JSONDecodeError, AttributeError):
        return  # (the loader says what is wrong with it)
    if not qc or qc.get("quant_method") == "fp8":  # (fp8: dequantized as it loads, any quantization on top)
        return
    from infertune.stored_quant import read_stored_quant

    stored = read_stored_quant(model)
    given = quant.get("quantization")
    if given not in (None, stored.method):
        raise ValueError(f"{model} is already quantized ({stored.method}); drop quantization={given!r}")
    if "keep_fp" in quant:
        kept = ", ".join(stored.ignore) or "none"
        raise ValueError(
            f"{model} is already quantized ({stored.method}): its full-precision layers are those it was quantized "
            f"with ({kept}); drop keep_fp"
        )
    quant["quantization"] = stored.method
    quant["quantize_lm_head"] = bool(quant.get("quantize_lm_head")) or stored.quantize_lm_head  # (quantize's flag)
    if stored.method == "w4a16":  # (the groups it was quantized in, whatever quant_group_size says: the CLI's default)
        quant["quant_group_size"], quant["quant_symmetric"] = stored.group_size, stored.symmetric


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        self._warn_inert_options()
        sched = self.scheduler
        if self.model.compile == "on" and self.parallel.tensor_parallel_size > 1:  # (said before any rank spawns)
            raise ValueError("compile='on' does not run with tensor parallel yet; use compile='auto' or 'off'")
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.model.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({sched.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.model.max_model_len}) so every prompt fits in one step"
            )
        if self.cache.kv_compression is not None:
            self.cache.kv_compression.check(self.model.arch.num_hidden_layers)
            windows = self.model.arch.layer_windows
            if self.cache.kv_compression.presses and windows and all(w is not None for w in windows):
                logging.getLogger(__name__).warning(
                    "kv_compression: every layer of this model attends within its own sliding window, and windowed "
                    "layers are never pressed: the press compresses nothing here (docs/long_context.md)"
                )
            refusal = self.kv_compression_refusal()
            if refusal is not None:
                drop = "drop it" if self.model.arch.mla is not None else "drop one of them"
                raise ValueError(f"kv_compression does not run with {refusal} yet; {drop}")
        if self.cache.mla_cache == "decompressed" and self.model.arch.mla is not None:
            if self.cache.kv_cache_dtype != "auto":
                raise ValueError("mla_cache='decompressed' keeps K / V in the model dtype; drop kv_cache_dtype")
        if self.cache.kv_int4_after is not None:
            spec = sched.speculative_config
            refusal = (
                "DeepSeek's latent (MLA) cache"
                if self.model.arch.mla is not None
                else "a draft model (its own KV cache)"
                if spec is not None and spec.method == "draft_model"
                else f"an odd head_dim ({self.model.arch.head_dim}: a byte holds two values of a token)"
                if self.model.arch.head_dim % 2
                else None
            )
            if refusal is not None:
                raise ValueError(f"kv_int4_after does not run with {refusal} yet; drop one of them")

    def _warn_inert_options(self) -> None:
        """One warning (once a process) for each option set to a value that does nothing with the others given: a
        script that sets it learns it was not used, rather than believing it was."""
        quant, par, arch = self.quant, self.parallel, self.model.arch
        inert = []
        if quant.quantization != "w4a16":
            why = f"it sets w4a16's groups (quantization is {quant.quantization!r})"
            if quant.quant_group_size != 128:
                inert.append((f"quant_group_size={quant.quant_group_size}", why))
            if quant.quant_symmetric:
                inert.append(("quant_symmetric=True", why))
        if quant.quantization is None and tuple(quant.keep_fp) != ("lm_head",):
            inert.append((f"keep_fp={tuple(quant.keep_fp)!r}", "no quantization is set, every layer is full precision"))
        if par.kv_role is None:
            for name, value, default in (
                ("kv_connector", par.kv_connector, None),
                ("kv_connector_config", par.kv_connector_config, None),
                ("kv_load_failure_policy", par.kv_load_failure_policy, "recompute"),
            ):
                if value != default:
                    inert.append((f"{name}={value!r}", "it is read only with kv_role (prefill/decode disaggregation)"))
        if par.enable_expert_parallel and (par.tensor_parallel_size == 1 or arch.moe is None):
            why = (
                "the model has no experts"
                if arch.moe is None
                else "tensor_parallel_size is 1 (one rank holds them all)"
            )
            inert.append(("enable_expert_parallel=True", why))
        if self.cache.mla_cache != "latent" and arch.mla is None:
            inert.append((f"mla_cache={self.cache.mla_cache!r}", "the model is not a DeepSeek (MLA) model"))
        for setting, why in inert:
            _warn_once(f"{setting} has no effect here: {why}")

    def kv_compression_refusal(self) -> str | None:
        """What of this engine KV compression does not run with yet (engine-wide or per request); None: nothing."""
        if self.model.arch.mla is not None:
            return "DeepSeek's latent (MLA) cache"
        if self.scheduler.speculative_config is not None:
            return "speculative decoding"
        if getattr(self.parallel, "kv_role", None) is not None:
            return "a KV connector (kv_role)"
        return None

    @classmethod
    def create(cls, model: str | None = None, **kwargs) -> EngineConfig:
        """Build the tree from flat keyword arguments (the LLM(...) and CLI surface)."""
        groups = OPTION_GROUPS
        parts: dict[str, dict] = {name: {} for name in groups}
        kwargs = _without_vllm_gpu_options(kwargs)
        for key, value in kwargs.items():
            owner = next((g for g, c in groups.items() if key in c.__dataclass_fields__ and key != "arch"), None)
            if owner is None:
                known = sorted(k for c in groups.values() for k in c.__dataclass_fields__ if k != "arch")
                raise OptionError(
                    f"unknown engine option {key!r}; {_option_hint(key, known)}known options: {', '.join(known)}"
                )
            declared = groups[owner].__dataclass_fields__[key]
            if value is None and not str(declared.type).replace(" ", "").endswith("|None"):
                continue  # (vLLM's None for an option: not set, so its default; LLM(enable_prefix_caching=None))
            parts[owner][key] = _coerced(declared, value)
        if model is not None:
            parts["model"]["model"] = model
        _take_stored_quantization(parts["model"].get("model") or default_model_path(), parts["quant"])
        return cls(**{name: groups[name](**parts[name]) for name in groups})
