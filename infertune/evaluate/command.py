"""`infertune eval`: perplexity, KL, top-1 agreement and greedy prefix of a model against a reference.

Wire it into cli.py with:  ev = sub.add_parser("eval", ...); command.add_arguments(ev); ev.set_defaults(func=command.run)
Exit status: 0, 1 when --gate fails, 2 on a usage error (raised as ValueError and printed by cli.main).
"""

from __future__ import annotations

import argparse
import sys

from infertune.files import add_json_flag, print_report

DESCRIPTION = (
    "Measure what a model (typically quantized) lost against a reference on held-out text: perplexity, "
    "KL(P_ref || P_cand) of the next-token distributions, top-1 agreement, and how many greedily decoded tokens "
    "stay identical. With --quantization and no --compare the reference is the same model unquantized; for a "
    "checkpoint written by `infertune quantize` it is the model it was made from. The default text is the "
    "built-in model's held-out split (Python stdlib files it never saw, PSF-2.0)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from infertune.config import engine_option_kwargs as option  # the engine options' help, choices and defaults

    p.add_argument("--model", default=None, help="candidate model folder (default: the built-in demo model)")
    p.add_argument("--compare", default=None, metavar="REF", help="reference model folder (default: see above)")
    p.add_argument("--quantization", **option("quantization", help="quantize the candidate on the fly"))
    p.add_argument(
        "--compare-quantization", **option("quantization", help="quantize the reference on the fly (default: none)")
    )
    p.add_argument("--quant-group-size", **option("quant_group_size", help="candidate w4a16 group size (default: 128)"))
    p.add_argument(
        "--keep-fp",
        default=None,
        metavar="LAYERS",
        help="comma-separated layers the candidate keeps in full precision (default: lm_head)",
    )
    p.add_argument(
        "--data",
        default=None,
        metavar="FILE",
        help='held-out text: .txt (one document) or .jsonl ({"text": ...} per line)',
    )
    p.add_argument(
        "--max-tokens", type=int, default=None, help="score at most this many tokens of the text (default: all)"
    )
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="window length in tokens (default: the model's max_model_len, at most 2048)",
    )
    p.add_argument("--stride", type=int, default=None, help="window step (default: half the context)")
    p.add_argument(
        "--num-prompts", type=int, default=8, help="prompts for the greedy-prefix check; 0 skips it (default: 8)"
    )
    p.add_argument("--greedy-tokens", type=int, default=64, help="tokens decoded per prompt (default: 64)")
    p.add_argument("--dtype", **option("dtype"))
    p.add_argument("--device", **option("device"))
    p.add_argument(
        "--gate",
        default=None,
        metavar="PCT",
        help="exit 1 when perplexity rises more than PCT percent over the reference, e.g. 1%%",
    )
    add_json_flag(p, "the report")


def report_and_gate(report, gate: str | None, json_target: str | None = None) -> int:
    """Print the report (json_target: --json's OUT, "-" for a bare --json); 1 when the gate fails, else 0 (shared
    with `infertune quantize`)."""
    import argparse
    import json

    from infertune.evaluate.accuracy import parse_gate

    print_report(argparse.Namespace(json=json_target), report.format(), json.loads(report.to_json()))
    if gate is None:
        return 0
    limit = parse_gate(gate)
    if report.passes_gate(limit):
        print(f"gate passed: perplexity {100 * report.perplexity_change:+.3f}% <= +{100 * limit:g}%", file=sys.stderr)
        return 0
    print(
        f"gate FAILED: perplexity {100 * report.perplexity_change:+.3f}% > +{100 * limit:g}% over the reference",
        file=sys.stderr,
    )
    return 1


def run(args: argparse.Namespace) -> int:
    from infertune.evaluate.accuracy import compare, parse_gate
    from infertune.files import check_writable

    check_writable("--json", args.json, make_parents=True)  # (before minutes of scoring, not after them)
    if args.gate is not None:
        parse_gate(args.gate)  # a bad gate fails before minutes of scoring
    for flag, least in (("context", 2), ("stride", 1), ("num_prompts", 0), ("greedy_tokens", 1), ("max_tokens", 2)):
        value = getattr(args, flag, None)  # (said now, in the flag's name, not replaced by a default or after scoring)
        if value is not None and value < least:
            raise ValueError(f"--{flag.replace('_', '-')} must be at least {least}, not {value}")
    if args.quantization is None and (args.keep_fp is not None or args.quant_group_size != 128):
        raise ValueError(  # (they would be dropped: nothing is quantized on the fly)
            "--keep-fp and --quant-group-size shape an on-the-fly --quantization; give one (a quantized checkpoint "
            "keeps the layers and groups it was quantized with)"
        )
    candidate = {"quant_group_size": args.quant_group_size}
    if args.keep_fp is not None:
        candidate["keep_fp"] = tuple(s.strip() for s in args.keep_fp.split(",") if s.strip())
    report = compare(
        args.model,
        args.compare,
        quantization=args.quantization,
        reference_quantization=args.compare_quantization,
        data=args.data,
        max_tokens=args.max_tokens,
        context=args.context,
        stride=args.stride,
        num_prompts=args.num_prompts,
        greedy_tokens=args.greedy_tokens,
        engine_options={"dtype": args.dtype, "device": args.device},
        candidate_options=candidate,
        show_progress=sys.stderr.isatty(),
    )
    if args.gate is not None and report.ref_perplexity is None:
        raise ValueError("--gate needs a reference: give --compare REF or --quantization")
    return report_and_gate(report, args.gate, args.json)
