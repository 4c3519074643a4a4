"""The contract between the engine and a backend's own kernels: `DecodeKernels`, and the plain data it takes.

A backend that has kernels of its own (the CPU backend's x86 package, infertune/kernels/x86.py) returns an object
that satisfies `DecodeKernels` from `Backend.decode_kernels()`; one that has none returns None and the engine runs
torch's operators throughout. Everything the engine knows of the kernels goes through this file:

- the linear layers' methods (layers/linear.py, quant/) call `linear_*`, ask `max_rows(kind)` up to which rows the
  kernel beats torch's GEMM, store weights in the kernels' own layouts through `pack_w4` / `compress` without
  knowing those layouts, and describe themselves to the fused step as a `KernelLinear`;
- the modules with an elementwise kernel (RMSNorm and Gemma's, rotary, SiLU- and GeLU-and-multiply:
  layers/kernel_op.py `KernelOp`) are given the kernels once at load and call `rms_norm` / `gemma_rms_norm` /
  `rotary_` / `silu_and_mul` / `gelu_and_mul`, which return None (False for rotary) where a layout does not fit,
  and the module then runs its PyTorch formula;
- the runner hands the whole decoder, as a `FusedModel` of tensors and sizes, to `fused_decoder`, which returns a
  `FusedDecoder` (one call per step) or the reason it cannot run;
- a mixture-of-experts layer (layers/moe.py: its `Router` and `Experts` are KernelOps) routes through `moe_route`
  (scores, top-k, weights and the grouping by expert in one call, a `MoeRouting`) and runs its experts through
  `moe_experts` (one grouped GEMM over the rows sorted by expert, the weights described as a `KernelExperts`); both
  return None where they do not fit, and the module then runs layers/moe.py's PyTorch reference.

Every kernel rounds as the PyTorch formula it replaces (to bf16 precision); tests/test_kernels.py holds each one
to its formula, and tests/test_kernel_interface.py runs the engine on a second, pure-PyTorch implementation of
this contract.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal, NamedTuple, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from infertune.config import MoeArch

# How a linear layer's weight is stored for the kernels:
#   bf16   the plain bf16 weight [N, K]
#   bf16c  the same weight, losslessly compressed (CompressedWeight)
#   w8     int8 [N, K] with per-output-channel scales [N] (bf16 or fp32)
#   w4     int4 in the kernels' own packing (pack_w4) with fp32 scale and zero [N, K / group_size]
#   w8a8   int8 in the kernels' own packing (pack_w8a8) with fp32 per-output-channel scales [N], times activations
#          rounded to int8 (linear_w8a8)
#   w8p    W8A16 on w8a8's packed weight (pack_w8a8) with fp32 scales [N], times activations rounded to int16
#          (linear_w8p: linear_w8's arithmetic, one weight stream a thread)
#   w4p    W4A16 on a packed int4 weight (pack_w4p) with its fp32 scale and zero in the same blocks (linear_w4p)
LinearKind = Literal["bf16", "bf16c", "w8", "w4", "w8a8", "w8p", "w4p"]


class CompressedWeight(Protocol):
    """A bf16 weight kept in a kernel's lossless compressed layout (`DecodeKernels.compress`)."""

    buffers: dict[str, torch.Tensor]  # the tensors that hold it: the layer registers them (memory, .to, state)
    out_features: int
    in_features: int
    gate_up: bool  # packed so that silu_and_mul() can run in the GEMM's epilogue

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] bf16 -> x W^T + bias [..., N] bf16, the very products of linear_bf16 on the plain weight."""
        ...

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of a gate_up weight for x, rounded as the separate activation; None where not packed so."""
        ...

    def dense(self) -> torch.Tensor:
        """The bf16 weight [N, K], bit for bit as it was given."""
        ...


@dataclass(frozen=True, slots=True)
class KernelLinear:
    """A linear layer's weights as the kernels see them (what a QuantMethod hands the fused step)."""

    kind: LinearKind
    out_features: int
    in_features: int
    bias: torch.Tensor | None = None
    weight: torch.Tensor | None = None  # bf16
    qweight: torch.Tensor | None = None  # w8: int8 [N, K]; w4: pack_w4's bytes; w8a8 / w8p: pack_w8a8's
    scales: torch.Tensor | None = None  # w8 [N]; w8a8 / w8p fp32 [N]; w4 [N, K / group_size] fp32
    zero: torch.Tensor | None = None  # w4, w4p (pack_w4p's)
    group_size: int = 0  # w4
    compressed: CompressedWeight | None = None  # bf16c
    compressed_experts: tuple[CompressedWeight, ...] | None = None  # bf16c experts (KernelExperts): expert e's is [e]
    input_scale: torch.Tensor | None = None  # w8a8: the activations' calibrated static scale, fp32 [1]; None: per row


class MoeRouting(NamedTuple):
    """Where each token of a step goes in a mixture-of-experts layer (a Router's output; `moe_route`'s result)."""

    weights: torch.Tensor  # [T, k] fp32, slot j of a token the j-th best expert
    ids: torch.Tensor  # [T, k] int64
    order: torch.Tensor  # [T * k] int64: the flat (token, slot) indices t * k + j sorted by expert, stable
    counts: torch.Tensor  # [E] int64: how many rows each expert got

    @classmethod
    def grouped(cls, weights: torch.Tensor, ids: torch.Tensor, num_experts: int) -> MoeRouting:
        """The routing of these picks, grouped as layers/moe.py's group_by_expert groups them."""
        return cls(weights, ids, *expert_grouping(ids, num_experts))


def expert_grouping(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ids [T, k] -> (order [T * k]: the flat (token, slot) indices sorted by expert, stable; counts [E]). The
    one implementation: layers/moe.py's group_by_expert (the name the profiler's MoE stages go by) calls it."""
    flat = ids.reshape(-1)
    return flat.argsort(stable=True), torch.bincount(flat, minlength=num_experts)


@dataclass(frozen=True, slots=True, eq=False, weakref_slot=True)  # (a kernel may keep what it makes of one)
class KernelExperts:
    """A mixture-of-experts layer's routed experts as the kernels see them: each projection a KernelLinear whose
    tensors carry a leading expert dimension (bf16: weight [E, N, K]; w8: qweight [E, N, K], scales [E, N]; w4:
    pack_w4's bytes of each expert stacked [E, ...], scales and zero [E, N, K / group_size]; bf16c: each expert's
    `compress` of its weight, in compressed_experts). gate_up's N rows are the I gate rows, then the I up rows (a
    compressed gate_up packed with gate_up=True: its silu_and_mul pairs them)."""

    num_experts: int
    gate_up: KernelLinear  # [E, 2I, H]
    down: KernelLinear  # [E, H, I]
    # Expert parallel: these are experts first .. first + num_experts - 1 of the router's `total` (0: num_experts, all
    # of them); a routing's ids are the router's, and the experts' output is this block's part (the other ranks add
    # theirs). An implementation that does not run a block returns None (moe_experts) or why (fused_decoder).
    first: int = 0
    total: int = 0


@dataclass(slots=True)
class FusedMoE:
    """A mixture-of-experts MLP for the fused step (layers/moe.py MoE): the router, the routed experts, an optional
    shared expert. The kernels route each step themselves (as `moe_route`) and hand a step's routing to `route`
    where `moe_route` would hand it back (a tie at the top-k boundary it cannot settle as torch.topk does), so the picks
    are the per-module path's."""

    moe: MoeArch
    router: torch.Tensor  # [E, hidden] bf16, or fp32 (DeepSeek's: the logits in fp32, as F.linear(x.float(), w))
    correction_bias: torch.Tensor | None  # [E] fp32: DeepSeek-V3's, for selection only
    experts: KernelExperts
    route: Callable[[torch.Tensor], MoeRouting]  # router logits [T, E] -> the routing (layers/moe.py Router._route)
    shared_gate_up: KernelLinear | None = None  # the shared expert (Qwen2-MoE), None: none
    shared_down: KernelLinear | None = None
    shared_gate: torch.Tensor | None = None  # [1, hidden] bf16: sigmoid(x . g) scales the shared expert's output


@dataclass(frozen=True, slots=True)
class FusedMla:
    """A latent-attention layer (DeepSeek-V2 / V3; models/deepseek.py DeepseekAttention over layers/attention/mla.py
    MlaAttention) for the fused step: the layer's kv_cache keeps one row a token, [c (rank), rotated k_pe (rope)];
    decode attends with the absorbed weights (W_UK into the query, W_UV after attention) over those rows."""

    q_a: KernelLinear | None  # q_a_proj [q_rank, hidden]; None: q_b is q_proj (no low rank, V2-Lite)
    q_a_norm: torch.Tensor | None  # [q_rank] bf16
    q_b: KernelLinear  # q_b_proj (or q_proj): [H (nope + rope), q_rank or hidden]
    kv_a: KernelLinear  # kv_a_proj_with_mqa [rank + rope, hidden]
    kv_a_norm: torch.Tensor  # [rank] bf16
    kv_up: torch.Tensor  # kv_b_proj [H (nope + v), rank] bf16: each head's W_UK rows, then its W_UV rows
    rank: int
    rope: int
    nope: int
    v_dim: int
    interleaved: bool  # q_pe / k_pe come as interleaved pairs (DeepSeek's checkpoints): de-interleaved before rotary
    latent_eps: float  # q_a_layernorm's and kv_a_layernorm's epsilon


@dataclass(slots=True)
class FusedLayer:
    """One decoder layer (pre-norm attention + gated MLP or mixture of experts, Llama family; Gemma's sandwich norms)
    for the fused step."""

    input_norm: torch.Tensor
    post_norm: torch.Tensor  # the MLP's input norm; with pre_ff_norm set, the norm of o_proj's output (Gemma)
    qkv: KernelLinear | None  # None where mla is set
    o: KernelLinear
    gate_up: KernelLinear | None  # the dense MLP (None where moe is set)
    down: KernelLinear | None
    kv_cache: torch.Tensor  # this layer's paged cache, as the attention backend allocated it
    q_norm: torch.Tensor | None = None  # [head_dim]: Qwen3's per-head RMSNorm of q and k before rotary
    k_norm: torch.Tensor | None = None
    moe: FusedMoE | None = None
    window: int = 0  # > 0: a sliding window (the row attends to its last `window` keys, its own included); 0: all
    group: int = 0  # the KV cache group whose slots and block tables the layer reads (FusedModel.kv_groups)
    # Gemma: x += post_norm(o_proj(o)); x += post_ff_norm(mlp(pre_ff_norm(x))). None: Llama's x += o_proj(o);
    # x += mlp(post_norm(x))
    pre_ff_norm: torch.Tensor | None = None
    post_ff_norm: torch.Tensor | None = None
    cos_sin: torch.Tensor | None = None  # the layer's own rotary table (Gemma 3's sliding layers); None: the model's
    # Latent attention (DeepSeek): the layer's projections and up-projection (qkv, q_norm / k_norm unused; o is
    # o_proj over the heads' v). An implementation that does not know it returns why where it is set.
    mla: FusedMla | None = None


@dataclass(frozen=True, slots=True)
class TpAllReduce:
    """The all-reduce a fused step runs after each row-parallel linear (o_proj, down) under tensor parallel. On one
    host, the shared-memory one (layers/shm_allreduce.py) in its protocol: the segment's address, the address of the
    int64 sequence number the Python side's calls advance too, this rank, the ranks, and the slots' fp32 capacity.
    Without the segment (ranks on more than one host: gloo), address 0 and `reduce`, the engine's own all-reduce of
    a bf16 tensor in place (TensorParallel.all_reduce), which the step calls back between its kernels."""

    address: int
    seq_address: int
    rank: int
    size: int
    max_numel: int
    reduce: Callable[[torch.Tensor], object] | None = None


@dataclass(slots=True)
class FusedModel:
    """The decoder handed to `DecodeKernels.fused_decoder`: sizes, and the tensors the step reads in place."""

    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    inter: int  # the widest intermediate size of the dense MLPs and shared experts
    block_size: int
    eps: float  # the layers' RMSNorm epsilon (q / k norms' too)
    scale: float  # attention's softmax scale
    cos_sin: torch.Tensor  # rotary table [max_position, head_dim] fp32: cos half, then sin half
    kv_int8: bool  # the cache holds int8 rows with a per-token, per-head scale (Int8PagedAttention)
    embed: torch.Tensor  # [vocab, hidden]
    final_norm: torch.Tensor
    final_eps: float
    layers: list[FusedLayer] = field(default_factory=list)
    max_context: int = 0  # the longest context a sequence can reach, in tokens (a multiple of block_size)
    step_rows: int = 0  # the most tokens one step can hold
    # KV cache groups (layers grouped by sliding window, each group with its own block tables): with more than one,
    # a step's slot_mapping and block_tables come stacked by group ([G, T] and [G, T, max_blocks]). An
    # implementation that does not know windows or groups returns why (fused_decoder) where a layer has one.
    kv_groups: int = 1
    # Gemma. act: the gated MLP's activation ("gelu_tanh": transformers' gelu_pytorch_tanh). norm "gemma": every norm
    # (the final one and q / k norms too) scales by (1 + w), computed in fp32 and rounded once (layers/norm.py
    # GemmaRMSNorm); "llama": bf16(w * bf16(x / rms(x))). embed_scale: the embeddings are multiplied by it (a bf16
    # value; Gemma's sqrt(hidden)). attn_softcap > 0: each attention score s (scaled) becomes cap tanh(s / cap) before
    # the softmax (Gemma 2). An implementation that does not know one of these returns why where it is set.
    act: Literal["silu", "gelu_tanh"] = "silu"
    norm: Literal["llama", "gemma"] = "llama"
    embed_scale: float = 1.0
    attn_softcap: float = 0.0
    # Tensor parallel: the model is this rank's share (heads, KV heads and intermediate features local; o_proj and
    # down row-parallel, their outputs summed over the ranks by tp_allreduce before the residual add); embed_fn gives
    # the step's input embeddings where they are not a lookup in embed (a vocab-parallel embedding, scale included).
    # An implementation without a collective returns why where tp_allreduce is set.
    tp_allreduce: TpAllReduce | None = None
    embed_fn: Callable[[torch.Tensor], torch.Tensor] | None = None
    # The int4 tier (CacheConfig.kv_int4_after, an int8 cache): a block-table entry with scheduler_output.INT4_LO or
    # INT4_HI set reads the low or high nibbles of an int4 block (Int8PagedAttention.pack_int4's layout). An
    # implementation that does not read them returns why where this is set.
    kv_int4: bool = False


class FusedDecoder(Protocol):
    """Every decoder layer of a step in one call, then the final norm."""

    max_rows: int  # decode-only steps of up to this many sequences
    max_prefill_rows: int  # steps with prompt rows (and decodes), up to this many tokens in all (0: none)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm (a view of a buffer the next step overwrites). Each row
        attends to the first context_lens[row] tokens of its block table row (a layer with a window to the last
        `window` of them; with FusedModel.kv_groups > 1, the slots and block tables come stacked by group and each
        layer reads its group's). out_rows (int64, ascending): the only rows the caller reads; past the last
        layer's attention just those go on."""
        ...

    def step_timers(self, reset: bool = False) -> dict[str, float]:
        """This decoder's own counts (each engine has its own: nothing is shared across a process): seconds in each
        of the kernels' fused_parts over its steps since the last reset, plus "calls" and "rows"."""
        ...


@runtime_checkable
class DecodeKernels(Protocol):
    """A backend's own kernels. Rows are tokens of a step; every tensor is on the backend's device."""

    name: str  # e.g. "x86 avx512-bf16 + amx"
    fused_parts: tuple[str, ...]  # the parts of the fused step that its FusedDecoder.step_timers() reports

    def max_rows(self, kind: LinearKind, *, moe: bool = False) -> int:
        """Rows up to which linear_*(kind) beats torch's GEMM here (past them the method takes the dense path);
        moe=True: for the layers of a mixture-of-experts model (a layout may pay there and not in a dense model: a
        decode step gives each expert one or a few rows, a prompt step all of its rows to the grouped kernel, and the
        dense layers must go where the experts go for a prompt step to stay in one fused step)."""
        ...

    def linear_bf16(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] bf16, weight [N, K] bf16 -> [..., N] bf16 (fp32 accumulation)."""
        ...

    def linear_w8(
        self, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor: ...

    def dequant_w8(self, qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """int8 [N, K] and scales [N] -> bf16 [N, K], w = bf16(q * bf16(s))."""
        ...

    def pack_w8a8(self, q: torch.Tensor) -> torch.Tensor:
        """int8 [N, K] -> the kernels' W8A8 storage (its layout is theirs alone). Only called where
        max_rows("w8a8") > 0."""
        ...

    def unpack_w8a8(self, packed: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
        """The inverse of pack_w8a8: int8 [N, K]."""
        ...

    def linear_w8a8(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scales: torch.Tensor,
        input_scale: torch.Tensor | None = None,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [..., K] bf16 rounded to int8 (per row, or by input_scale [1]) times pack_w8a8's weight with fp32 scales
        [N], exact int32 sums -> [..., N] bf16: quant/int8.py W8A8Method's reference product, bit for bit."""
        ...

    def linear_w8p(
        self, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """W8A16 on pack_w8a8's weight with fp32 scales [N]: linear_w8's arithmetic (x rounded to int16 per row,
        exact integer sums, one rounding to bf16) on the packed layout. Only called where max_rows("w8p") > 0."""
        ...

    def w4_supported(self, in_features: int, group_size: int) -> bool: ...

    def pack_w4p(
        self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [N, K] in 0..15, scale and zero fp32 [N, K / group_size] -> the packed int4 weight and its scale and
        zero (the kernels' own layout). Only called where max_rows("w4p") > 0."""
        ...

    def unpack_w4p(
        self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, out_features: int, in_features: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The inverse of pack_w4p: (q uint8 [N, K], scale, zero fp32 [N, K / group_size])."""
        ...

    def linear_w4p(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group_size: int,
        out_features: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """W4A16 on pack_w4p's weight, w = q * scale + zero: x rounded to int16 per row, exact integer sums per
        group, fp32 per feature group by group; prompts on the dequantized weight."""
        ...

    def pack_w4(self, q: torch.Tensor) -> torch.Tensor:
        """Integers [N, K] in 0..15 -> the kernels' int4 storage (its layout is theirs alone)."""
        ...

    def unpack_w4(self, packed: torch.Tensor) -> torch.Tensor:
        """The inverse of pack_w4: uint8 [N, K] in 0..15."""
        ...

    def linear_w4(
        self,
        x: torch.Tensor,
        packed: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group_size: int,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """x [..., K] bf16 times w = q * scale + zero (per group of group_size inputs) -> [..., N] bf16."""
        ...

    def dequant_w4(
        self, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
    ) -> torch.Tensor: ...

    def greedy_tokens(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Greedy sampling: logits [rows, V] fp32, or bf16 (a bf16 LM head's output where the step needs nothing
        but the argmax) -> int64 [rows], logits.float().nan_to_num(nan=-inf).argmax(-1) exactly (+-inf as
        nan_to_num maps them to +-fmax; the first index among equal values); None where the dtype or layout does
        not fit (the sampler then runs that formula)."""
        ...

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """bf16(w * bf16(x / rms(x))) with fp32 statistics; None where x's layout does not fit."""
        ...

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """[T, 2I] -> bf16(bf16(silu(gate)) * up) [T, I]; None where it does not fit."""
        ...

    def gemma_rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
        """Gemma's RMSNorm: bf16((x / rms(x)) * (1 + w)), statistics, factors and product in fp32, one rounding; None
        where x's layout does not fit."""
        ...

    def gelu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor | None:
        """[T, 2I] -> bf16(bf16(gelu_tanh(gate)) * up) [T, I] (Gemma's MLP); None where it does not fit."""
        ...

    def rotary_(self, qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
        """Rotate qk [T, heads, D] in place (neox layout, fp32 products); False, untouched, where it cannot."""
        ...

    def can_compress(self, out_features: int, in_features: int) -> bool:
        """Whether compress() takes a weight of this shape here."""
        ...

    def compress(self, weight: torch.Tensor, gate_up: bool = False) -> CompressedWeight:
        """A bf16 weight [N, K] in the kernels' lossless compressed layout. gate_up: the weight is [gate; up] of an
        MLP (no bias), packed so that its silu_and_mul() works."""
        ...

    def moe_route(
        self,
        logits: torch.Tensor,
        moe: MoeArch,
        correction_bias: torch.Tensor | None = None,
        tied: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
    ) -> MoeRouting | None:
        """Router logits [T, E] (fp32 or bf16) -> each token's top_k experts and weights by moe's rule, the grouping
        of group_by_expert with them: the experts of layers/moe.py route(), each with its weight within 1e-6, in its
        order (best first) except among equal scores (the lower index first here; torch.topk's own order there);
        None where the rule or the layout does not fit, or where a tie at the boundary (the k-th best expert or the
        topk_group-th best group equal to the next) decides which experts a token gets and the kernel cannot pick as
        torch.topk does (a C kernel may: csrc/moe.h moe_topk_torch): route() then decides. With
        tied given (route() for some rows' logits: their weights and ids), a tie no longer returns None: the tied
        rows' logits go to tied(), the other rows keep the kernel's picks, and the whole is grouped."""
        ...

    def moe_experts(self, x: torch.Tensor, experts: KernelExperts, routing: MoeRouting) -> torch.Tensor | None:
        """x [T, H] bf16 -> the routed experts' weighted sum [T, H] bf16 (experts_reference, rounded as it rounds; with
        experts.first / total set, the sum over the block's experts only); None where the weights' kinds or the step
        do not fit (too many rows, ...)."""
        ...

    def fused_decoder(self, model: FusedModel) -> FusedDecoder | str:
        """The fused step for this decoder, or why it cannot run (a sentence)."""
        ...

    def profiled(self, name: str) -> AbstractContextManager:
        """A profiler range `infertune_kernels::<name>` while torch.profiler runs (kernel calls are not aten ops)."""
        ...
