"""The quantized checkpoint infertune writes: Hugging Face folder + compressed-tensors-style quantization_config.

Tensors (safetensors, Hugging Face names; for a quantized linear layer P, e.g. model.layers.0.mlp.down_proj):

    w8a16, w8a8   P.weight         int8    [N, K]    q in -127..127
                  P.weight_scale   float32 [N, 1]    w ~ q * weight_scale (symmetric, per output channel)
                  P.input_scale    float32 [1]       w8a8 with static activations only: x ~ round(x / s) * s
    w4a16         P.weight_packed  uint8   [N, K/2]  byte j of a row = q[2j] | q[2j+1] << 4, q in 0..15
                  P.weight_scale   float32 [N, K/g]  w ~ q * weight_scale + weight_zero, per group of g
                  P.weight_zero    float32 [N, K/g]    input columns (the group's clamped minimum)
    P.bias and every other tensor (embeddings, norms, layers kept in full precision) as in the source,
    except the norms SmoothQuant rescales.

MoE experts are stored in Hugging Face's per-expert layout, each expert's projection as the linear layer it is there:
P = model.layers.L.mlp.experts.N.gate_proj | up_proj | down_proj (Mixtral: model.layers.L.block_sparse_moe.experts.N.
w1 | w3 | w2), with the tensors above for its [N, K] weight. A source in transformers v5's fused layout
(P.experts.gate_up_proj [E, 2I, H], gate rows then up rows; P.experts.down_proj [E, H, I]) is written under the
per-expert names (split_fused_experts). Expert e's tensors are exactly what quantizing that expert at load gives.
An experts block kept in full precision is listed in `ignore` once, under its module name model.layers.L.mlp.experts
(the name transformers v5 and infertune give it in every family). Routers (mlp.gate) and Qwen2-MoE's
shared_expert_gate are never quantized; under w8a8 the experts take dynamic per-token activation scales.

config.json gets "quantization_config" after compressed-tensors (quant_method "compressed-tensors",
config_groups with weights / input_activations schemes, ignore = the Linear modules left unquantized,
quantization_status "compressed"). Deviations, each because exactness with the engine wins:
* int8 layers use format "int-quantized" as compressed-tensors does, but scales are stored in float32
  (compressed-tensors usually stores the model dtype);
* int4 uses format "infertune-int4-uint8": uint8 nibbles (compressed-tensors' "pack-quantized" packs eight
  nibbles into int32 with a weight_shape tensor), and an asymmetric group's offset is a float `weight_zero`
  (the group minimum) instead of an integer `weight_zero_point`, which could not represent it exactly.
  Other tools reject this format instead of misreading it.
* an "infertune" entry records the method, clipping, calibration and the source model (for `infertune eval`).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

FORMAT_INT8 = "int-quantized"
FORMAT_INT4 = "infertune-int4-uint8"
FORMAT_VERSION = 1
# Files of a Hugging Face folder that describe weights; everything else (tokenizer, templates) is copied.
_WEIGHT_FILES = (
    "*.safetensors",
    "*.safetensors.index.json",
    "*.bin",
    "*.bin.index.json",
    "*.pt",
    "*.pth",
    "config.json",
    "README.md",
)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] with values 0..15 (K even) -> uint8 [N, K/2]: column 2j in the low nibble, 2j+1 in the high."""
    if q.shape[-1] % 2:
        raise ValueError(f"in_features={q.shape[-1]} must be even to pack int4 pairs")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """Inverse of pack_int4: uint8 [N, K/2] -> int32 [N, K]."""
    low, high = (packed & 0x0F).to(torch.int32), (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def weight_scheme(method: str, group_size: int, symmetric: bool, clip: str) -> dict:
    observer = clip.partition(":")[0]
    if method == "w4a16":
        return {
            "num_bits": 4,
            "type": "int",
            "symmetric": symmetric,
            "strategy": "group",
            "group_size": group_size,
            "dynamic": False,
            "observer": observer,
            "actorder": None,
        }
    return {
        "num_bits": 8,
        "type": "int",
        "symmetric": True,
        "strategy": "channel",
        "group_size": None,
        "dynamic": False,
        "observer": observer,
        "actorder": None,
    }


def input_scheme(method: str, static: bool, act_clip: str) -> dict | None:
    if method != "w8a8":
        return None
    if static:
        return {
            "num_bits": 8,
            "type": "int",
            "symmetric": True,
            "strategy": "tensor",
            "dynamic": False,
            "observer": act_clip.partition(":")[0],
        }
    return {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True, "observer": None}


def quantization_config(
    method: str,
    group_size: int,
    symmetric: bool,
    clip: str,
    static: bool,
    act_clip: str,
    ignore: list[str],
    extra: dict,
) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": FORMAT_INT4 if method == "w4a16" else FORMAT_INT8,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weight_scheme(method, group_size, symmetric, clip),
                "input_activations": input_scheme(method, static, act_clip),
                "output_activations": None,
            }
        },
        "ignore": sorted(ignore),
        "kv_cache_scheme": None,
        "infertune": {"format_version": FORMAT_VERSION, "method": method, **extra},
    }


def layer_tensors(prefix: str, method: str, quantized: tuple, input_scale: float | None = None) -> dict:
    """The stored tensors of one quantized linear layer (see the module docstring)."""
    if method == "w4a16":
        q, scale, zero = quantized
        out = {
            f"{prefix}.weight_packed": pack_int4(q),
            f"{prefix}.weight_scale": scale.float().contiguous(),
            f"{prefix}.weight_zero": zero.float().contiguous(),
        }
    else:
        q, scale = quantized
        out = {
            f"{prefix}.weight": q.to(torch.int8).contiguous(),
            f"{prefix}.weight_scale": scale.float().reshape(-1, 1),
        }
    if input_scale is not None:
        out[f"{prefix}.input_scale"] = torch.tensor([input_scale], dtype=torch.float32)
    return out


def split_fused_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """A fused experts tensor (P.gate_up_proj [E, 2I, H] or P.down_proj [E, H, I], P = ...experts) -> its per-expert
    weights {P.N.gate_proj.weight | P.N.up_proj.weight | P.N.down_proj.weight: [N, K]}."""
    prefix, _, proj = name.rpartition(".")
    if proj == "down_proj":
        return {f"{prefix}.{e}.down_proj.weight": tensor[e] for e in range(tensor.shape[0])}
    inter = tensor.shape[1] // 2
    out = {}
    for e in range(tensor.shape[0]):
        out[f"{prefix}.{e}.gate_proj.weight"] = tensor[e, :inter]
        out[f"{prefix}.{e}.up_proj.weight"] = tensor[e, inter:]
    return out


def copy_side_files(src: str, out: str) -> list[str]:
    """Copy tokenizer, templates and generation config (every file that is not weights or config.json)."""
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and not any(f.match(p) for p in _WEIGHT_FILES):
            shutil.copy2(f, Path(out) / f.name)
            copied.append(f.name)
    return copied


def write_config(src: str, out: str, qconfig: dict) -> dict:
    cfg = json.loads((Path(src) / "config.json").read_text())
    cfg["quantization_config"] = qconfig
    (Path(out) / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return cfg
