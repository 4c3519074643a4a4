"""The `infertune` command. Subcommands: generate (more arrive with the server, bench and tuning tools)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from pathlib import Path


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=None, help="Hugging Face model folder (default: the built-in demo model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and activations dtype; auto = the checkpoint's, as the device supports (default: auto)")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda", "npu"],
                   help="where to run; auto prefers cuda, then npu, then cpu (default: auto)")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output in tokens (default: the model's max_position_embeddings)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences decoded together (default: 64)")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget of one step; long prompts are prefilled in chunks of it (default: 2048)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    g.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="KV-cache budget in bytes (default: a fraction of free memory, see --kv-cache-memory-fraction)")
    g.add_argument("--kv-cache-memory-fraction", type=float, default=0.5,
                   help="share of free memory the KV cache may take when no byte budget is given (default: 0.5)")
    g.add_argument("--no-prefix-caching", action="store_true", help="disable the automatic prefix cache")
    g.add_argument("--max-running-tokens", type=int, default=None,
                   help="dynamic batch by input length: admit sequences only while their lengths sum to at most "
                   "this many tokens, so short inputs batch wider than long ones (default: off)")
    g.add_argument("--seed", type=int, default=0, help="engine seed for unseeded sampling (default: 0)")
    g.add_argument("--quantization", default=None, choices=["w8a16", "w4a16", "w8a8"],
                   help="quantize linear weights after loading: int8 per channel (w8a16), int4 per group "
                   "(w4a16), or int8 weights and activations (w8a8); norms, rotary and logits stay full precision")
    g.add_argument("--quant-group-size", type=int, default=128, help="w4a16 group size (default: 128)")
    g.add_argument("--compile", default="auto", choices=["auto", "on", "off"],
                   help="torch.compile the decoder's dense stages (norms, projections, rotary, MLP) in a warm-up "
                   "before serving: fewer, fused ops per step for a start-up cost of seconds to tens of seconds; "
                   "auto = on only for models of >= 100M parameters on backends where it measured faster (none "
                   "yet: on CPU it measured slower, so auto runs eager); off = eager (default: auto)")
    g.add_argument("--decode-kernels", default="auto", choices=["auto", "linear", "off"],
                   help="infertune's own decode kernels, on x86 CPUs with AVX-512 BF16 and VNNI (built with the "
                   "system C compiler on first use and cached): auto = GEMV / AMX kernels for steps of up to 16 "
                   "rows plus the fused decode step (every layer of a decode-only step in one call); linear = the "
                   "linear kernels only, under the PyTorch forward; off = torch's matmuls (default: auto)")
    g.add_argument("--compress-weights", default="auto", choices=["auto", "off"],
                   help="auto = where the decode kernels run on a CPU with AMX, keep plain bf16 projections "
                   "losslessly in 12 bits a weight (bit-identical outputs; decode steps read 25%% fewer bytes, "
                   "the weights take 0.76x the memory, load takes ~2 ms more per million weights); off = keep "
                   "them as loaded (default: auto)")
    g.add_argument("--distributed-executor-backend", default="uni", choices=["uni", "mp"],
                   help="where the model runs: uni = in this process; mp = in a worker process of its own, reached "
                   "by pickled per-step scheduler outputs (start-up takes a few seconds more) (default: uni)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8"],
                   help="KV-cache storage: the model dtype, or int8 with per-token, per-head scales (about half the "
                   "bytes, so about twice the tokens in the same budget) (default: auto)")


def add_limits_args(p: argparse.ArgumentParser) -> None:
    """The request limits' flags, made from LimitsConfig's fields (their help, types and defaults live there)."""
    from dataclasses import MISSING, fields

    from infertune.config import LimitsConfig, parse_size

    def size(text: str) -> int:
        try:
            return parse_size(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    g = p.add_argument_group("request limits", "what one request may cost, checked before it is queued")
    for f in fields(LimitsConfig):
        kind = size if f.metadata.get("size") else float if "float" in str(f.type) else int
        default = None if f.default is MISSING else f.default
        text = f.metadata["help"]
        if "(default:" not in text:
            text += f" (default: {default})"
        g.add_argument("--" + f.name.replace("_", "-"), dest=f.name, type=kind, default=default, help=text)


def limits_table() -> str:
    """The README's table of the request-limit options, made from LimitsConfig's fields (a test keeps them equal)."""
    from dataclasses import MISSING, fields

    from infertune.config import LimitsConfig

    rows = ["| `serve` flag | engine option | default | meaning |", "|---|---|---|---|"]
    for f in fields(LimitsConfig):
        default = None if f.default is MISSING else f.default
        text = f.metadata["help"].replace("%%", "%")
        text, _, said = text.partition(" (default: ")
        shown = said.rstrip(")") if said else f"`{default}`"
        rows.append(f"| `--{f.name.replace('_', '-')}` | `{f.name}` | {shown} | {text} |")
    return "\n".join(rows)


def _limits_kwargs(args: argparse.Namespace) -> dict:
    from dataclasses import fields

    from infertune.config import LimitsConfig

    return {f.name: getattr(args, f.name) for f in fields(LimitsConfig) if hasattr(args, f.name)}


def engine_kwargs(args: argparse.Namespace) -> dict:
    return _limits_kwargs(args) | dict(
        dtype=args.dtype, device=args.device, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes, kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        enable_prefix_caching=not args.no_prefix_caching, seed=args.seed, max_running_tokens=args.max_running_tokens,
        quantization=args.quantization, quant_group_size=args.quant_group_size, kv_cache_dtype=args.kv_cache_dtype,
        compile=args.compile, decode_kernels=args.decode_kernels, compress_weights=args.compress_weights,
        distributed_executor_backend=args.distributed_executor_backend,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from infertune.llm import LLM
    from infertune.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, show_progress=True, **engine_kwargs(args))
    load_s = time.perf_counter() - t0
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens,
        seed=args.sample_seed, stop=args.stop or None, ignore_eos=args.ignore_eos,
    )
    if args.chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    else:
        out = llm.generate(args.prompt, params, use_tqdm=False)[0]
    completion = out.outputs[0]
    print(completion.text)
    m = out.metrics
    n_out = len(completion.token_ids)
    decode_s = (m.finished_time - m.first_token_time) if m and m.finished_time else 0.0
    decode_tps = (n_out - 1) / decode_s if n_out > 1 and decode_s > 0 else float("nan")
    print(
        f"[infertune] prompt {len(out.prompt_token_ids)} tok | output {n_out} tok ({completion.finish_reason}) | "
        f"TTFT {m.ttft * 1000:.1f} ms | decode {decode_tps:.1f} tok/s | load {load_s:.1f} s | "
        f"{llm.engine.executor.describe()}",
        file=sys.stderr,
    )
    return 0


def load_config_file(path: str | None) -> dict:
    """Engine options from a JSON file (what `infertune tune --out-config` writes); they override the flags."""
    if path is None:
        return {}
    try:
        options = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"--config {path}: cannot read engine options ({e})") from e
    if not isinstance(options, dict):
        raise ValueError(f"--config {path}: expected a JSON object of engine options")
    return options


def cmd_serve(args: argparse.Namespace) -> int:
    from infertune.serve.launcher import serve

    logging.getLogger("infertune").setLevel(logging.INFO)
    options = {**engine_kwargs(args), **load_config_file(args.config)}
    model = options.pop("model", None) or args.model
    return serve(
        model, host=args.host, port=args.port, api_key=args.api_key, served_model_name=args.served_model_name, max_body_bytes=args.max_body_bytes,
        graceful_timeout_s=args.graceful_timeout, **options,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="infertune",
        description="LLM inference engine and tuning toolkit. Run `infertune COMMAND --help` for a command's options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate text for one prompt and print one line of stats",
                         description="Generate a completion for PROMPT and print it, then a stats line on stderr "
                         "(prompt tokens, time to first token, decode tokens/s). With no --model the built-in demo "
                         "model is used.")
    gen.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0 = off)")
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed for reproducible output")
    gen.add_argument("--stop", action="append", help="stop string (repeatable); not included in the output")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                         description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
                         "/v1/chat/completions (streaming with stream=true), /v1/models, /health and Prometheus "
                         "/metrics. With no --model the built-in demo model is served. SIGTERM stops accepting, "
                         "lets in-flight requests finish within --graceful-timeout, then exits 0.")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    srv.add_argument("--port", type=int, default=8000, help="port (default: 8000)")
    srv.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1/* routes")
    srv.add_argument("--served-model-name", default=None, help="model name clients send (default: the folder's name)")
    srv.add_argument("--max-body-bytes", type=int, default=4 * 2**20,
                     help="largest request body accepted; larger gets 413 (default: 4 MiB)")
    srv.add_argument("--config", default=None, metavar="FILE.json",
                     help="engine options as JSON (e.g. from `infertune tune --out-config`); they override the flags")
    srv.add_argument("--graceful-timeout", type=float, default=10.0,
                     help="seconds in-flight requests get to finish after SIGTERM (default: 10)")
    add_engine_args(srv)
    add_limits_args(srv)
    srv.set_defaults(func=cmd_serve)

    from infertune.distill import command as distill_command
    from infertune.evaluate import command as eval_command
    from infertune.plan import command as plan_command
    from infertune.profile import audit, debug_layers, doctor, profile_cmd
    from infertune.tools import quantize as quantize_command
    from infertune.tune import command as tune_command
    from infertune.tune import ledger as ledger_command

    # Tools that bring their own add_arguments(parser) / run(args) (imported lazily inside run: --help stays fast).
    tools = (
        ("profile", profile_cmd, "where the time goes: categories for prefill and decode, top ops, hints",
         profile_cmd.DESCRIPTION),
        ("doctor", doctor, "check versions (torch / torch_npu / CANN / CUDA), CPU features, threads",
         "Check Python, torch, transformers, torch_npu and CANN, CUDA and driver against a compatibility matrix "
         "kept as data; CPU features and thread settings; what to fix. Exits 1 on a hard mismatch."),
        ("audit", audit, "list the aten ops a model step launches and how a backend runs each",
         "Trace a prefill and a decode step of the model, list every aten op with counts and example shapes, and "
         "mark which the target backend runs natively and which would fall back to the CPU, with mapping hints and "
         "dynamic-shape hazards. Needs no target hardware."),
        ("debug-layers", debug_layers, "find the first module that goes NaN/Inf or drifts from an fp32 run",
         "Run the prompt in the chosen dtype and in fp32 with hooks on every module and report the first module "
         "whose output is non-finite or diverges beyond --threshold (the equivalent of ASCEND_LAYER_DEBUG=1). "
         "Exits 1 when it finds one."),
        ("plan", plan_command, "capacity, speed and cost of a model on a device (no hardware needed)",
         plan_command.DESCRIPTION),
        ("tune", tune_command, "sweep batch settings under an SLO; recommend online and offline configs",
         tune_command.DESCRIPTION),
        ("ledger", ledger_command, "the step-by-step optimization table, measured on this machine",
         ledger_command.DESCRIPTION),
        ("eval", eval_command, "accuracy against a reference: perplexity, KL, top-1 agreement, greedy prefix",
         eval_command.DESCRIPTION),
        ("quantize", quantize_command, "write a quantized checkpoint (w8a16 / w4a16 / w8a8, calibration), then eval it",
         quantize_command.DESCRIPTION),
        ("distill", distill_command, "distil a teacher into a small student (KD loss, checkpoints, resume)",
         distill_command.DESCRIPTION),
        ("train", distill_command.TRAIN, "train a model from scratch with cross-entropy (same data pipeline)",
         distill_command.TRAIN_DESCRIPTION),
    )
    for name, module, help_, description in tools:
        tool = sub.add_parser(name, help=help_, description=description)
        module.add_arguments(tool)
        tool.set_defaults(func=module.run)

    bench = sub.add_parser("bench", help="benchmarks: bench throughput / latency (offline), bench serve / soak (HTTP)",
                           description="Benchmarks. `bench throughput` and `bench latency` run infertune beside HF "
                           "transformers on the same model and workload; `bench serve` load-tests any OpenAI-compatible "
                           "server.")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    from infertune.bench import serve_load

    bench_serve = bench_sub.add_parser(
        "serve", help="load-test an OpenAI-compatible server (Poisson arrivals, TTFT/TPOT/ITL percentiles)",
        description="Send a workload to an OpenAI-compatible server (infertune, vLLM, llama.cpp) and report "
        "throughput, TTFT / TPOT / ITL / end-to-end latency percentiles, goodput under an SLO, and failures.")
    serve_load.add_arguments(bench_serve)
    bench_serve.set_defaults(func=serve_load.run)
    from infertune.bench import soak

    bench_soak = bench_sub.add_parser(
        "soak", help="soak-test an infertune server: many requests, hanging-up clients, /health and RSS watched",
        description=soak.__doc__.split("\n\n")[0], epilog="\n\n".join(soak.__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    soak.add_arguments(bench_soak)
    bench_soak.set_defaults(func=soak.run)
    from infertune.bench import offline

    for name, batches, help_ in (
        ("throughput", [1, 16], "offline throughput: infertune vs HF transformers (and quantized variants), side by side"),
        ("latency", [1], "batch-1 latency: TTFT and decode tok/s, infertune vs HF transformers"),
    ):
        cmd = bench_sub.add_parser(name, help=help_, description=offline.__doc__.split("\n\n")[0],
                                   epilog="\n\n".join(offline.__doc__.split("\n\n")[1:]),
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
        offline.add_arguments(cmd, default_batch=batches)
        cmd.set_defaults(func=offline.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"infertune {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
