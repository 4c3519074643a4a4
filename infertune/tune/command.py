"""`infertune tune`: sweep max_num_seqs (powers of two) x max_num_batched_tokens on a workload, measure
throughput, TTFT, TPOT and memory per setting, and recommend one config for online serving (the highest
throughput meeting the SLO) and one for offline throughput (the highest tok/s).

Wire it into cli.py with:  tune = sub.add_parser("tune", ...); command.add_arguments(tune); tune.set_defaults(func=command.run)
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from infertune.files import add_json_flag, emit_json, json_to_stdout
from infertune.plotting import pyplot, require_matplotlib
from infertune.tune.recommend import format_slo, knee, parse_slo, recommend, series_key, slo_violations

DESCRIPTION = (
    "Sweep max_num_seqs over powers of two up to --max-batch (and max_num_batched_tokens over a few values) on a "
    "workload, measure output tok/s, TTFT and TPOT percentiles and memory per setting, print the batch table "
    "(marking OOM and where throughput stops rising), and recommend an online config (max throughput under --slo) "
    "and an offline one (max tok/s). --out-config writes engine options that LLM(**config) accepts."
)


def powers_of_two(limit: int) -> list[int]:
    out, b = [], 1
    while b <= limit:
        out.append(b)
        b *= 2
    if out[-1] != limit:
        out.append(limit)
    return out


def _int_list(text: str) -> list[int]:
    try:
        vals = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not vals or vals[0] < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers")
    return vals


def _choice_list(*choices: str, numbers: bool = False):
    def parse(text: str) -> list[str]:
        vals = [x.strip() for x in text.split(",") if x.strip()]
        bad = [v for v in vals if v not in choices and not (numbers and v.isdigit() and int(v) > 0)]
        if not vals or bad:
            allowed = ", ".join(choices) + (", or positive integers" if numbers else "")
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {allowed}")
        return list(dict.fromkeys(vals))

    return parse


def variants(args) -> list[dict]:
    """The product of the swept KV dtypes, quantizations and dynamic-batch caps, as engine options."""
    out = []
    for kv in args.kv_cache_dtype:
        for q in args.quantization:
            for cap in args.max_running_tokens:
                out.append(
                    dict(
                        kv_cache_dtype=kv,
                        quantization=None if q == "none" else q,
                        max_running_tokens=None if cap == "none" else int(cap),
                        **({"quant_group_size": args.quant_group_size} if q == "w4a16" else {}),
                    )
                )
    return out


def variant_label(options: dict) -> str:
    parts = []
    if options.get("kv_cache_dtype", "auto") != "auto":
        parts.append(f"kv {options['kv_cache_dtype']}")
    if options.get("quantization"):
        parts.append(options["quantization"])
    if options.get("max_running_tokens"):
        parts.append(f"dynamic <= {options['max_running_tokens']} tok")
    return ", ".join(parts)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from infertune.config import engine_choices  # the engine options' declared values
    from infertune.config import engine_option_kwargs as option

    kv_dtypes, quants = engine_choices("kv_cache_dtype"), ("none", *engine_choices("quantization"))
    p.add_argument("--model", **option("model"))
    p.add_argument(
        "--slo",
        default=None,
        metavar="TERMS",
        help="latency SLO for the online pick, e.g. ttft_p90=100ms,tpot_p90=50ms (metrics: ttft/tpot "
        "p50/p90/p99; units ms, s, us; bare numbers are ms)",
    )
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request (default: 128)")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request (default: 64)")
    p.add_argument(
        "--workload",
        type=Path,
        default=None,
        metavar="FILE.jsonl",
        help='one request a line: {"input_len": N, "output_len": M} or {"prompt_token_ids": [...], '
        '"output_len": M}; overrides --input-len / --output-len',
    )
    p.add_argument("--max-batch", type=int, default=32, help="largest max_num_seqs tried (default: 32)")
    p.add_argument(
        "--batched-tokens",
        type=_int_list,
        default=[512, 2048],
        metavar="T[,T...]",
        help="max_num_batched_tokens values tried (default: 512,2048)",
    )
    p.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help="requests per setting (default: 2 x --max-batch, or the workload file's count)",
    )
    p.add_argument("--dtype", **option("dtype", default="bfloat16"))
    p.add_argument(
        "--kv-cache-dtype",
        type=_choice_list(*kv_dtypes),
        default=["auto"],
        metavar="D[,D...]",
        help=f"KV-cache dtypes to try: {', '.join(kv_dtypes)} (default: auto)",
    )
    p.add_argument(
        "--quantization",
        type=_choice_list(*quants),
        default=["none"],
        metavar="Q[,Q...]",
        help=f"weight quantizations to try: {', '.join(quants)} (default: none)",
    )
    p.add_argument("--quant-group-size", **option("quant_group_size"))
    p.add_argument(
        "--max-running-tokens",
        type=_choice_list("none", numbers=True),
        default=["none"],
        metavar="N[,N...]",
        help="dynamic batch by input length: caps on the running sequences' summed "
        "lengths to try, and 'none' for no cap (default: none)",
    )
    p.add_argument(
        "--kv-cache-memory-bytes",
        **option(
            "kv_cache_memory_bytes",
            help="fixed KV budget in bytes (8G, 512Mi, ...) for every setting; a setting whose "
            "budget cannot hold one full sequence is an OOM row (default: the engine's default, sized to max_num_seqs)",
        ),
    )
    p.add_argument("--repeats", type=int, default=1, help="timed runs per setting, best kept (default: 1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    p.add_argument(
        "--config-for",
        choices=["online", "offline"],
        default="online",
        help="which pick --out-config holds (default: online; offline when no row meets the SLO)",
    )
    p.add_argument("--out-config", type=Path, default=None, metavar="OUT.json", help="write the picked engine options")
    p.add_argument(
        "--plot", type=Path, default=None, metavar="OUT.png", help="throughput and TTFT vs batch (matplotlib)"
    )
    add_json_flag(p, "the rows and picks")
    p.add_argument(
        "--kv-compression",
        metavar="JSON",
        **option(
            "kv_compression",
            help='a press, e.g. \'{"press": "snapkv", "compression_ratio": 0.75}\': time one request per '
            "--kv-threshold-lengths with and without it and write the policy (full up to the length where it stops "
            "paying, the press above) into the configs (default: off)",
        ),
    )
    p.add_argument(
        "--kv-threshold-lengths",
        type=_int_list,
        default=[512, 1024, 2048, 4096],
        metavar="N[,N...]",
        help="prompt lengths timed for --kv-compression (default: 512,1024,2048,4096)",
    )


def load_workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    """(prompt token ids, output lengths) of the workload, seeded."""
    rng = random.Random(args.seed)
    high = max(2, vocab - 8)  # avoid the special ids at the top of small vocabularies
    if args.workload is not None:
        prompts, outs = [], []
        for n, line in enumerate(args.workload.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                ids = item.get("prompt_token_ids") or [rng.randrange(high) for _ in range(int(item["input_len"]))]
                out = int(item.get("output_len", item.get("max_tokens", args.output_len)))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f'{args.workload}:{n}: expected {{"input_len": N, "output_len": M}}: {e}') from None
            prompts.append([int(x) for x in ids])
            outs.append(out)
        if not prompts:
            raise ValueError(f"{args.workload} holds no requests")
        if args.num_prompts:
            prompts, outs = (
                (prompts * args.num_prompts)[: args.num_prompts],
                (outs * args.num_prompts)[: args.num_prompts],
            )
        return prompts, outs
    n = args.num_prompts or 2 * args.max_batch
    return [[rng.randrange(high) for _ in range(args.input_len)] for _ in range(n)], [args.output_len] * n


def model_vocab(model: str | None) -> tuple[str | None, int]:
    """(the model folder as an absolute path, None for the demo model; its vocabulary size), the folder checked as
    the engine reads it (an architecture it does not run, a config.json it cannot parse: one clear error before the
    sweep, not a failed row for every setting)."""
    from infertune.config import ArchConfig, default_model_path

    arch = ArchConfig.from_model_dir(model or default_model_path())
    return (str(Path(model).resolve()) if model is not None else None), arch.vocab_size


def sweep(
    model: str | None,
    base: dict,
    batches: list[int],
    token_values: list[int],
    prompts,
    output_lens,
    repeats: int = 1,
    progress: bool = True,
    extra: list[dict] | None = None,
) -> list[dict]:
    """Measure every (variant, max_num_batched_tokens, max_num_seqs) setting; OOM / failed ones become rows too."""
    from tqdm import tqdm

    from infertune.tune.measure import measure_infertune

    settings = [(v, b, t) for v in (extra or [{}]) for t in token_values for b in batches]
    warm = [prompts[0][: max(1, min(8, len(prompts[0])))]]
    _warm_the_process(model, base)
    rows = []
    bar = tqdm(settings, desc="tune", unit="setting", disable=not progress, file=sys.stderr)
    for v, b, t in bar:
        label = variant_label(v)
        bar.set_postfix_str(f"{label + ' ' if label else ''}max_num_seqs={b} max_num_batched_tokens={t}")
        options = {
            k: val for k, val in dict(base, **v, max_num_seqs=b, max_num_batched_tokens=t).items() if val is not None
        }
        row = measure_infertune(model, options, prompts, output_lens, warmup_prompts=warm, repeats=repeats)
        row.update(max_num_seqs=b, max_num_batched_tokens=t, variant=label)
        rows.append(row)
    return rows


def _warm_the_process(model: str | None, base: dict) -> None:
    """Build (and drop) one engine before the first row: the process's one-time growth (libraries, the tokenizer's
    and the kernels' first use, ~70 MiB on the demo model) would otherwise count in the first row's RSS alone."""
    import gc

    from infertune import LLM

    try:
        llm = LLM(model, **{**{k: v for k, v in base.items() if v is not None}, "max_num_seqs": 1})
        llm.shutdown()
        del llm
    except Exception:  # noqa: BLE001  (the rows say what fails; this is only the warm-up)
        pass
    gc.collect()


def engine_config(model: str | None, row: dict) -> dict:
    """Engine options of a measured row, as LLM(**config) takes them (prefix caching and max_model_len back to their
    defaults: the sweep bounds max_model_len by its own workload's longest request, which says nothing of the
    prompts the config will be served)."""
    skip = ("enable_prefix_caching", "max_model_len")
    cfg = {"model": model, **{k: v for k, v in row["options"].items() if k not in skip}}
    return {k: v for k, v in cfg.items() if v is not None or k == "model"}


def _ms(v) -> str:
    return "–" if v is None else f"{v * 1e3:.1f}"


def render_table(rows: list[dict], slo: dict) -> str:
    knees = knee(rows)
    lines = [
        "| variant | batch | batched tokens | tokens/s | TTFT p50 ms | TTFT p90 ms | TPOT p50 ms | TPOT p90 ms | "
        "memory (KV MiB / RSS +MiB) | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        variant = r.get("variant") or "base"
        if r["status"] != "ok":
            label = "OOM" if r["status"] == "oom" else "failed"
            lines.append(
                f"| {variant} | {r['max_num_seqs']} | {r['max_num_batched_tokens']} | {label} | | | | | | "
                f"{r.get('error', '')[:120]} |"
            )
            continue
        notes = []
        if knees.get(series_key(r)) == r["max_num_seqs"]:
            notes.append("throughput stops rising here")
        if slo:
            v = slo_violations(r, slo)
            notes.append("meets SLO" if not v else "misses SLO: " + "; ".join(v))
        lines.append(
            f"| {variant} | {r['max_num_seqs']} | {r['max_num_batched_tokens']} | {r['output_tok_s']:.1f} | "
            f"{_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p90_s'])} | {_ms(r['tpot_p50_s'])} | {_ms(r['tpot_p90_s'])} | "
            f"{r['kv_cache_bytes'] / 2**20:.1f} / {r['rss_growth_mib']:.0f} | {', '.join(notes)} |"
        )
    return "\n".join(lines)


def write_plot(rows: list[dict], path: Path, title: str) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for key in dict.fromkeys(series_key(r) for r in rows):
        ok = [r for r in rows if series_key(r) == key and r["status"] == "ok"]
        if not ok:
            continue
        label = ", ".join(
            x for x in ((ok[0].get("variant") or ""), f"{ok[0]['max_num_batched_tokens']} tokens/step") if x
        )
        ax1.plot([r["max_num_seqs"] for r in ok], [r["output_tok_s"] for r in ok], marker="o", label=label)
        ax2.plot([r["max_num_seqs"] for r in ok], [r["ttft_p90_s"] * 1e3 for r in ok], marker="o", label=label)
    for ax, ylabel in ((ax1, "output tokens/s"), (ax2, "TTFT p90 ms")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("max_num_seqs")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    ax1.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    slo = parse_slo(args.slo)
    if args.max_batch < 1:
        raise ValueError("--max-batch must be at least 1")
    from infertune.files import check_writable

    check_writable("--out-config", args.out_config, make_parents=True)
    check_writable("--plot", args.plot, make_parents=True)
    check_writable("--json", args.json, make_parents=True)
    for flag in ("input_len", "output_len", "num_prompts", "repeats"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least 1, not {value}")
    if args.plot is not None:  # fail before the sweep, not after it
        require_matplotlib()
    if args.kv_compression is not None:  # a bad press fails before the sweep
        from infertune.kv_compression import KVCompressionConfig

        KVCompressionConfig.from_dict(args.kv_compression)
    model, vocab = model_vocab(args.model)
    if args.kv_compression is not None:  # (the threshold's lengths must fit the model: said now, not after the sweep)
        from infertune.config import ArchConfig, default_model_path

        positions = ArchConfig.from_model_dir(model or default_model_path()).max_position_embeddings
        longest = max(args.kv_threshold_lengths) + args.output_len
        if longest > positions:
            raise ValueError(
                f"--kv-threshold-lengths up to {max(args.kv_threshold_lengths)} plus --output-len {args.output_len} "
                f"need {longest} positions, more than this model's {positions}; give shorter --kv-threshold-lengths"
            )
    prompts, output_lens = load_workload(args, vocab)
    max_len = max(len(p) + o for p, o in zip(prompts, output_lens))
    base = dict(
        dtype=args.dtype,
        max_model_len=max_len,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        enable_prefix_caching=False,
    )
    base = {k: v for k, v in base.items() if v is not None}
    rows = sweep(
        model,
        base,
        powers_of_two(args.max_batch),
        args.batched_tokens,
        prompts,
        output_lens,
        args.repeats,
        extra=variants(args),
        progress=sys.stderr.isatty(),  # (no bar's carriage-return frames in a log)
    )
    rec = recommend(rows, slo)
    picks = {"online": rec.online, "offline": rec.offline}
    configs = {k: engine_config(model, r) if r else None for k, r in picks.items()}
    chosen = args.config_for if configs[args.config_for] else "offline"
    kv_rows = kv_said = None
    if args.kv_compression is not None:  # where the press starts to pay: its policy joins the configs
        from infertune.tune import kv_threshold

        kv_base = {k: v for k, v in base.items() if k != "max_model_len"}
        kv_rows = kv_threshold.measure(
            model, kv_base, args.kv_compression, args.kv_threshold_lengths, args.output_len, vocab, args.seed
        )
        threshold = kv_threshold.pick_threshold(kv_rows)
        kv_said = kv_threshold.render(kv_rows, threshold)
        for config in configs.values():
            if config:
                config["kv_compression"] = kv_threshold.policy(args.kv_compression, threshold)
    if args.out_config is not None and configs[chosen]:
        args.out_config.parent.mkdir(parents=True, exist_ok=True)
        args.out_config.write_text(json.dumps(configs[chosen], indent=2) + "\n")
    if args.plot is not None:
        write_plot(rows, args.plot, f"infertune tune: {model or 'demo model'}")
    doc = dict(
        model=model,
        slo=slo,
        workload=dict(requests=len(prompts), max_model_len=max_len),
        rows=rows,
        online=configs["online"],
        offline=configs["offline"],
        messages=rec.messages,
        kv_compression_rows=kv_rows,
        knee={" / ".join(map(str, k)) if isinstance(k, tuple) else str(k): v for k, v in knee(rows).items()},
    )
    emit_json(args.json, doc, indent=2)
    if not json_to_stdout(args):
        print(f"Workload: {len(prompts)} requests, longest {max_len} tokens; SLO: {format_slo(slo)}\n")
        print(render_table(rows, slo))
        print()
        for kind in ("online", "offline"):
            r = picks[kind]
            if r:
                print(
                    f"{kind}: {(r.get('variant') or 'base') + ', '}max_num_seqs={r['max_num_seqs']} "
                    f"max_num_batched_tokens={r['max_num_batched_tokens']} "
                    f"-> {r['output_tok_s']:.1f} tok/s, TTFT p90 {_ms(r['ttft_p90_s'])} ms, TPOT p90 "
                    f"{_ms(r['tpot_p90_s'])} ms"
                )
            else:
                print(f"{kind}: none")
        for m in rec.messages:
            print(f"note: {m}")
        if kv_said:
            print(f"\n{kv_said}")
        if args.out_config is not None and configs[chosen]:
            print(f"wrote the {chosen} config to {args.out_config}")
        if args.plot is not None:
            print(f"wrote {args.plot}")
    return 0 if rec.offline is not None and (not slo or rec.online is not None) else 1
