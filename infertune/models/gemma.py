"""Gemma 2 and Gemma 3 text decoders (Gemma2ForCausalLM, Gemma3ForCausalLM), computed as transformers computes them.

Built on the Llama decoder's attention and MLP (llama.py); what differs:
- RMSNorm scales by (1 + w), in fp32 (layers/norm.py GemmaRMSNorm), and there are four a layer: input and
  post-attention around attention, pre- and post-feedforward around the MLP (each branch is normed before its
  residual add);
- the embeddings are multiplied by sqrt(hidden), that factor rounded to the model dtype first, as transformers does;
- the MLP is gated by GeLU (tanh approximation), and the softmax scale is query_pre_attn_scalar ** -0.5;
- layers alternate sliding-window and full attention (ArchConfig.layer_windows, passed to the attention backend);
- Gemma 2 soft-caps the attention scores (attn_logit_softcapping) and the logits (final_logit_softcapping);
- Gemma 3 norms each head of q and k (Gemma's norm), and its sliding layers rotate with their own rope base
  (rope_local_base_freq): the step looks up both rotary tables once, and each layer takes its kind's.

The layer has the Llama decoder's three stages (project, attend, finish), so runner/compiled.py can compile it.
"""

from __future__ import annotations

import torch
from torch import nn

from infertune.config import ArchConfig
from infertune.layers.activation import GeluAndMul
from infertune.layers.attention import AttentionBackend, AttentionMetadata
from infertune.layers.linear import Linear
from infertune.layers.norm import GemmaRMSNorm
from infertune.layers.rotary import RotaryEmbedding
from infertune.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, run_layers


class ScaledEmbedding(nn.Embedding):
    """Token embeddings times sqrt(hidden), the factor rounded to the model dtype (sqrt(3072) = 55.43 is 55.5 in bf16)."""

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype) -> None:
        # An uninitialised weight, as in LlamaModel: the checkpoint overwrites it.
        weight = torch.empty(vocab_size, hidden_size, dtype=dtype)
        super().__init__(vocab_size, hidden_size, _weight=weight, _freeze=True)
        self.scale = torch.tensor(hidden_size**0.5, dtype=dtype, device="cpu").item()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * self.scale


class LayerKindRotary(nn.Module):
    """The rotary table of each attention kind (Gemma 3: the full layers' base and the sliding layers' own), looked
    up together once a step: cos, sin [T, kinds, D/2], of which a layer takes its kind's column. Both are views of
    one [T, kinds, D] tensor (cos half, then sin half), the layout the rotary kernel takes."""

    def __init__(self, tables: list[RotaryEmbedding]) -> None:
        super().__init__()
        self.tables = nn.ModuleList(tables)

    def cos_sin_at(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.stack([table.cos_sin[positions] for table in self.tables], dim=1)  # [T, kinds, D]
        cos, sin = rows.chunk(2, dim=-1)
        return cos, sin


class GemmaAttention(LlamaAttention):
    def __init__(self, cfg: ArchConfig, rotary: RotaryEmbedding, attn, dtype: torch.dtype, index: int) -> None:
        super().__init__(cfg, rotary, attn, dtype, index)
        self.scale = cfg.query_pre_attn_scalar**-0.5
        self.softcap = cfg.attn_logit_softcapping
        if cfg.qk_norm:  # Gemma 3
            self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps, dtype)


class GemmaMLP(LlamaMLP):
    """The gated MLP with GeLU (tanh) in place of SiLU."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype) -> None:
        super().__init__(cfg, dtype)
        self.gate_up_proj.silu_pairs = False  # no quant method may fuse a SiLU into this projection
        self.act = GeluAndMul()

    def _mlp(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x)))


class GemmaDecoderLayer(nn.Module):
    def __init__(
        self, cfg: ArchConfig, rotary: RotaryEmbedding, attn: AttentionBackend, dtype: torch.dtype, index: int
    ) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.self_attn = GemmaAttention(cfg, rotary, attn, dtype, index)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        self.mlp = GemmaMLP(cfg, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps, dtype)
        # Which column of the step's rotary tables this layer rotates with: 1 for a sliding layer with its own base.
        self.rope_kind = int(cfg.local_rope_theta is not None and self.self_attn.window is not None)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Stage 1: input norm, qkv projection, q / k norms and rotary (this layer's table) -> q, k, v."""
        kind = slice(self.rope_kind, self.rope_kind + 1)
        return self.self_attn.project(self.input_layernorm(x), cos[:, kind], sin[:, kind])

    def attend(self, q, k, v, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Stage 2: the attention backend, within this layer's window, soft-capped on Gemma 2 -> o [T, H, D]."""
        return self.self_attn.attend(q, k, v, kv_cache, meta)

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Stage 3: o_proj, post-attention norm and residual; pre-feedforward norm, MLP, post-feedforward norm and
        residual."""
        x = x + self.post_attention_layernorm(self.self_attn.o_proj(o.reshape(x.shape[0], self.self_attn.q_size)))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))

    def forward(self, x, cos, sin, kv_cache, meta) -> torch.Tensor:
        return self.finish(self.attend(*self.project(x, cos, sin), kv_cache, meta), x)


class GemmaModel(nn.Module):
    def __init__(self, cfg: ArchConfig, max_position: int, attn: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, dtype)
        tables = [RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling)]
        if cfg.local_rope_theta is not None:  # Gemma 3's sliding layers
            tables.append(RotaryEmbedding(cfg.head_dim, max_position, cfg.local_rope_theta, cfg.local_rope_scaling))
        self.rotary = LayerKindRotary(tables)
        # (the rotation itself does not depend on the table: every layer's attention applies it with tables[0])
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(cfg, tables[0], attn, dtype, i) for i in range(cfg.num_hidden_layers)
        )
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, input_ids, positions, kv_caches: list[torch.Tensor], meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, hidden]
        cos, sin = self.rotary.cos_sin_at(positions)  # [T, kinds, D/2]
        return self.norm(run_layers(self.layers, x, cos, sin, kv_caches, meta))


class GemmaForCausalLM(nn.Module):
    """Gemma2ForCausalLM and Gemma3ForCausalLM (text only; checkpoint names as Hugging Face's)."""

    packed_modules = LlamaForCausalLM.packed_modules
    tp_plan = LlamaForCausalLM.tp_plan

    def __init__(self, cfg: ArchConfig, max_position: int, attn: AttentionBackend, dtype: torch.dtype) -> None:
        super().__init__()
        self.config = cfg
        self.model = GemmaModel(cfg, max_position, attn, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, dtype=dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.final_softcap = cfg.final_logit_softcapping

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:  # -> [T, hidden]
        return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:  # [N, hidden] -> [N, V] fp32
        # (always fp32: the final soft-capping is computed in it; fp32=False is a permission, not a request)
        logits = self.lm_head(hidden).float()
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits
