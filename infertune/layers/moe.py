"""Mixture-of-experts MLP: a router picks top_k of num_experts gated MLPs per token, and their outputs are summed
with the router's weights (plus, in some families, a shared expert every token runs).

Three stages, each a plain function of tensors so that tests and other backends can hold a kernel to them:
  route(logits, moe, bias)          scores -> top-k expert ids and weights, every routing rule of MoeArch
  group_by_expert(ids, E)           the (token, slot) pairs sorted by expert, and how many each expert got
  experts_reference(...)            the experts over the grouped rows, one matmul pair per expert picked

`MoE` is the module: a `Router` (weight [E, H], DeepSeek-V3's e_score_correction_bias), `Experts` (the weights
as 3-D tensors, transformers v5's fused layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]; per-expert
checkpoint tensors load into their slices), and an optional shared expert built by the model.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from infertune.config import MoeArch


def route(
    logits: torch.Tensor, moe: MoeArch, correction_bias: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router logits [T, E] -> (weights [T, k] fp32, expert ids [T, k] int64), as each family's reference does."""
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
    ids = choice.topk(moe.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if moe.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + (1e-20 if moe.scoring == "sigmoid" else 0.0))
    if moe.routed_scaling_factor != 1.0:
        weights = weights * moe.routed_scaling_factor
    return weights, ids


def group_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] -> (order [T * k]: the flat (token, slot) indices sorted by expert, stable; counts [E])."""
    flat = ids.reshape(-1)
    return flat.argsort(stable=True), torch.bincount(flat, minlength=num_experts)


def experts_reference(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor
) -> torch.Tensor:
    """The routed experts in plain PyTorch: rows sorted by expert, one gate_up / down matmul per expert that any
    token picked, each row scaled by its weight, and scattered back with a sum. x [T, H] -> [T, H]."""
    t, k = ids.shape
    inter = down.shape[-1]
    order, counts = group_by_expert(ids, gate_up.shape[0])
    token = order // k
    rows = x[token]  # [T * k, H], grouped by expert
    out = torch.empty_like(rows)
    start = 0
    for expert, n in enumerate(counts.tolist()):
        if n:
            h = F.linear(rows[start : start + n], gate_up[expert])
            out[start : start + n] = F.linear(F.silu(h[:, :inter]) * h[:, inter:], down[expert])
            start += n
    out *= weights.reshape(-1)[order].unsqueeze(1).to(out.dtype)
    return torch.zeros_like(x).index_add_(0, token, out)


class Router(nn.Module):
    """The router's weight [E, H] (fp32 where the family computes it in fp32) and DeepSeek-V3's selection bias."""

    def __init__(self, hidden: int, moe: MoeArch, dtype: torch.dtype) -> None:
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(
            torch.empty(moe.num_experts, hidden, dtype=torch.float32 if moe.router_fp32 else dtype)
        )
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(moe.num_experts, dtype=torch.float32)) if moe.correction_bias else None
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, ids [T, k])."""
        logits = F.linear(x.to(self.weight.dtype), self.weight)
        return route(logits, self.moe, self.e_score_correction_bias)


class Experts(nn.Module):
    """The routed experts' weights, fused: gate_up_proj [E, 2I, H] (gate rows, then up rows), down_proj [E, H, I].

    Loads either layout: a whole 3-D tensor (shard None) or one expert's projection, shard (expert, 0 | 1) for
    gate / up and expert for down."""

    def __init__(self, hidden: int, moe: MoeArch, dtype: torch.dtype) -> None:
        super().__init__()
        e, inter = moe.num_experts, moe.intermediate_size
        self.num_experts, self.intermediate_size = e, inter
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * inter, hidden, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(e, hidden, inter, dtype=dtype))
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.down_proj.weight_loader = self._load_down
        # what a checkpoint must fill: the whole tensor, or every expert's slices (see loader._expected_shards)
        self.gate_up_proj.expected_shards = {(i, j) for i in range(e) for j in (0, 1)}
        self.down_proj.expected_shards = set(range(e))

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

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return experts_reference(x, self.gate_up_proj, self.down_proj, weights, ids)


def _copy(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)}, the model expects {tuple(dst.shape)}")
    dst.copy_(src)


class MoE(nn.Module):
    """Router + routed experts (+ the model's shared expert, registered under the checkpoint's name for it)."""

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
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)
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
