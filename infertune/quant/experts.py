"""W8A16 / W4A16 / W8A8 for the routed experts (layers/moe.py Experts), in the Linear methods' own per-expert layout.

Each expert's gate_up_proj [2I, H] and down_proj [H, I] is kept exactly as W8A16Method / W4A16Method / W8A8Method
keep a Linear of that shape (their quantizer, their packing, their buffers), stacked along a leading expert dim and
registered on the Experts module as f"{projection}_{buffer}", e.g.

    w8a16   gate_up_proj_qweight int8 [E, 2I, H], gate_up_proj_scales [E, 2I] (model dtype); down_proj_* alike;
            where the kernels pack W8A16 (AVX-512), each expert's pack_w8a8 words [E, ...] and fp32 scales
    w4a16   with the backend's kernels (bf16 on x86): gate_up_proj_qweight (pack_w4 of each expert, or pack_w4p's
            blocks where the kernels take them: AVX-512 without AMX) and gate_up_proj_w4_scale / gate_up_proj_w4_zero
            fp32 [E, 2I, H/g] (pack_w4p's blocked [E, 2I/64, H/g, 64]); else torch's int4 layouts (W4A16Method)

so expert e's slice [e] of every buffer is what the per-Linear kernels (linear_w8 / linear_w4) take for a Linear,
and what the grouped expert GEMM reads (`kernel_experts`). The forward runs the Linear method on the slices of the
experts some token picked (its int kernel for a few rows, a dequantized matmul for a prefill), never on the others.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from infertune.kernels import hugepages
from infertune.kernels.interface import KernelExperts
from infertune.layers.linear import QuantMethod
from infertune.layers.moe import ExpertMatmul, Experts, ExpertsMethod
from infertune.quant.int4 import W4A16Method, dequantize_int4

PROJECTIONS = ("gate_up_proj", "down_proj")


class ExpertSlice:
    """One expert's projection, shaped like the Linear the per-Linear methods expect: its buffers are the [e] slices of
    the stacked ones (while packing: what the method registers)."""

    def __init__(self, out_features: int, in_features: int, buffers: dict | None = None) -> None:
        self.out_features, self.in_features, self.bias = out_features, in_features, None
        self.buffers: dict[str, torch.Tensor | None] = {} if buffers is None else buffers

    def register_buffer(self, name: str, tensor: torch.Tensor | None) -> None:
        self.buffers[name] = tensor

    def __getattr__(self, name: str):  # (only reached when the attribute is not an ordinary one)
        buffers = self.__dict__.get("buffers", {})
        if name in buffers:
            return buffers[name]
        raise AttributeError(name)


class QuantizedExperts(ExpertsMethod):
    """The experts quantized after loading, one expert at a time (never an fp32 copy of them all), by the Linear
    method `make_linear_method` makes (one instance per projection: its layout choices depend on the shape)."""

    def __init__(self, make_linear_method: Callable[[], QuantMethod]) -> None:
        # (each method keeps the layout it keeps for a Linear: the kernels' packed one where they take it, which the
        # grouped expert GEMM reads too: csrc/moe.h moe_expert_lin)
        self.linear_methods = {proj: make_linear_method() for proj in PROJECTIONS}
        for method in self.linear_methods.values():  # (a layout may pay in MoE models only: kernels' max_rows(moe=))
            if hasattr(method, "moe"):
                method.moe = True
        self.name = self.linear_methods["down_proj"].name
        self.shapes: dict[str, tuple[int, int]] = {}  # projection -> one expert's (N, K)
        self.buffer_names: dict[str, list[str]] = {}

    def process_weights_after_loading(self, layer: Experts) -> None:
        for proj, method in self.linear_methods.items():
            weight = getattr(layer, proj).data  # [E, N, K], model dtype

            def quantize_one(view: ExpertSlice, e: int, weight=weight, method=method) -> None:
                view.weight = weight[e]
                method.process_weights_after_loading(view)

            self.stack(layer, proj, tuple(weight.shape), quantize_one)
            del weight, quantize_one  # the last references: this projection's full-precision weights go now

    def stack(
        self, layer: Experts, proj: str, shape: tuple[int, int, int], pack_one: Callable[[ExpertSlice, int], None]
    ) -> None:
        """Pack each expert of `proj` (shape [E, N, K]) into an ExpertSlice with pack_one, copy its buffers into
        stacked [E, ...] ones, and put those on the layer in place of `proj`'s loaded tensors."""
        num_experts, n, k = shape
        stacked: dict[str, torch.Tensor | None] = {}
        for e in range(num_experts):
            view = ExpertSlice(n, k)
            with hugepages.transient():  # (each expert's pack dies once copied: never in a chunk it would pin)
                pack_one(view, e)
            if e == 0:  # the stacks the experts keep and every step streams: on 2 MB pages where the system allows
                stacked = {name: None if t is None else _stack_of(t, num_experts) for name, t in view.buffers.items()}
            assert view.buffers.keys() == stacked.keys(), "every expert of a projection packs into the same buffers"
            for name, t in view.buffers.items():
                assert (t is None) == (stacked[name] is None), f"{proj}: expert {e} packs {name} unlike expert 0"
                if t is not None:
                    stacked[name][e].copy_(t)
        loaded = [name for name, _ in layer.named_parameters(recurse=False) if name.partition("_weight")[0] == proj]
        for name in loaded:  # the checkpoint's tensors: proj itself, or the stored slots proj_weight_*
            delattr(layer, name)
        for name, t in stacked.items():
            layer.register_buffer(f"{proj}_{name}", t)
        self.shapes[proj], self.buffer_names[proj] = (n, k), list(stacked)

    def stacked_buffers(self, layer: Experts, proj: str) -> dict[str, torch.Tensor | None]:
        """The Linear method's buffer names -> the stacked tensors [E, ...] (expert e's are [e])."""
        return {name: getattr(layer, f"{proj}_{name}") for name in self.buffer_names[proj]}

    def expert_view(self, layer: Experts, proj: str, e: int) -> ExpertSlice:
        buffers = self.stacked_buffers(layer, proj)
        return ExpertSlice(*self.shapes[proj], {name: None if t is None else t[e] for name, t in buffers.items()})

    def matmuls(self, layer: Experts) -> tuple[ExpertMatmul, ExpertMatmul]:
        def matmul_of(proj: str) -> ExpertMatmul:
            method = self.linear_methods[proj]
            return lambda e, rows: method.apply(self.expert_view(layer, proj, e), rows)

        return matmul_of("gate_up_proj"), matmul_of("down_proj")

    def kernel_experts(self, layer: Experts) -> KernelExperts | None:
        """Each projection's stacked buffers as its Linear method describes a Linear's to the kernels (linear_w8 /
        linear_w4's layouts, with the leading expert dim), for the grouped expert GEMM; None where one keeps torch's."""
        lins = [
            self.linear_methods[proj].kernel_weights(ExpertSlice(*self.shapes[proj], self.stacked_buffers(layer, proj)))
            for proj in PROJECTIONS
        ]
        return None if any(lin is None for lin in lins) else KernelExperts(layer.num_experts, *lins)

    def dequantized_weight(self, layer: Experts, proj: str) -> torch.Tensor:
        """fp32 [E, N, K]: the weights the forward multiplies (for tests and for checking against a reference)."""
        method = self.linear_methods[proj]
        return torch.stack([_dequantized(method, self.expert_view(layer, proj, e)) for e in range(layer.num_experts)])


def _stack_of(t: torch.Tensor, num_experts: int) -> torch.Tensor:
    """An uninitialised [num_experts, *t.shape] tensor like t: on CPU a mapping of its own advised onto 2 MB pages
    (kernels/hugepages.py; torch's memory below 2 MB or where the system has no huge pages)."""
    if t.device.type != "cpu":
        return t.new_empty((num_experts, *t.shape))
    return hugepages.empty((num_experts, *t.shape), t.dtype, own=True)


def _dequantized(method: QuantMethod, view: ExpertSlice) -> torch.Tensor:
    if not isinstance(method, W4A16Method):
        return method.dequantized_weight(view)
    if "q_ref" in view.buffers:  # the reference layout (no int4 kernel on this device)
        return dequantize_int4(view.q_ref.to(torch.int32), view.scale_ref, view.low_ref, method.group_size)
    return method._dense_weight(view, torch.float32)  # (the dense weight its prefill path multiplies)


__all__ = ["ExpertSlice", "PROJECTIONS", "QuantizedExperts"]
