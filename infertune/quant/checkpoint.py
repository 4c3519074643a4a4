"""Pre-quantized checkpoints (written by `infertune quantize`): read config.json's quantization_config and give
each quantized Linear a method whose weights are the stored integers, so loading copies them into int8 / uint8
slots and process_weights_after_loading only packs them for the kernel (no quantization at load time).

Stored tensors per quantized layer P (Hugging Face names; see infertune/tools/quant_format.py):
  int8 (format "int-quantized"):        P.weight int8 [N, K], P.weight_scale fp32 [N, 1] (+ P.input_scale fp32 [1]
                                        for static W8A8 activations)
  int4 (format "infertune-int4-uint8"): P.weight_packed uint8 [N, K/2] (column 2j low nibble, 2j+1 high),
                                        P.weight_scale fp32 [N, K/g], P.weight_zero fp32 [N, K/g]; w = q*scale + zero
MoE experts are stored per expert (P = ...experts.N.gate_proj | up_proj | down_proj, Mixtral's w1 | w3 | w2) with
the same tensors; StoredExperts loads them into [E, ...] slots and packs each expert as the Linear methods do.
"""

from __future__ import annotations

import torch
from torch import nn

from infertune.layers.linear import Linear, QuantMethod
from infertune.layers.moe import Experts
from infertune.quant.experts import PROJECTIONS, QuantizedExperts
from infertune.quant.int4 import W4A16Method
from infertune.quant.int8 import W8A8Method, W8A16Method
from infertune.stored_quant import StoredQuant


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K/2] -> int32 [N, K] in 0..15 (column 2j from the low nibble, 2j+1 from the high)."""
    low, high = (packed & 0x0F).to(torch.int32), (packed >> 4).to(torch.int32)
    return torch.stack([low, high], dim=-1).reshape(packed.shape[0], -1)


def _slot(layer: Linear, name: str, shape: tuple[int, ...], dtype: torch.dtype, loader=None) -> None:
    param = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
    param.weight_loader = loader or layer.weight_loader
    slicer = getattr(layer, "tp_slicer", None)  # tensor parallel (layers/parallel.py): this rank's slice
    if slicer is not None and loader is None:
        from infertune.layers.parallel import sliced_loader

        param.weight_loader = sliced_loader(param.weight_loader, slicer)
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
    def __init__(self, fast_kernel: bool = True, static_activations: bool = False, kernels=None) -> None:
        super().__init__(fast_kernel, kernels)
        self.static_activations = static_activations

    def static_scale(self, layer: Linear) -> torch.Tensor | None:
        return layer.input_scale if self.static_activations else None

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


class StoredExperts(QuantizedExperts):
    """Routed experts whose checkpoint holds the integers: slots [E, ...] for each projection's stored tensors (the
    per-expert checkpoint tensors load into their slices, as plain ones do), packed expert by expert after loading
    by the Linear method, exactly as a Stored* Linear of that shape is. Under w8a8 the experts take dynamic
    per-token activation scales (calibration measures the Linears' inputs only)."""

    def __init__(self, stored: StoredQuant, make_linear_method) -> None:
        super().__init__(make_linear_method)
        self.stored = stored

    def create_weights(self, layer: Experts, dtype: torch.dtype) -> None:
        self.params_dtype = dtype
        self.loaded_shapes = {proj: tuple(getattr(layer, proj).shape) for proj in PROJECTIONS}  # [E, N, K]
        g = self.stored.group_size
        for proj, (e, n, k) in self.loaded_shapes.items():
            plain = getattr(layer, proj)
            if self.stored.method == "w4a16":
                if k % g or k % 2:
                    raise ValueError(
                        f"experts' {proj} has in_features={k}, which does not fit int4 groups of {g}; "
                        "is config.json right for these weights?"
                    )
                slots = {"weight_packed": ((e, n, k // 2), torch.uint8), "weight_scale": ((e, n, k // g), None)}
                slots["weight_zero"] = ((e, n, k // g), None)
            else:
                slots = {"weight": ((e, n, k), torch.int8), "weight_scale": ((e, n, 1), None)}
            delattr(layer, proj)
            for name, (shape, slot_dtype) in slots.items():
                param = nn.Parameter(torch.empty(shape, dtype=slot_dtype or torch.float32), requires_grad=False)
                param.weight_loader, param.expected_shards = plain.weight_loader, plain.expected_shards
                setattr(layer, proj if name == "weight" else f"{proj}_{name}", param)

    def process_weights_after_loading(self, layer: Experts) -> None:
        dtype = self.params_dtype
        for proj, method in self.linear_methods.items():
            if self.stored.method == "w4a16":
                packed, scale, zero = (getattr(layer, f"{proj}_weight_{t}").data for t in ("packed", "scale", "zero"))

                def pack_one(view, e, method=method, packed=packed, scale=scale, zero=zero):
                    method.pack_weights(view, unpack_int4(packed[e]), scale[e], zero[e], dtype)
            else:
                q, scale = getattr(layer, proj).data, getattr(layer, f"{proj}_weight_scale").data
                if isinstance(method, W8A16Method) and bool((q == -128).any()):  # (W8A8Method is one too)
                    method.torch_layout_only = True  # (the kernels refuse -128: every expert of proj keeps torch's)

                def pack_one(view, e, method=method, q=q, scale=scale):
                    method.pack_weights(view, q[e], scale[e].view(-1), dtype)

            self.stack(layer, proj, self.loaded_shapes[proj], pack_one)


def _linear_method(stored: StoredQuant, fast_kernels: bool, kernel_max_rows: int | None, kernels) -> QuantMethod:
    """The Linear method whose layout a stored expert's integers are packed into."""
    if stored.method == "w8a16":
        return W8A16Method(fast_kernels, kernel_max_rows, kernels)
    if stored.method == "w8a8":
        return W8A8Method(fast_kernels, kernels)
    return W4A16Method(stored.group_size, stored.symmetric, fast_kernels, kernel_max_rows, kernels)


def hf_modules(name: str, module: Linear, packed: dict[str, tuple[str, object]]) -> list[str]:
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
    """Give each Linear the checkpoint says is quantized a Stored* method and create its integer slots (and each
    MoE experts module not in the ignore list, by its module name, a StoredExperts method).

    Call before the model is materialized (on the meta device) and after the plain layers got their
    methods (prepacking), so unquantized layers run exactly as they would in an unquantized model.
    """
    fast_kernels = backend.has_quant_kernels if backend is not None else True
    kernel_max_rows = backend.quant_kernel_max_rows if backend is not None else None
    chosen = {}
    moe = any(isinstance(m, Experts) for m in model.modules())  # (as attach_linear_methods: max_rows(moe=))
    for name, module in model.named_modules():
        if isinstance(module, Experts):
            if not stored.ignores(name):
                module.quant_method = StoredExperts(
                    stored, lambda: _linear_method(stored, fast_kernels, kernel_max_rows, kernels)
                )
                module.quant_method.create_weights(module, dtype)
                chosen[name] = module.quant_method.name
            continue
        if not isinstance(module, Linear):
            continue
        ignored = [stored.ignores(hf) for hf in hf_modules(name, module, packed)]
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
            method = StoredW8A8(fast_kernels, stored.static_activations, kernels)
        else:
            method = StoredW4A16(stored.group_size, stored.symmetric, fast_kernels, kernel_max_rows, kernels)
            method.moe = moe
        module.quant_method = method
        method.create_weights(module, dtype)
        chosen[name] = method.name
    return chosen
