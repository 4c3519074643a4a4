"""`infertune plan`: capacity, speed and cost of a model on a device, from its config.json and the catalog.

Wire it into cli.py with:  plan = sub.add_parser("plan", ...); command.add_arguments(plan); plan.set_defaults(func=command.run)
"""

from __future__ import annotations

import argparse
import json
import sys

from infertune.files import add_json_flag, emit_json, json_to_stdout, print_report
from infertune.plan.memory import KV_DTYPES, KVFormat, WeightFormat, shipped_models
from infertune.plan.weights import WEIGHT_DTYPES

DESCRIPTION = (
    "Plan a deployment without running it: exact weight and KV-cache bytes from the model's config.json, the "
    "concurrent sequences that fit, roofline prefill / decode speed by batch size (TTFT, TPOT), $ per million "
    "tokens, tokens per joule and a prefill / decode card split. --device local measures this machine first."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from infertune.config import default_model_path

    p.add_argument(
        "--model",
        default=default_model_path(),
        help="Hugging Face model folder or its config.json, or a shipped config: "
        f"{', '.join(shipped_models())} (default: the built-in demo model)",
    )
    p.add_argument(
        "--device",
        default=None,
        help="catalog device (910b, 910b2, 910c, h100, h200, a100, l40s, rtx4090, ...) or 'local' / "
        "'local:cpu|cuda|npu' to measure this machine (default: the one device of --device-file, "
        "else local)",
    )
    p.add_argument(
        "--device-file",
        action="append",
        default=[],
        metavar="F",
        help="JSON file with your own device(s) (repeatable); see infertune/plan/catalog.py for the fields",
    )
    p.add_argument("--list-devices", action="store_true", help="list the catalog (with sources) and exit")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel cards per instance (default: 1)")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens per request (default: 1536)")
    p.add_argument("--output-len", type=int, default=None, help="generated tokens per request (default: 512)")
    p.add_argument(
        "--context",
        type=int,
        default=None,
        help="tokens per sequence for KV sizing and max concurrency (default: input + output; with only "
        "--context given, output = min(512, context/4) and input = the rest)",
    )
    p.add_argument("--batch", type=int, default=None, help="batch to highlight, size the KV for, and calibrate at")
    p.add_argument(
        "--weight-dtype",
        choices=WEIGHT_DTYPES,
        default=None,
        help="bf16-12bit: infertune's lossless 12-bit layout of bf16 weights (the default engine's on CPUs "
        "with AMX; same outputs, 0.75x the bytes); w8a16 / w8a8 / w4a16: quantized (w8a8 holds w8a16's bytes; its "
        "int8 GEMMs are not modelled: compute as bf16); fp8: a block-scaled fp8 checkpoint "
        "(1 byte a weight + fp32 block scales, what DeepSeek-V3 and Qwen3-*-FP8 publish; infertune dequantizes "
        "it to bf16 at load) (default: the checkpoint's, fp8 for an fp8 checkpoint, else bf16)",
    )
    p.add_argument(
        "--group-size",
        type=int,
        default=None,
        help="W4A16 quantization group size (default: a W4A16 checkpoint's own, else 128)",
    )
    p.add_argument(
        "--quantize-lm-head",
        action="store_true",
        help="the lm_head in int8 per vocabulary row too, as the engine's --quantize-lm-head (default: kept in bf16)",
    )
    p.add_argument(
        "--kv-dtype",
        choices=KV_DTYPES,
        default="auto",
        help="KV-cache dtype; auto = 16-bit; int8 adds an fp32 scale per token and KV head, as the engine stores it (default: auto)",
    )
    p.add_argument(
        "--kv-int4-after",
        type=int,
        default=None,
        metavar="N",
        help="with --kv-dtype int8: the engine's int4 tier (its --kv-int4-after): a sequence's tokens N or more behind "
        "its newest counted at head_dim / 2 bytes and an fp16 scale a KV head, in full-attention layers (default: "
        "off)",
    )
    p.add_argument(
        "--kv-compression",
        default=None,
        metavar="JSON",
        help='the engine\'s kv_compression (its --kv-compression): a press ({"press": "snapkv", '
        '"compression_ratio": 0.5}) or a policy by layer and prompt length ({"policy": [...]}, e.g. the one '
        "`infertune tune --kv-compression` writes): each group of layers then holds what its window or press keeps of "
        "an --input-len prompt, plus the tokens decoded after it, in the KV bytes, the sequences that fit and a decode "
        "step's reads (default: off)",
    )
    p.add_argument(
        "--memory-utilization",
        type=float,
        default=0.90,
        help="share of card memory the engine may use; the rest is runtime overhead (default: 0.90)",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=2048,
        help="tokens per step: prefill chunk and activation reserve (default: 2048, the engine's)",
    )
    p.add_argument("--eff-bw", type=float, default=None, help="bandwidth efficiency 0-1 (default: 0.82; local: 1.0)")
    p.add_argument("--eff-compute", type=float, default=None, help="compute efficiency 0-1 (default: 0.50; local: 1.0)")
    p.add_argument(
        "--measured-decode-tps",
        type=float,
        default=None,
        help="calibrate: decode tokens/s you measured at --batch (default 1) on this device",
    )
    p.add_argument(
        "--measured-prefill-tps",
        type=float,
        default=None,
        help="calibrate: prefill tokens/s you measured for one --input-len prompt",
    )
    p.add_argument("--price-per-hour", type=float, default=None, help="USD per card-hour (overrides the catalog)")
    p.add_argument("--cards", type=int, default=8, help="cards for the prefill / decode split; 0 skips it (default: 8)")
    p.add_argument("--rate", type=float, default=None, help="requests/s the P/D split must sustain")
    p.add_argument(
        "--pd",
        action="store_true",
        help="also print the `infertune serve --pd P:D` command that runs the P/D split of --cards (JSON: "
        "serve_command), and the reason for it",
    )
    add_json_flag(p, "the plan (with --list-devices: the catalog)")


def _check_numbers(args: argparse.Namespace) -> None:
    """Usage errors that name the flag the user gave (not one derived from it)."""
    from infertune.config import QUANT_GROUP_SIZES

    if args.context is not None and args.context < 2:
        raise ValueError(f"--context {args.context} must be >= 2 (a prompt token and a generated one)")
    for flag, value in (("--price-per-hour", args.price_per_hour), ("--cards", args.cards)):
        if value is not None and value < 0:
            raise ValueError(f"{flag} {value:g} must be >= 0")
    if args.group_size is not None and args.group_size not in QUANT_GROUP_SIZES:
        raise ValueError(
            f"--group-size {args.group_size} is not one the engine runs: {', '.join(map(str, QUANT_GROUP_SIZES))}"
        )


def _lengths(args: argparse.Namespace) -> tuple[int, int, int | None]:
    inp, out, ctx = args.input_len, args.output_len, args.context
    if ctx is not None and inp is None and out is None:
        out = min(512, max(1, ctx // 4))
        return ctx - out, out, ctx
    return (1536 if inp is None else inp), (512 if out is None else out), ctx


def _device(args: argparse.Namespace):
    from infertune.plan.catalog import find_device, load_catalog, load_device_file

    if args.device is None and args.device_file:
        own = [d for f in args.device_file for d in load_device_file(f)]
        if len(own) == 1:
            return own[0]
    name = (args.device or "local").lower()
    if name == "local" or name.startswith("local:"):
        from infertune.plan.probe import probe_local

        return probe_local(name.partition(":")[2] or "auto")
    return find_device(load_catalog(args.device_file), name)


def run(args: argparse.Namespace) -> int:
    from infertune.plan.memory import ModelSpec
    from infertune.plan.planner import PlanRequest, make_plan
    from infertune.plan.render import render_text
    from infertune.plan.roofline import Efficiency, default_efficiency

    if args.list_devices:
        from infertune.plan.catalog import load_catalog

        catalog = load_catalog(args.device_file)
        if args.json is not None:
            emit_json(args.json, {k: v.to_dict() for k, v in catalog.items()}, indent=2)
        if not json_to_stdout(args):
            for dev in catalog.values():
                price = (
                    f"${dev.price.usd_per_hour:g}/h ({dev.price.provider}, {dev.price.date})"
                    if dev.price
                    else "no price"
                )
                print(
                    f"{dev.name:9s} {dev.display_name}: {dev.memory_bytes / 1e9:g} GB, "
                    f"{dev.memory_bandwidth_bytes_per_s / 1e12:g} TB/s, {dev.bf16_tflops:g} TFLOPS bf16, "
                    f"{_num(dev.tdp_watts, 'W')}, {price}\n          source: {'; '.join(dev.source)}"
                )
        return 0
    _check_numbers(args)
    spec = ModelSpec.load(args.model)
    device = _device(args)
    eff = None
    if args.eff_bw is not None or args.eff_compute is not None:
        base = default_efficiency(device)
        eff = Efficiency(
            args.eff_bw if args.eff_bw is not None else base.bandwidth,
            args.eff_compute if args.eff_compute is not None else base.compute,
            "set on the command line",
        )
    inp, out, ctx = _lengths(args)
    fmt = None  # the checkpoint's
    stored = spec.weight_format  # (a quantized or fp8 checkpoint's own format; None: 16-bit)
    if (
        stored is not None
        and stored.name in ("w8a16", "w8a8", "w4a16")
        and args.weight_dtype not in (None, stored.name)
    ):
        raise ValueError(f"{args.model} is already quantized ({stored.name}); drop --weight-dtype {args.weight_dtype}")
    if stored is not None and stored.name == "w4a16" and args.group_size not in (None, stored.group_size):
        raise ValueError(
            f"{args.model} is already quantized in groups of {stored.group_size}; drop --group-size {args.group_size}"
        )
    group = args.group_size or (stored.group_size if stored is not None and stored.name == "w4a16" else 128)
    head = args.quantize_lm_head or (stored is not None and stored.quantize_lm_head)  # (quantize --quantize-lm-head)
    if args.weight_dtype is not None:
        block = stored.block if stored is not None else (128, 128)
        fmt = WeightFormat(args.weight_dtype, group, quantize_lm_head=head, block=block)
    elif args.quantize_lm_head or args.group_size is not None:
        base = stored or WeightFormat()
        fmt = WeightFormat(base.name, group, quantize_lm_head=head, block=base.block)
    plan = make_plan(
        PlanRequest(
            spec=spec,
            device=device,
            tp=args.tp,
            input_len=inp,
            output_len=out,
            context=ctx,
            batch=args.batch,
            weight_format=fmt,
            kv_format=KVFormat(
                args.kv_dtype, int4_after=args.kv_int4_after, compression=_kv_compression(args), prompt_len=inp
            ),
            efficiency=eff,
            measured_decode_tps=args.measured_decode_tps,
            measured_prefill_tps=args.measured_prefill_tps,
            memory_utilization=args.memory_utilization,
            tokens_per_step=args.max_num_batched_tokens,
            price_per_hour=args.price_per_hour,
            cards=args.cards or None,
            rate=args.rate,
        )
    )
    if args.pd:
        from infertune.plan.pd import explain, serve_command

        if not plan["pd_split"]:
            raise ValueError(f"--pd: no prefill / decode split with --cards {args.cards} and --tp {args.tp}")
        plan["serve_command"] = serve_command(args.model, plan["pd_split"])
        plan["serve_reason"] = explain(plan["pd_split"], spec.name, device.name)
    text = render_text(plan)
    if args.pd:
        text += f"\n\n  serve it:   {plan['serve_command']}\n              ({plan['serve_reason']})"
    print_report(args, text, plan, indent=2)
    return 0


def _num(v: float | None, unit: str) -> str:
    return f"{v:g} {unit}" if v is not None else f"? {unit}"


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (python -m infertune.plan.command ...) until cli.py wires `infertune plan`."""
    parser = argparse.ArgumentParser(prog="infertune plan", description=DESCRIPTION)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"infertune plan: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())


def _kv_compression(args):
    """--kv-compression JSON parsed as the engine parses its option (kv_compression.KVCompressionConfig), or None."""
    if args.kv_compression is None:
        return None
    from infertune.kv_compression import KVCompressionConfig

    try:
        value = json.loads(args.kv_compression)
    except json.JSONDecodeError as e:
        raise ValueError(f"--kv-compression {args.kv_compression!r} is not JSON: {e}") from e
    return KVCompressionConfig.from_dict(value)
