"""Time by category for `infertune profile`: classify profiler events and attribute a step's wall time. No torch.

The profiler gives, per thread, properly nested spans: the step range the driver opens, the `infertune::<kind>`
ranges the instrumentation opens around engine calls and model modules, and aten ops (which nest: linear -> t, mm).
Every microsecond of a step goes to exactly one category: each span's SELF time (its length minus its children's)
goes to the category of the innermost context it belongs to, so the categories add up to the step's wall time
by construction. Self time of an op goes to the op's category (decided by the instrumented scopes it runs in,
then by its outermost aten op's name); self time of a range (Python between ops, the gaps) goes to "host".
A MoE layer splits three ways: its router module (router matmul, scores, top-k, grouping by expert) and the
dispatch around the experts (rows gathered in expert order, weighted, scattered back) are "moe_router", the
experts' matmuls are "matmul", their SiLU is "activation".

On a device with an asynchronous queue (CUDA) the categories are taken from the device timeline instead: each
kernel's time goes to the category of the CPU op that launched it, and the step's wall time the device was idle
is host overhead and idle gaps.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

CATEGORIES = (
    "attention",
    "kv_cache",
    "moe_router",
    "matmul",
    "fused_decode",
    "norm",
    "activation",
    "rotary",
    "sampling",
    "communication",
    "host",
    "other",
)
LABELS = {
    "attention": "attention",
    "kv_cache": "KV-cache read/write",
    "moe_router": "MoE router + dispatch",
    "matmul": "matmul / linear",
    "fused_decode": "fused decode step (C)",
    "norm": "norm",
    "activation": "activation",
    "rotary": "rotary",
    "sampling": "sampling",
    "communication": "communication",
    "host": "host / Python + idle gaps",
    "other": "other",
}

SCOPE_PREFIX = "infertune::"
# What a step ran (timeline.batch_phase), in report order: only prefill chunks, prefill chunks next to decodes (a
# chunked prefill overlapping decoding sequences: its own phase, counted as neither), only decodes.
PHASES = ("prefill", "mixed", "decode")
STEP_KIND = "step"
# A range the profiler's own bookkeeping opens (counting the experts' load): its ops are host time, not the model's.
INSTRUMENTATION_SCOPE = "instrumentation"
# Ranges around host-side engine work: every op inside them is host work (e.g. building input tensors from lists).
HOST_SCOPES = frozenset({"schedule", "prepare_inputs", "update", "detokenize", INSTRUMENTATION_SCOPE})
# A module scope that decides the category of everything inside it.
LEAF_SCOPE_CATEGORY = {
    "linear": "matmul",
    "norm": "norm",
    "rotary": "rotary",
    "activation": "activation",
    "embedding": "other",
}
# A container module: ops it runs itself (outside child modules) get this category unless their name says better.
# A MoE block's own ops (the shared expert's gate and the sums) are "other" unless named; inside its experts, what
# is neither a matmul nor the activation is the dispatch around them (rows gathered in expert order, weighted and
# scattered back), which the router's grouping decides and a fused router / grouped GEMM removes.
CONTAINER_DEFAULT = {"attention_block": "attention", "mlp": "activation", "moe_block": "other", "experts": "moe_router"}
# The MoE router module (router matmul, scores, top-k, and the grouping by expert where it runs): all its ops.
ROUTER_SCOPE = "moe_router"

# Op names (aten spelling, no namespace, no overload).
MATMUL_OPS = frozenset(
    {
        "mm",
        "addmm",
        "bmm",
        "baddbmm",
        "addbmm",
        "matmul",
        "linear",
        "mv",
        "addmv",
        "dot",
        "einsum",
        "_int_mm",
        "_addmm_activation",
        "_scaled_mm",
        "_weight_int8pack_mm",
        "_weight_int4pack_mm",
        "_weight_int4pack_mm_for_cpu",
        "_weight_int4pack_mm_with_scales_and_zeros",
        "_mixed_dtypes_linear",
        "npu_quant_matmul",
        "npu_weight_quant_batchmatmul",
        # infertune's CPU kernels (infertune_kernels:: ranges), and the dequantization / unpacking feeding a prefill's
        # GEMM
        "linear_bf16",
        "linear_w8",
        "linear_w4",
        "linear_w8a8",
        "linear_w8p",
        "linear_w4p",
        "dequant_w8",
        "dequant_w4",
        "linear_bf16c",
        "unpack_bf16c",
    }
)
# Gathers of cached K/V (reads) and scatters into the cache (writes), inside attention.
KV_WRITE_OPS = frozenset(
    {
        "index_copy_",
        "index_copy",
        "index_put_",
        "index_put",
        "_index_put_impl_",
        "scatter_",
        "reshape_and_cache",
        "_reshape_and_cache",
        "npu_scatter_nd_update_",
        "scatter_update_",
    }
)
KV_READ_OPS = frozenset({"index", "index_select", "gather", "take"})
KV_OPS = KV_WRITE_OPS | KV_READ_OPS
# Ops that only make a view, alias or allocate: no arithmetic, no device kernel.
VIEW_OPS = frozenset(
    {
        "view",
        "_unsafe_view",
        "reshape",
        "transpose",
        "t",
        "permute",
        "select",
        "slice",
        "unsqueeze",
        "squeeze",
        "expand",
        "as_strided",
        "chunk",
        "split",
        "split_with_sizes",
        "unbind",
        "narrow",
        "detach",
        "detach_",
        "alias",
        "lift_fresh",
        "empty",
        "empty_like",
        "empty_strided",
        "resolve_conj",
        "resolve_neg",
        "result_type",
        "view_as",
        "_reshape_alias",
        "unflatten",
        "flatten",
        "movedim",
        "numpy_T",
        "contiguous",
    }
)
_COMM_NAME = re.compile(
    r"all_?reduce|all_?gather|reduce_scatter|all_?to_?all|broadcast|barrier|nccl|gloo|hccl|"
    r"record_param_comms|^c10d::|^_c10d_functional::|send|recv",
    re.IGNORECASE,
)


def op_base(name: str) -> str:
    """'aten::index_copy_' -> 'index_copy_'; 'aten.mm.default' -> 'mm'."""
    if "::" in name:
        return name.split("::", 1)[1].split(".", 1)[0]
    parts = name.split(".")
    return parts[1] if len(parts) >= 2 and parts[0] in ("aten", "prims", "quantized") else name


def op_namespace(name: str) -> str:
    return name.split("::", 1)[0] if "::" in name else ""


def is_communication(name: str) -> bool:
    return bool(_COMM_NAME.search(name))


def scope_kind(name: str) -> str | None:
    """'infertune::linear model.layers.0.mlp.down_proj' -> 'linear'; 'infertune::step#3' -> 'step'; else None."""
    if not name.startswith(SCOPE_PREFIX):
        return None
    return name[len(SCOPE_PREFIX) :].split(" ", 1)[0].split("#", 1)[0]


def is_counted_op(name: str) -> bool:
    """An operator call (aten and other op namespaces), not a range, a runtime call or a profiler marker."""
    ns = op_namespace(name)
    return bool(ns) and ns not in ("profiler", "infertune")


def module_scope_kind(class_names: list[str]) -> str | None:
    """The scope a model module opens, from its class name and its bases' (own class first; None: not instrumented).

    Names, not types, so models added later (MoE blocks, new norms) are recognised without importing them.
    """
    for raw in class_names:
        n = raw.lower()
        if "router" in n or ("moe" in n and "gate" in n):  # Router, Qwen3MoeTopKRouter, DeepSeek's MoEGate
            return ROUTER_SCOPE
        if "expert" in n and "shared" not in n:  # the routed experts (a shared expert is an MLP)
            return "experts"
        if "rotary" in n or "rope" in n:
            return "rotary"
        if "norm" in n:
            return "norm"
        if n.endswith("linear"):
            return "linear"
        if n.endswith("attention"):
            return "attention_block"
        if n.endswith("mlp") or n.endswith("feedforward"):
            return "mlp"
        if n.endswith("decoderlayer"):
            return "layer"
        if "embedding" in n:
            return "embedding"
        if n in ("silu", "gelu", "relu", "sigmoid", "tanh", "siluandmul", "geluandmul") or n.endswith("activation"):
            return "activation"
        if "moe" in n:  # the block around router and experts (MoE, Qwen2MoeSparseMoeBlock), after Qwen2MoeMLP & co.
            return "moe_block"
    return None


def category_by_op_name(base: str) -> str:
    if base in MATMUL_OPS:
        return "matmul"
    if base == "fused_decode_layers":  # every layer of a decode step in one C call (runner/fused_decode.py)
        return "fused_decode"
    if "attention" in base or base.startswith("_flash_attention") or base.startswith("flash_attn"):
        return "attention"
    if base in KV_WRITE_OPS:
        return "kv_cache"
    if "norm" in base:
        return "norm"
    if "rotary" in base or "rope" in base:
        return "rotary"
    if base.rstrip("_") in (
        "silu",
        "gelu",
        "relu",
        "sigmoid",
        "tanh",
        "softplus",
        "swiglu",
        "npu_swiglu",
        "mish",
        "silu_and_mul",
    ):
        return "activation"
    return "other"


def classify(root_op: str, scopes: tuple[str, ...]) -> str:
    """Category of an op, from the instrumented scopes it runs in (outer -> inner) and its outermost aten op's name.

    Scopes win over names (the mm inside a Linear is matmul, the rsqrt inside RMSNorm is norm); inside attention,
    cache scatters and gathers are KV access; names decide where no scope does.
    """
    base = op_base(root_op)
    if is_communication(root_op):
        return "communication"
    kinds = set(scopes)
    if kinds & HOST_SCOPES:
        return "host"
    if "sampler" in kinds:
        return "sampling"
    if ROUTER_SCOPE in kinds:
        return "moe_router"
    if "kv_write" in kinds:
        return "kv_cache"
    if "attention_backend" in kinds:
        return "kv_cache" if base in KV_OPS else "attention"
    for kind in reversed(scopes):
        if kind in LEAF_SCOPE_CATEGORY:
            return LEAF_SCOPE_CATEGORY[kind]
        if kind in CONTAINER_DEFAULT:
            if kind == "attention_block" and base in KV_OPS:
                return "kv_cache"
            if kind == "experts":
                return _experts_category(root_op, base)
            by_name = category_by_op_name(base)
            return by_name if by_name != "other" else CONTAINER_DEFAULT[kind]
    return category_by_op_name(base)


def _experts_category(root_op: str, base: str) -> str:
    """Inside the routed experts: their matmuls (and a backend kernel's grouped GEMM) are matmul, SiLU-and-mul is
    activation, the rest (argsort / gather / index_add_ around them) is the MoE dispatch."""
    by_name = category_by_op_name(base)
    if by_name in ("matmul", "activation"):
        return by_name
    if op_namespace(root_op) not in ("", "aten", "prims"):  # a kernel call (infertune_kernels::...): the GEMM
        return "matmul"
    return "moe_router"


def host_label(scopes: tuple[str, ...]) -> str:
    """Where uncovered (Python / gap) time was spent, for the host detail line."""
    for kind in reversed(scopes):
        if kind in HOST_SCOPES:
            return kind
        if kind == "sampler":
            return "python_in_sampler"
        if (
            kind in ("forward", "logits", "layer", "attention_backend", "kv_write", ROUTER_SCOPE)
            or kind in CONTAINER_DEFAULT
            or kind in LEAF_SCOPE_CATEGORY
        ):
            return "python_in_forward"
        if kind == "execute":
            return "python_in_runner"
    return "engine_step_other"


def kv_label(root_op: str, scopes: tuple[str, ...]) -> str:
    return "write" if "kv_write" in scopes or op_base(root_op) in KV_WRITE_OPS else "read"


# ---- attribution -------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Span:
    name: str
    start: float  # us
    end: float  # us
    id: int = -1  # profiler correlation id: device kernels point at the CPU op that launched them


@dataclass(slots=True)
class StepProfile:
    """One engine step: its wall time split into categories, and what ran in it."""

    wall_us: float
    by_category: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    host_detail: dict[str, float] = field(default_factory=dict)  # the "host" category, split by where
    # Host-side time not covered by ops, by where it was spent (on the CPU timeline: host_detail itself).
    cpu_host_detail: dict[str, float] = field(default_factory=dict)
    kv_detail: dict[str, float] = field(default_factory=dict)
    # (op name, category) -> [self us, calls]; on the device timeline: (kernel name, category) -> [us, launches]
    ops: dict[tuple[str, str], list] = field(default_factory=dict)
    num_ops: int = 0  # outermost operator calls (what the Python code dispatched)
    num_ranges: int = 0  # instrumentation ranges opened in the step (their own cost lands in host time)
    num_view_ops: int = 0  # of which only views / allocations
    ops_by_scope: dict[str, int] = field(default_factory=dict)
    num_kernels: int | None = None  # device kernels (device timeline only)
    op_category: dict[int, str] = field(default_factory=dict)  # correlation id -> category (CPU ops)
    op_kv_label: dict[int, str] = field(default_factory=dict)
    timeline: str = "cpu"


def _add(d: dict, key, value: float) -> None:
    d[key] = d.get(key, 0.0) + value


def attribute_cpu(step: Span, spans: list[Span]) -> StepProfile:
    """Split step's wall time over categories from the spans of its thread (any order; outside ones are ignored).

    Spans that overlap without nesting (rare; clock jitter) are clipped to their parent, so children never cover
    more than their parent and the self times sum to the step's wall time exactly.
    """
    prof = StepProfile(wall_us=step.end - step.start)
    inside = sorted(
        (s for s in spans if s is not step and step.start <= s.start < step.end),
        key=lambda s: (s.start, -(s.end - s.start)),
    )
    # frame: [span, end (clipped), scopes, root op name or None, children's time, category]
    stack: list[list] = [[step, step.end, (), None, 0.0, "host"]]

    def close(frame: list) -> None:
        span, end, scopes, root, child, _ = frame
        self_us = max(end - span.start - child, 0.0)
        if scope_kind(span.name) is not None:
            prof.by_category["host"] += self_us
            _add(prof.host_detail, host_label(scopes), self_us)
            return
        category = frame[5]
        prof.by_category[category] += self_us
        if category == "host":
            _add(prof.host_detail, host_label(scopes), self_us)
        elif category == "kv_cache":
            _add(prof.kv_detail, kv_label(root, scopes), self_us)
        entry = prof.ops.setdefault((span.name, category), [0.0, 0])
        entry[0] += self_us
        entry[1] += 1

    for span in inside:
        while stack[-1][1] <= span.start and len(stack) > 1:
            close(stack.pop())
        parent = stack[-1]
        end = min(span.end, parent[1])
        parent[4] += end - span.start
        kind = scope_kind(span.name)
        p_scopes, p_root = parent[2], parent[3]
        if kind is not None:
            prof.num_ranges += 1
            stack.append([span, end, p_scopes + (kind,), None, 0.0, "host"])
            continue
        root = p_root or span.name
        category = classify(root, p_scopes)
        stack.append([span, end, p_scopes, root, 0.0, category])
        if span.id >= 0:
            prof.op_category[span.id] = category
            if category == "kv_cache":
                prof.op_kv_label[span.id] = kv_label(root, p_scopes)
        if p_root is None and is_counted_op(span.name):
            prof.num_ops += 1
            prof.num_view_ops += op_base(span.name) in VIEW_OPS
            where = next(
                (k for k in reversed(p_scopes) if k in HOST_SCOPES or k in ("forward", "logits", "sampler")), "other"
            )
            prof.ops_by_scope[where] = prof.ops_by_scope.get(where, 0) + 1
    while len(stack) > 1:
        close(stack.pop())
    step_frame = stack[0]
    gap = max(prof.wall_us - step_frame[4], 0.0)
    prof.by_category["host"] += gap
    _add(prof.host_detail, "engine_step_other", gap)
    prof.cpu_host_detail = prof.host_detail
    return prof


def attribute_device(step: Span, kernels: list[Span], cpu: StepProfile) -> StepProfile:
    """The device-timeline split of a step: kernel time by the category of the CPU op that launched each kernel
    (cpu.op_category, by correlation id); the rest of the step's wall time, the device idle, is host / gaps."""
    # Top "ops" on the device timeline are kernels: name -> [category, device us, launches].
    prof = StepProfile(
        wall_us=step.end - step.start,
        timeline="device",
        num_ops=cpu.num_ops,
        num_view_ops=cpu.num_view_ops,
        ops_by_scope=dict(cpu.ops_by_scope),
        num_ranges=cpu.num_ranges,
    )
    mine = sorted((k for k in kernels if step.start <= k.start < step.end), key=lambda k: k.start)
    prof.num_kernels = len(mine)
    cursor = step.start
    busy = 0.0
    for k in mine:
        start, end = max(k.start, cursor), min(k.end, step.end)
        if end <= start:
            continue
        category = cpu.op_category.get(k.id, "other")
        prof.by_category[category] += end - start
        if category == "kv_cache":
            _add(prof.kv_detail, cpu.op_kv_label.get(k.id, "read"), end - start)
        entry = prof.ops.setdefault((k.name, category), [0.0, 0])
        entry[0] += end - start
        entry[1] += 1
        busy += end - start
        cursor = end
    idle = prof.wall_us - busy
    prof.by_category["host"] += idle
    prof.host_detail = {"device_idle": idle}
    prof.cpu_host_detail = dict(cpu.cpu_host_detail)  # what the host was doing meanwhile
    return prof


# ---- phases ------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class PhaseSummary:
    phase: str
    steps: int = 0
    wall_us: float = 0.0
    by_category: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0.0))
    host_detail: dict[str, float] = field(default_factory=dict)
    cpu_host_detail: dict[str, float] = field(default_factory=dict)
    kv_detail: dict[str, float] = field(default_factory=dict)
    ops: dict[tuple[str, str], list] = field(default_factory=dict)
    ops_per_step: list[int] = field(default_factory=list)
    view_ops_per_step: list[int] = field(default_factory=list)
    kernels_per_step: list[int] = field(default_factory=list)
    ranges_per_step: list[int] = field(default_factory=list)
    ops_by_scope: dict[str, int] = field(default_factory=dict)
    tokens: int = 0
    seqs_per_step: list[int] = field(default_factory=list)

    def add(self, step: StepProfile, tokens: int = 0, seqs: int = 0) -> None:
        self.steps += 1
        self.wall_us += step.wall_us
        self.tokens += tokens
        self.seqs_per_step.append(seqs)
        for k, v in step.by_category.items():
            self.by_category[k] = self.by_category.get(k, 0.0) + v
        for k, v in step.host_detail.items():
            _add(self.host_detail, k, v)
        for k, v in step.cpu_host_detail.items():
            _add(self.cpu_host_detail, k, v)
        for k, v in step.kv_detail.items():
            _add(self.kv_detail, k, v)
        for key, (us, calls) in step.ops.items():
            entry = self.ops.setdefault(key, [0.0, 0])
            entry[0] += us
            entry[1] += calls
        self.ops_per_step.append(step.num_ops)
        self.view_ops_per_step.append(step.num_view_ops)
        self.ranges_per_step.append(step.num_ranges)
        if step.num_kernels is not None:
            self.kernels_per_step.append(step.num_kernels)
        for k, v in step.ops_by_scope.items():
            self.ops_by_scope[k] = self.ops_by_scope.get(k, 0) + v

    def share(self) -> dict[str, float]:
        total = self.wall_us or 1.0
        return {k: self.by_category.get(k, 0.0) / total for k in CATEGORIES}

    def top_ops(self, n: int) -> list[dict]:
        total = self.wall_us or 1.0
        rows = sorted(self.ops.items(), key=lambda kv: -kv[1][0])[:n]
        steps = self.steps or 1
        return [
            {
                "op": name,
                "category": cat,
                "self_us_per_step": us / steps,
                "calls_per_step": calls / steps,
                "share": us / total,
            }
            for (name, cat), (us, calls) in rows
        ]
