"""What a quantized checkpoint's config.json says (its quantization_config), read without torch: the engine's config
takes the method from it (EngineConfig.create), the loader its layers (quant/checkpoint.py)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

FORMAT_INT8 = "int-quantized"
FORMAT_INT4 = "infertune-int4-uint8"


@dataclass(frozen=True, slots=True)
class StoredQuant:
    method: str  # w8a16 | w8a8 | w4a16
    group_size: int | None
    symmetric: bool
    static_activations: bool
    ignore: tuple[str, ...]  # Hugging Face module names (or "re:" patterns) left unquantized
    quantize_lm_head: bool = False  # `quantize --quantize-lm-head`: its stored head goes to int8 at every load

    def ignores(self, hf_module: str) -> bool:
        return any(re.fullmatch(p[3:], hf_module) if p.startswith("re:") else p == hf_module for p in self.ignore)


def read_stored_quant(model_dir: str) -> StoredQuant | None:
    """The checkpoint's quantization, or None for a plain checkpoint (or a block-scaled fp8 one, which quant/fp8.py
    dequantizes as it loads)."""
    path = Path(model_dir) / "config.json"
    return stored_quant_of(json.loads(path.read_text()).get("quantization_config"), str(path))


def stored_quant_of(qc: dict | None, path: str = "config.json") -> StoredQuant | None:
    """read_stored_quant of a quantization_config already read (`path` names it in errors)."""
    if not qc or qc.get("quant_method") == "fp8":
        return None
    fmt, groups = qc.get("format"), qc.get("config_groups") or {}
    if qc.get("quant_method") != "compressed-tensors" or fmt not in (FORMAT_INT8, FORMAT_INT4) or len(groups) != 1:
        raise ValueError(
            f"{path}: quantization_config (quant_method={qc.get('quant_method')!r}, format={fmt!r}) is not one infertune "
            f"reads; it loads checkpoints written by `infertune quantize` (formats {FORMAT_INT8}, {FORMAT_INT4}) and "
            "block-scaled fp8 ones (quant_method 'fp8', as DeepSeek-V3 and Qwen3-*-FP8 publish them)"
        )
    scheme = next(iter(groups.values()))
    weights, acts = scheme.get("weights") or {}, scheme.get("input_activations")
    bits = weights.get("num_bits")
    if fmt == FORMAT_INT4 and bits == 4 and weights.get("strategy") == "group" and not acts:
        method = "w4a16"
    elif fmt == FORMAT_INT8 and bits == 8 and weights.get("strategy") == "channel" and weights.get("symmetric", True):
        method = "w8a8" if acts else "w8a16"
    else:
        raise ValueError(f"{path}: quantization scheme {weights} with format {fmt!r} is not supported")
    if acts and (acts.get("num_bits") != 8 or acts.get("strategy") not in ("token", "tensor")):
        raise ValueError(f"{path}: input activation scheme {acts} is not supported (int8 per token or per tensor)")
    return StoredQuant(
        method=method,
        group_size=weights.get("group_size"),
        symmetric=bool(weights.get("symmetric", False)),
        static_activations=bool(acts) and not acts.get("dynamic", True),
        ignore=tuple(qc.get("ignore") or ()),
        quantize_lm_head=bool((qc.get("infertune") or {}).get("quantize_lm_head")),
    )


__all__ = ["FORMAT_INT4", "FORMAT_INT8", "StoredQuant", "read_stored_quant", "stored_quant_of"]
