"""Weight arithmetic: exact parameter counts and bytes of a model's weights in each format, from its ArchConfig.

Pure integer arithmetic (no torch), exact for the layer layouts infertune runs (Llama / Qwen2 / Mistral / Qwen3, the
MoE families, DeepSeek's MLA); the tests check it against `sum(p.numel())` of real transformers models.

- W8A16 = int8 weights + one scale per output channel; W4A16 = int4 weights + a scale and a zero point per group
  of `group_size` input elements of each output row (the `scales_and_zeros` layout of aten's int4 kernels, which
  infertune's quant/int4.py uses; zero_bytes=0 models a scale-only format). Scales and zeros are bf16 (2 bytes).
  Only the decoder layers' projections (and routed experts) are quantized; with `quantize_lm_head` the lm_head is
  int8 + one scale per vocabulary row whatever the format (as the engine's `quantize_lm_head` keeps it), beside a
  tied embedding's bf16 copy; embeddings, norms, biases and MoE routers stay in bf16.
- FP8 = a block-scaled fp8 checkpoint as published (DeepSeek-V3, Qwen3-*-FP8): one byte a weight plus one fp32
  scale per `block` (128 x 128) of each matrix, the last block row / column partial; the same matrices as W8A16
  plus MLA's kv_b_proj, which those checkpoints store in fp8 too (infertune dequantizes them at load: plan that
  with bf16).
- MoE: a layer's routed experts are counted whole (`params_routed_experts`); one token runs top_k of them, so
  `params_active` is the total less the (num_experts - top_k) experts it does not pick. A step of b tokens reads,
  per MoE layer, the distinct experts they touch: in expectation E (1 - (1 - k/E)^b) with uniform routing
  (`experts_touched`). Routers (fp32 where the family computes them in fp32) and DeepSeek's correction bias count
  with the MLP.
- MLA (DeepSeek): q (q_a_proj, q_a_layernorm, q_b_proj, or one q_proj), kv_a_proj_with_mqa, kv_a_layernorm,
  kv_b_proj and o_proj.
"""

from __future__ import annotations

from dataclasses import dataclass

from infertune.config import GEMMA_ARCHITECTURES, ArchConfig

WEIGHT_DTYPES = ("bf16", "bf16-12bit", "w8a16", "w8a8", "w4a16", "fp8")
FP8_SCALE_BYTES = 4  # fp32 weight_scale_inv per block


# The matrices each format stores in its own encoding (the rest stay bf16), as infertune (or the checkpoint) does:
#   linear   the decoder layers' Linear projections: attention, dense MLPs, shared experts
#   expert   the routed experts (quantized expert by expert, quant/experts.py; the 12-bit layout is for Linears only)
#   latent   MLA's kv_b_proj, not a Linear in infertune (layers/attention/mla.py): only a checkpoint's fp8 covers it
_COVERS = {
    "bf16": (),
    "bf16-12bit": ("linear",),
    "w8a16": ("linear", "expert"),
    "w8a8": ("linear", "expert"),  # (the same int8 weights and per-channel scales as w8a16)
    "w4a16": ("linear", "expert"),
    "fp8": ("linear", "expert", "latent"),
}


@dataclass(frozen=True)
class WeightFormat:
    name: str = "bf16"
    group_size: int = 128  # W4A16 only
    scale_bytes: int = 2  # bf16 scales
    zero_bytes: int = 2  # W4A16 only: bf16 zero point per group
    quantize_lm_head: bool = False
    block: tuple[int, int] | None = (128, 128)  # FP8 only: rows x columns per scale; None = one scale per matrix

    def __post_init__(self) -> None:
        if self.name not in WEIGHT_DTYPES:
            raise ValueError(f"weight dtype {self.name!r} is unknown; choose one of {', '.join(WEIGHT_DTYPES)}")
        if self.group_size <= 0:
            raise ValueError(f"group_size must be positive (got {self.group_size})")
        if self.block is not None and (len(self.block) != 2 or min(self.block) <= 0):
            raise ValueError(f"an fp8 weight_block_size is two positive integers (got {self.block})")

    @property
    def bits(self) -> int:
        return {"bf16": 16, "bf16-12bit": 12, "w8a16": 8, "w8a8": 8, "w4a16": 4, "fp8": 8}[self.name]

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
        if self.name == "fp8":
            bn, bk = self.block or (out_features, in_features)
            return data, -(-out_features // bn) * -(-in_features // bk) * FP8_SCALE_BYTES
        if self.name in ("w8a16", "w8a8"):
            return data, out_features * self.scale_bytes
        if in_features % self.group_size:  # (the engine and `infertune quantize` refuse such a layer too)
            raise ValueError(
                f"w4a16 in groups of {self.group_size} does not fit a layer of {in_features} input features; "
                "pick a group size dividing it (--group-size)"
            )
        groups = out_features * (in_features // self.group_size)
        return data, groups * (self.scale_bytes + self.zero_bytes)

    def matrix_bytes(self, out_features: int, in_features: int, kind: str) -> tuple[int, int]:
        """linear_bytes for the matrices this format covers (`_COVERS`), plain bf16 for the others."""
        if kind in _COVERS[self.name]:
            return self.linear_bytes(out_features, in_features)
        return out_features * in_features * 2, 0


BF16 = WeightFormat()  # the default (a frozen instance, shared)


@dataclass
class _Tally:
    """Parameters and bytes of a group of tensors (per layer or summed)."""

    params: int = 0
    matrix: int = 0  # of which matmul weights
    data: int = 0  # bytes of weights and vectors, quant scales included
    scales: int = 0

    def matrices(self, fmt: WeightFormat, mats: list[tuple[int, int]], kind: str, count: int = 1) -> None:
        for out_f, in_f in mats:
            d, s = fmt.matrix_bytes(out_f, in_f, kind)
            self.params += count * out_f * in_f
            self.matrix += count * out_f * in_f
            self.data += count * (d + s)
            self.scales += count * s

    def vector(self, n: int, element_bytes: int = 2, count: int = 1, matmul: bool = False) -> None:
        """Tensors no format quantizes: biases, norms, routers (`matmul`: a router weight, multiplied by)."""
        self.params += count * n
        self.matrix += count * n if matmul else 0
        self.data += count * n * element_bytes

    def add(self, other: _Tally, count: int = 1) -> None:
        self.params += count * other.params
        self.matrix += count * other.matrix
        self.data += count * other.data
        self.scales += count * other.scales


@dataclass(frozen=True)
class WeightBreakdown:
    """Exact parameter counts and bytes. `params_*` are element counts of the unquantized model."""

    params_embedding: int
    params_lm_head: int  # 0 when tied (the embedding matrix is the lm_head)
    params_attention: int  # q/k/v/o (or MLA's projections) weights and biases, all layers
    params_mlp: int  # dense MLPs and MoE blocks (router, routed and shared experts), all layers
    params_norms: int  # every RMSNorm: per layer, Qwen3's q/k norms, MLA's latent norms, the final norm
    params_layer_linear_weights: int  # every matrix of every layer, all routed experts included
    bytes_embedding: int
    bytes_lm_head: int  # a separate lm_head copy (untied, or tied but quantized); 0 when it is the embedding
    bytes_layers: int  # attention + mlp + per-layer norms incl. quant scales
    bytes_final_norm: int
    bytes_quant_scales: int  # scales (and W4A16 zero points), included in bytes_layers / bytes_lm_head
    bytes_replicated: int  # copied to every tensor-parallel rank: norms, routers, MLA's latent down-projections
    tied: bool
    moe_layers: int = 0
    num_experts: int = 0
    top_k: int = 0
    params_expert: int = 0  # one routed expert (gate, up, down)
    bytes_expert: int = 0  # one routed expert in this format, its scales included

    @property
    def total_params(self) -> int:
        return self.params_embedding + self.params_lm_head + self.params_attention + self.params_mlp + self.params_norms

    @property
    def total_bytes(self) -> int:
        return self.bytes_embedding + self.bytes_lm_head + self.bytes_layers + self.bytes_final_norm

    @property
    def params_routed_experts(self) -> int:
        return self.moe_layers * self.num_experts * self.params_expert

    @property
    def params_unpicked(self) -> int:
        """Routed-expert parameters a token does not run: (E - k) experts in every MoE layer."""
        return self.moe_layers * (self.num_experts - self.top_k) * self.params_expert

    @property
    def params_active(self) -> int:
        """Parameters one token's forward uses: all but the experts it does not pick (the embedding table counted,
        as Mistral and Qwen count their published "active" figures)."""
        return self.total_params - self.params_unpicked

    @property
    def params_active_streamed(self) -> int:
        """params_active less an untied input embedding (a row lookup, not a matmul): the weights a one-token
        decode step reads (DeepSeek's count of "activated" parameters)."""
        return self.params_active - (0 if self.tied else self.params_embedding)

    @property
    def params_active_linear_weights(self) -> int:
        """Layer matrices one token multiplies by (the FLOPs side of params_active)."""
        return self.params_layer_linear_weights - self.params_unpicked

    @property
    def streamed_bytes_per_step(self) -> int:
        """Bytes a forward step reads when it touches every weight: every layer (every expert), the final norm and
        the lm_head matrix.

        The input embedding is a row lookup (a few KB per token), so an untied embedding table is not streamed;
        a tied one is, because it is also the lm_head.
        """
        head = self.bytes_lm_head if self.bytes_lm_head else (self.bytes_embedding if self.tied else 0)
        return self.bytes_layers + self.bytes_final_norm + head

    def experts_touched(self, tokens: int) -> float:
        """Expected distinct routed experts `tokens` tokens pick in one MoE layer (each a uniform k-subset)."""
        return expected_experts_touched(self.num_experts, self.top_k, tokens) if self.moe_layers else 0.0

    def weight_bytes_read(self, tokens: int) -> float:
        """Weight bytes a step of `tokens` tokens reads: streamed_bytes_per_step with, in each MoE layer, only the
        experts the tokens touch (in expectation)."""
        unread = self.num_experts - self.experts_touched(tokens) if self.moe_layers else 0.0
        return self.streamed_bytes_per_step - self.moe_layers * unread * self.bytes_expert

    @property
    def lm_head_matmul_params(self) -> int:
        return self.params_lm_head or self.params_embedding

    @property
    def replicated_bytes(self) -> int:
        return self.bytes_replicated


def expected_experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """E (1 - (1 - k/E)^b): each of b tokens picks k distinct experts uniformly, so a given expert escapes one token
    with probability 1 - k/E and all b of them with (1 - k/E)^b."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def _attention(a: ArchConfig, fmt: WeightFormat) -> tuple[_Tally, _Tally, _Tally]:
    """One layer's attention -> (its weights and biases, its norms, the replicated part of the weights)."""
    h = a.hidden_size
    weights, norms, replicated = _Tally(), _Tally(), _Tally()
    if a.mla is not None:
        m, heads = a.mla, a.num_attention_heads
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        down = [(m.cache_width, h)]  # kv_a_proj_with_mqa: the latent and the shared rotary key
        if m.q_lora_rank is not None:
            down.append((m.q_lora_rank, h))  # q_a_proj
            weights.matrices(fmt, [(heads * qk, m.q_lora_rank)], "linear")  # q_b_proj
            norms.vector(m.q_lora_rank)
        else:
            weights.matrices(fmt, [(heads * qk, h)], "linear")  # q_proj
        replicated.matrices(fmt, down, "linear")
        if a.attention_bias:  # on q_a_proj, kv_a_proj_with_mqa and o_proj (as Hugging Face's DeepSeek modules)
            replicated.vector(sum(out for out, _ in down))
            weights.vector(h)
        weights.matrices(fmt, [(heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)], "latent")  # kv_b_proj
        weights.matrices(fmt, [(h, heads * m.v_head_dim)], "linear")  # o_proj
        norms.vector(m.kv_lora_rank)
        weights.add(replicated)
        return weights, norms, replicated
    q_out, kv_out = a.num_attention_heads * a.head_dim, a.num_key_value_heads * a.head_dim
    weights.matrices(fmt, [(q_out, h), (kv_out, h), (kv_out, h), (h, q_out)], "linear")
    if a.attention_bias:  # Qwen2 (and Qwen2-MoE): bias on q/k/v only; Llama-style attention_bias: on o too
        qwen2 = a.architecture in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        weights.vector(q_out + 2 * kv_out + (0 if qwen2 else h))
    if a.qk_norm:
        norms.vector(2 * a.head_dim)
    return weights, norms, replicated


def _mlp(a: ArchConfig, fmt: WeightFormat, inter: int, kind: str = "linear") -> _Tally:
    """A gated MLP (gate, up, down) of intermediate size `inter`."""
    t, h = _Tally(), a.hidden_size
    t.matrices(fmt, [(inter, h), (inter, h), (h, inter)], kind)
    if a.mlp_bias and kind == "linear":
        t.vector(2 * inter + h)
    return t


def weight_breakdown_of(a: ArchConfig, fmt: WeightFormat) -> WeightBreakdown:
    h, layers, moe = a.hidden_size, a.num_hidden_layers, a.moe
    attn, attn_norms, attn_replicated = _attention(a, fmt)
    moe_layers = len(moe.layers) if moe is not None else 0
    dense = _mlp(a, fmt, a.intermediate_size)
    expert = _mlp(a, fmt, moe.intermediate_size, "expert") if moe else _Tally()
    block, router = _Tally(), _Tally()  # one MoE layer's MLP, and its replicated router part
    if moe is not None:
        block.add(expert, moe.num_experts)
        router.vector(moe.num_experts * h, 4 if moe.router_fp32 else 2, matmul=True)
        if moe.correction_bias:
            router.vector(moe.num_experts, 4)  # e_score_correction_bias, fp32
        if moe.shared_intermediate_size:
            block.add(_mlp(a, fmt, moe.shared_intermediate_size))
            if moe.shared_gate:
                router.vector(h, matmul=True)  # Qwen2-MoE's shared_expert_gate [1, H]
        block.add(router)
    mlp = _Tally()
    mlp.add(dense, layers - moe_layers)
    mlp.add(block, moe_layers)
    norms = _Tally()
    # input and post-attention norms; Gemma's pre- and post-feedforward ones too
    norms.vector((4 if a.architecture in GEMMA_ARCHITECTURES else 2) * h, count=layers)
    norms.add(attn_norms, layers)
    vocab_h = a.vocab_size * h
    if a.tie_word_embeddings and not fmt.quantize_lm_head:
        head_bytes = head_scales = 0
    elif fmt.quantize_lm_head:  # int8 per channel whatever the format (QuantConfig.quantize_lm_head)
        head_bytes, head_scales = WeightFormat("w8a16", scale_bytes=fmt.scale_bytes).linear_bytes(a.vocab_size, h)
    else:
        head_bytes, head_scales = vocab_h * 2, 0
    return WeightBreakdown(
        params_embedding=vocab_h,
        params_lm_head=0 if a.tie_word_embeddings else vocab_h,
        params_attention=layers * attn.params,
        params_mlp=mlp.params,
        params_norms=norms.params + h,
        params_layer_linear_weights=layers * attn.matrix + mlp.matrix,
        bytes_embedding=vocab_h * 2,
        bytes_lm_head=head_bytes + head_scales,
        bytes_layers=layers * attn.data + mlp.data + norms.data,
        bytes_final_norm=h * 2,
        bytes_quant_scales=layers * attn.scales + mlp.scales + head_scales,
        bytes_replicated=norms.data + h * 2 + layers * attn_replicated.data + moe_layers * router.data,
        tied=a.tie_word_embeddings,
        moe_layers=moe_layers,
        num_experts=moe.num_experts if moe else 0,
        top_k=moe.top_k if moe else 0,
        params_expert=expert.params,
        bytes_expert=expert.data,
    )
