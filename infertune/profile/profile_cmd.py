"""`infertune profile`: where a prefill and a decode step spend their time, by category, with what to try next.

It runs a representative workload (batch x input_len prompt tokens, output_len new tokens each) through the real
engine twice: once plain, to warm up and time the steps unprofiled, then under torch.profiler with ranges around
the engine's parts (see timeline.py). It prints the time share of each category for prefill, decode and mixed
steps (a mixed step runs prefill chunks next to decodes: its own phase, never counted as either; the shares add
up to the steps' wall time), the ops per decode step and their estimated launch overhead, the top ops by
self time, and hints tied to the figures; on a MoE model, the load of each layer's experts (tokens routed to each,
the busiest against the mean). --trace, --json and --plot write the Chrome trace, a JSON summary and a stacked bar
chart.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from infertune.files import JSON_STDOUT, add_json_flag, print_report
from infertune.plotting import pyplot
from infertune.profile.profile_categories import CATEGORIES, LABELS, PHASES
from infertune.profile.profile_hints import derive_hints

DESCRIPTION = __doc__.split("\n\n")[1].replace("\n", " ")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from infertune.config import engine_option_kwargs as option  # the engine options' help, choices and defaults

    p.add_argument("--model", **option("model"))
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    p.add_argument("--output-len", type=int, default=32, help="new tokens per request (default: 32)")
    p.add_argument("--batch", type=int, default=4, help="requests run together (default: 4)")
    p.add_argument("--dtype", **option("dtype"))
    p.add_argument("--device", **option("device"))
    p.add_argument("--quantization", **option("quantization"))
    p.add_argument("--quant-group-size", **option("quant_group_size"))
    p.add_argument("--quantize-lm-head", **option("quantize_lm_head"))
    p.add_argument("--max-num-batched-tokens", **option("max_num_batched_tokens"))
    p.add_argument(
        "--tensor-parallel-size",
        **option(
            "tensor_parallel_size",
            help="ranks the model runs on (default: 1). Above 1 the report splits each phase's step into compute, "
            "communication (the all-reduces and gathers, timed on every rank) and driver + IPC, instead of the op "
            "table (torch.profiler sees one process)",
        ),
    )
    p.add_argument(
        "--distributed-executor-backend",
        **option("distributed_executor_backend", choices=["mp", "ray"], default="mp"),
    )
    p.add_argument(
        "--decode-kernels",
        **option(
            "decode_kernels",
            help="infertune's decode kernels as the engine runs them (auto: the fused decode step shows "
            "as one category); linear: the per-op forward on the kernels' linears, to split a decode step by op; off: "
            "torch's matmuls (default: auto)",
        ),
    )
    p.add_argument(
        "--greedy",
        action="store_true",
        help="greedy decoding (default: temperature 0.8, top_p 0.95, as a served workload would sample)",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the unprofiled warm-up run: no baseline timings, and the first profiled step pays one-time costs",
    )
    p.add_argument("--top", type=int, default=12, help="top ops listed per phase (default: 12)")
    p.add_argument("--trace", metavar="OUT.json", default=None, help="write the Chrome / Perfetto trace here")
    add_json_flag(p, "the summary")
    p.add_argument("--plot", metavar="OUT.png", default=None, help="draw the breakdown (needs matplotlib)")


def _pyplot():
    return pyplot(RuntimeError)


def run(args: argparse.Namespace) -> int:
    from infertune.config import ArchConfig, default_model_path
    from infertune.files import check_writable
    from infertune.profile.timeline import profile_workload

    for name in ("input_len", "output_len", "batch", "tensor_parallel_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1")
    if args.plot:
        _pyplot()  # fail before the run, not after it
    for flag in ("trace", "json", "plot"):  # (a path that cannot be written: said now, not after the whole run)
        check_writable(f"--{flag}", getattr(args, flag))
    limit = ArchConfig.from_model_dir(args.model or default_model_path()).max_position_embeddings
    need = args.input_len + args.output_len
    if need > limit:
        raise ValueError(f"--input-len + --output-len = {need} exceeds the model's max_position_embeddings={limit}")
    if args.tensor_parallel_size > 1:
        return _run_tensor_parallel(args, need)
    llm = _engine(args, need)
    sampling, params = _sampling(args)
    result = profile_workload(llm, args.input_len, args.output_len, args.batch, params, warmup=not args.no_warmup)
    import torch

    from infertune.profile.kv_bytes import measure_decode_kv_reads
    from infertune.profile.timeline import make_prompts

    vocab = llm.engine.config.model.arch.vocab_size
    kv_reads = measure_decode_kv_reads(
        llm, args.input_len, args.batch, make_prompts(vocab, args.input_len, args.batch, 4)
    )

    runner = llm.engine.executor.runner
    context = {
        "model": llm.config.model.model,
        "device": llm.engine.executor.backend.describe(),
        "dtype": str(runner.dtype).removeprefix("torch."),
        # (the engine's: a quantized checkpoint's own method too, where --quantization is not given)
        "quantization": llm.config.quant.quantization,
        "decode_kernels": args.decode_kernels if runner.decode_kernels is not None else "off",
        "batch": args.batch,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "sampling": sampling,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "timeline": result.timeline,
    }
    summary = build_summary(result, context, args.top)
    summary["kv_reads"] = kv_reads.to_dict()
    if args.trace:
        write_trace(result, args.trace)
        summary["files"]["trace"] = args.trace
    if args.plot:
        write_plot(summary, args.plot)
        summary["files"]["plot"] = args.plot
    if args.json not in (None, JSON_STDOUT):
        summary["files"]["json"] = args.json
    print_report(args, format_report(summary), summary)
    return 0


def _sampling(args) -> tuple[str, object]:
    from infertune.sampling_params import SamplingParams

    if args.greedy:
        return "greedy", SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
    return "temperature 0.8, top_p 0.95", SamplingParams(
        max_tokens=args.output_len, temperature=0.8, top_p=0.95, ignore_eos=True
    )


def _engine(args: argparse.Namespace, need: int, **extra):
    """The engine the profile runs: the workload's shape, the flags' dtype, kernels and quantization."""
    from infertune.llm import LLM

    quant = {"quantization": args.quantization, "quant_group_size": args.quant_group_size} if args.quantization else {}
    if args.quantize_lm_head:  # (a quantized checkpoint takes it without --quantization)
        quant["quantize_lm_head"] = True
    return LLM(
        args.model,
        dtype=args.dtype,
        device=args.device,
        max_model_len=need,
        max_num_seqs=args.batch,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_kernels=args.decode_kernels,
        **quant,
        **extra,
    )


def _run_tensor_parallel(args: argparse.Namespace, need: int) -> int:
    from infertune.profile.tp_profile import format_tp_report, profile_tensor_parallel, write_tp_plot

    if args.trace:
        raise ValueError("--trace needs the model in this process: run it without --tensor-parallel-size")
    llm = _engine(
        args,
        need,
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
    )
    try:
        sampling, params = _sampling(args)
        summary = profile_tensor_parallel(
            llm, args.input_len, args.output_len, args.batch, params, warmup=not args.no_warmup
        )
    finally:
        llm.engine.executor.shutdown()
    context = {"batch": args.batch, "input_len": args.input_len, "output_len": args.output_len, "sampling": sampling}
    summary["context"] = {**context, "model": llm.config.model.model, "dtype": args.dtype}
    if args.plot:
        write_tp_plot(summary, args.plot)
    print_report(args, format_tp_report(summary, context), summary)
    return 0


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    ordered = sorted(xs)
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def build_summary(result, context: dict, top: int = 12) -> dict:
    """The JSON summary (what --json writes, and what the report, the plot and the hints read)."""
    phases = {}
    for name in PHASES:
        ph = result.phases.get(name)
        if ph is None:
            continue
        profiled = [r for r in result.records if r.phase == name]
        wall = ph.wall_us or 1.0
        base = result.baseline.get(name, [])
        jitter = base or [r.wall_us for r in result.records if r.phase == name]
        # Page faults of the unprofiled steps where there are some (the profiler allocates its own event buffers).
        faults = result.baseline_faults.get(name) or [r.page_faults for r in result.records if r.phase == name]
        # The fused step's own split (C timers), from the unprofiled steps where there are some
        fused = result.baseline_fused.get(name) or [r.fused for r in result.records if r.phase == name and r.fused]
        phases[name] = {
            "steps": ph.steps,
            "ms_per_step": ph.wall_us / ph.steps / 1000,
            "unprofiled_ms_per_step": _median(base) / 1000 if base else None,
            "step_ms_p50": _median(jitter) / 1000 if jitter else None,
            "step_ms_p90": _quantile(jitter, 0.9) / 1000 if jitter else None,
            "tokens_per_step": ph.tokens / ph.steps,
            "prefill_tokens_per_step": sum(r.num_prefill_tokens for r in profiled) / len(profiled)
            if profiled
            else None,
            "decode_tokens_per_step": sum(r.num_decode_tokens for r in profiled) / len(profiled) if profiled else None,
            "page_faults_per_step": _median(faults),
            "seqs_per_step": sum(ph.seqs_per_step) / ph.steps,
            "share": ph.share(),
            "ms_per_step_by_category": {k: ph.by_category[k] / ph.steps / 1000 for k in CATEGORIES},
            # Host-side time outside ops, by where it went (on a device timeline: CPU time, not the device's idle).
            "host_detail_share": {k: v / wall for k, v in sorted(ph.cpu_host_detail.items(), key=lambda kv: -kv[1])},
            "device_idle_share": ph.host_detail.get("device_idle", 0.0) / wall if result.timeline == "device" else None,
            "kv_detail_share": {k: v / wall for k, v in ph.kv_detail.items()},
            "ops_per_step": _median(ph.ops_per_step),
            "view_ops_per_step": _median(ph.view_ops_per_step),
            "kernels_per_step": _median(ph.kernels_per_step),
            "ops_per_step_by_scope": {k: v / ph.steps for k, v in ph.ops_by_scope.items()},
            "ranges_per_step": _median(ph.ranges_per_step),
            "top_ops": ph.top_ops(top),
            "fused_step_ms": ({k: 1000 * statistics.mean(f[k] for f in fused) for k in fused[0]} if fused else None),
        }
    steps = [
        {
            "index": r.index,
            "phase": r.phase,
            "seqs": r.num_seqs,
            "tokens": r.num_tokens,
            "prefill_tokens": r.num_prefill_tokens,
            "decode_tokens": r.num_decode_tokens,
            "wall_ms": r.wall_us / 1000,
        }
        for r in result.records
    ]
    summary = {
        "context": context,
        "categories": list(CATEGORIES),
        "labels": LABELS,
        "phases": phases,
        "steps": steps,
        "launch": {},
        "instrumentation": {
            "instrumented": result.instrumented,
            "missing": result.missing,
            "range_us": result.range_us,
        },
        "expert_load": expert_load_rows(result.expert_load),
        "files": {},
    }
    dec = phases.get("decode")
    if dec:
        kernels = dec["kernels_per_step"]
        n = kernels if kernels is not None else dec["ops_per_step"]
        step_us = 1000 * (dec["unprofiled_ms_per_step"] or dec["ms_per_step"])
        overhead = n * result.launch_us
        summary["launch"] = {
            "counted": "device kernels" if kernels is not None else "aten ops",
            "launches_per_decode_step": n,
            "per_launch_us": result.launch_us,
            "overhead_us_per_decode_step": overhead,
            "share_of_decode_step": overhead / step_us,
            "step_basis": "unprofiled" if dec["unprofiled_ms_per_step"] else "profiled",
        }
        ranges_us = (dec["ranges_per_step"] or 0) * result.range_us
        summary["instrumentation"] |= {
            "ranges_per_decode_step": dec["ranges_per_step"],
            "share_of_decode_step": ranges_us / (1000 * dec["ms_per_step"]),
        }
    summary["hints"] = derive_hints(summary)
    return summary


HOTTEST_EXPERTS = 3


def expert_load_rows(load: dict[str, list[int]]) -> list[dict]:
    """Per MoE layer (router name -> tokens routed to each expert over the profiled run): the busiest expert against
    the mean (imbalance: what an expert-parallel step waits on), the experts nobody picked, the hottest ones."""
    rows = []
    for name, counts in load.items():
        routed = sum(counts)
        mean = routed / len(counts)
        hottest = sorted(range(len(counts)), key=lambda e: (-counts[e], e))[:HOTTEST_EXPERTS]
        rows.append(
            {
                "layer": name,
                "experts": len(counts),
                "routed": routed,
                "max": max(counts),
                "mean": mean,
                "imbalance": max(counts) / mean if routed else None,
                "idle_experts": sum(c == 0 for c in counts),
                "hottest": [[e, counts[e]] for e in hottest],
                "counts": counts,
            }
        )
    return rows


def _format_expert_load(rows: list[dict]) -> list[str]:
    lines = [
        "",
        "expert load (token-to-expert assignments over the profiled run; imbalance = busiest expert / mean)",
        f"  {'router':<36} {'experts':>7} {'routed':>8} {'max':>6} {'mean':>7} {'imbalance':>9} {'idle':>5}  hottest",
    ]
    for r in rows:
        imbalance = f"{r['imbalance']:.2f}x" if r["imbalance"] is not None else "-"
        hottest = ", ".join(f"#{e} {n}" for e, n in r["hottest"])
        lines.append(
            f"  {r['layer'][-36:]:<36} {r['experts']:>7} {r['routed']:>8} {r['max']:>6} {r['mean']:>7.1f} "
            f"{imbalance:>9} {r['idle_experts']:>5}  {hottest}"
        )
    most = max((r["routed"] for r in rows), default=0)
    if len(rows) > 1 and rows[-1]["routed"] < most:
        # (runner/fused_decode.py: out_rows; a per-module forward routes every row in every layer)
        lines.append(
            f"  note: {rows[-1]['layer']} routed {rows[-1]['routed']} assignments against the other layers' {most}: "
            "a prompt step in the fused step takes only the rows whose logits are sampled (each prompt's last "
            "token) through the last layer's MLP, the others need only their K / V; its load is over those rows"
        )
    return lines


def format_report(s: dict) -> str:
    ctx, phases = s["context"], s["phases"]
    names = [p for p in PHASES if p in phases]
    lines = [
        f"infertune profile: {ctx['model']} ({ctx['dtype']}{', ' + ctx['quantization'] if ctx['quantization'] else ''}"
        f", {ctx['device']}, {ctx['torch_threads']} threads) batch {ctx['batch']} x ({ctx['input_len']} in + "
        f"{ctx['output_len']} out), sampling {ctx['sampling']}; {ctx['timeline']} timeline"
    ]
    for p in names:
        ph = phases[p]
        base = f", {ph['unprofiled_ms_per_step']:.2f} unprofiled" if ph["unprofiled_ms_per_step"] else ""
        faults = ph.get("page_faults_per_step")
        faults = f", {faults:,.0f} page faults/step" if faults is not None else ""
        split = ""
        if p == "mixed" and ph.get("prefill_tokens_per_step") is not None:
            split = (
                f" ({ph['prefill_tokens_per_step']:.0f} prefill + {ph['decode_tokens_per_step']:.0f} decode, "
                "prefill chunks run next to decodes)"
            )
        lines.append(
            f"  {p}: {ph['steps']} step(s), {ph['tokens_per_step']:.0f} tokens{split} / "
            f"{ph['seqs_per_step']:.1f} seqs per step, {ph['ms_per_step']:.2f} ms/step profiled{base}{faults}"
        )
    lines += [
        "",
        "time by category (share of step wall time; self time of each op and range goes to exactly one "
        "category, so each column adds up to 100%)",
    ]
    lines.append(f"  {'category':<28}" + "".join(f"{p:>22}" for p in names))
    for cat in CATEGORIES:
        cells = "".join(
            f"{100 * phases[p]['share'][cat]:>9.1f}% {phases[p]['ms_per_step_by_category'][cat]:>7.3f} ms"
            for p in names
        )
        lines.append(f"  {LABELS[cat]:<28}{cells}")
    lines.append(
        f"  {'total (per step)':<28}"
        + "".join(f"{100 * sum(phases[p]['share'].values()):>9.1f}% {phases[p]['ms_per_step']:>7.3f} ms" for p in names)
    )
    for p in names:
        ph = phases[p]
        host = ", ".join(f"{k} {100 * v:.1f}%" for k, v in ph["host_detail_share"].items() if v >= 0.0005)
        kv = ", ".join(f"{k} {100 * v:.1f}%" for k, v in ph["kv_detail_share"].items())
        where = "host-side time outside ops (CPU)" if ph["device_idle_share"] is not None else "host detail"
        lines.append(f"  {p} {where}: {host}" + (f"; KV: {kv}" if kv else ""))
    for p in names:
        split = phases[p].get("fused_step_ms")
        if split:
            total = sum(split.values()) or 1.0
            parts = ", ".join(
                f"{k} {v:.2f} ms ({100 * v / total:.0f}%)" for k, v in sorted(split.items(), key=lambda kv: -kv[1])
            )
            lines.append(f"  {p} fused step (C), {total:.2f} ms a step where it ran: {parts}")
    inst = s["instrumentation"]
    if inst.get("ranges_per_decode_step") is not None:
        lines.append(
            f"  instrumentation: {inst['ranges_per_decode_step']:g} ranges per decode step x "
            f"{inst['range_us']:.1f} us = {100 * inst['share_of_decode_step']:.1f}% of the decode step "
            "(inside python_in_forward)"
        )
    if inst["missing"]:
        lines.append(f"  not instrumented (absent in this engine): {', '.join(inst['missing'])}")
    launch = s["launch"]
    if launch:
        dec = phases["decode"]
        scopes = ", ".join(f"{k} {v:g}" for k, v in sorted(dec["ops_per_step_by_scope"].items(), key=lambda kv: -kv[1]))
        lines += [
            "",
            f"launches: {dec['ops_per_step']:g} aten ops per decode step ({dec['view_ops_per_step']:g} of them "
            f"views / allocations; by scope: {scopes})"
            + (f", {dec['kernels_per_step']:g} device kernels" if dec["kernels_per_step"] is not None else ""),
            f"  one trivial op costs {launch['per_launch_us']:.2f} us here: {launch['launches_per_decode_step']:g} "
            f"{launch['counted']} x {launch['per_launch_us']:.2f} us = "
            f"{launch['overhead_us_per_decode_step'] / 1000:.2f} ms of launch overhead per decode step "
            f"({100 * launch['share_of_decode_step']:.0f}% of the {launch['step_basis']} step)",
        ]
    for p in names:
        lines += [
            "",
            f"top ops by self time ({p}, per step)",
            f"  {'op':<52} {'category':<14} {'ms':>8} {'calls':>7} {'share':>7}",
        ]
        for r in phases[p]["top_ops"]:
            lines.append(
                f"  {r['op'][:52]:<52} {r['category']:<14} {r['self_us_per_step'] / 1000:>8.3f} "
                f"{r['calls_per_step']:>7.1f} {100 * r['share']:>6.1f}%"
            )
    if s.get("expert_load"):
        lines += _format_expert_load(s["expert_load"])
    from infertune.profile.kv_bytes import format_kv_reads  # (imports torch: not when the CLI is built)

    if "decode" in phases:  # (--output-len 1: no decode step, so no decode step's KV reads to report)
        lines += format_kv_reads(s.get("kv_reads") or {})
    else:
        lines += ["", "no decode steps (--output-len 1): the KV-cache reads of a decode step are not measured"]
    lines += ["", "hints"]
    lines += [f"  - {h['text']}" for h in s["hints"]] or ["  none: no category crossed its threshold"]
    for k, v in s["files"].items():
        lines.append(f"{k}: {v}")
    return "\n".join(lines)


def write_trace(result, path: str) -> None:
    """The profiler's Chrome / Perfetto trace, with each step's range renamed to say what the step was."""
    result.prof.export_chrome_trace(path)
    labels = {
        f"infertune::step#{r.index}": f"infertune::step#{r.index} {r.phase} ({r.num_seqs} seqs, "
        f"{r.num_tokens} tokens"
        + (f": {r.num_prefill_tokens} prefill + {r.num_decode_tokens} decode" if r.phase == "mixed" else "")
        + ")"
        for r in result.records
    }
    trace = json.loads(Path(path).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    for e in events:
        if e.get("name") in labels:
            e["name"] = labels[e["name"]]
    Path(path).write_text(json.dumps(trace))


def write_plot(summary: dict, path: str) -> None:
    """A stacked bar per phase: each category's share of the step wall time."""
    plt = _pyplot()
    phases = [p for p in PHASES if p in summary["phases"]]
    fig, ax = plt.subplots(figsize=(7, 5))
    cmap = plt.get_cmap("tab20")
    bottoms = [0.0] * len(phases)
    for i, cat in enumerate(CATEGORIES):
        vals = [100 * summary["phases"][p]["share"][cat] for p in phases]
        ax.bar(phases, vals, bottom=bottoms, color=cmap(i), label=LABELS[cat], width=0.5)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ms = [f"{p}\n{summary['phases'][p]['ms_per_step']:.2f} ms/step" for p in phases]
    ax.set_xticks(range(len(phases)), ms)
    ax.set_ylabel("share of step wall time (%)")
    ax.set_ylim(0, 100)
    ctx = summary["context"]
    quant = f" {ctx['quantization']}" if ctx.get("quantization") else ""
    ax.set_title(
        f"infertune profile: batch {ctx['batch']}, {ctx['input_len']} in + {ctx['output_len']} out, "
        f"{ctx['dtype']}{quant}"
    )
    ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":  # python -m infertune.profile.profile_cmd, until the CLI names it
    parser = argparse.ArgumentParser(prog="infertune profile", description=DESCRIPTION)
    add_arguments(parser)
    sys.exit(run(parser.parse_args()))
