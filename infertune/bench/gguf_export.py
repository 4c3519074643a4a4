"""Hugging Face folder -> GGUF for llama.cpp, the benchmark's peer: Llama (arch `llama`), Qwen3-MoE (`qwen3moe`) and
DeepSeek-V2 / V3 (`deepseek2`).

Matrices in bf16 or f32, norms f32, the tokenizer's byte-level BPE vocabulary (the benchmark feeds token ids, so the
merges only need to load). Written with the `gguf` package's GGUFWriter; tensor names and metadata keys are
llama.cpp's (its src/llama-arch.cpp and the per-architecture loaders under src/models/).

- Llama: q_proj / k_proj rows permuted from HF's rotate-half layout into llama.cpp's interleaved pairs (LLM_ARCH_LLAMA
  applies GPT-J rotary).
- Qwen3-MoE: llama.cpp runs NeoX rotary for it (HF's layout: no permutation), q_norm / k_norm per head, and every
  layer a MoE of softmax top-k with renormalised weights: the router `ffn_gate_inp` [E, H] and the experts stacked
  into `ffn_gate_exps` / `ffn_up_exps` [E, I, H] and `ffn_down_exps` [E, H, I] (from either checkpoint layout:
  per-expert `mlp.experts.N.*_proj` or transformers v5's fused `mlp.experts.gate_up_proj` / `down_proj`). A
  checkpoint llama.cpp's qwen3moe graph would run differently (norm_topk_prob false, dense layers through
  decoder_sparse_step / mlp_only_layers, rope scaling, attention bias) is refused.
- DeepSeek-V2 / V3: llama.cpp's deepseek2 runs latent attention as one KV head of kv_lora_rank + rope dims with the
  absorbed weights, so kv_b_proj [H (nope + v), rank] goes in as `attn_k_b` [H, rank, nope] (each head's W_UK
  transposed) and `attn_v_b` [H, v, rank]; its rotary takes adjacent pairs, HF's layout as it is (no permutation).
  The first_k_dense_replace dense layers, the shared experts (`*_shexp`), V3's correction bias (`exp_probs_b`), the
  routed scaling and renormalisation and the gating function go in as metadata, read as the engine reads them
  (ArchConfig: V3's sigmoid and renormalisation by default); the MTP layers past num_hidden_layers are left out. Group-limited routing (n_group > 1 with topk_group < n_group) and
  rope scaling are refused: this llama.cpp's graph would route or rotate differently; so are queries without low
  rank (q_lora_rank null) outside 27 layers, which llama.cpp recognises as DeepSeek-V2-Lite by its layer count.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from infertune.bench.offline_models import read_model_config

ARCHES = {
    "LlamaForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "qwen3moe",
    "DeepseekV2ForCausalLM": "deepseek2",
    "DeepseekV3ForCausalLM": "deepseek2",
}


class PeerUnavailable(RuntimeError):
    """The peer's software is not installed here, or cannot run this model; the benchmark reports it as skipped."""


def _permute_rows(w, n_head: int):
    """HF's rotate-half q/k rows -> llama.cpp's interleaved-pair layout (LLM_ARCH_LLAMA applies GPT-J rotary)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",  # the MoE router [E, H]
    # DeepSeek's latent attention and shared experts
    "self_attn.q_a_proj.weight": "attn_q_a.weight",
    "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
    "self_attn.q_b_proj.weight": "attn_q_b.weight",
    "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
    "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
    "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
    "mlp.shared_experts.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_experts.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_experts.down_proj.weight": "ffn_down_shexp.weight",
}
_FIXED = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate|up|down)_proj\.weight")
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj(?:\.weight)?")


def _gguf_tensor_name(name: str) -> str | None:
    if name in _FIXED:
        return _FIXED[name]
    parts = name.split(".")
    if len(parts) < 5 or parts[:2] != ["model", "layers"]:
        return None
    rest = ".".join(parts[3:])
    return f"blk.{parts[2]}.{_LAYER[rest]}" if rest in _LAYER else None


def _check_supported(cfg: dict) -> str:
    arch = cfg.get("architectures", ["LlamaForCausalLM"])[0]
    if arch not in ARCHES:
        raise PeerUnavailable(
            f"GGUF export here covers LlamaForCausalLM, Qwen3MoeForCausalLM and DeepseekV2 / V3ForCausalLM, not "
            f"{cfg.get('architectures')}"
        )
    scaled = (cfg.get("rope_parameters") or {}).get("rope_type", "default") != "default"
    if cfg.get("attention_bias") or cfg.get("mlp_bias") or cfg.get("rope_scaling") or scaled:
        raise PeerUnavailable("GGUF export here covers models without biases or rope scaling")
    if arch == "Qwen3MoeForCausalLM":
        why = []
        if not cfg.get("norm_topk_prob", False):
            why.append("norm_topk_prob is false (llama.cpp's qwen3moe renormalises the top-k weights)")
        if int(cfg.get("decoder_sparse_step", 1) or 1) != 1 or cfg.get("mlp_only_layers"):
            why.append("some layers are dense (decoder_sparse_step / mlp_only_layers: qwen3moe has MoE in every layer)")
        if cfg.get("use_sliding_window"):
            why.append("use_sliding_window is set")
        if why:
            raise PeerUnavailable("GGUF export to llama.cpp's qwen3moe: " + "; ".join(why))
    return ARCHES[arch]


def _deepseek_arch(model_dir: Path):
    """The engine's own reading of the checkpoint (ArchConfig: its MoE routing and latent attention, each default
    as infertune runs it), refused where llama.cpp's deepseek2 would run it differently."""
    from infertune.config import ArchConfig

    arch = ArchConfig.from_model_dir(str(model_dir))
    moe, mla, layers = arch.moe, arch.mla, arch.num_hidden_layers
    why = []
    if moe is None:
        why.append("no routed experts")
    else:
        first_dense = min(moe.layers, default=layers)
        if moe.layers != tuple(range(first_dense, layers)):
            why.append("MoE layers other than every layer after the first dense ones (moe_layer_freq)")
        if moe.n_group > 1 and moe.topk_group < moe.n_group:
            why.append(f"group-limited routing (n_group={moe.n_group}, topk_group={moe.topk_group})")
    if mla.q_lora_rank is None and layers != 27:
        why.append(
            "q_lora_rank is null (queries without low rank), which this llama.cpp reads only from a 27-layer "
            "model (it tells DeepSeek-V2-Lite by its layer count)"
        )
    if why:
        raise PeerUnavailable("GGUF export to llama.cpp's deepseek2: " + "; ".join(why))
    return arch


def _add_deepseek_metadata(w, gguf, arch, cfg: dict) -> None:
    """llama.cpp's deepseek2 hyperparameters: latent attention as one KV head (key = latent + rope, value = latent),
    the per-head sizes the absorbed weights decompress to, the dense leading layers and the routing."""
    moe, mla = arch.moe, arch.mla
    rank, rope = mla.kv_lora_rank, mla.qk_rope_head_dim
    w.add_head_count_kv(1)
    w.add_key_length(rank + rope)
    w.add_value_length(rank)
    w.add_key_length_mla(mla.qk_nope_head_dim + rope)
    w.add_value_length_mla(mla.v_head_dim)
    w.add_kv_lora_rank(rank)
    if mla.q_lora_rank is not None:
        w.add_q_lora_rank(mla.q_lora_rank)
    w.add_rope_dimension_count(rope)
    w.add_leading_dense_block_count(min(moe.layers))
    w.add_expert_count(moe.num_experts)
    w.add_expert_used_count(moe.top_k)
    w.add_expert_feed_forward_length(moe.intermediate_size)
    w.add_expert_shared_count(int(cfg.get("n_shared_experts") or 0))
    w.add_expert_weights_scale(moe.routed_scaling_factor)
    w.add_expert_weights_norm(moe.norm_topk_prob)
    sigmoid = moe.scoring == "sigmoid"  # (MOE_SCORING: softmax or sigmoid)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if sigmoid else gguf.ExpertGatingFuncType.SOFTMAX)


def export_gguf(model_dir: Path, out: Path, dtype: str = "bfloat16") -> Path:
    """Write a Llama, Qwen3-MoE or DeepSeek-V2 / V3 HF folder as GGUF (matrices in bf16 or f32, norms f32)."""
    try:
        import gguf
    except ImportError:
        raise PeerUnavailable("the `gguf` package is not installed (pip install gguf, or infertune[peers])") from None
    import numpy as np
    import torch
    from safetensors import safe_open

    cfg = read_model_config(model_dir)
    arch = _check_supported(cfg)
    deepseek = _deepseek_arch(model_dir) if arch == "deepseek2" else None
    n_head, n_kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // n_head
    rope_theta = cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    tmp = out.with_suffix(".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(model_dir.name)
    w.add_context_length(cfg.get("max_position_embeddings", 2048))
    w.add_embedding_length(hidden)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    if arch == "deepseek2":
        _add_deepseek_metadata(w, gguf, deepseek, cfg)
    else:
        w.add_head_count_kv(n_kv)
        w.add_rope_dimension_count(head_dim)
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(float(rope_theta))
    w.add_layer_norm_rms_eps(float(cfg.get("rms_norm_eps", 1e-6)))
    w.add_vocab_size(cfg["vocab_size"])
    num_experts = deepseek.moe.num_experts if deepseek is not None else 0
    if arch == "qwen3moe":
        num_experts = int(cfg.get("num_experts") or cfg["num_local_experts"])  # (transformers v5 writes the latter)
        w.add_expert_count(num_experts)
        w.add_expert_used_count(int(cfg["num_experts_per_tok"]))
        w.add_expert_feed_forward_length(int(cfg["moe_intermediate_size"]))
    big = gguf.GGMLQuantizationType.BF16 if dtype == "bfloat16" else gguf.GGMLQuantizationType.F32
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16 if dtype == "bfloat16" else gguf.LlamaFileType.ALL_F32)
    _add_tokenizer(w, gguf, model_dir, cfg)

    def add(gname: str, t: torch.Tensor) -> None:
        if t.dim() == 1:
            w.add_tensor(gname, t.float().numpy())
        elif big == gguf.GGMLQuantizationType.BF16:
            w.add_tensor(
                gname, t.to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16), raw_dtype=big
            )
        else:
            w.add_tensor(gname, t.float().contiguous().numpy())

    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}  # (layer, gate | up | down) -> expert -> [I, H] ...
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():  # noqa: SIM118  (safe_open is not a mapping)
                if m := _EXPERT.fullmatch(name):
                    experts.setdefault((int(m[1]), m[3]), {})[int(m[2])] = f.get_tensor(name)
                    continue
                if m := _FUSED.fullmatch(name):  # [E, 2I, H] (gate rows, then up rows) or [E, H, I]
                    t = f.get_tensor(name)
                    if m[2] == "down":
                        add(f"blk.{m[1]}.ffn_down_exps.weight", t)
                    else:
                        inter = t.shape[1] // 2
                        add(f"blk.{m[1]}.ffn_gate_exps.weight", t[:, :inter])
                        add(f"blk.{m[1]}.ffn_up_exps.weight", t[:, inter:])
                    continue
                if (m := re.match(r"model\.layers\.(\d+)\.", name)) and int(m[1]) >= cfg["num_hidden_layers"]:
                    continue  # (DeepSeek's MTP layers)
                if arch == "deepseek2" and name.endswith("self_attn.kv_b_proj.weight"):
                    layer = name.split(".")[2]
                    nope, v = deepseek.mla.qk_nope_head_dim, deepseek.mla.v_head_dim
                    kv_b = f.get_tensor(name).reshape(n_head, nope + v, -1)
                    add(f"blk.{layer}.attn_k_b.weight", kv_b[:, :nope].transpose(1, 2))  # [H, rank, nope]
                    add(f"blk.{layer}.attn_v_b.weight", kv_b[:, nope:])  # [H, v, rank]
                    continue
                gname = _gguf_tensor_name(name)
                if gname is None:
                    continue
                t = f.get_tensor(name)
                if arch == "llama" and name.endswith("q_proj.weight"):
                    t = _permute_rows(t, n_head)
                elif arch == "llama" and name.endswith("k_proj.weight"):
                    t = _permute_rows(t, n_kv)
                add(gname, t)
    for (layer, proj), per_expert in sorted(experts.items()):  # per-expert tensors stacked, expert 0 first
        if sorted(per_expert) != list(range(num_experts)):
            raise ValueError(f"{model_dir}: layer {layer} has {proj}_proj of experts {sorted(per_expert)[:8]} ...")
        add(f"blk.{layer}.ffn_{proj}_exps.weight", torch.stack([per_expert[e] for e in range(num_experts)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    tmp.replace(out)
    return out


def _add_tokenizer(w, gguf, model_dir: Path, cfg: dict) -> None:
    """The folder's byte-level BPE vocabulary as llama.cpp's gpt2 tokenizer."""
    tok = json.loads((model_dir / "tokenizer.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    specials = {}
    for added in tok.get("added_tokens", []):
        vocab[added["content"]] = added["id"]
        specials[added["id"]] = added["content"]
    tokens = [""] * cfg["vocab_size"]
    for text, i in vocab.items():
        if i < len(tokens):
            tokens[i] = text
    for i, t in enumerate(tokens):
        if not t:
            tokens[i] = f"[PAD{i}]"
            specials[i] = tokens[i]
    merges = tok["model"].get("merges") or []
    merges = [" ".join(m) if isinstance(m, list) else m for m in merges] or ["Ġ Ġ"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in specials else gguf.TokenType.NORMAL for i in range(len(tokens))])
    w.add_token_merges(merges)
    eos = cfg.get("eos_token_id", 0)
    eos = eos[0] if isinstance(eos, list) else eos
    w.add_eos_token_id(int(eos if eos is not None else 0))
    w.add_bos_token_id(int(cfg.get("bos_token_id") if cfg.get("bos_token_id") is not None else 0))
