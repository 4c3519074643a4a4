"""`infertune quantize`: write a quantized checkpoint folder, then print its accuracy against the source.

Wire it into cli.py with:  q = sub.add_parser("quantize", ...); quantize.add_arguments(q); q.set_defaults(func=quantize.run)
Exit status: 0, 1 when --gate fails, 2 on a usage error (raised as ValueError and printed by cli.main).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from infertune.files import add_json_flag, json_to_stdout

DESCRIPTION = (
    "Quantize a Hugging Face checkpoint offline and write a folder infertune loads directly (int8 / packed int4 "
    "tensors in safetensors, tokenizer files, config.json with a compressed-tensors-style quantization_config). "
    "W8A8 runs calibration text through the model first (activation statistics per linear input, percentile "
    "clipping; optional static activation scales and SmoothQuant). At the end it prints the accuracy report "
    "(perplexity, KL, top-1 agreement, greedy prefix) of the new checkpoint against the source model."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="source Hugging Face folder (default: the built-in demo model)")
    p.add_argument(
        "--method",
        required=True,
        choices=["w8a16", "w4a16", "w8a8"],
        help="int8 weights per channel (w8a16), int4 per group (w4a16), int8 weights and activations (w8a8)",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="new folder for the quantized checkpoint")
    p.add_argument("--group-size", type=int, default=128, help="w4a16 group size: 32, 64, 128, 256 (default: 128)")
    p.add_argument("--symmetric", action="store_true", help="w4a16: symmetric groups (-8..7) instead of [min, max]")
    p.add_argument(
        "--clip",
        default="minmax",
        metavar="minmax|mse|percentile:P",
        help="weight range: minmax (default, as on the fly), mse (search the clip ratio per channel / group "
        "minimising the reconstruction error) or percentile:P of |w|",
    )
    p.add_argument(
        "--act-clip",
        default="percentile:99.9",
        metavar="percentile:P|minmax",
        help="w8a8 activation range from calibration (default: percentile:99.9)",
    )
    p.add_argument(
        "--static-activations",
        action="store_true",
        help="w8a8: store per-tensor activation scales from calibration (default: dynamic per-token scales)",
    )
    p.add_argument(
        "--smoothquant",
        type=float,
        default=None,
        metavar="ALPHA",
        help="w8a8: migrate activation outliers into the weights (SmoothQuant, e.g. 0.5)",
    )
    p.add_argument(
        "--calib",
        default=None,
        metavar="FILE",
        help="calibration text, .txt or .jsonl (default: snippets of the Python stdlib shipped with infertune)",
    )
    p.add_argument("--num-samples", type=int, default=512, help="calibration samples (default: 512)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per calibration sample (default: 128)")
    p.add_argument(
        "--keep-fp",
        default="lm_head",
        metavar="LAYERS",
        help="comma-separated layers kept in full precision, fnmatch patterns on the engine's module "
        "names (e.g. lm_head,model.layers.0.*) (default: lm_head)",
    )
    p.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="the LM head in int8 per vocabulary row too (tied or not), as the engine's --quantize-lm-head: the "
        "checkpoint keeps its head's values and says so in its quantization_config, and every load applies it "
        "(default: the head stays in full precision)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype for calibration and evaluation (default: auto)",
    )
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"], help="(default: auto)")
    p.add_argument("--no-eval", action="store_true", help="skip the accuracy report")
    p.add_argument("--eval-data", default=None, metavar="FILE", help="held-out text for the report (default: as eval)")
    p.add_argument("--eval-max-tokens", type=int, default=None, help="score at most this many tokens (default: all)")
    p.add_argument(
        "--gate",
        default=None,
        metavar="PCT",
        help="exit 1 when the quantized model's perplexity is more than PCT percent above the source's",
    )
    add_json_flag(p, "the accuracy report")


def loader_reads_quantized_checkpoints() -> bool:
    """Whether this infertune's loader reads what quantize writes (quant/checkpoint.py, from the loader patch)."""
    return importlib.util.find_spec("infertune.quant.checkpoint") is not None


def run(args: argparse.Namespace) -> int:
    from infertune.evaluate.accuracy import compare, parse_gate
    from infertune.evaluate.command import report_and_gate
    from infertune.files import check_writable
    from infertune.tools.quantizer import quantize

    check_writable("--json", args.json, make_parents=True)  # (before the work, not after it and the report)
    if args.gate is not None:
        parse_gate(args.gate)
        if args.no_eval:
            raise ValueError("--gate needs the accuracy report; drop --no-eval")
        if not loader_reads_quantized_checkpoints():
            raise ValueError("--gate needs a loader that reads quantized checkpoints (this infertune's does not)")
    if not args.no_eval:  # the report's own inputs, checked before minutes of quantizing rather than after
        from infertune.evaluate.data import load_documents

        if args.eval_data is not None:
            load_documents(args.eval_data)
        if args.eval_max_tokens is not None and args.eval_max_tokens < 2:
            raise ValueError(f"--eval-max-tokens {args.eval_max_tokens} must be at least 2")
    keep = tuple(s.strip() for s in args.keep_fp.split(",") if s.strip())
    result = quantize(
        args.model,
        args.method,
        args.out,
        group_size=args.group_size,
        symmetric=args.symmetric,
        clip=args.clip,
        act_clip=args.act_clip,
        static_activations=args.static_activations,
        smoothquant=args.smoothquant,
        calib=args.calib,
        num_samples=args.num_samples,
        seq_len=args.seq_len,
        keep_fp=keep,
        quantize_lm_head=args.quantize_lm_head,
        dtype=args.dtype,
        device=args.device,
        show_progress=sys.stderr.isatty(),
    )
    print(result.format(), file=sys.stderr if json_to_stdout(args) else sys.stdout)
    if args.no_eval:
        return 0
    if not loader_reads_quantized_checkpoints():
        print("accuracy report skipped: this infertune's loader cannot read quantized checkpoints yet", file=sys.stderr)
        return 0
    try:
        report = compare(
            args.out,
            args.model,
            data=args.eval_data,
            max_tokens=args.eval_max_tokens,
            engine_options={"dtype": args.dtype, "device": args.device},
            show_progress=sys.stderr.isatty(),
        )
    except (Exception, KeyboardInterrupt) as e:
        # The checkpoint is whole (written before the report began): say so, and how to score it again alone.
        print(
            f"the quantized checkpoint in {args.out} is complete, but its accuracy report failed: "
            f"{type(e).__name__}: {e}\nscore it again with: infertune eval --model {args.out} --compare {args.model}",
            file=sys.stderr,
        )
        return 130 if isinstance(e, KeyboardInterrupt) else 1
    return report_and_gate(report, args.gate, args.json)
