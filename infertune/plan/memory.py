"""Memory model: exact weight bytes, KV-cache bytes and the sequences that fit, all from a model's config.json.

Pure integer arithmetic on `ArchConfig` (no torch); the weights' side is weights.py. Every count here is exact for
the layer layouts that infertune runs; the tests check it against `sum(p.numel())` of a real transformers model.

Conventions:
- bytes are exact integers; a "GB" in a message is 1e9 bytes;
- weight formats (bf16, the 12-bit layout, W8A16, W4A16, FP8 block-scaled checkpoints), MoE and MLA weights:
  see weights.py;
- INT8 KV stores one scale per token, per layer, per KV head, for K and for V (`kv_scale_bytes`, fp16: 2), so a
  token costs 2 x layers x kv_heads x (head_dim + kv_scale_bytes) bytes: a factor (head_dim + 2) / (2 x head_dim)
  of the 16-bit cache (0.5078 for head_dim 128). With kv_scale_bytes=0 (one scale per tensor) it is exactly half;
- MLA (DeepSeek) caches one plane of kv_lora_rank + qk_rope_head_dim values a token and layer (the latent and the
  shared rotary key, no K and V pair): DeepSeek-V3 keeps (512 + 64) x 61 layers x 2 bytes = 70,272 B a token in
  bf16; in INT8 that row has one scale: 61 x (576 + 2) bytes;
- tensor parallel (--tp N): attention heads and dense matrices are split over the N cards, and the routed experts
  are dealt whole to them (expert parallel: E / N each, so N must divide E); norms, routers and MLA's latent
  down-projections (q_a_proj, kv_a_proj_with_mqa) are replicated, and so is MLA's latent cache (one row a token on
  every card, like a single KV head). MoE all-to-all traffic is not modelled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from infertune.config import ArchConfig
from infertune.plan.weights import BF16, WeightBreakdown, WeightFormat, weight_breakdown_of
from infertune.stored_quant import stored_quant_of

KV_DTYPES = ("auto", "bf16", "fp16", "fp32", "int8")
# Config files of published models, shipped so that `plan --model deepseek-v3` needs no download (SOURCE.md there).
SHIPPED_DIR = Path(__file__).parent / "data" / "models"


def shipped_models() -> list[str]:
    return sorted(p.stem for p in SHIPPED_DIR.glob("*.json"))


@dataclass(frozen=True)
class ModelSpec:
    """An ArchConfig plus what the planner needs beyond it: which layers use a sliding window, and how the checkpoint
    stores its weights where config.json says (`weight_format`: a block-scaled fp8 checkpoint; None: 16-bit)."""

    name: str
    arch: ArchConfig
    num_windowed_layers: int  # layers whose KV is capped at arch.sliding_window tokens
    weight_format: WeightFormat | None = None
    quant_method: str | None = None  # quantization_config's quant_method, also where the planner does not model it
    checkpoint_dtype: str | None = None  # config.json's dtype / torch_dtype ("float32", "bfloat16", ...), if said

    @classmethod
    def from_dict(cls, cfg: dict, name: str = "model", where: str = "config.json") -> ModelSpec:
        arch = ArchConfig.from_dict(cfg, where=where)
        qc = cfg.get("quantization_config") or {}
        stored = None
        if qc.get("quant_method") == "fp8":
            block = qc.get("weight_block_size")
            stored = WeightFormat("fp8", block=None if block is None else tuple(int(b) for b in block))
        if qc.get("quant_method") == "compressed-tensors":  # what `infertune quantize` writes, or an int8 one the
            try:  # engine reads as it (stored_quant.py); others stay unmodelled (the planner says so)
                own = stored_quant_of(qc, where)
                method, group, head = own.method, own.group_size, own.quantize_lm_head
            except ValueError:  # (infertune's own entry names the method however the rest is written)
                extra = qc.get("infertune") or {}
                weights = ((qc.get("config_groups") or {}).get("group_0") or {}).get("weights") or {}
                method, group, head = extra.get("method"), weights.get("group_size"), extra.get("quantize_lm_head")
            if method in ("w8a16", "w8a8", "w4a16"):
                stored = WeightFormat(method, int(group or 128), quantize_lm_head=bool(head))
        return cls(
            name=name,
            arch=arch,
            num_windowed_layers=sum(w is not None for w in arch.layer_windows or ()),
            weight_format=stored,
            quant_method=qc.get("quant_method"),
            checkpoint_dtype=cfg.get("dtype") or cfg.get("torch_dtype"),
        )

    @classmethod
    def load(cls, path: str | Path) -> ModelSpec:
        """A Hugging Face model folder, its config.json, or the name of a shipped config (`shipped_models()`)."""
        p = Path(path)
        file = p / "config.json" if p.is_dir() else p
        name = (p if p.is_dir() else p.parent).name or "model"
        if not file.is_file() and (SHIPPED_DIR / f"{str(path).lower()}.json").is_file():
            file, name = SHIPPED_DIR / f"{str(path).lower()}.json", str(path).lower()
        if not file.is_file():
            raise FileNotFoundError(
                f"{path!r}: no config.json there; pass a Hugging Face model folder, its config.json, or one of "
                f"the shipped configs: {', '.join(shipped_models())}"
            )
        try:
            cfg = json.loads(file.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{file} is not valid JSON: {e}") from e
        return cls.from_dict(cfg, name=name, where=str(file))


def weight_breakdown(spec: ModelSpec, fmt: WeightFormat = BF16) -> WeightBreakdown:
    return weight_breakdown_of(spec.arch, fmt)


# ---------------------------------------------------------------------------------------------- KV cache


@dataclass(frozen=True)
class KVFormat:
    name: str = "auto"
    # int8 only: one fp32 scale per token, layer, KV head, for K and for V (MLA: its one row), as the engine stores
    # it (layers/attention/paged.py and mla.py SCALE_BYTES)
    scale_bytes: int = 4
    # The engine's int4 tier (kv_int4_after, int8 only): a sequence's tokens this many or more behind its newest in
    # int4 (head_dim / 2 bytes and an fp16 scale a token and KV head) in its full-attention layers; None: off.
    int4_after: int | None = None
    # The engine's kv_compression (kv_compression.KVCompressionConfig: a press, or a policy by layer and prompt
    # length): its window rules cap layers at their window, its presses keep what they keep of each prompt of
    # prompt_len tokens (None: the whole sequence is the prompt), the tokens decoded after it whole; pressed=False:
    # before the press has run (a prefill's writes), the window rules only.
    compression: object | None = field(default=None, compare=False)
    prompt_len: int | None = None
    pressed: bool = True

    def __post_init__(self) -> None:
        if self.name not in KV_DTYPES:
            raise ValueError(f"KV dtype {self.name!r} is unknown; choose one of {', '.join(KV_DTYPES)}")
        if self.compression is not None and self.prompt_len is not None and self.prompt_len < 1:
            raise ValueError(f"the prompt length the press runs on must be >= 1 (got {self.prompt_len})")
        if self.int4_after is not None and (self.name != "int8" or self.int4_after < 0):
            raise ValueError(
                f"the int4 tier (int4_after={self.int4_after}) needs the int8 KV dtype (--kv-dtype int8) and a "
                "token count >= 0"
            )

    @property
    def element_bytes(self) -> int:
        # auto = the activation dtype, 16-bit for every weight format here (W8A16 / W4A16 keep bf16 activations).
        return {"auto": 2, "bf16": 2, "fp16": 2, "fp32": 4, "int8": 1}[self.name]


def kv_bytes_per_token_per_layer(spec: ModelSpec, kv: KVFormat = KVFormat()) -> int:
    a = spec.arch
    scale = kv.scale_bytes if kv.name == "int8" else 0
    planes = 1 if a.mla else 2  # MLA: one latent row (ArchConfig's one "head" of cache_width); else K and V
    return planes * a.num_key_value_heads * (a.head_dim * kv.element_bytes + scale)


def kv_bytes_per_token(spec: ModelSpec, kv: KVFormat = KVFormat()) -> int:
    """2 (K and V; 1 for MLA's latent) x layers x kv_heads x head_dim x dtype bytes (+ INT8 scales); ignores any
    sliding window."""
    return spec.arch.num_hidden_layers * kv_bytes_per_token_per_layer(spec, kv)


def kv_groups(spec: ModelSpec, context: int, kv: KVFormat = KVFormat()):
    """The engine's KV cache groups for this model at max_model_len = context (scheduler_output.kv_cache_groups):
    the model's windows with a compression policy's window rules, and its compressed layers grouped by what they
    keep (kv_compression.layer_key), as the model runner groups them."""
    from infertune.scheduler_output import kv_cache_groups

    a, comp = spec.arch, kv.compression
    if comp is None:
        return kv_cache_groups(a.layer_windows, a.num_hidden_layers, max(context, 2))
    if a.mla is not None:
        raise ValueError("KV compression is the engine's for K / V caches; MLA's latent cache does not take it")
    comp.check(a.num_hidden_layers)
    windows = comp.layer_windows(a.layer_windows, a.num_hidden_layers)
    keys = tuple(comp.layer_key(i) for i in range(a.num_hidden_layers))
    return kv_cache_groups(windows, a.num_hidden_layers, max(context, 2), keys)


def kv_group_tokens(spec: ModelSpec, context: int, kv: KVFormat = KVFormat()) -> list[tuple[object, int]]:
    """Each of the engine's KV cache groups (kv_groups) with the tokens one sequence of `context` tokens keeps in
    each of its layers: a full-attention layer all of them, a windowed one at most its window, a compressed one
    what its press keeps of the prompt (kv.prompt_len, at most context) plus the tokens decoded after it."""
    comp, num_layers = kv.compression, spec.arch.num_hidden_layers
    prompt = context if kv.prompt_len is None else min(kv.prompt_len, context)
    out = []
    for g in kv_groups(spec, context, kv):
        if g.window is not None:
            tokens = min(context, g.window)
        elif g.compressed and kv.pressed:
            tokens = comp.kept_tokens(g.layers[0], num_layers, prompt) + (context - prompt)
        else:
            tokens = context
        out.append((g, tokens))
    return out


def kv_token_layers(spec: ModelSpec, context: int, kv: KVFormat = KVFormat()) -> int:
    """Sum over layers of the tokens of KV each layer keeps (and a decode step reads) for a sequence of `context`
    tokens: a full-attention layer all of them, a windowed one at most its window, a compressed one what its press
    keeps (kv_group_tokens)."""
    return sum(len(g.layers) * tokens for g, tokens in kv_group_tokens(spec, context, kv))


def kv_page_token_layers(spec: ModelSpec, context: int, kv: KVFormat = KVFormat()) -> int:
    """The layer pages x tokens one sequence of `context` tokens holds in the engine's KV cache: its KV cache groups
    (each kind of layer, full or windowed, cut into groups of equal size where the kinds' layer counts differ) share
    block ids of one pool, a block id a page of each layer of the largest group, so a group of fewer layers pays
    for the pages it leaves empty (engine/kv_cache_coordinator.py, scheduler_output.kv_cache_groups). Gemma 3 1B's
    22 windowed and 4 full layers: 7 groups of 4 layers' pages, the last windowed one of 2 (2 pages a block empty)."""
    groups = kv_group_tokens(spec, context, kv)
    pages = max(len(g.layers) for g, _ in groups)
    return sum(pages * tokens for _, tokens in groups)


def kv_int4_bytes_per_token_per_layer(spec: ModelSpec) -> int:
    """A token's K and V in one layer in the int4 tier: head_dim / 2 bytes of nibbles and an fp16 scale a KV head."""
    return 2 * spec.arch.num_key_value_heads * (spec.arch.head_dim // 2 + 2)


def kv_bytes_per_sequence(spec: ModelSpec, context: int, kv: KVFormat = KVFormat(), held: bool = True) -> int:
    """The KV cache bytes of one sequence of `context` tokens: with held (the default), what it holds in the
    engine's pool (kv_page_token_layers: the pages a smaller group leaves empty included); else the bytes its
    layers keep, what a decode step reads. With the int4 tier, a full-attention layer keeps int4_after tokens at
    int8 and the rest in int4 (the engine packs whole pairs of blocks, so up to two blocks more stay int8);
    windowed layers are not tiered. With KV compression, each group holds what kv_group_tokens says."""
    if kv.int4_after is not None and spec.arch.mla:
        raise ValueError("the int4 tier is the engine's for K / V caches; MLA's latent cache does not take it")
    per_layer = kv_bytes_per_token_per_layer(spec, kv)
    groups = kv_group_tokens(spec, context, kv)
    pages = max(len(g.layers) for g, _ in groups)
    total = 0
    for g, tokens in groups:
        layers = pages if held else len(g.layers)  # (held: a block is a page of each layer of the largest group)
        total += layers * tokens * per_layer
        if kv.int4_after is not None and g.window is None:  # (the full groups' old tokens, re-stored in int4)
            old = max(0, tokens - kv.int4_after)
            total -= layers * old * (per_layer - kv_int4_bytes_per_token_per_layer(spec))
    return total


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
    if a.moe is not None and a.moe.num_experts % tp:
        raise ValueError(
            f"--tp {tp} does not divide num_experts={a.moe.num_experts}: the planner deals the routed experts "
            "whole to the cards (expert parallel); pick a divisor"
        )


def kv_shard_fraction(spec: ModelSpec, tp: int) -> float:
    """Share of a sequence's KV each rank stores: kv_heads/tp heads, or one replicated head when tp > kv_heads
    (MLA's latent is that one head: every rank keeps all of it)."""
    kv = spec.arch.num_key_value_heads
    return max(1, kv // tp) / kv


def weight_bytes_per_card(w: WeightBreakdown, tp: int) -> int:
    sharded = w.total_bytes - w.replicated_bytes
    return math.ceil(sharded / tp) + w.replicated_bytes


def activation_reserve_bytes(spec: ModelSpec, tokens_per_step: int, batch: int, tp: int = 1) -> int:
    """Peak activation workspace of one step, per card.

    Per token in flight, a decoder layer holds at most: the residual and normed hidden (2 x hidden), the q/k/v
    projection ((heads + 2 kv_heads) x head_dim; MLA: q, the latent row, and the K and V a prefill decompresses)
    and the MLP's gate, up and product (3 x intermediate; a MoE layer: 3 x (top_k x expert + shared) intermediate),
    2 bytes each, /tp for the sharded parts. Plus fp32 logits for the rows that sample (batch x vocab x 4).
    Attention scores are not materialized (flash / paged attention).
    """
    a, moe = spec.arch, spec.arch.moe
    if a.mla is not None:
        m = a.mla
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        attn = a.num_attention_heads * (2 * qk + m.v_head_dim) // tp + m.cache_width
    else:
        attn = (a.num_attention_heads + 2 * a.num_key_value_heads) * a.head_dim // tp
    inter = a.intermediate_size if moe is None or len(moe.layers) < a.num_hidden_layers else 0
    if moe is not None:
        inter = max(inter, moe.top_k * moe.intermediate_size + moe.shared_intermediate_size)
    per_token = 2 * a.hidden_size + attn + 3 * inter // tp
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
    # KV compression: what a prompt holds beyond its compressed share until its press has run (room kept for one)
    prefill_peak_bytes: int = 0

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
    # With KV compression a prompt is held whole until its press runs at the end of its prefill: room for one such
    # prompt beyond the compressed sequences (prompts are prefilled one after another once they do not fit a step)
    peak = 0
    if kv.compression is not None:
        prompt = context if kv.prompt_len is None else min(kv.prompt_len, context)
        whole = kv_bytes_per_sequence(spec, prompt, replace(kv, pressed=False))
        peak = max(0, math.ceil((whole - kv_bytes_per_sequence(spec, prompt, kv)) * kv_shard_fraction(spec, tp)))
    max_seqs = max(0, (budget - peak) // per_seq) if per_seq else 0
    return MemoryBudget(device_bytes, usable, weights, act, budget, per_seq, int(max_seqs), peak)
