"""Tensor parallelism: a model built for one rank's share (ArchConfig.for_tensor_parallel), loaded in slices, with
the collectives between its layers (torch.distributed: gloo on CPU, the backend's own elsewhere).

Each module class says how its children split in a `tp_plan` class attribute, {child name: style}:
  colwise       output features split: rank r keeps its block of rows (of each packed shard: q, k, v or gate, up);
                a block of fewer rows than ranks x local (KV heads fewer than the ranks) is shared by
                size // rows-blocks consecutive ranks, each keeping a replica
  rowwise       input features split: rank r keeps its block of columns, and the output is summed over the ranks
                (all-reduce) after the module; the bias is added on rank 0 only
  experts       layers/moe.py Experts: every expert's features split, gate / up rows and down columns; with
                expert_parallel the experts themselves split, each rank keeping E / size of them whole
  vocab_embed   an embedding's rows split into blocks of ceil(V / size): each rank looks up the ids in its block,
                the others give zeros, and the all-reduce sums the one row that is not
  vocab_head    the head's rows split the same way: each rank's logits gathered and cut back to V
  reduce        the module's own output is all-reduced (a MoE block: routed experts plus a shared expert, summed
                once); rowwise layers inside it then skip their own all-reduce
The plan is applied to the model on the meta device, before quantization methods and storage: each rank allocates
only its share and the loader copies only its slices (through the parameters' weight_loader, as for packed
layers). Forward hooks add the collectives, so the model files keep their single-rank code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class CommStats:
    """What this rank spent in collectives since the last take(), by kind: calls, bytes sent in, nanoseconds (each
    call timed with perf_counter_ns, ~0.1 us against collectives of 20 us and more). A rank's time in a collective
    includes waiting for the slowest rank to arrive, so load imbalance between ranks shows here too. The step time
    (exec_ns, the runner's whole execute_model) is recorded by the worker (executor/worker.py run_step)."""

    calls: dict[str, int] = field(default_factory=dict)
    nbytes: dict[str, int] = field(default_factory=dict)
    ns: dict[str, int] = field(default_factory=dict)
    exec_ns: int = 0
    steps: int = 0

    def add(self, kind: str, nbytes: int, ns: int) -> None:
        self.add_many(kind, 1, nbytes, ns)

    def add_many(self, kind: str, calls: int, nbytes: int, ns: int) -> None:
        """calls collectives of one kind at once (those counted elsewhere: the fused step's, in C)."""
        self.calls[kind] = self.calls.get(kind, 0) + calls
        self.nbytes[kind] = self.nbytes.get(kind, 0) + nbytes
        self.ns[kind] = self.ns.get(kind, 0) + ns

    def take(self) -> dict:
        """The counts as plain data, and start again from zero."""
        out = {
            "steps": self.steps,
            "exec_ns": self.exec_ns,
            "collectives": {k: {"calls": self.calls[k], "bytes": self.nbytes[k], "ns": self.ns[k]} for k in self.calls},
        }
        self.calls, self.nbytes, self.ns, self.exec_ns, self.steps = {}, {}, {}, 0, 0
        return out


# This process's counts (one rank per process).
COMM = CommStats()


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in a tensor-parallel group (the group is torch.distributed's default one)."""

    rank: int
    size: int
    group: Any = None  # a torch.distributed ProcessGroup; None: the default group
    # the ranks of one host: small all-reduces (decode steps) through shared memory (layers/shm_allreduce.py)
    shm: Any = None
    # MoE routed experts split whole over the ranks (the "experts" style below), not by their features
    expert_parallel: bool = False

    def all_reduce_from_fused_step(self, x: torch.Tensor) -> torch.Tensor:
        """all_reduce, called back by the fused C step where there is no shared-memory segment (counted apart)."""
        return self.all_reduce(x, ", called back by the fused step")

    def all_reduce(self, x: torch.Tensor, caller: str = "") -> torch.Tensor:
        """The sum over the ranks, in place (in fp32 where x is narrower, then rounded once)."""
        t0 = time.perf_counter_ns()
        if self.shm is not None and x.is_contiguous():
            # in pieces of the slots' size: a prefill chunk's activations too (gloo's loopback TCP moves a
            # 1.4 MiB prefill all-reduce in ~6.7 ms on the 2-core machine, the slots in ~1 ms)
            flat, step = x.view(-1), self.shm.max_numel
            for i in range(0, flat.numel(), step):
                self.shm.all_reduce(flat[i : i + step])
            out, kind = x, "all_reduce (shared memory)"
        elif x.dtype in (torch.float32, torch.float64):
            dist.all_reduce(x, group=self.group)
            out, kind = x, "all_reduce (gloo)"
        else:
            wide = x.float()
            dist.all_reduce(wide, group=self.group)
            out, kind = x.copy_(wide), "all_reduce (gloo)"
        COMM.add(kind.replace(")", caller + ")"), x.numel() * x.element_size(), time.perf_counter_ns() - t0)
        return out

    def min_over_ranks(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t)

    def gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n], rank order."""
        t0 = time.perf_counter_ns()
        if self.shm is not None and self.shm.fits(x):
            out, kind = self.shm.all_gather_last(x), "all_gather (shared memory)"
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x.contiguous(), group=self.group)
            out, kind = torch.cat(parts, dim=-1), "all_gather (gloo)"
        COMM.add(kind, x.numel() * x.element_size(), time.perf_counter_ns() - t0)
        return out


def block_of(rows: int, local: int, tp: TensorParallel) -> int:
    """Where rank tp.rank's `local` rows start in a tensor of `rows` (a whole split, or a replicated one: KV heads
    fewer than the ranks)."""
    whole = local * tp.size
    if rows == whole:
        return tp.rank * local
    if rows % local == 0 and whole % rows == 0:
        return (tp.rank // (whole // rows)) * local  # whole // rows consecutive ranks share each block
    raise ValueError(f"a checkpoint tensor of {rows} rows does not split into {tp.size} ranks of {local}")


def take(t: torch.Tensor, dim: int, local: int, tp: TensorParallel) -> torch.Tensor:
    return t.narrow(dim, block_of(t.shape[dim], local, tp), local)


def shard_model(model: nn.Module, tp: TensorParallel) -> None:
    """Apply every module's tp_plan (see the module docstring) to a model built on the meta device for one rank."""
    if tp.size == 1:
        return
    _walk(model, tp, reduced=False)


def _walk(module: nn.Module, tp: TensorParallel, reduced: bool) -> None:
    plan: dict[str, str] = getattr(type(module), "tp_plan", {})
    if plan.get("") == "reduce":  # this module sums its parts' outputs itself
        module.register_forward_hook(lambda m, args, out: tp.all_reduce(out))
        reduced = True
    done = set()
    for path, style in plan.items():
        if not path:
            continue
        child = module.get_submodule(path) if _has(module, path) else None
        if child is None:
            continue
        STYLES[style](child, tp, reduced, module, path)
        done.add(id(child))
    for child in module.children():
        if id(child) not in done:
            _walk(child, tp, reduced)


def _has(module: nn.Module, path: str) -> bool:
    try:
        return module.get_submodule(path) is not None
    except AttributeError:
        return False


def sliced_loader(inner, slicer):
    """A loader (p, loaded, shard) that feeds `inner` (None: a plain copy) the rank's slice of each checkpoint
    tensor, slicer(loaded, shard, p) -> slice, where p is the slot being filled (its shape is this rank's)."""

    def load(p: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        sliced = slicer(loaded, shard, p)
        if inner is None:
            if p.shape != sliced.shape:
                raise ValueError(f"checkpoint slice {tuple(sliced.shape)}, the model expects {tuple(p.shape)}")
            p.data.copy_(sliced)
        else:
            inner(p, sliced, shard)

    return load


def _wrap_loader(param: nn.Parameter, slicer) -> None:
    param.weight_loader = sliced_loader(getattr(param, "weight_loader", None), slicer)


def _colwise(module: nn.Module, tp: TensorParallel, reduced: bool, parent=None, path="") -> None:
    offsets = getattr(module, "shard_offsets", None)

    def slicer(loaded, shard, p):  # output rows: of the weight, its bias, and a stored layer's integers and scales
        local = offsets[shard][1] if offsets and shard is not None else p.shape[0]
        return take(loaded, 0, local, tp)

    module.tp_slicer = slicer  # (quant/checkpoint.py: the slots of a stored quantized layer load through it too)
    for name in ("weight", "bias"):
        param = getattr(module, name, None)
        if isinstance(param, nn.Parameter):
            _wrap_loader(param, slicer)


def _rowwise(module: nn.Module, tp: TensorParallel, reduced: bool, parent=None, path="") -> None:
    # input columns of the weight, and of a stored layer's slots: int8 [N, K], packed int4 [N, K/2], group scales
    # [N, K/g] each split at the slot's own width; a per-channel scale [N, 1] is every rank's (a replica)
    def slicer(loaded, shard, p):
        return take(loaded, 1, p.shape[1], tp)

    module.tp_slicer = slicer
    _wrap_loader(module.weight, slicer)
    bias = getattr(module, "bias", None)
    if isinstance(bias, nn.Parameter):  # summed over the ranks: added once
        _wrap_loader(bias, lambda loaded, shard, p: loaded if tp.rank == 0 else torch.zeros_like(loaded))
    if not reduced:
        module.register_forward_hook(lambda m, args, out: tp.all_reduce(out))


def _experts(module: nn.Module, tp: TensorParallel, reduced: bool, parent=None, path="") -> None:
    if tp.expert_parallel:
        _whole_experts(module, tp)
    else:
        _expert_features(module, tp)
    if not reduced:
        module.register_forward_hook(lambda m, args, out: tp.all_reduce(out))


def _whole_experts(module: nn.Module, tp: TensorParallel) -> None:
    """Expert parallel: rank r keeps experts [r * E / N, (r + 1) * E / N) whole ([local, 2I, H] and [local, H, I]),
    loads only their tensors, and runs the (token, slot) pairs routed to them; the block's all-reduce sums the
    ranks' parts (a token's experts on other ranks contribute there)."""
    total = module.num_experts
    if total % tp.size:
        raise ValueError(f"enable_expert_parallel: {tp.size} ranks do not divide the {total} experts")
    local = total // tp.size
    first = tp.rank * local
    for name in ("gate_up_proj", "down_proj"):
        old = getattr(module, name)
        new = nn.Parameter(torch.empty(local, *old.shape[1:], dtype=old.dtype, device=old.device), requires_grad=False)
        inner = old.weight_loader  # Experts' own: (param, tensor, shard) with shard (expert, half) | expert | None

        def load(p, loaded, shard, inner=inner, name=name):
            if shard is None:  # the fused 3-D tensor of every expert: this rank's block of them
                if loaded.shape[0] != total:
                    raise ValueError(f"experts.{name}: checkpoint holds {loaded.shape[0]} experts, the model {total}")
                inner(p, loaded.narrow(0, first, local), None)
                return
            expert = shard[0] if isinstance(shard, tuple) else shard
            if first <= expert < first + local:  # (another rank's expert: not loaded here)
                local_shard = (expert - first, shard[1]) if isinstance(shard, tuple) else expert - first
                inner(p, loaded, local_shard)

        new.weight_loader = load
        # the shards the checkpoint must fill on this rank, named as the checkpoint names them (global ids)
        new.expected_shards = {
            s for s in old.expected_shards if (s[0] if isinstance(s, tuple) else s) in range(first, first + local)
        }
        setattr(module, name, new)
    module.num_experts, module.expert_offset = local, first


def _expert_features(module: nn.Module, tp: TensorParallel) -> None:
    inter = module.intermediate_size  # this rank's features of each expert

    def gate_up(loaded, shard, p):
        if shard is None:  # [E, 2I, H]: the gate rows, then the up rows
            gate, up = loaded.chunk(2, dim=1)
            return torch.cat([take(gate, 1, inter, tp), take(up, 1, inter, tp)], dim=1)
        return take(loaded, 0, inter, tp)  # one expert's gate or up [I, H] (or its stored integers / scales)

    def down(loaded, shard, p):  # the input features: split at the slot's width (a stored layer's [E, H, K/2],
        # [E, H, K/g]; a per-channel scale [E, H, 1] is every rank's)
        return take(loaded, 2 if shard is None else 1, p.shape[-1], tp)

    _wrap_loader(module.gate_up_proj, gate_up)
    _wrap_loader(module.down_proj, down)


def _vocab_rows(vocab: int, tp: TensorParallel) -> tuple[int, int, int]:
    """(rows per rank, this rank's first row, how many of its rows are real) of a vocabulary split."""
    local = -(-vocab // tp.size)
    start = tp.rank * local
    return local, start, max(0, min(local, vocab - start))


def _vocab_param(module: nn.Module, old: nn.Parameter, vocab: int, tp: TensorParallel) -> nn.Parameter:
    local, start, real = _vocab_rows(vocab, tp)
    new = nn.Parameter(torch.empty(local, old.shape[1], dtype=old.dtype, device=old.device), requires_grad=False)

    def load(p: torch.Tensor, loaded: torch.Tensor, shard: object = None) -> None:
        if loaded.shape != (vocab, p.shape[1]):
            raise ValueError(
                f"checkpoint tensor has shape {tuple(loaded.shape)}, the model expects {(vocab, p.shape[1])}"
            )
        p.data[:real].copy_(loaded[start : start + real])
        p.data[real:].zero_()  # padding rows: looked up by no id, their logits cut off

    new.weight_loader = load
    return new


def _vocab_embed(module: nn.Embedding, tp: TensorParallel, reduced: bool, parent=None, path="") -> None:
    vocab = module.num_embeddings
    local, start, real = _vocab_rows(vocab, tp)
    module.weight = _vocab_param(module, module.weight, vocab, tp)
    module.num_embeddings = local
    masks: list[torch.Tensor] = []

    def to_local(m, args):
        ids = args[0] - start
        outside = (ids < 0) | (ids >= real)
        masks.append(outside)
        return (ids.masked_fill(outside, 0), *args[1:])

    def combine(m, args, out):
        out = out.masked_fill(masks.pop()[..., None], 0)
        return tp.all_reduce(out)

    module.register_forward_pre_hook(to_local)
    module.register_forward_hook(combine)


def _vocab_head(module: nn.Module, tp: TensorParallel, reduced: bool, parent=None, path="") -> None:
    vocab = module.out_features
    embed = getattr(getattr(parent, "model", None), "embed_tokens", None)
    if embed is not None and getattr(parent.config, "tie_word_embeddings", False):
        module.weight = embed.weight  # already split by the embedding's plan (applied first: listed first)
        assert module.weight.shape[0] == _vocab_rows(vocab, tp)[0], "tp_plan must list the embedding before the head"
    else:
        module.weight = _vocab_param(module, module.weight, vocab, tp)
    module.out_features = module.weight.shape[0]
    if getattr(module, "bias", None) is not None:
        raise ValueError("a tensor-parallel lm_head with a bias is not supported")
    module.register_forward_hook(lambda m, args, out: tp.gather_last(out)[..., :vocab])


STYLES = {
    "colwise": _colwise,
    "rowwise": _rowwise,
    "experts": _experts,
    "vocab_embed": _vocab_embed,
    "vocab_head": _vocab_head,
}
