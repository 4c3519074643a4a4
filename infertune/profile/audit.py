"""`infertune audit`: which aten ops a model step launches, and how a target backend would run each one.

It traces a prefill and a decode step through the real engine on the CPU (no target hardware needed),
then judges every op against the backend's op table (profile/data/ops_<backend>.json, or --op-table):
native, fallback (to the CPU), unsupported, unknown (outside the table's coverage) or decomposed (a
composite op the backend never sees; its parts are judged instead). It also flags what breaks static
graphs: ops whose output shape depends on the data, host syncs, shapes that change between the two
steps, float64 and integer matmuls, and dtypes the table warns about.

Where the engine has native kernels (on x86 CPUs: the fused C decode step, one call for every decoder layer,
and the kernels' linears), those are C calls that never reach the dispatcher. So the audit first runs the
steps through the engine as configured and reports what ran natively, per step (whether the fused step ran,
which kernels, the aten ops still dispatched around them); then it traces the torch path on a second engine
with decode_kernels="off" and judges that against the table, labelled as such: the path the engine takes on
every other backend, in float32, and wherever the native kernels do not apply.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from infertune.files import add_json_flag, print_report
from infertune.profile.audit_stages import format_stages, stage_ops
from infertune.profile.op_tables import BACKEND_TABLES, SEVERITY, AtenFacts, OpTable, Resolution, resolve

if TYPE_CHECKING:  # torch is imported only when a trace is taken, so building the CLI stays fast
    from infertune.profile.op_trace import NativeTrace, OpEvent, OpTrace

# Hints that hold on any backend. A table's own "hints" (with its sources) take precedence.
DATA_DEPENDENT = (
    "output size depends on the data: a device->host sync per call, a graph break / recompile "
    "under torch.compile or graph capture; use a fixed-size mask (where / masked_fill) or pad to a "
    "static size"
)
GENERAL_HINTS = {
    "einsum": "einsum decomposes into permute/reshape + bmm (see the rows it expands to); where einsum is slow, "
    "write the matmul + sum explicitly",
    "nonzero": DATA_DEPENDENT,
    "where": "one-argument where() is nonzero(): " + DATA_DEPENDENT,
    "masked_select": DATA_DEPENDENT,
    "masked_scatter_": "the number of elements taken from source depends on the mask; " + DATA_DEPENDENT,
    "_unique2": DATA_DEPENDENT,
    "unique_dim": DATA_DEPENDENT,
    "unique_consecutive": DATA_DEPENDENT,
    "repeat_interleave.self_Tensor": "output length = sum(repeats), known only on the device; pass output_size= "
    "or " + DATA_DEPENDENT,
    "index.Tensor": "advanced indexing: with a bool mask its output size depends on the data (like masked_select);"
    " prefer integer indices, index_select or where",
    "index_put_": "with a bool mask this is data-dependent; prefer masked_fill_ / where, or index_copy_ with "
    "integer indices",
    "_index_put_impl_": "with a bool mask this is data-dependent; prefer masked_fill_ / where",
    "_local_scalar_dense": ".item() / .tolist() / bool(tensor): a host sync, and a graph break under capture; "
    "keep it out of the forward (the engine allows one per step, in the sampler)",
}
MATMUL_OPS = {"mm", "bmm", "addmm", "baddbmm", "matmul", "mv", "dot", "addmv", "linear", "addbmm"}
INDEX_OPS = {"index.Tensor", "index_put", "index_put_", "_index_put_impl_"}
# Ops worth a note wherever they appear (index ops only matter with bool masks: see the hazards).
TROUBLEMAKERS = set(GENERAL_HINTS) - INDEX_OPS


@dataclass(slots=True)
class OpRow:
    op: str  # "aten.mm.default"
    key: str
    status: str
    basis: str
    counts: dict[str, int]
    example_inputs: list[str]
    dtypes: list[str]
    called_from: list[str] = field(default_factory=list)  # the composite ops it came out of
    decomposes_into: list[str] = field(default_factory=list)
    hint: str = ""

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@dataclass(slots=True)
class AuditReport:
    backend: str
    table: dict
    phases: dict[str, dict]
    ops: list[OpRow]
    hazards: dict[str, list[dict]]
    context: dict = field(default_factory=dict)
    table_hint_keys: frozenset[str] = frozenset()
    native: dict | None = None  # the default path's native kernels per step (native_summary), None: not run
    # MoE / MLA stage -> its kernel-level ops [{op, status, counts}], and the target's fused op for it (fused_stages)
    stages: dict[str, list[dict]] = field(default_factory=dict)
    fused_stages: dict[str, str] = field(default_factory=dict)
    torch_path: dict = field(default_factory=dict)  # which engine the traced (torch-path) steps ran on, and why

    def rows(self, status: str) -> list[OpRow]:
        return [r for r in self.ops if r.status == status]

    def summary(self) -> dict:
        c = Counter(r.status for r in self.ops)
        return {s: c.get(s, 0) for s in SEVERITY} | {k: len(v) for k, v in self.hazards.items()}

    def to_dict(self) -> dict:
        return {
            "context": self.context,
            "backend": self.backend,
            "table": self.table,
            "phases": self.phases,
            "summary": self.summary(),
            "ops": [asdict(r) | {"total": r.total} for r in self.ops],
            "hazards": self.hazards,
            "default_path": self.native,
            "torch_path": self.torch_path,
            "stages": self.stages,
            "fused_stages": {k: v for k, v in self.fused_stages.items() if k in self.stages},
        }


def _fmt_sig(sig) -> str:
    shape, dtype = sig
    return f"[{', '.join(map(str, shape))}] {dtype}"


def _generic_hint(status: str, backend: str, key: str) -> str:
    if key.endswith("_for_cpu") and backend != "cpu":
        return (
            "a CPU-only kernel that the CPU trace chose (attention / quantized matmul paths pick a kernel per "
            f"device); on {backend} the same layer calls that device's own kernel: audit it there, or check the "
            "layer's code path for this backend"
        )
    if status == "fallback":
        return (
            f"no {backend} kernel: it runs on the host, with a device->host copy of its inputs and a copy back "
            f"on every call; map {key} to an op the backend has, or move it out of the per-token loop"
        )
    if status == "unsupported":
        return f"no {backend} kernel and no fallback: this raises NotImplementedError on {backend}"
    if status == "unknown":
        return (
            "outside the table's coverage: run once on the device (a fallback prints a warning naming the op) "
            "and add the op to the table with its source"
        )
    return ""


def audit_trace(trace: OpTrace, table: OpTable, aten: AtenFacts | None = None) -> AuditReport:
    """Judge every recorded op against table; flag dynamic-shape and dtype hazards."""
    aten = aten or AtenFacts.load()
    events = trace.events
    cache: dict[tuple[str, bool], Resolution] = {}
    status: list[Resolution] = []
    visible: list[bool] = []
    for e in events:
        r = cache.get((e.key, e.has_children))
        if r is None:
            r = cache[(e.key, e.has_children)] = resolve(e.key, e.namespace, table, aten, e.has_children)
        status.append(r)
        # An op is what the backend runs unless it sits inside a composite the backend handles itself.
        visible.append(e.parent is None or (visible[e.parent] and status[e.parent].status == "decomposed"))

    rows: dict[tuple[str, str], OpRow] = {}
    phase_sigs: dict[str, dict[str, set]] = {}
    for i, e in enumerate(events):
        if not visible[i]:
            continue
        r = status[i]
        row = rows.get((e.name, r.status))
        if row is None:
            row = rows[(e.name, r.status)] = OpRow(
                e.name, e.key, r.status, r.basis, {}, [_fmt_sig(s) for s in e.inputs], []
            )
        row.counts[e.phase] = row.counts.get(e.phase, 0) + 1
        for _, dtype in e.inputs + e.outputs:
            if dtype not in row.dtypes:
                row.dtypes.append(dtype)
        if e.parent is not None:
            parent = events[e.parent].name
            if parent not in row.called_from:
                row.called_from.append(parent)
            prow = rows.get((parent, "decomposed"))
            if prow is not None and e.name not in prow.decomposes_into:
                prow.decomposes_into.append(e.name)
        if r.status != "decomposed":  # hazards are judged on what reaches kernels
            phase_sigs.setdefault(e.name, {}).setdefault(e.phase, set()).add(e.inputs)
    for row in rows.values():  # a table's own (sourced) hint wins; else what the status means, plus op lore
        general = [_generic_hint(row.status, table.backend, row.key), GENERAL_HINTS.get(row.key, "")]
        row.hint = table.hints.get(row.key) or "; ".join(h for h in general if h)

    ops = sorted(rows.values(), key=lambda r: (SEVERITY.get(r.status, 9), -r.total, r.op))
    kernels = [e for i, e in enumerate(events) if visible[i] and status[i].status != "decomposed"]
    hazards = _hazards(kernels, phase_sigs, trace, table)
    stage_rows = stage_ops(events, visible, status)
    table_info = {
        "path": table.path,
        "source": table.source,
        "version": table.version,
        "complete": table.complete,
        "on_missing": table.on_missing,
        "coverage": table.coverage,
    }
    return AuditReport(
        table.backend,
        table_info,
        dict(trace.phases),
        ops,
        hazards,
        table_hint_keys=frozenset(table.hints),
        stages=stage_rows,
        fused_stages=dict(table.fused_stages),
    )


def native_summary(native: NativeTrace) -> dict:
    """The default path's native side as plain data: how many decode / prefill steps the fused C step ran, which
    kernels ran (calls over all steps), and each step's record."""
    decode = [st for st in native.steps if st.phase.startswith("decode")]
    prefill = [st for st in native.steps if st.phase == "prefill"]
    kernels: Counter = Counter()
    for st in native.steps:
        kernels.update(st.kernels)
    fused_decode = [st for st in decode if st.fused]
    parts = (
        {k: sum(st.fused_ms.get(k, 0.0) for st in fused_decode) / len(fused_decode) for k in fused_decode[0].fused_ms}
        if fused_decode
        else {}
    )
    return {
        "decode_kernels": native.decode_kernels,
        "fused_built": native.fused_built,
        "decode_steps": len(decode),
        "fused_decode_steps": len(fused_decode),
        "prefill_steps": len(prefill),
        "fused_prefill_steps": sum(st.fused for st in prefill),
        "kernels": dict(kernels.most_common()),
        "fused_ms_per_decode_step": parts,
        "steps": [asdict(st) for st in native.steps],
    }


def _hazards(events: list[OpEvent], phase_sigs: dict, trace: OpTrace, table: OpTable) -> dict[str, list[dict]]:
    dynamic: dict[str, dict] = {}
    float64: Counter = Counter()
    int_matmul: Counter = Counter()
    for e in events:
        data_dependent = "dynamic_output_shape" in e.tags or "data_dependent_output" in e.tags
        if e.key in INDEX_OPS:  # tagged dynamic because of bool masks; integer indices keep shapes static
            data_dependent = any(dtype in ("bool", "uint8") for _, dtype in e.inputs[1:])
        if e.key == "where" and len(e.inputs) == 1:
            data_dependent = True
        if data_dependent:
            d = dynamic.setdefault(
                e.name, {"op": e.name, "count": 0, "phases": [], "why": GENERAL_HINTS.get(e.key, DATA_DEPENDENT)}
            )
            d["count"] += 1
            if e.phase not in d["phases"]:
                d["phases"].append(e.phase)
        if any(dtype == "float64" for _, dtype in e.inputs + e.outputs):
            float64[e.name] += 1
        if e.key in MATMUL_OPS and any(dtype.startswith(("int", "uint")) for _, dtype in e.inputs):
            int_matmul[e.name] += 1

    varying = []
    phases = list(trace.phases) or sorted({e.phase for e in events})
    if len(phases) >= 2:
        a, b = phases[0], phases[1]
        for name, per_phase in phase_sigs.items():
            sa, sb = per_phase.get(a), per_phase.get(b)
            if sa and sb and sa != sb:  # show a shape only prefill saw next to one only decode saw
                ex_a, ex_b = min(sa - sb or sa), min(sb - sa or sb)
                varying.append({"op": name, a: [_fmt_sig(s) for s in ex_a], b: [_fmt_sig(s) for s in ex_b]})

    seen_dtypes = {dtype for e in events for _, dtype in e.inputs + e.outputs}
    dtype_notes = [{"dtype": d, "note": note} for d, note in table.dtype_notes.items() if d in seen_dtypes]
    return {
        "data_dependent_shape": list(dynamic.values()),
        "float64": [
            {
                "op": k,
                "count": v,
                "why": "float64 doubles memory traffic and has no fast path on most accelerators; keep float32",
            }
            for k, v in float64.items()
        ],
        "integer_matmul": [
            {
                "op": k,
                "count": v,
                "why": "integer matmuls skip the matrix units on GPUs/NPUs and "
                "are often not implemented there; compute in float or use the int8 kernels",
            }
            for k, v in int_matmul.items()
        ],
        "shape_varies_between_steps": varying,
        "dtype_notes": dtype_notes,
    }


# ---- command line ----------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    from infertune.config import engine_option_kwargs as option  # the engine options' help, choices and defaults

    p.add_argument("--model", **option("model"))
    p.add_argument(
        "--backend",
        required=True,
        choices=sorted(BACKEND_TABLES),
        help="target backend whose op table the trace is judged against",
    )
    p.add_argument(
        "--dtype",
        **option(
            "dtype",
            choices=("auto", "float32", "bfloat16"),
            help="dtype to trace in (tracing runs on the CPU, which refuses float16: audit an fp16 deployment "
            "with bfloat16, the op set is the same) (default: auto)",
        ),
    )
    p.add_argument("--prompt-len", type=int, default=32, help="tokens in the traced prefill (default: 32)")
    p.add_argument(
        "--sample",
        action="store_true",
        help="trace random sampling (temperature 0.8, top-p 0.95, top-k 50) instead of greedy",
    )
    p.add_argument(
        "--quantization",
        **option("quantization", help="audit the model quantized on the fly, as `generate --quantization` runs it"),
    )
    p.add_argument("--quant-group-size", **option("quant_group_size"))
    p.add_argument("--op-table", default=None, help="audit against this JSON op table instead of the shipped one")
    p.add_argument(
        "--device",
        **option(
            "device",
            choices=("cpu", "cuda", "npu"),
            default="cpu",
            help="where to run the traced steps (default: cpu; the target needs no hardware)",
        ),
    )
    add_json_flag(p, "the report")


NATIVE_DECODE_STEPS = 3  # decode steps run through the engine as configured, to count those the fused step ran


def run(args: argparse.Namespace) -> int:
    import gc

    from infertune.llm import LLM
    from infertune.profile.op_trace import trace_engine_steps, trace_native_steps

    table = OpTable.load(args.op_table or args.backend)
    if args.op_table and table.backend != args.backend:
        print(f"note: --op-table describes backend {table.backend!r}, --backend is {args.backend!r}", file=sys.stderr)
    quant = {"quantization": args.quantization} if getattr(args, "quantization", None) else {}
    if quant and getattr(args, "quant_group_size", None) is not None:
        quant["quant_group_size"] = args.quant_group_size
    max_len = _fit_len(args.model, args.prompt_len + 2)  # (raises, naming --prompt-len, when even one decode won't fit)
    decode_steps = max(1, min(NATIVE_DECODE_STEPS, _fit_len(args.model, None) - args.prompt_len - 1))
    max_len = max(max_len, args.prompt_len + decode_steps + 1)

    def engine(**kw):
        return LLM(
            args.model,
            dtype=args.dtype,
            device=args.device,
            max_num_seqs=1,
            **quant,
            max_num_batched_tokens=max(2048, args.prompt_len),
            max_model_len=max_len,
            **kw,
        )

    # 1. The engine as configured: what ran outside the dispatcher (the fused C step, the kernels), per step.
    llm = engine()
    setting = llm.config.model.decode_kernels
    native = trace_native_steps(llm, args.prompt_len, sample=args.sample, decode_steps=decode_steps)
    # 2. The torch path, which the op table judges: the same engine where it has no native kernels, else a second
    # one with decode_kernels="off".
    if native.decode_kernels:
        del llm
        gc.collect()
        llm = engine(decode_kernels="off", prepack_weights=False)
        torch_path = {
            "engine": "second",
            "decode_kernels": "off",
            "why": "the default engine runs native kernels (C calls the dispatcher never sees); the ops "
            "below are its torch path (plain weights: prepacking into oneDNN's layout is the CPU's own): what runs "
            "on every other backend, in float32, and in the steps the kernels do not take",
        }
    else:
        torch_path = {
            "engine": "same",
            "decode_kernels": setting,
            "why": "the engine has no native kernels here (runner.decode_kernels is None): the torch path "
            "is the path it runs",
        }
    trace = trace_engine_steps(llm, args.prompt_len, sample=args.sample)
    report = audit_trace(trace, table)
    report.native, report.torch_path = native_summary(native), torch_path
    report.context = {
        "model": llm.config.model.model,
        "dtype": str(llm.engine.executor.runner.dtype).removeprefix("torch."),
        "traced_on": llm.engine.executor.backend.describe(),
        "sampling": "random" if args.sample else "greedy",
        "quantization": args.quantization,
        "decode_kernels": setting,
    }
    print_report(args, format_report(report), report.to_dict())
    return 0


def _fit_len(model: str | None, want: int | None) -> int:
    """want positions, checked against the model's max_position_embeddings (want=None: that limit)."""
    from infertune.config import ArchConfig, default_model_path

    limit = ArchConfig.from_model_dir(model or default_model_path()).max_position_embeddings
    if want is None:
        return limit
    if want > limit:
        raise ValueError(f"--prompt-len needs {want} positions but the model has max_position_embeddings={limit}")
    return want


def format_native(report: AuditReport) -> list[str]:
    """The default path's native section: the fused C step and the kernels per step, then the torch path's label."""
    n, tp = report.native, report.torch_path
    if n is None:
        return []
    setting = report.context.get("decode_kernels", "?")
    lines = [f"default path (the engine as configured, decode_kernels={setting}):"]
    if not n["decode_kernels"]:
        lines.append(
            "  no native kernels on this engine (runner.decode_kernels is None: a float32 model, not the CPU, "
            "or the kernels off / unavailable, see `infertune doctor`): every op reaches the dispatcher"
        )
    else:
        kernels = ", ".join(f"{k} x{v}" for k, v in n["kernels"].items()) or "none"
        built = "" if n["fused_built"] else " (runner.fused is None: the fused step is not built for this model)"
        prefill = (
            f", and {n['fused_prefill_steps']} of {n['prefill_steps']} prefill steps" if n["prefill_steps"] else ""
        )
        lines.append(
            f"  fused C step: {n['fused_decode_steps']} of {n['decode_steps']} decode steps ran in it"
            f"{prefill}{built}; native kernels: {kernels}"
        )
        lines.append(f"  {'step':<9} {'tokens':>6} {'fused':>6} {'rows':>5} {'aten ops':>8}  native kernels (calls)")
        for st in n["steps"]:
            ks = ", ".join(f"{k} {v}" for k, v in st["kernels"].items()) or "-"
            lines.append(
                f"  {st['phase']:<9} {st['tokens']:>6} {'yes' if st['fused'] else 'no':>6} "
                f"{st['fused_rows'] if st['fused'] else '-':>5} {st['aten_ops']:>8}  {ks}"
            )
        parts = n.get("fused_ms_per_decode_step") or {}
        if parts:
            lines.append(
                "  fused step by part (its C timers), ms per decode step: "
                + ", ".join(f"{k} {v:.3f}" for k, v in parts.items())
            )
        lines.append(
            "  these are C calls, not aten ops: no op table judges them (they are infertune's CPU kernels; "
            "other backends run the torch path)"
        )
    if tp:
        engine = 'a second engine with decode_kernels="off"' if tp.get("engine") == "second" else "the same engine"
        lines.append(f"torch path audited below: {engine}: {tp.get('why', '')}")
    lines.append("")
    return lines


def format_report(report: AuditReport) -> str:
    ctx, t = report.context, report.table
    phases = list(report.phases)
    lines = []
    if ctx:
        lines.append(
            f"infertune audit: {ctx.get('model')} ({ctx.get('dtype')}, {ctx.get('sampling')} sampling, "
            f"traced on {ctx.get('traced_on')}) -> target {report.backend}"
        )
    lines += format_native(report)
    lines.append(
        f"op table: {t['path']}\n  source: {t['source']}\n  version: {t['version']}; "
        f"{'complete' if t['complete'] else 'PARTIAL coverage: unlisted ops are unknown'}; "
        f"missing ops {'fall back to the CPU' if t['on_missing'] == 'fallback-to-cpu' else 'are unsupported'}"
    )
    prefix = "torch-path steps: " if report.native is not None else "steps: "
    lines.append(
        prefix
        + ", ".join(
            f"{p} ({v.get('tokens_seen') or v.get('tokens')} tokens, "
            f"{sum(r.counts.get(p, 0) for r in report.ops if r.status != 'decomposed')} "
            f"kernel calls)"
            for p, v in report.phases.items()
        )
    )
    header = f"{'status':<11} " + " ".join(f"{p[:8]:>8}" for p in phases) + f"  {'op':<52} example inputs"
    lines += ["", header, "-" * len(header)]
    for r in report.ops:
        counts = " ".join(f"{r.counts.get(p, 0):>8}" for p in phases)
        lines.append(f"{r.status:<11} {counts}  {r.op:<52} {', '.join(r.example_inputs)[:70] or '-'}")
        if r.status == "decomposed" and r.decomposes_into:
            lines.append(f"{'':<11} {'':>{9 * len(phases) - 1}}    -> {', '.join(r.decomposes_into)}")
    attention = [
        r
        for r in report.ops
        if r.status in ("fallback", "unsupported", "unknown")
        or r.key in TROUBLEMAKERS
        or r.key in report.table_hint_keys
    ]
    if attention:
        lines += ["", "what to look at:"]
        for r in attention:
            via = f" (inside {', '.join(r.called_from)})" if r.called_from else ""
            lines.append(f"  {r.status.upper():<11} {r.op}{via}: {r.hint}")
    lines += format_stages(report.stages, report.fused_stages, report.backend, phases)
    lines += ["", "hazards for static graphs (torch.compile, graph capture):"]
    hz = report.hazards
    if not any(hz.values()):
        lines.append("  none found")
    for d in hz["data_dependent_shape"]:
        lines.append(f"  data-dependent shape: {d['op']} x{d['count']} ({', '.join(d['phases'])}): {d['why']}")
    for d in hz["float64"]:
        lines.append(f"  float64: {d['op']} x{d['count']}: {d['why']}")
    for d in hz["integer_matmul"]:
        lines.append(f"  integer matmul: {d['op']} x{d['count']}: {d['why']}")
    for d in hz["dtype_notes"]:
        lines.append(f"  dtype {d['dtype']} on {report.backend}: {d['note']}")
    varying = hz["shape_varies_between_steps"]
    if varying and len(phases) >= 2:
        a, b = phases[0], phases[1]
        lines.append(
            f"  {len(varying)} op kinds see different input shapes in {a} and {b}: each distinct shape is a "
            f"separate graph under capture / a recompile under torch.compile without dynamic shapes; bucket "
            f"the token count (pad to fixed sizes) and warm each bucket up. For example:"
        )
        for d in varying[:8]:
            lines.append(f"    {d['op']}: {a} {', '.join(d[a])[:60]} | {b} {', '.join(d[b])[:60]}")
    s = report.summary()
    lines += ["", "summary: " + ", ".join(f"{v} {k}" for k, v in s.items())]
    return "\n".join(lines)
