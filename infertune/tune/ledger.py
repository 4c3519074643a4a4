"""`infertune ledger`: the step-by-step optimization table, measured on this machine.

HF transformers generate ("PyTorch native") -> infertune eager, one sequence at a time -> + paged KV and
continuous batching -> + prepacked weights -> + compiled decode (torch.compile) -> + infertune's decode kernels
(fused decode step; replaces torch.compile) -> + INT8 KV -> + W8A16 -> + W8A8 -> + W4A16 -> + tuned batch. Every step
keeps the ones before it (a quantization replaces the one before). On a MoE model the kernels step leaves the MoE layers in PyTorch (route() and the per-expert loop)
and two more steps follow, the seeds' MoE fusions: the fused gating top-k (router kernel), then the grouped expert
GEMM; W8A16 / W4A16 quantize the experts too. On an MLA model the steps up to the kernels keep each head's
decompressed K / V (`mla_cache="decompressed"`), and the seeds' "decompressed cache -> latent cache" step follows them,
with both caches' bytes per token. Steps whose feature is not built are reported as
"not available", never measured or estimated. Lossy steps carry the perplexity change of the step's whole
configuration against the unquantized model (`infertune.evaluate.compare`), where the weights are trained.

Wire it into cli.py with:  led = sub.add_parser("ledger", ...); ledger.add_arguments(led); led.set_defaults(func=ledger.run)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from infertune.files import add_json_flag, emit_json
from infertune.plotting import pyplot, require_matplotlib

DESCRIPTION = (
    "Measure the optimization ledger on this machine: HF transformers generate, then infertune eager, + paged KV "
    "and continuous batching, + prepacked weights, + compiled decode, + decode kernels, + INT8 KV, + W8A16, + W8A8, "
    "+ W4A16, + tuned batch; tokens/s, TTFT, memory, gain per step and cumulative vs HF, and the perplexity "
    "change of lossy steps; --pd adds the P/D split step (2 colocated replicas -> 1 prefill + 1 decode behind the router, "
    "TTFT / TPOT percentiles); --longctx adds the long-context step (full KV -> window + compression policy: KV per "
    "sequence, sequences in a budget, speed, KL against full KV). Markdown table by default; --json / --md / --plot "
    "write files."
)

NOT_AVAILABLE = "not available"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", default=None, help="Hugging Face model folder (default: the built-in demo model)")
    g.add_argument(
        "--preset",
        choices=["small", "386m", "moe", "mla"],
        default=None,
        help="a random-weight model built once by `bench throughput`: small / 386m Llamas, moe = the scaled "
        "Qwen3-30B-A3B, mla = the scaled DeepSeek-V2-Lite (accuracy is then n/a)",
    )
    p.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("/tmp/infertune-bench"),
        help="where --preset models are built, once (default: /tmp/infertune-bench)",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request (default: 64)")
    p.add_argument(
        "--batch", type=int, default=8, help="batch of HF generate and max_num_seqs of the batched steps (default: 8)"
    )
    p.add_argument("--num-prompts", type=int, default=None, help="requests per step (default: 2 x --batch)")
    p.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="largest max_num_seqs the tuned-batch step tries (default: --num-prompts)",
    )
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=["bfloat16", "float32"],
        help="weights and activations of every step; the decode-kernel and MoE-kernel steps need bfloat16 "
        "(default: bfloat16)",
    )
    p.add_argument(
        "--quant-group-size",
        type=int,
        default=None,
        help="W4A16 group size (default: the largest of 32 / 64 / 128 dividing every quantized layer's input)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers row")
    p.add_argument("--no-accuracy", action="store_true", help="skip the perplexity deltas")
    p.add_argument(
        "--accuracy-tokens", type=int, default=4096, help="held-out tokens scored per lossy step (default: 4096)"
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="measure every step in this process (faster; memory is then RSS growth, not each step's "
        "own peak RSS in a fresh process)",
    )
    p.add_argument("--repeats", type=int, default=1, help="timed runs per step, best kept (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    add_json_flag(p, "every figure")
    p.add_argument("--md", type=Path, default=None, metavar="OUT", help="write the Markdown table")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="tokens/s per step (matplotlib)")
    p.add_argument(
        "--pd",
        action="store_true",
        help="then the seeds' P/D split step: the model served as 2 colocated replicas, then as 1 prefill + 1 "
        "decode instance, behind `infertune router`, under long prompts mixed with long outputs: TTFT / TPOT "
        "p50 and p99 (starts 3 server processes per setup, one thread each; minutes; infertune/bench/pd.py)",
    )
    p.add_argument("--pd-num-prompts", type=int, default=16, help="requests of the P/D step (default: 16)")
    p.add_argument(
        "--longctx",
        action="store_true",
        help="then the seeds' long-context step, full KV -> window + compression policy (layers 0-1 in a window of "
        "128, full attention up to --longctx-threshold prompt tokens, SnapKV above): KV per sequence, sequences in "
        "a 1 GiB budget, TTFT and decode tok/s at --longctx-context tokens (a tiny random Llama, fp32), and KL / "
        "top-1 agreement against full KV on the built-in model's held-out text (infertune/bench/longctx.py)",
    )
    p.add_argument(
        "--longctx-context", type=int, default=16384, help="prompt tokens of the long-context step (default: 16384)"
    )
    p.add_argument(
        "--longctx-keep", type=float, default=0.25, help="the share of the prompt SnapKV keeps (default: 0.25)"
    )
    p.add_argument(
        "--longctx-threshold",
        type=int,
        default=4096,
        help="the policy's longest full-attention prompt (default: 4096; `infertune tune --kv-compression` "
        "measures where compression starts to pay)",
    )
    p.add_argument(
        "--longctx-decode", type=int, default=32, help="decode steps timed in the long-context step (default: 32)"
    )
    p.add_argument("--pd-request-rate", type=float, default=0.5, help="their arrival rate, req/s (default: 0.5)")


# (key, label, engine options added by this step, lossy?). None options = not built yet.
STEPS = [
    ("hf", "HF transformers generate (PyTorch native)", None, False),
    ("eager", "infertune eager, one sequence at a time", dict(prepack_weights=False, max_num_seqs=1), False),
    ("batching", "+ paged KV and continuous batching", dict(max_num_seqs="batch"), False),
    ("prepack", "+ prepacked weights", dict(prepack_weights=True), False),
    ("compiled", "+ compiled decode (torch.compile)", dict(compile="on"), False),
    # infertune's own kernels and fused decode step take the place of torch.compile (the two do not combine).
    ("kernels", "+ decode kernels, fused decode step (compile off)", dict(decode_kernels="auto", compile="off"), False),
    # MLA models: the steps before this one keep each head's decompressed K / V (mla_cache="decompressed", the
    # seeds' starting point); this one the latent cache with the absorbed decode (and the fused step, which reads
    # latent rows only; a MoE model's MoE steps follow, with it).
    ("mla_latent", "+ latent MLA cache, absorbed decode (vs decompressed K/V)", dict(mla_cache="latent"), False),
    # MoE models (STEPS_MOE): the kernels step leaves the MoE layers in PyTorch, then the seeds' two MoE fusions.
    ("moe_router", "+ fused gating top-k (router scores, top-k, weights, grouping: one kernel call)", None, False),
    ("moe_experts", "+ grouped expert GEMM (per-expert loop -> one kernel call)", None, False),
    ("moe_fused", "+ MoE layers in the fused decode step (router, top-k, experts: inside its one C call)", None, False),
    ("int8_kv", "+ INT8 KV cache", dict(kv_cache_dtype="int8"), True),
    ("w8a16", "+ W8A16 weights", dict(quantization="w8a16"), True),
    # (the seeds' W8A8: the activations rounded to int8 per token too, int8 x int8 GEMMs; replaces W8A16)
    ("w8a8", "+ W8A8 (int8 activations too, instead of W8A16)", dict(quantization="w8a8"), True),
    ("w4a16", "+ W4A16 weights", dict(quantization="w4a16"), True),
    ("tuned", "+ tuned batch (the tuner's offline pick)", dict(max_num_seqs="tuned"), False),
]


MOE_STEP_OPTIONS = {
    "kernels": dict(decode_kernels="auto", compile="off", moe_kernels="none"),
    "moe_router": dict(moe_kernels="router"),
    "moe_experts": dict(moe_kernels="experts"),
    "moe_fused": dict(moe_kernels="all"),
}
MOE_LABELS = {
    "kernels": "+ decode kernels for the dense stages (MoE router and experts in PyTorch; compile off)",
    "w8a16": "+ W8A16 weights (experts included)",
    "w8a8": "+ W8A8 (int8 activations too, instead of W8A16; experts included)",
    "w4a16": "+ W4A16 weights (experts included)",
}
# The MLA step's cache bytes: the latent rows against the decompressed K / V the steps before it keep.
MLA_NOTE = "latent cache {latent} B/token, against {full} B/token of decompressed K/V before it"


def steps_for(arch) -> list[tuple[str, str, dict | None, bool]]:
    """STEPS as they apply to this model: the MoE steps on a MoE model, the MLA step on an MLA model, each step's
    label and options adjusted to the model (the others' rows would measure nothing new)."""
    out = []
    for key, label, adds, lossy in STEPS:
        if key in ("moe_router", "moe_experts", "moe_fused") and arch.moe is None:
            continue
        if key == "mla_latent" and arch.mla is None:
            continue
        if arch.moe is not None:
            adds = MOE_STEP_OPTIONS.get(key, adds)
            label = MOE_LABELS.get(key, label)
        if key == "eager" and arch.mla is not None:  # (until the MLA step: each head's K / V)
            adds = dict(adds, mla_cache="decompressed")
        out.append((key, label, adds, lossy))
    return out


def quant_group_size(arch, wanted: int | None) -> int:
    """W4A16's group size: `wanted`, or the largest of QUANT_GROUP_SIZES up to 128 that divides every quantized
    layer's input width (a tiny test model's 64-wide layers take 64)."""
    from infertune.config import QUANT_GROUP_SIZES

    if wanted is not None:
        return wanted
    m, moe = arch.mla, arch.moe
    # the input widths: o_proj's (heads x v_head_dim under MLA), the MLP's and experts', MLA's q_b / kv_b / q_proj
    widths = [
        arch.hidden_size,
        arch.intermediate_size,
        arch.num_attention_heads * (m.v_head_dim if m else arch.head_dim),
    ]
    widths += [moe.intermediate_size, moe.shared_intermediate_size] if moe is not None else []
    widths += [m.kv_lora_rank, m.q_lora_rank or arch.hidden_size] if m is not None else []
    fits = [g for g in QUANT_GROUP_SIZES if g <= 128 and all(w % g == 0 for w in widths if w)]
    return max(fits) if fits else 128


def mla_note(arch, elem: int) -> str:
    m = arch.mla
    latent = arch.num_hidden_layers * m.cache_width * elem
    full = (
        arch.num_hidden_layers
        * arch.num_attention_heads
        * (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim)
        * elem
    )
    return MLA_NOTE.format(latent=latent, full=full)


def resolve_model(args) -> tuple[str | None, str, bool]:
    """(model argument for LLM, folder for HF, trained weights?)"""
    from infertune.config import default_model_path

    if args.preset:
        from infertune.bench.offline import ensure_model

        return str(ensure_model(args.preset, args.cache_dir)), str(ensure_model(args.preset, args.cache_dir)), False
    if args.model:
        if not (Path(args.model) / "config.json").is_file():
            raise ValueError(f"--model {args.model}: not a Hugging Face model folder (no config.json)")
        return args.model, args.model, True
    return None, default_model_path(), True


def accuracy_delta(model: str | None, options: dict, args) -> dict:
    """Perplexity of the step's lossy configuration vs the same model unquantized with a model-dtype KV cache."""
    from infertune.config import default_model_path
    from infertune.evaluate import compare

    path = model or default_model_path()
    # (the step's own group size: a W4A16 step on a model whose widths 128 does not divide has picked a smaller one)
    cand = {k: options[k] for k in ("kv_cache_dtype", "quant_group_size") if options.get(k, "auto") != "auto"}
    # Perplexity scoring runs each window as one prefill, which attends to the fresh K/V rather than reading the
    # cache back, so an INT8 KV cache shows up only in decoding: the greedy prefix (tokens decoded identically
    # to the reference from a few prompts) covers it.
    rep = compare(
        path,
        reference=path,
        quantization=options.get("quantization"),
        max_tokens=args.accuracy_tokens,
        num_prompts=4,
        greedy_tokens=32,
        engine_options=dict(dtype=args.dtype),
        candidate_options=cand,
    )
    return dict(
        perplexity=rep.perplexity,
        ref_perplexity=rep.ref_perplexity,
        perplexity_change=rep.perplexity_change,
        kl_mean=rep.kl_mean,
        top1_agreement=rep.top1_agreement,
        tokens=rep.num_tokens,
        greedy_prefix_mean=rep.greedy_prefix_mean,
        greedy_tokens=rep.greedy_tokens,
    )


def build_ledger(args, progress: bool = True) -> dict:
    from tqdm import tqdm

    from infertune.config import ArchConfig
    from infertune.tune import measure
    from infertune.tune.command import powers_of_two, sweep
    from infertune.tune.recommend import recommend

    model, hf_dir, trained = resolve_model(args)
    arch = ArchConfig.from_model_dir(hf_dir)  # (before anything else reads config.json: its errors are clear ones)
    vocab = arch.vocab_size
    group_size = quant_group_size(arch, getattr(args, "quant_group_size", None))
    steps = steps_for(arch)
    from infertune.bench.offline import make_prompts

    n = 2 * args.batch if args.num_prompts is None else args.num_prompts
    prompts = make_prompts(args.seed, n, 0, args.input_len, vocab)
    warm = make_prompts(args.seed, 1, -1, min(args.input_len, 8), vocab)
    outs = [args.output_len] * n
    max_len = args.input_len + args.output_len
    current = dict(
        dtype=args.dtype,
        max_model_len=max_len,
        enable_prefix_caching=False,
        prepack_weights=False,
        max_num_seqs=1,
        compile="off",
        decode_kernels="off",
    )

    def call(fn_name: str, **kwargs) -> dict:
        if args.in_process:
            return getattr(measure, fn_name)(**kwargs)
        return measure.run_isolated(fn_name, **kwargs)

    rows = []
    bar = tqdm(steps, desc="ledger", unit="step", disable=not progress, file=sys.stderr)
    for key, label, adds, lossy in bar:
        bar.set_postfix_str(key)
        row = dict(step=key, label=label, lossy=lossy)
        if key == "hf":
            if args.no_hf:
                row.update(status="skipped")
            else:
                row.update(
                    call(
                        "measure_hf",
                        model_dir=hf_dir,
                        dtype=args.dtype,
                        prompts=prompts,
                        output_len=args.output_len,
                        batch=args.batch,
                    )
                )
                row["options"] = dict(batch=args.batch, dtype=args.dtype, attn_implementation="sdpa")
            rows.append(row)
            continue
        if adds is None:
            row.update(status=NOT_AVAILABLE, note="not built")
            rows.append(row)
            continue
        if key == "mla_latent":
            row["note"] = mla_note(arch, 2 if args.dtype == "bfloat16" else 4)
        if key.startswith("moe_") and not current.get("decode_kernels_ran"):
            row.update(status=NOT_AVAILABLE, note="the decode kernels did not run (see the kernels row)")
            rows.append(row)
            continue
        step_opts = {k: v for k, v in current.items() if k != "decode_kernels_ran"}
        for k, v in adds.items():
            step_opts[k] = args.batch if v == "batch" else v
        if step_opts.get("quantization") == "w4a16":
            step_opts["quant_group_size"] = group_size
        if key == "tuned":
            limit = n if args.max_batch is None else args.max_batch
            tried = sweep(
                model,
                {k: v for k, v in step_opts.items() if k not in ("max_num_seqs", "max_num_batched_tokens")},
                powers_of_two(limit),
                [2048],
                prompts,
                outs,
                progress=False,
            )
            pick = recommend(tried).offline
            if pick is None:
                row.update(status="error", error="every tuned setting failed")
                rows.append(row)
                continue
            step_opts["max_num_seqs"] = pick["max_num_seqs"]
            row["tuner_rows"] = [
                dict(max_num_seqs=r["max_num_seqs"], status=r["status"], output_tok_s=r.get("output_tok_s"))
                for r in tried
            ]
        row.update(
            call(
                "measure_infertune",
                model=model,
                options=step_opts,
                prompts=prompts,
                output_lens=outs,
                warmup_prompts=warm,
                repeats=args.repeats,
            )
        )
        row["options"] = step_opts
        if key == "kernels" and row["status"] == "ok" and row.get("decode_kernels") is None:
            # (the row's label says kernels: say they did not run, and why, rather than time torch's path under it)
            row["note"] = (
                f"the decode kernels did not run: they are bf16 kernels and --dtype is {args.dtype}"
                if args.dtype != "bfloat16"
                else "the decode kernels did not run on this machine (infertune doctor says why)"
            )
        if row["status"] == "ok":
            current = dict(step_opts, decode_kernels_ran=row.get("decode_kernels") is not None)
        if lossy and row["status"] == "ok":
            if not trained:
                row["accuracy"] = "n/a (random weights)"
            elif args.no_accuracy:
                row["accuracy"] = "skipped"
            else:
                row["accuracy"] = accuracy_delta(model, step_opts, args)
        rows.append(row)
    # Gains: over the previous measured row, and cumulative over HF.
    prev = None
    hf = next((r for r in rows if r["step"] == "hf" and r.get("status") == "ok"), None)
    for r in rows:
        if r.get("status") != "ok":
            continue
        r["gain_vs_previous"] = r["output_tok_s"] / prev["output_tok_s"] if prev else None
        r["cumulative_vs_hf"] = r["output_tok_s"] / hf["output_tok_s"] if hf else None
        prev = r
    return dict(
        model=model or "built-in demo model",
        hf_model_dir=hf_dir,
        trained_weights=trained,
        isolated=not args.in_process,
        workload=dict(
            requests=n,
            input_len=args.input_len,
            output_len=args.output_len,
            batch=args.batch,
            dtype=args.dtype,
            greedy=True,
            ignore_eos=True,
        ),
        steps=rows,
    )


def _acc_text(r: dict) -> str:
    acc = r.get("accuracy")
    if not r.get("lossy"):
        return "lossless"
    if acc is None:
        return "–"
    if isinstance(acc, str):
        return acc
    text = f"ppl {acc['ref_perplexity']:.3f} -> {acc['perplexity']:.3f} ({acc['perplexity_change'] * 100:+.2f} %)"
    if acc.get("greedy_prefix_mean") is not None:
        text += f"; greedy prefix {acc['greedy_prefix_mean']:.1f}/{acc['greedy_tokens']}"
    return text


def run_context(args) -> dict:
    """Where and how the figures were measured: the CPU (with its core and thread counts and the versions) and the
    command that reproduces the table (a ledger said neither)."""
    import os
    import shlex

    import torch

    from infertune.bench.offline import cpu_model, environment_line

    threads = torch.get_num_threads()
    ctx: dict = dict(
        machine=dict(cpu=cpu_model(), cpus=os.cpu_count(), threads=threads, environment=environment_line(threads))
    )
    argv = getattr(args, "argv", None)  # (set by cli.main: the command line as typed)
    if argv:
        ctx["command"] = "infertune " + shlex.join(argv)
    return ctx


def render_markdown(doc: dict) -> str:
    w = doc["workload"]
    isolated = doc.get("isolated", False)
    mem_label = "peak RSS MiB" if isolated else "RSS +MiB"
    lines = [
        f"Model: {doc['model']}. Workload: {w['requests']} requests of {w['input_len']} prompt + {w['output_len']} "
        f"generated tokens, greedy, {w['dtype']}, batch {w['batch']}. Each step keeps the ones above it.",
        *([f"Measured on: {doc['machine']['environment']}."] if doc.get("machine") else []),
        *([f"Command: `{doc['command']}`"] if doc.get("command") else []),
        "",
        f"| step | tokens/s | TTFT p50 ms | memory (KV MiB / {mem_label}) | gain vs previous | cumulative vs HF | "
        "accuracy |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for r in doc["steps"]:
        st = r.get("status")
        if st != "ok":
            what = {"oom": "OOM", "error": "failed", "skipped": "skipped"}.get(st, st)
            detail = r.get("note") or r.get("error") or ""
            lines.append(f"| {r['label']} | {what} | | | | | {detail[:100]} |")
            continue
        kv = "–" if r.get("kv_cache_bytes") is None else f"{r['kv_cache_bytes'] / 2**20:.2f}"
        gain = "–" if r.get("gain_vs_previous") is None else f"{r['gain_vs_previous']:.2f}x"
        cum = "–" if r.get("cumulative_vs_hf") is None else f"{r['cumulative_vs_hf']:.2f}x"
        label = r["label"] + (f" (max_num_seqs={r['options']['max_num_seqs']})" if r["step"] == "tuned" else "")
        ttft = "–" if r.get("ttft_p50_s") is None else f"{r['ttft_p50_s'] * 1e3:.1f}"
        acc = "; ".join(t for t in (_acc_text(r), r.get("note") or "") if t)  # (the MLA step's cache bytes)
        lines.append(
            f"| {label} | {r['output_tok_s']:.1f} | {ttft} | {kv} / {r['peak_rss_mib' if isolated else 'rss_growth_mib']:.0f} | {gain} | {cum} | "
            f"{acc} |"
        )
    memory_note = (
        "the peak RSS of the fresh process that ran the step (Python and torch imports included; "
        "transformers where the step uses it: HF generate, and an engine whose tokenizer folder needs "
        "AutoTokenizer)"
        if isolated
        else "the growth of this process's RSS over load + "
        "generate (one process for all steps, so memory an earlier step freed and this one reused is not "
        "counted)"
    )
    lines += [
        "",
        "TTFT is per request from the submission of the whole workload (queueing included). Memory: the "
        f"engine's KV-cache allocation, and {memory_note}. Accuracy: perplexity of the "
        "step's whole configuration vs the unquantized model on held-out text (prefill scoring, which does not "
        "read the KV cache back, so INT8 KV shows in the greedy prefix: tokens decoded identically to the "
        "reference out of N). Figures on a shared machine move between runs; use --repeats for steadier ones.",
    ]
    return "\n".join(lines)


def pd_split(args) -> tuple[dict, str]:
    """The seeds' "P/D split" step (colocated -> 1 prefill + 1 decode behind the router): {setup: bench serve's
    summary} and its Markdown, with the engine's default options on every instance."""
    from infertune.bench.pd import Workload, compare, render
    from infertune.config import ArchConfig

    _, hf_dir, _ = resolve_model(args)
    max_len = min(ArchConfig.from_model_dir(hf_dir).max_position_embeddings, 4096)
    w = Workload(args.pd_num_prompts, args.pd_request_rate, 4 * args.input_len, 16, args.output_len, 4)
    flags = ["--model", hf_dir, "--dtype", args.dtype, "--max-model-len", str(max_len)]
    results = compare(["--max-num-seqs", str(max(args.batch, 2)), *flags], w, log=lambda m: print(m, file=sys.stderr))
    head = (
        f"P/D split: {w.num_prompts} requests at {w.request_rate:g}/s alternating {w.long_input} prompt words + "
        f"{w.short_output} tokens with {w.short_input} + {w.long_output}, each instance one thread, engine defaults."
    )
    return results, head + "\n\n" + render(results)


def longctx_step(args, log=None) -> tuple[dict, str]:
    """The seeds' step "full KV -> window + compression policy" on a long-context workload: {"speed": rows of full
    and the policy, "accuracy": the policy's KL / top-1 against full KV} and its Markdown."""
    from infertune.bench import longctx

    log = log or (lambda m: print(m, file=sys.stderr))
    s = longctx.Settings(
        contexts=[args.longctx_context],
        decode=args.longctx_decode,
        keep=args.longctx_keep,
        threshold=args.longctx_threshold,
        acc_windows=4,
    )
    s.check()
    policy = longctx.seeds_policy(s.keep, s.threshold)
    path = longctx.model_path(args.cache_dir, s)
    doc: dict = {"speed": longctx.speed_rows(path, s, {"full": None, "policy": policy}, log=log, warmup=False)}
    # On the built-in model's 768-token spans the threshold is scaled down so that the policy compresses there.
    acc_policy = longctx.seeds_policy(s.keep, min(s.threshold, s.acc_prompt // 2))
    if args.no_accuracy:
        doc["accuracy"] = []
    else:
        doc["accuracy"] = longctx.accuracy_rows(s, {"policy": acc_policy}, log=log)
    full, pol = (next(r for r in doc["speed"] if r["config"] == c) for c in ("full", "policy"))
    acc = doc["accuracy"][0] if doc["accuracy"] else None
    kl, top1 = (f"{acc['kl']:.4f}", f"{acc['top1']:.3f}") if acc else ("skipped", "skipped")
    doc.update(context=s.contexts[0], policy=policy, accuracy_policy=acc_policy)
    lines = [
        f"Long-context step: one sequence of {s.contexts[0]} prompt tokens + {s.decode} decoded, a tiny random Llama "
        f"({s.layers} layers, fp32, batch 1); policy = {json.dumps(policy)}; sequences in a {s.budget_mib:g} MiB KV "
        f"budget. Accuracy: the built-in model on held-out text, {s.acc_prompt}-token prompts, the policy's "
        f"threshold scaled to {acc_policy['policy'][1]['max_length']} tokens.",
        "",
        "| step | KV / sequence | sequences in budget | TTFT | decode tok/s | KL(full ‖ step), nats | top-1 agreement |",
        "|---|---|---|---|---|---|---|",
        f"| full KV | {full['kv'] / 2**20:.2f} MiB | {full['seqs']} | {full['ttft']:.2f} s | {full['tok_s']:.1f} | 0 | 1 |",
        f"| + window + compression policy | {pol['kv'] / 2**20:.2f} MiB | {pol['seqs']} | {pol['ttft']:.2f} s "
        f"| {pol['tok_s']:.1f} | {kl} | {top1} |",
        "",
        f"Gain: {full['kv'] / pol['kv']:.1f}x the sequences in the same budget, {pol['tok_s'] / full['tok_s']:.2f}x "
        f"decode tok/s, TTFT {pol['ttft'] / full['ttft']:.2f}x.",
    ]
    return doc, "\n".join(lines)


def write_plot(doc: dict, path: Path) -> None:
    plt = pyplot()
    rows = doc["steps"]
    fig, ax = plt.subplots(figsize=(10, 4))
    vals = [r["output_tok_s"] if r.get("status") == "ok" else 0 for r in rows]
    ax.bar(range(len(rows)), vals, color=["C0" if r.get("status") == "ok" else "lightgray" for r in rows])
    ax.set_xticks(range(len(rows)), [r["step"] + ("\n(n/a)" if r.get("status") != "ok" else "") for r in rows])
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"infertune ledger: {doc['model']}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def check_values(args) -> None:
    """The other numbers, checked before the first step (0 for --num-prompts / --max-batch stood for the default
    silently, a negative one was an IndexError, --repeats 0 timed nothing, a bad group size, --accuracy-tokens or
    P/D setting failed its step after the others had run)."""
    from infertune.config import QUANT_GROUP_SIZES

    for flag in ("num_prompts", "max_batch", "repeats"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    group = getattr(args, "quant_group_size", None)
    if group is not None and group not in QUANT_GROUP_SIZES:
        raise ValueError(f"--quant-group-size must be one of {', '.join(map(str, QUANT_GROUP_SIZES))}, got {group}")
    if not getattr(args, "no_accuracy", False) and args.accuracy_tokens < 2:
        raise ValueError(f"--accuracy-tokens must be >= 2 (or give --no-accuracy), got {args.accuracy_tokens}")
    if getattr(args, "longctx", False):  # (the long-context settings' own errors said "decode=0", not the flag)
        if args.longctx_context < 1:
            raise ValueError(f"--longctx-context must be >= 1, got {args.longctx_context}")
        if args.longctx_decode < 3:
            raise ValueError(f"--longctx-decode must be >= 3 (the first two are not timed), got {args.longctx_decode}")
        if not 0 < args.longctx_keep < 1:
            raise ValueError(f"--longctx-keep must lie in (0, 1), got {args.longctx_keep}")
        if args.longctx_threshold < 1:
            raise ValueError(f"--longctx-threshold must be >= 1, got {args.longctx_threshold}")
    if getattr(args, "pd", False):
        if args.pd_num_prompts < 1:
            raise ValueError(f"--pd-num-prompts must be >= 1, got {args.pd_num_prompts}")
        if not args.pd_request_rate > 0:
            raise ValueError(f"--pd-request-rate must be > 0, got {args.pd_request_rate}")


def run(args: argparse.Namespace) -> int:
    if min(args.input_len, args.output_len, args.batch) < 1:
        raise ValueError("--input-len, --output-len and --batch must be positive")
    check_values(args)
    if getattr(args, "longctx", False):  # a bad long-context setting fails before the other steps run
        from infertune.bench.longctx import Settings

        Settings(
            [args.longctx_context], decode=args.longctx_decode, keep=args.longctx_keep, threshold=args.longctx_threshold
        ).check()
    if args.plot is not None:
        require_matplotlib()
    from infertune.files import check_writable

    for flag in ("md", "json", "plot"):  # (a path that cannot be written: said now, not after every step ran)
        check_writable(f"--{flag}", getattr(args, flag, None), make_parents=True)
    doc = build_ledger(args, progress=sys.stderr.isatty())  # (no bar's carriage-return frames in a log)
    doc.update(run_context(args))
    md = render_markdown(doc)
    if getattr(args, "pd", False):
        doc["pd_split"], text = pd_split(args)
        md += "\n\n" + text
    if getattr(args, "longctx", False):
        doc["longctx"], text = longctx_step(args)
        md += "\n\n" + text
    print(md)
    if args.md is not None:
        args.md.parent.mkdir(parents=True, exist_ok=True)
        args.md.write_text(md + "\n")
    emit_json(args.json, doc, indent=2)
    if args.plot is not None:
        write_plot(doc, args.plot)
    failed = [r for r in doc["steps"] if r.get("status") in ("error", "oom")]
    return 1 if failed else 0
