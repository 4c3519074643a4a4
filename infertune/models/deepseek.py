"""DeepSeek-V2 / V3 decoder (V2-Lite included): multi-head latent attention over a cache of latents, and DeepSeek's
MoE (routed experts plus always-on shared experts) after the first first_k_dense_replace dense layers.

Attention per token: q from q_a_proj -> q_a_layernorm -> q_b_proj (or one q_proj where q_lora_rank is None), split
per head into q_nope and q_pe; kv_a_proj_with_mqa gives the latent c (-> kv_a_layernorm) and one rotary key k_pe
shared by the heads. The rows [c, rotated k_pe] are what the cache keeps; layers/attention/mla.py attends over them
with the layer's kv_b_proj (absorbed at decode, decompressed at prefill); o_proj follows.

Rotary: DeepSeek's checkpoints rotate interleaved pairs (x0, x1), (x2, x3), ...; q_pe and k_pe are de-interleaved
(evens, then odds) before the rotate-half rotary, which then computes exactly those pairs' rotations. The order of
the rope dims is internal (only q_pe . k_pe is used), so this matches Hugging Face's values exactly. YaRN's
mscale_all_dim also scales the softmax (by mscale^2), as Hugging Face does.

The layer has the Llama decoder's three stages (project, attend, finish; see llama.py), project returning
(q_nope, q_pe, latent) in place of (q, k, v).
"""

from __future__ import annotations

import torch
from torch import nn

from infertune.config import ArchConfig
from infertune.layers.attention import AttentionMetadata, LatentUpProjection
from infertune.layers.linear import Linear
from infertune.layers.moe import MoE
from infertune.layers.norm import RMSNorm
from infertune.layers.rotary import RotaryEmbedding, yarn_mscale
from infertune.models.llama import LlamaForCausalLM, LlamaMLP, LlamaModel

# Hugging Face builds q_a_layernorm and kv_a_layernorm with the default eps, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """[..., D] interleaved pairs (x0, x1, x2, x3, ...) -> (x0, x2, ..., x1, x3, ...), the rotate-half layout."""
    return torch.cat([x[..., 0::2], x[..., 1::2]], dim=-1)


class DeepseekAttention(nn.Module):
    # heads split over the ranks; the latent (kv_a_proj_with_mqa) and q's low-rank down-projection are every head's
    tp_plan = {"q_proj": "colwise", "q_b_proj": "colwise", "kv_b_proj": "colwise", "o_proj": "rowwise"}

    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, attn, dtype: torch.dtype) -> None:
        super().__init__()
        mla = cfg.mla
        self.num_heads = h = cfg.num_attention_heads
        self.nope_dim, self.rope_dim, self.v_dim = mla.qk_nope_head_dim, mla.qk_rope_head_dim, mla.v_head_dim
        self.rank, self.interleaved, self.q_lora = mla.kv_lora_rank, mla.rope_interleave, mla.q_lora_rank is not None
        qk_dim = self.nope_dim + self.rope_dim
        bias = cfg.attention_bias
        if not self.q_lora:
            self.q_proj = Linear(cfg.hidden_size, h * qk_dim, dtype=dtype)
        else:
            self.q_a_proj = Linear(cfg.hidden_size, mla.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS, dtype)
            self.q_b_proj = Linear(mla.q_lora_rank, h * qk_dim, dtype=dtype)
        self.kv_a_proj_with_mqa = Linear(cfg.hidden_size, mla.cache_width, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.rank, LATENT_NORM_EPS, dtype)
        self.kv_b_proj = LatentUpProjection(h, mla, dtype)
        self.o_proj = Linear(h * self.v_dim, cfg.hidden_size, bias=bias, dtype=dtype)
        self.rotary = rotary
        self.attn = attn
        self.scale = qk_dim**-0.5
        rope = cfg.rope_scaling or {}
        if rope.get("mscale_all_dim"):
            self.scale *= yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, hidden] (normed) -> q_nope [T, H, nope], q_pe [T, H, rope] (rotated), latent [T, R + rope]
        (c normed, then the rotated k_pe: the row the cache keeps)."""
        t, h = x.shape[0], self.num_heads
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(t, h, self.nope_dim + self.rope_dim)
        kv = self.kv_a_proj_with_mqa(x)  # [T, R + rope]
        # the rotary parts of q's heads and k_pe, rotated in one call: [T, H + 1, rope]
        pe = torch.cat([q[..., self.nope_dim :], kv[:, None, self.rank :]], dim=1)
        pe = self.rotary(deinterleave(pe) if self.interleaved else pe, cos, sin)
        latent = torch.cat([self.kv_a_layernorm(kv[:, : self.rank]), pe[:, h]], dim=-1)
        return q[..., : self.nope_dim], pe[:, :h], latent

    def attend(self, q_nope, q_pe, latent, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.attn.forward(q_nope, q_pe, latent, kv_cache, meta, self.scale, self.kv_b_proj)  # [T, H, v]


def deepseek_moe(cfg: ArchConfig, dtype: torch.dtype) -> MoE:
    """DeepSeek's MoE block: the routed experts plus n_shared_experts fused into one ungated MLP."""
    moe = cfg.moe
    shared = LlamaMLP(cfg, dtype, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
    return MoE(cfg.hidden_size, moe, dtype, shared=shared, shared_name="shared_experts")


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, attn, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.self_attn = DeepseekAttention(cfg, rotary, attn, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        moe_layer = cfg.moe is not None and index in cfg.moe.layers
        self.mlp = deepseek_moe(cfg, dtype) if moe_layer else LlamaMLP(cfg, dtype)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Stage 1: input norm, q and latent projections, rotary -> q_nope, q_pe, latent."""
        return self.self_attn.project(self.input_layernorm(x), cos, sin)

    def attend(self, q_nope, q_pe, latent, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Stage 2: the latent attention backend (writes this step's latents, reads the cache) -> o [T, H, v]."""
        return self.self_attn.attend(q_nope, q_pe, latent, kv_cache, meta)

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Stage 3: o_proj and residual, post-attention norm, MLP (dense or MoE) and residual."""
        x = x + self.self_attn.o_proj(o.reshape(x.shape[0], -1))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        return self.finish(self.attend(*self.project(x, cos, sin), kv_cache, meta), x)


class DeepseekForCausalLM(LlamaForCausalLM):
    """DeepseekV2ForCausalLM and DeepseekV3ForCausalLM (checkpoint names as Hugging Face's): LlamaForCausalLM's
    embedding, final norm and head around DeepseekDecoderLayers, whose one rotary table covers only the
    qk_rope_head_dim dims of each head (and k_pe)."""

    packed_modules = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    checkpoint_renames = {}

    def build_model(self, cfg: ArchConfig, max_position: int, attn, dtype: torch.dtype) -> nn.Module:
        assert cfg.mla is not None, "DeepSeek models have latent attention"
        return LlamaModel(cfg, max_position, attn, dtype, DeepseekDecoderLayer, cfg.mla.qk_rope_head_dim)
