"""Llama-family decoder over a flattened batch and a paged KV cache: Llama, Qwen2 (q/k/v bias), Mistral, Qwen3
(per-head q / k RMSNorm), Phi-3 (fused qkv_proj / gate_up_proj in its checkpoints, split at load by
ArchConfig.fused_checkpoint; partial rotary), and their mixture-of-experts kin (Qwen2-MoE with its gated shared expert, Qwen3-MoE,
Mixtral), whose MoE layers are layers/moe.py MoE in place of the MLP.

The forward takes every scheduled token of the step as one [T] run; attention finds each sequence's context
through the AttentionMetadata, within the layer's sliding window where it has one (Mistral, Qwen2's
use_sliding_window: ArchConfig.layer_windows). Weights for q/k/v and gate/up are packed.

A decoder layer is three stages, so that the runner can compile the dense parts and keep attention (whose shapes
follow the context lengths) eager:
  project(x, cos, sin)        input norm, qkv projection, rotary            -> q, k, v
  attention                   the attention backend (paged KV cache)         -> o
  finish(o, x)                o_proj + residual, post-norm, MLP + residual   -> the layer's output
`LlamaModel.forward` runs them in order; `infertune.runner.compiled` runs the same methods through torch.compile.
"""

from __future__ import annotations

import torch
from torch import nn

from infertune.config import ArchConfig
from infertune.layers.activation import SiluAndMul
from infertune.layers.attention import AttentionBackend, AttentionMetadata
from infertune.layers.linear import Linear, PackedLinear
from infertune.layers.moe import MoE
from infertune.layers.norm import RMSNorm
from infertune.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    tp_plan = {"qkv_proj": "colwise", "o_proj": "rowwise"}  # heads split over the ranks (layers/parallel.py)

    def __init__(
        self, cfg: ArchConfig, rotary: RotaryEmbedding, attn: AttentionBackend, dtype: torch.dtype, index: int = 0
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = PackedLinear(
            cfg.hidden_size,
            {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=cfg.attention_bias,
            dtype=dtype,
        )
        # Llama's (and Qwen3's) attention_bias also covers o_proj; Qwen2's q/k/v bias does not.
        o_bias = cfg.attention_bias and cfg.architecture not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM")
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=o_bias, dtype=dtype)
        self.rotary = rotary
        self.attn = attn
        self.index = index
        self.window = cfg.layer_windows[index] if cfg.layer_windows else None  # this layer's sliding window
        self.softcap = None  # attention logit soft-capping (Gemma 2 sets it)
        # Qwen3: each head of q and of k is RMS-normalised (over head_dim) before rotary.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, dtype) if cfg.qk_norm else None

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden] (normed) -> q [T, H, D], k, v [T, Hkv, D]: views of one qkv buffer, q and k rotated."""
        t = x.shape[0]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x).view(t, h + 2 * hkv, d)
        qk = qkv[:, : h + hkv]
        if self.q_norm is not None:
            qk = torch.cat(
                [
                    self.q_norm(qk[:, :h].reshape(t * h, d)).view(t, h, d),
                    self.k_norm(qk[:, h:].reshape(t * hkv, d)).view(t, hkv, d),
                ],
                dim=1,
            )
        if self.rotary.head_dim == d:
            qk = self.rotary(qk, cos, sin)
        else:  # partial rotary (Phi-3's partial_rotary_factor): the first rotary dims of each head, in place
            self.rotary(qk[..., : self.rotary.head_dim], cos, sin)
        return qk[:, :h], qk[:, h:], qkv[:, h + hkv :]

    def attend(self, q, k, v, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """The attention backend over this layer's cache, within its window -> o [T, H, D]."""
        if meta.press_rows is not None:  # KV compression: the observation window's queries (SnapKV)
            meta.press_queries[self.index] = q.index_select(0, meta.press_rows)
        meta = meta.for_layer(self.index)  # this layer's KV cache group
        return self.attn.forward(q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        o = self.attend(*self.project(x, cos, sin), kv_cache, meta)  # [T, H, D]
        return self.o_proj(o.reshape(x.shape[0], self.q_size))


# Prefill rows per MLP pass (see LlamaMLP.forward): big enough that the GEMMs run as fast as at 2048 rows.
MLP_CHUNK_ROWS = 512


class LlamaMLP(nn.Module):
    tp_plan = {"gate_up_proj": "colwise", "down_proj": "rowwise"}

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, intermediate_size: int | None = None) -> None:
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = PackedLinear(cfg.hidden_size, {0: inter, 1: inter}, bias=cfg.mlp_bias, dtype=dtype)
        self.gate_up_proj.silu_pairs = True  # a quant method may pack gate and up side by side for a fused SiLU
        self.down_proj = Linear(inter, cfg.hidden_size, bias=cfg.mlp_bias, dtype=dtype)
        self.act = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        if x.dim() == 2 and rows > MLP_CHUNK_ROWS and not torch.compiler.is_compiling():
            # A long prefill runs the MLP a block of rows at a time: its two big activations (gate_up, 2 x
            # intermediate wide, and act) then take a quarter of the memory at 2048 rows, for the same GEMM speed.
            out = x.new_empty((rows, self.down_proj.out_features))
            for start in range(0, rows, MLP_CHUNK_ROWS):
                out[start : start + MLP_CHUNK_ROWS] = self._mlp(x[start : start + MLP_CHUNK_ROWS])
            return out
        return self._mlp(x)

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        act = self.gate_up_proj.quant_method.silu_and_mul(self.gate_up_proj, x)  # SiLU in the GEMM's epilogue
        if act is None:
            act = self.act(self.gate_up_proj(x))
        return self.down_proj(act)


def moe_mlp(cfg: ArchConfig, dtype: torch.dtype) -> MoE:
    """The MoE block of a Llama-family MoE model (Qwen2-MoE's shared expert included)."""
    moe = cfg.moe
    shared = LlamaMLP(cfg, dtype, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
    return MoE(cfg.hidden_size, moe, dtype, shared=shared, shared_name="shared_expert")


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ArchConfig, rotary: RotaryEmbedding, attn: AttentionBackend, dtype: torch.dtype, index: int = 0
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(cfg, rotary, attn, dtype, index)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.mlp = moe_mlp(cfg, dtype) if cfg.moe is not None and index in cfg.moe.layers else LlamaMLP(cfg, dtype)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Stage 1: input norm, qkv projection and rotary -> q, k, v."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attend(self, q, k, v, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Stage 2: the attention backend (writes this step's K/V, reads the paged cache) -> o [T, H, D]."""
        return self.self_attn.attend(q, k, v, kv_cache, meta)

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Stage 3: o_proj and residual, post-attention norm, MLP and residual -> the layer's output."""
        x = x + self.self_attn.o_proj(o.reshape(x.shape[0], self.self_attn.q_size))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        return self.finish(self.attend(*self.project(x, cos, sin), kv_cache, meta), x)


class LlamaModel(nn.Module):
    """Embedding, the decoder layers (layer_cls: LlamaDecoderLayer, or a family's own with its signature) around one
    rotary table of rotary_dim (default: the config's, Phi-3's partial rotary, else head_dim), and the final norm."""

    def __init__(
        self,
        cfg: ArchConfig,
        max_position: int,
        attn: AttentionBackend,
        dtype: torch.dtype,
        layer_cls: type[nn.Module] | None = None,
        rotary_dim: int | None = None,
    ) -> None:
        super().__init__()
        # Built around an uninitialised weight: the checkpoint overwrites it, and nn.Embedding's own normal_()
        # init on the meta device imports torch._dynamo and sympy (~70 MiB of resident memory for nothing).
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight, _freeze=True)
        # One table shared by every layer.
        rotary_dim = rotary_dim or cfg.rotary_dim or cfg.head_dim
        self.rotary = RotaryEmbedding(rotary_dim, max_position, cfg.rope_theta, cfg.rope_scaling)
        layer_cls = layer_cls or LlamaDecoderLayer
        self.layers = nn.ModuleList(layer_cls(cfg, self.rotary, attn, dtype, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin_at(positions)
        return self.norm(run_layers(self.layers, x, cos, sin, kv_caches, meta))


def run_layers(layers, x: torch.Tensor, cos, sin, kv_caches: list[torch.Tensor], meta: AttentionMetadata):
    """x through the decoder layers, each over its KV cache; a layer-by-layer KV connector (meta.kv_hook) waits for
    layer i's loaded KV before it and is told after it that layer i's KV is written."""
    hook = meta.kv_hook
    for i, (layer, kv_cache) in enumerate(zip(layers, kv_caches)):
        if hook is not None:
            hook.wait_for_layer_load(i)
        x = layer(x, cos, sin, kv_cache, meta)
        if hook is not None:
            hook.save_kv_layer(i)
    return x


class LlamaForCausalLM(nn.Module):
    tp_plan = {"model.embed_tokens": "vocab_embed", "lm_head": "vocab_head"}  # (the embedding first: tied heads)
    # Hugging Face projection name -> (our packed module, shard key)
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }
    # Mixtral's MoE block is called block_sparse_moe in its checkpoints.
    checkpoint_renames = {"block_sparse_moe": "mlp"}

    def __init__(self, cfg: ArchConfig, max_position: int, attn: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.model = self.build_model(cfg, max_position, attn, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_model(self, cfg: ArchConfig, max_position: int, attn: AttentionBackend, dtype: torch.dtype) -> nn.Module:
        return LlamaModel(cfg, max_position, attn, dtype)

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:  # -> [T, hidden]
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:  # [N, hidden] -> [N, V]
        """The logits in fp32; fp32=False: in the LM head's own dtype (bf16 on a bf16 model), for a caller that
        reads them as the fp32 they widen to (greedy argmax) and saves the [N, V] copy."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits
