"""Mixture-of-experts MLP: a router picks top_k of num_experts gated MLPs per token, and their outputs are summed
with the router's weights (plus, in some families, a shared expert every token runs).

Three stages, each a plain function of tensors so that tests and other backends can hold a kernel to them:
  route(logits, moe, bias)          scores -> top-k expert ids and weights, every routing rule of MoeArch
  group_by_expert(ids, E)           the (token, slot) pairs sorted by expert, and how many each expert got
  experts_reference(...)            the experts over the grouped rows, one matmul pair per expert picked
                                    (run_experts: the same with each expert's matmuls as callables, e.g. a
                                    quantized method's, quant/experts.py)

`MoE` is the module: a `Router` (weight [E, H], DeepSeek-V3's e_score_correction_bias), `Experts` (the weights
as 3-D tensors, transformers v5's fused layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]; per-expert
checkpoint tensors load into their slices), and an optional shared expert built by the model.

Router and Experts are KernelOps: with a backend's kernels (kernels/interface.py) the router's scores, top-k,
weights and grouping are one `moe_route` call, and the experts one grouped GEMM (`moe_experts`); these functions
are their forward_native and the reference the kernels are tested against (the kernel's router settles a tie at the
top-k boundary as torch.topk does, and hands a row back to route() where it cannot: see csrc/moe.h).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from infertune.config import MoeArch
from infertune.kernels.interface import CompressedWeight, KernelExperts, KernelLinear, MoeRouting, expert_grouping
from infertune.layers.kernel_op import KernelOp


def route(
    logits: torch.Tensor, moe: MoeArch, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64), as each family's reference does."""
    scores, choice = _choice(logits, moe, correction_bias)
    ids = choice.topk(moe.top_k, dim=-1).indices
    return routed_weights(scores, ids, moe), ids


def _choice(
    logits: torch.Tensor, moe: MoeArch, correction_bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores, the values top-k selects on): the scores plus the correction bias, the groups not kept masked out."""
    logits = logits.float()
    t, e = logits.shape
    scores = logits.softmax(dim=-1) if moe.scoring == "softmax" else logits.sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()
    if moe.topk_method != "greedy" and moe.n_group > 1:
        grouped = choice.view(t, moe.n_group, e // moe.n_group)
        if moe.topk_method == "noaux_tc":  # a group is worth the sum of its two best (biased) scores
            group_scores = grouped.topk(min(2, e // moe.n_group), dim=-1).values.sum(dim=-1)
        else:  # group_limited_greedy: a group is worth its best score
            group_scores = grouped.amax(dim=-1)
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(moe.topk_group, dim=-1).indices, True)
        # DeepSeek-V3 masks the dropped groups with -inf, V2 with 0 (its scores are positive softmax values).
        fill = float("-inf") if moe.topk_method == "noaux_tc" else 0.0
        choice = choice.masked_fill(~keep.unsqueeze(-1).expand_as(grouped).reshape(t, e), fill)
    return scores, choice


def routed_weights(scores: torch.Tensor, ids: torch.Tensor, moe: MoeArch) -> torch.Tensor:
    """The weights [T, k] fp32 of the picked experts ids [T, k] from the scores [T, E]: renormalised and scaled as
    the family's reference does."""
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if moe.scoring == "sigmoid" else 0.0))
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights


def weights_of_picks(
    logits: torch.Tensor, moe: MoeArch, correction_bias: torch.Tensor | None, ids: torch.Tensor
) -> torch.Tensor:
    """The weights route() gives the experts ids [T, k] whoever picked them (a routing changed on purpose)."""
    return routed_weights(_choice(logits, moe, correction_bias)[0], ids, moe)


def boundary_margins(
    logits: torch.Tensor, moe: MoeArch, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """How near each row's routing is to another pick, in the router's logit units: (margin [T], the worst expert
    picked [T], the best left out [T]), the margin being how far the left-out expert's logit must rise for it to
    displace the picked one (within the groups kept; inf where no expert is left out, or none can get in).
    Softmax scores keep the logits' order, so the margin is the logit gap; sigmoid scores with a correction bias
    need the logit whose sigmoid plus its bias reaches the picked one's. (`doctor --consistency` weighs a flipped
    route by it: a margin within the dtype's noise can send a token to other experts in another kernel.)"""
    logits = logits.float()
    scores, choice = _choice(logits, moe, correction_bias)
    t, k = logits.shape[0], moe.top_k
    ranked = choice.sort(dim=-1, descending=True)
    if k >= logits.shape[1]:
        none = torch.full((t,), float("inf"))
        return none, ranked.indices[:, -1], ranked.indices[:, -1]
    kth, out = ranked.indices[:, k - 1], ranked.indices[:, k]
    masked = ranked.values[:, k] == (float("-inf") if moe.topk_method == "noaux_tc" else 0.0)
    masked &= moe.topk_method != "greedy" and moe.n_group > 1  # (a dropped group's expert: no small rise gets it in)
    l_kth, l_out = logits.gather(1, kth[:, None])[:, 0], logits.gather(1, out[:, None])[:, 0]
    if moe.scoring == "softmax" and correction_bias is None:
        margin = l_kth - l_out
    else:
        bias = correction_bias.float() if correction_bias is not None else torch.zeros(logits.shape[1])
        target = choice.gather(1, kth[:, None])[:, 0] - bias[out]  # the sigmoid the left-out expert must reach
        if moe.scoring == "softmax":  # (softmax with a bias: the scores' gap over the score's slope p (1 - p))
            p = scores.gather(1, out[:, None])[:, 0]
            margin = (target - p) / (p * (1 - p)).clamp_min(1e-30)
        else:
            margin = torch.where(
                (target > 0) & (target < 1), torch.logit(target.clamp(1e-30, 1 - 1e-7)) - l_out, float("inf")
            )
    return torch.where(masked, float("inf"), margin.clamp_min(0.0)), kth, out


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] -> (order [T * k]: the flat (token, slot) indices sorted by expert, stable; counts [E])."""
    return expert_grouping(ids, num_experts)


# One expert's matmul: (expert, rows [n, K]) -> rows times that expert's weight, [n, N].
ExpertMatmul = Callable[[int, torch.Tensor], torch.Tensor]


def experts_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The routed experts in plain PyTorch: rows sorted by expert, one gate_up / down matmul per expert that any
    token picked, each row scaled by its weight, and scattered back with a sum. x [T, H] -> [T, H]."""
    return run_experts(
        x,
        weights,
        ids,
        gate_up.shape[0],
        lambda e, rows: F.linear(rows, gate_up[e]),
        lambda e, rows: F.linear(rows, down[e]),
    )


def run_experts(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    num_experts: int,
    gate_up: ExpertMatmul,
    down: ExpertMatmul,
    grouping: tuple[torch.Tensor, torch.Tensor] | None = None,
    first: int = 0,
    local: int | None = None,
) -> torch.Tensor:
    """experts_reference with each expert's two matmuls given as callables (a quantized method's, which
    dequantizes or runs an int kernel on that expert's slice only): called for the experts some token picked.
    grouping: group_by_expert(ids, num_experts) where the router already has it. first / local: only experts
    first .. first + local - 1 run (expert parallel: this rank's), the matmuls indexed from 0 for them; the other
    experts' (token, slot) pairs contribute nothing here."""
    k = ids.shape[1]
    order, counts = grouping if grouping is not None else group_by_expert(ids, num_experts)
    counts = counts.tolist()
    if first or local is not None:
        lo = sum(counts[:first])
        counts = counts[first : first + (num_experts - first if local is None else local)]
        order = order[lo : lo + sum(counts)]  # (sorted by expert: this rank's pairs are one run of it)
    token = order // k
    rows = x[token]  # [pairs, H], grouped by expert
    out = torch.empty_like(rows)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            h = gate_up(expert, rows[start : start + n])  # [n, 2I]
            inter = h.shape[-1] // 2
            out[start : start + n] = down(expert, F.silu(h[:, :inter]) * h[:, inter:])
            start += n
    out *= weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token, out)


# Tokens up to which a bf16 router takes the kernels: their GEMV for its matmul (past this, with only E outputs to
# split over the threads, torch's wins: 0.77 against 1.37 ms at 128 tokens), and the fused top-k (router and top-k at
# 16 tokens: 0.55 ms against 0.84; benchmarks/bench_moe_kernels.py).
# An fp32 router's logits (DeepSeek's) take the fused top-k at any count.
ROUTER_KERNEL_ROWS = 16


class Router(KernelOp):
    """The router's weight [E, H] (fp32 where the family computes it in fp32) and DeepSeek-V3's selection bias.
    x [T, H] -> MoeRouting: weights [T, k] fp32, ids [T, k] and the grouping by expert."""

    def __init__(self, hidden: int, moe: MoeArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(
            torch.empty(moe.num_experts, hidden, dtype=torch.float32 if moe.router_fp32 else dtype)
        )
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32)) if moe.correction_bias else None
        )

    def forward_native(self, x: torch.Tensor) -> MoeRouting:
        return self._route(F.linear(x.to(self.weight.dtype), self.weight))

    def forward_kernels(self, x: torch.Tensor) -> MoeRouting:
        k = self.kernels
        if self.weight.dtype is torch.bfloat16 and x.shape[0] > ROUTER_KERNEL_ROWS:
            return self.forward_native(x)
        if x.dtype is self.weight.dtype is torch.bfloat16 and x.shape[0] <= k.max_rows("bf16"):
            logits = k.linear_bf16(x, self.weight)  # [T, E]
        else:
            logits = F.linear(x.to(self.weight.dtype), self.weight)
        # (the rows with a tie at the top-k boundary the kernel cannot settle go to route(), the others keep the kernel's
        # picks: as the fused step's hand-back does; None: a layout the kernel does not take, route() settles it)
        routing = k.moe_route(
            logits,
            self.moe,
            self.e_score_correction_bias,
            tied=lambda rows: route(rows, self.moe, self.e_score_correction_bias),
        )
        return routing if routing is not None else self._route(logits)

    def _route(self, logits: torch.Tensor) -> MoeRouting:
        weights, ids = route(logits, self.moe, self.e_score_correction_bias)
        return MoeRouting(weights, ids, *group_by_expert(ids, self.moe.num_experts))


class Experts(KernelOp):
    """The routed experts' weights, fused: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I].
    (x [T, H], MoeRouting) -> [T, H]: the reference (run_experts) or the kernels' grouped GEMM.

    Loads either layout: a whole 3-D tensor (shard None) or one expert's projection, shard (expert, 0 | 1) for
    gate / up and expert for down."""

    def __init__(self, hidden: int, moe: MoeArch, dtype: torch.dtype) -> None:
        super().__init__()
        e, inter = moe.num_experts, moe.intermediate_size
        self.num_experts, self.intermediate_size = e, inter
        # expert parallel (layers/parallel.py): this module keeps experts expert_offset .. + num_experts - 1 of
        # the router's global_experts
        self.global_experts, self.expert_offset = e, 0
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, inter, dtype=dtype))
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.down_proj.weight_loader = self._load_down
        # what a checkpoint must fill: the whole tensor, or every expert's slices (see loader._expected_shards)
        self.gate_up_proj.expected_shards = {(i, j) for i in range(e) for j in (0, 1)}
        self.down_proj.expected_shards = set(range(e))
        self.quant_method: ExpertsMethod = ExpertsMethod()  # quant/__init__.py attaches a quantized one

    def _load_gate_up(self, param: torch.Tensor, tensor: torch.Tensor, shard) -> None:
        if shard is None:
            _copy(param, tensor, "experts.gate_up_proj")
        else:
            expert, half = shard
            inter = self.intermediate_size
            _copy(
                param[expert, half * inter : (half + 1) * inter], tensor, f"expert {expert} {'gate up'.split()[half]}"
            )

    def _load_down(self, param: torch.Tensor, tensor: torch.Tensor, shard) -> None:
        _copy(
            param if shard is None else param[shard],
            tensor,
            "experts.down_proj" if shard is None else f"expert {shard} down",
        )

    def forward_native(self, x: torch.Tensor, routing: MoeRouting) -> torch.Tensor:
        gate_up, down = self.quant_method.matmuls(self)
        grouping = (routing.order, routing.counts)
        # (expert parallel: this module's experts only; else offset 0 and every expert)
        return run_experts(
            x, routing.weights, routing.ids, self.global_experts, gate_up, down, grouping,
            first=self.expert_offset, local=self.num_experts,
        )  # fmt: skip

    def forward_kernels(self, x: torch.Tensor, routing: MoeRouting) -> torch.Tensor | None:
        if x.dtype is not torch.bfloat16 or self._kernel_experts is None:
            return None
        return self.kernels.moe_experts(x, self._kernel_experts, routing)

    def kernel_view(self) -> KernelExperts | None:
        """The experts as the kernels take them (quant_method.kernel_experts), with this rank's block of the router's
        experts where they are split whole over the ranks (expert parallel)."""
        got = self.quant_method.kernel_experts(self)
        if got is not None and self.num_experts != self.global_experts:
            got = dataclasses.replace(got, first=self.expert_offset, total=self.global_experts)
        return got

    def use_kernels(self, kernels) -> None:
        super().use_kernels(kernels)
        # (after loading and quantization: the tensors the description points at are final)
        self._kernel_experts = self.kernel_view() if kernels is not None else None


class ExpertsMethod:
    """How Experts keeps its weights and multiplies one expert's rows by them: plain 3-D tensors here; the quantized
    methods (quant/experts.py) keep integers per expert instead (the experts' counterpart of a Linear's
    QuantMethod)."""

    name = "unquantized"

    def process_weights_after_loading(self, layer: Experts) -> None:
        """Quantize or repack once the checkpoint is in place (nothing for plain weights)."""

    def matmuls(self, layer: Experts) -> tuple[ExpertMatmul, ExpertMatmul]:
        """(gate_up, down) matmuls of one expert at a time."""
        return (lambda e, rows: F.linear(rows, layer.gate_up_proj[e])), (
            lambda e, rows: F.linear(rows, layer.down_proj[e])
        )

    def kernel_experts(self, layer: Experts) -> KernelExperts | None:
        """The stacked weights as the kernels' grouped GEMM reads them (None: a layout only the matmuls know)."""
        if layer.gate_up_proj.dtype is not torch.bfloat16:
            return None
        e, inter = layer.num_experts, layer.intermediate_size
        hidden = layer.gate_up_proj.shape[-1]
        return KernelExperts(
            e,
            KernelLinear("bf16", 2 * inter, hidden, weight=layer.gate_up_proj.detach()),
            KernelLinear("bf16", hidden, inter, weight=layer.down_proj.detach()),
        )


class CompressedExperts(ExpertsMethod):
    """Plain bf16 experts kept in the kernels' lossless compressed layout (`DecodeKernels.compress`, one expert's
    projection at a time; on x86 12 bits a weight): a decode step streams ~0.76x the experts' bytes for the very
    products of the bf16 experts, and the layer holds that much less memory. Each expert's buffers are registered
    on the layer as f"{projection}_{e}_{name}" in place of the loaded 3-D tensors; a gate_up is packed so that its
    silu_and_mul() runs in the epilogue (the grouped kernel takes act straight from it)."""

    name = "decode-kernel-12bit"

    def __init__(self, kernels) -> None:
        self.kernels = kernels
        self.weights: dict[str, list[CompressedWeight]] = {}

    def process_weights_after_loading(self, layer: Experts) -> None:
        for proj in ("gate_up_proj", "down_proj"):
            weight = getattr(layer, proj).data  # [E, N, K] bf16
            packed = []
            for e in range(weight.shape[0]):
                cw = self.kernels.compress(weight[e], gate_up=proj == "gate_up_proj")
                for name, t in cw.buffers.items():
                    layer.register_buffer(f"{proj}_{e}_{name}", t)
                packed.append(cw)
            for name in [n for n, _ in layer.named_parameters(recurse=False) if n.partition("_weight")[0] == proj]:
                delattr(layer, name)  # the checkpoint's tensors go: the packed buffers are the weights now
            del weight
            self.weights[proj] = packed

    def matmuls(self, layer: Experts) -> tuple[ExpertMatmul, ExpertMatmul]:
        def matmul_of(proj: str) -> ExpertMatmul:
            weights = self.weights[proj]

            def matmul(e: int, rows: torch.Tensor) -> torch.Tensor:
                if rows.dtype is torch.bfloat16 and not torch.compiler.is_compiling():
                    return weights[e].linear(rows)
                return F.linear(rows, weights[e].dense().to(rows.dtype))

            return matmul

        return matmul_of("gate_up_proj"), matmul_of("down_proj")

    def kernel_experts(self, layer: Experts) -> KernelExperts | None:
        (gate_up, down), e = (self.weights[p] for p in ("gate_up_proj", "down_proj")), layer.num_experts
        g, d = gate_up[0], down[0]
        return KernelExperts(
            e,
            KernelLinear("bf16c", g.out_features, g.in_features, compressed_experts=tuple(gate_up)),
            KernelLinear("bf16c", d.out_features, d.in_features, compressed_experts=tuple(down)),
        )

    def dense_weight(self, layer: Experts, proj: str) -> torch.Tensor:
        """The bf16 weights [E, N, K] of a projection, bit for bit as loaded."""
        return torch.stack([w.dense() for w in self.weights[proj]])


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src)


class MoE(nn.Module):
    """Router + routed experts (+ the model's shared expert, registered under the checkpoint's name for it)."""

    # tensor parallel (layers/parallel.py): every expert's features split, the router whole, the block's output
    # (routed plus shared) summed over the ranks once
    tp_plan = {"": "reduce", "experts": "experts"}

    def __init__(
        self,
        hidden: int,
        moe: MoeArch,
        dtype: torch.dtype,
        shared: nn.Module | None = None,
        shared_name: str = "shared_expert",
    ) -> None:
        super().__init__()
        self.moe = moe
        self.gate = Router(hidden, moe, dtype)
        self.experts = Experts(hidden, moe, dtype)
        self.shared_name = shared_name if shared is not None else None
        if shared is not None:
            self.add_module(shared_name, shared)
        # Qwen2-MoE: sigmoid(shared_expert_gate(x)) scales the shared expert's output.
        self.shared_expert_gate = _GateWeight(hidden, dtype) if shared is not None and moe.shared_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.gate(x))
        if self.shared_name is not None:
            shared = getattr(self, self.shared_name)(x)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
            out = out + shared
        return out


class _GateWeight(nn.Module):
    def __init__(self, hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(1, hidden, dtype=dtype))
