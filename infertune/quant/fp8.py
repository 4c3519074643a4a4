"""FP8 block-scaled checkpoints as published (DeepSeek-V3, Qwen3-*-FP8): read config.json's quantization_config and
dequantize each weight to the model dtype as it streams out of the checkpoint, so the model loads as a plain one.

config.json: "quantization_config": {"quant_method": "fp8", "weight_block_size": [bn, bk], "activation_scheme":
"dynamic" | "static", "fmt": "e4m3", "modules_to_not_convert": [...]} (transformers' FineGrainedFP8Config). Each
quantized projection P stores

  P.weight            float8_e4m3fn [N, K]
  P.weight_scale_inv  fp32 [ceil(N / bn), ceil(K / bk)]     w[i, j] = float(P.weight[i, j]) * scale_inv[i // bn, j // bk]

(the last block row / column is partial where N or K is not a multiple; weight_block_size null: one scale for the
whole matrix). Fused 3-D expert tensors (transformers v5: experts.gate_up_proj [E, 2I, H]) carry
experts.gate_up_proj_scale_inv [E, ...] the same way, per expert. A static activation_scheme adds P.activation_scale,
the per-tensor input scale of fp8 activations: the weights are dequantized here and activations stay in the model
dtype, so those are dropped. Tensors stored in another dtype (embeddings, norms, routers, the modules_to_not_convert)
load as they are.

Dequantizing costs one block row of fp32 at a time, never a whole weight (let alone the model) in fp32. With a
quantization method (`quantization="w8a16"`), the dequantized layers are then re-quantized per channel as for a
16-bit checkpoint, except the modules_to_not_convert, which stay in full precision as the checkpoint keeps them.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from torch import nn

from infertune.config import QuantConfig
from infertune.layers.linear import Linear
from infertune.layers.moe import Experts
from infertune.quant.checkpoint import hf_modules

SCALE_SUFFIX = "_scale_inv"  # P.weight -> P.weight_scale_inv, experts.gate_up_proj -> experts.gate_up_proj_scale_inv
ACTIVATION_SCALE = "activation_scale"
ACTIVATION_SCHEMES = ("dynamic", "static")


@dataclass(frozen=True, slots=True)
class Fp8Checkpoint:
    block: tuple[int, int] | None  # rows x columns a scale covers; None: one scale per tensor (per expert)
    activation_scheme: str
    modules_to_not_convert: tuple[str, ...]  # Hugging Face module names or patterns the checkpoint left unquantized

    def not_converted(self, hf_module: str) -> bool:
        """transformers' rule: a pattern matches from the start up to a module boundary (also as a regex), or as
        a suffix."""
        return any(
            re.match(rf"(?:{p})(?:(?<=\.)|(?=\.|$))", hf_module) or hf_module.endswith(p)
            for p in self.modules_to_not_convert
        )


def read_fp8_checkpoint(model_dir: str) -> Fp8Checkpoint | None:
    """The checkpoint's fp8 format, or None when config.json has no quantization_config with quant_method fp8."""
    path = Path(model_dir) / "config.json"
    qc = json.loads(path.read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != "fp8":
        return None
    block = qc.get("weight_block_size", [128, 128])
    if block is not None and (
        not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)
    ):
        raise ValueError(f"{path}: quantization_config weight_block_size must be two positive integers (got {block!r})")
    scheme = str(qc.get("activation_scheme", "dynamic")).lower()
    if scheme not in ACTIVATION_SCHEMES:
        raise ValueError(f"{path}: fp8 activation_scheme {scheme!r} is unknown; infertune reads {ACTIVATION_SCHEMES}")
    for key, supported in (("fmt", "e4m3"), ("scale_fmt", "float"), ("expert_dtype", "fp8")):
        if qc.get(key, supported) != supported:
            raise ValueError(
                f"{path}: fp8 quantization_config {key}={qc[key]!r} is not supported; infertune reads {key}={supported!r} "
                "(float8_e4m3fn weights with fp32 block scales)"
            )
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or ()
    return Fp8Checkpoint(None if block is None else (block[0], block[1]), scheme, tuple(skip))


def dequantize_fp8(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] | None, dtype: torch.dtype
) -> torch.Tensor:
    """float8 [..., N, K] and its fp32 block scales [..., ceil(N / bn), ceil(K / bk)] -> [..., N, K] in `dtype`,
    one block row at a time (each block row in fp32, then cast)."""
    n, k = weight.shape[-2:]
    lead = weight.shape[:-2]
    bn, bk = block or (n, k)
    out = torch.empty(weight.shape, dtype=dtype)
    scale = scale_inv.float().reshape(*lead, -(-n // bn), -(-k // bk))
    for r, start in enumerate(range(0, n, bn)):
        row_scale = scale[..., r, :].repeat_interleave(bk, dim=-1)[..., :k].unsqueeze(-2)  # [..., 1, K]
        out[..., start : start + bn, :] = (weight[..., start : start + bn, :].float() * row_scale).to(dtype)
    return out


class Fp8Dequantizer:
    """Pairs each fp8 weight with its scales as the checkpoint's tensors stream past (in any order, across files)
    and hands it on dequantized. A scale arriving first waits (a few bytes per block); so does an fp8 weight whose
    scale comes later (one byte a weight)."""

    def __init__(self, fp8: Fp8Checkpoint, dtype: torch.dtype, passes: Callable[[str], bool] = lambda name: False):
        self.fp8, self.dtype = fp8, dtype
        self.passes = passes  # tensors handed on untouched (those the loader skips anyway: DeepSeek's MTP layers)
        self.weights: dict[str, torch.Tensor] = {}  # fp8 weights waiting for their scale
        self.scales: dict[str, torch.Tensor] = {}  # scales waiting for their weight, by the weight's name

    def stream(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in tensors:
            if self.passes(name):
                yield name, tensor
            elif name.endswith(SCALE_SUFFIX):
                weight = name[: -len(SCALE_SUFFIX)]
                if weight in self.weights:
                    yield weight, self._dequantized(weight, self.weights.pop(weight), tensor)
                else:
                    self.scales[weight] = tensor
            elif name.endswith(ACTIVATION_SCALE) and self.fp8.activation_scheme == "static":
                continue  # fp8 activations' input scale: activations stay in the model dtype
            elif tensor.dtype == torch.float8_e4m3fn:
                if name in self.scales:
                    yield name, self._dequantized(name, tensor, self.scales.pop(name))
                else:
                    self.weights[name] = tensor
            elif tensor.dtype.is_floating_point and tensor.element_size() == 1:
                raise ValueError(f"tensor {name!r} is stored as {tensor.dtype}; fp8 checkpoints hold float8_e4m3fn")
            else:
                yield name, tensor

    def finish(self) -> None:
        """Raise for a weight whose scales never came, or scales with no weight."""
        if self.weights:
            names = sorted(self.weights)
            raise ValueError(
                f"fp8 weight {names[0]!r} has no scale tensor {names[0] + SCALE_SUFFIX!r} in the checkpoint"
                + (f" (and {len(names) - 1} more)" if len(names) > 1 else "")
                + "; the checkpoint is incomplete or not in the block-scaled fp8 format"
            )
        if self.scales:
            name = sorted(self.scales)[0]
            raise ValueError(f"scale tensor {name + SCALE_SUFFIX!r} has no fp8 weight {name!r} in the checkpoint")

    def _dequantized(self, name: str, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: has a scale tensor but is stored as {weight.dtype}, not float8_e4m3fn")
        if weight.dim() < 2:
            raise ValueError(f"{name}: an fp8 weight has at least 2 dimensions (got shape {tuple(weight.shape)})")
        n, k = weight.shape[-2:]
        bn, bk = self.fp8.block or (n, k)
        expected = (*weight.shape[:-2], -(-n // bn), -(-k // bk))
        if self.fp8.block is None:  # one scale per matrix: any shape holding that many
            fits = scale_inv.numel() == weight.shape[:-2].numel()
        else:
            fits = tuple(scale_inv.shape) == expected
        if not fits:
            raise ValueError(
                f"{name + SCALE_SUFFIX}: shape {tuple(scale_inv.shape)}, but weight_block_size {self.fp8.block} "
                f"over the weight's {tuple(weight.shape)} needs {expected}; is config.json right for these weights?"
            )
        return dequantize_fp8(weight, scale_inv, self.fp8.block, self.dtype)


def not_converted_modules(model: nn.Module, fp8: Fp8Checkpoint, packed: dict) -> list[str]:
    """The engine's modules the checkpoint left unquantized (modules_to_not_convert), which a re-quantization keeps
    in full precision: a packed layer when any of its parts is; routed experts by their module's name."""
    return [
        name
        for name, module in model.named_modules()
        if (isinstance(module, Linear) and any(fp8.not_converted(hf) for hf in hf_modules(name, module, packed)))
        or (isinstance(module, Experts) and fp8.not_converted(name))
    ]


def requantize_config(model: nn.Module, fp8: Fp8Checkpoint, quant: QuantConfig, packed: dict) -> QuantConfig:
    """The quantization to apply on top of the dequantized fp8 weights: `quant`, with the modules the checkpoint
    left unquantized also kept in full precision (not_converted_modules)."""
    keep = not_converted_modules(model, fp8, packed)
    return replace(quant, keep_fp=tuple(quant.keep_fp) + tuple(keep)) if keep else quant
