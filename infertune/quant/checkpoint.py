"""Pre-quantized checkpoints (written by `infertune quantize`): read config.json's quantization_config and give
each quantized Linear a method whose weights are the stored integers, so loading copies them into int8 / uint8
slots and process_weights_after_loading only packs them for the kernel (no quantization at load time).

Stored tensors per quantized layer P (Hugging Face names; see infertune/tools/quant_format.py):
  int8 (format "int-quantized"):        P.weight int8 [N, K], P.weight_scale fp32 [N, 1] (+ P.input_scale fp32 [1]
                                        for static W8A8 activations)
  int4 (format "infertune-int4-uint8"): P.weight_packed uint8 [N, K/2] (column 2j low nibble, 2j+1 high),
                                        P.weight_scale fp32 [N, K/g], P.weight_zero fp32 [N, K/g]; w = q*scale + zero
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from infertune.layers.linear import Linear
from infertune.quant.int4 import W4A16Method
from infertune.quant.int8 import W8A8Method, W8A16Method

FORMAT_INT8 = "int-quantized"
FORMAT_INT4 = "infertune-int4-uint8"


@dataclass(frozen=True, slots=True)
class StoredQuant:
    method: str  # w8a16 | w8a8 | w4a16
    group_size: int | None
    symmetric: bool
    static_activations: bool
    ignore: tuple[str, ...]  # Hugging Face module names (or "re:" patterns) left unquantized

    def ignores(self, hf_module: str) -> bool:
        return any(re.fullmatch(p[3:], hf_module) if p.startswith("re:") else p == hf_module for p in self.ignore)


def read_stored_quant(model_dir: str) -> StoredQuant | None:
    """The checkpoint's quantization, or None for a plain checkpoint."""
    path = Path(model_dir) / "config.json"
    qc = json.loads(path.read_text()).get("quantization_config")
    if not qc:
        return None
    fmt, groups = qc.get("format"), qc.get("config_groups") or {}
    if qc.get("quant_method") != "compressed-tensors" or fmt not in (FORMAT_INT8, FORMAT_INT4) or len(groups) != 1:
        raise ValueError(
            f"{path}: quantization_config (quant_method={qc.get('quant_method')!r}, format={fmt!r}) is not one infertune "
            f"reads; it loads checkpoints written by `infertune quantize` (formats {FORMAT_INT8}, {FORMAT_INT4})"
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
    )


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int32 [N, K] in 0..15 (column 2j from the low nibble, 2j+1 from the high)."""
    low, high = (packed & 0x0F).to(torch.int32), (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def _slot(layer: Linear, name: str, shape: tuple[int, ...], dtype: torch.dtype, loader=None) -> None:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader or layer.weight_loader
    setattr(layer, name, param)


def _load_input_scale(param: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
    # q, k and v (gate and up) read the same input, so the quantizer stores the same scale for each shard.
    param.data.copy_(loaded.reshape(param.shape))


def _take(layer: Linear, *names: str) -> list[torch.Tensor]:
    out = [getattr(layer, n).data for n in names]
    for n in names:
        delattr(layer, n)
    return out


class StoredW8A16(W8A16Method):
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        self.params_dtype = dtype
        _slot(layer, "weight", (layer.out_features, layer.in_features), torch.int8)
        _slot(layer, "weight_scale", (layer.out_features, 1), torch.float32)

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, scale = _take(layer, "weight", "weight_scale")
        self.pack_weights(layer, q, scale.view(-1), self.params_dtype)


class StoredW8A8(W8A8Method):
    def __init__(self, fast_kernel: bool = True, static_activations: bool = False) -> None:
        super().__init__(fast_kernel)
        self.static_activations = static_activations

    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        StoredW8A16.create_weights(self, layer, dtype)
        if self.static_activations:
            _slot(layer, "input_scale", (1,), torch.float32, _load_input_scale)

    def process_weights_after_loading(self, layer: Linear) -> None:
        q, scale = _take(layer, "weight", "weight_scale")
        self.pack_weights(layer, q, scale.view(-1), self.params_dtype)
        if self.static_activations:
            (input_scale,) = _take(layer, "input_scale")
            layer.register_buffer("input_scale", input_scale.float())  # [1]

    def quantize_input(self, layer: Linear, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.static_activations:
            return super().quantize_input(layer, x)
        # One calibrated scale for every token (percentile-clipped): values beyond it saturate at +-127.
        return torch.round(x.float() / layer.input_scale).clamp(-127, 127).to(torch.int8), layer.input_scale


class StoredW4A16(W4A16Method):
    def create_weights(self, layer: Linear, dtype: torch.dtype) -> None:
        n, k, g = layer.out_features, layer.in_features, self.group_size
        if k % g or k % 2:
            raise ValueError(
                f"in_features={k} does not fit int4 groups of {g}; is config.json right for these weights?"
            )
        self.params_dtype = dtype
        del layer.weight
        _slot(layer, "weight_packed", (n, k // 2), torch.uint8)
        _slot(layer, "weight_scale", (n, k // g), torch.float32)
        _slot(layer, "weight_zero", (n, k // g), torch.float32)

    def process_weights_after_loading(self, layer: Linear) -> None:
        packed, scale, zero = _take(layer, "weight_packed", "weight_scale", "weight_zero")
        self.pack_weights(layer, unpack_int4(packed), scale, zero, self.params_dtype)


def _hf_modules(name: str, module: Linear, packed: dict[str, tuple[str, object]]) -> list[str]:
    """Our module name -> the Hugging Face module names stored for it (one per shard of a packed layer)."""
    prefix, _, last = name.rpartition(".")
    shards = [hf for hf, (ours, _) in packed.items() if ours == last]
    return [f"{prefix}.{hf}" if prefix else hf for hf in shards] or [name]


def attach_stored_methods(
    model: nn.Module,
    stored: StoredQuant,
    packed: dict[str, tuple[str, object]],
    dtype: torch.dtype,
    backend=None,
    kernels=None,
) -> dict[str, str]:
    """Give each Linear the checkpoint says is quantized a Stored* method and create its integer slots.

    Call before the model is materialized (on the meta device) and after the plain layers got their
    methods (prepacking), so unquantized layers run exactly as they would in an unquantized model.
    """
    fast_kernels = backend.has_quant_kernels if backend is not None else True
    kernel_max_rows = backend.quant_kernel_max_rows if backend is not None else None
    chosen = {}
    for name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        ignored = [stored.ignores(hf) for hf in _hf_modules(name, module, packed)]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(
                f"quantization_config ignores only some of the projections packed into {name}; "
                "quantize all of them or none"
            )
        if stored.method == "w8a16":
            method = StoredW8A16(fast_kernels, kernel_max_rows, kernels)
        elif stored.method == "w8a8":
            method = StoredW8A8(fast_kernels, stored.static_activations)
        else:
            method = StoredW4A16(stored.group_size, stored.symmetric, fast_kernels, kernel_max_rows, kernels)
        module.quant_method = method
        method.create_weights(module, dtype)
        chosen[name] = method.name
    return chosen
