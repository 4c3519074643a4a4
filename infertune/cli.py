"""The `infertune` command: generate and serve; the tools profile, doctor, audit, debug-layers, plan, tune, ledger,
eval, quantize, distill and train; and bench throughput / latency / serve / soak. Run `infertune COMMAND --help`.

The engine and request-limit flags are made from the options' declarations in infertune/config.py (help, choices,
default, flag), as are the README's options tables (engine_table, limits_table; tests keep the README equal).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from infertune.engine_flags import _engine_groups, _flagged, add_engine_args, add_limits_args, engine_kwargs


def _default_said(f) -> tuple[str, str]:
    """(help without its "(default: ...)", the default as the README says it)."""
    from dataclasses import MISSING

    text, _, said = f.metadata["help"].partition(" (default: ")
    if said:
        return text, said.removesuffix(")")
    default = None if f.default is MISSING else f.default
    return text, f"`{default}`" if isinstance(default, str) else f"`{default!r}`"


def limits_table() -> str:
    """The README's table of the request-limit options, made from LimitsConfig's fields (a test keeps them equal)."""
    from infertune.config import engine_flag

    rows = ["| `serve` flag | engine option | default | meaning |", "|---|---|---|---|"]
    for f in _flagged("limits"):
        text, shown = _default_said(f)
        rows.append(f"| `{engine_flag(f.name)}` | `{f.name}` | {shown} | {text} |")
    return "\n".join(rows)


def _values(f) -> str:
    """What an option takes, for the README: its choices, else its type."""
    from infertune.config import engine_choices

    if engine_choices(f.name):
        shown = ", ".join(f"`{c}`" for c in engine_choices(f.name))
        return shown + (" or `None`" if f.default is None else "")
    if f.metadata.get("size"):
        return "bytes (`8G`, `512Mi`, `1000000`)" + (" or `None`" if f.default is None else "")
    if f.metadata.get("json"):
        return "a dict (JSON text on the command line)" + (" or `None`" if f.default is None else "")
    return str(f.type).replace(" | None", " or `None`").replace("tuple[str, ...]", "patterns")


# Where the README's options table sends a reader for more on an option (field metadata "see")
_SEE = {
    "Decode kernels": "docs/kernels.md#decode-kernels",
    "Compiled decode": "docs/kernels.md#compiled-decode",
    "Quantization": "docs/tools.md#quantize-and-evaluate",
    "Speculative decoding": "docs/server.md#speculative-decoding",
    "KV compression": "docs/long_context.md#kv-compression",
}


def engine_table() -> str:
    """The README's table of the engine options, made from their declarations (a test keeps them equal)."""
    from infertune.config import engine_flag, option_fields

    rows = ["| option | flag | default | values | meaning |", "|---|---|---|---|---|"]
    for f in option_fields(*_engine_groups()):
        text, shown = _default_said(f)
        if f.metadata.get("see"):
            section = f.metadata["see"]
            text += f"; see [{section}]({_SEE[section]})"
        text = text.replace("*", "\\*")  # a literal * in markdown (*.safetensors, layers.0.*)
        flag = f"`{engine_flag(f.name)}`" if engine_flag(f.name) else "none: Python or `serve --config`"
        rows.append(f"| `{f.name}` | {flag} | {shown} | {_values(f)} | {text} |")
    limits = option_fields("limits")
    rows.append(
        f"| {', '.join(f'`{f.name}`' for f in limits)} | `serve` flags | in that table | | what one request "
        "may cost (n and stops offline too); see [One request never takes the server down]"
        "(#one-request-never-takes-the-server-down) |"
    )
    return "\n".join(rows)


def cmd_generate(args: argparse.Namespace) -> int:
    from infertune.config import default_model_path
    from infertune.llm import LLM
    from infertune.sampling_params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(args.model, show_progress=True, **engine_kwargs(args))
    load_s = time.perf_counter() - t0
    healing = args.token_healing
    if healing is None:  # on for the built-in demo model's plain prompts (chat prompts are not healed)
        healing = not args.chat and Path(llm.config.model.model).resolve() == Path(default_model_path()).resolve()
    params = SamplingParams(
        temperature=args.temperature,
        token_healing=healing,
        top_p=args.top_p,
        top_k=args.top_k,
        max_tokens=args.max_tokens,
        seed=args.sample_seed,
        stop=args.stop or None,
        ignore_eos=args.ignore_eos,
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
        f"{llm.engine.executor.describe()}{_weights_said(llm)}"
        + (" | token healing (--no-token-healing: off)" if healing else ""),
        file=sys.stderr,
    )
    return 0


def _weights_said(llm) -> str:
    """ ", weights w8a16" where the model's linears run quantized (on the fly or a quantized checkpoint); "" else."""
    model = getattr(getattr(llm.engine.executor, "runner", None), "model", None)
    if model is None:  # (tensor-parallel: the workers hold the model)
        q = llm.config.quant.quantization
        return f", weights {q}" if q else ""
    kinds = {getattr(m.quant_method, "name", "") for m in model.modules() if getattr(m, "quant_method", None)}
    kinds &= {"w8a16", "w4a16", "w8a8"}
    return f", weights {'+'.join(sorted(kinds))}" if kinds else ""


# The server's own settings a --config file may hold beside engine options (vLLM's config files hold them too), by
# their flag names; cmd_serve hands them to the launcher. The serve flags that place instances are the command line's.
_SERVER_SETTINGS = (
    "model",
    "host",
    "port",
    "api_key",
    "served_model_name",
    "chat_template",
    "max_body_bytes",
    "graceful_timeout",
    "tool_call_parser",
    "enable_auto_tool_choice",
)
_COMMAND_LINE_ONLY = ("config", "data_parallel_size", "pd", "pd_device", "placement")


def load_config_file(path: str | None) -> dict:
    """Options from a --config file, by their names (dashes read as underscores); they override the defaults, flags
    written on the command line override them (vLLM's order). YAML as
    vLLM's `--config`, keys the long flag names (`max-num-seqs: 8`, `served-model-name: [a, b]`); .json files are
    JSON (what `infertune tune --out-config` writes), engine options without a flag included. A key that is neither
    an engine option nor a server setting is an error naming it."""
    if path is None:
        return {}
    import yaml

    try:
        text = Path(path).read_text(encoding="utf-8")
        options = json.loads(text) if Path(path).suffix.lower() == ".json" else yaml.safe_load(text)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, yaml.YAMLError) as e:
        raise ValueError(f"--config {path}: cannot read options ({e})") from e
    if options is None:  # (an empty YAML file)
        return {}
    if not isinstance(options, dict):
        raise ValueError(f"--config {path}: expected a mapping of option names to values, got {type(options).__name__}")
    return {_config_key(path, key): value for key, value in options.items()}


def flags_given(args: argparse.Namespace) -> set[str]:
    """The dests of the options written on `args`' command line (its subcommand's), as opposed to those left at their
    defaults: what a --config file may not override (vLLM's order: defaults < file < command line)."""
    parser = _innermost(build_parser(), args)
    by_flag = {flag: action.dest for action in parser._actions for flag in action.option_strings}
    own = args.argv[args.argv.index(args.command) + 1 :] if args.command in args.argv else args.argv
    given = set()
    for token in own:
        if token == "--":
            break
        flag = token.split("=", 1)[0] if token.startswith("--") else token
        if flag in by_flag:
            given.add(by_flag[flag])
    return given


def _config_key(path: str, key) -> str:
    """A --config key as its option name (dashes as underscores), or a ValueError naming it and what is close."""
    import difflib

    from infertune.config import VLLM_GPU_OPTIONS, option_fields

    name = key.replace("-", "_") if isinstance(key, str) else None
    if name in _COMMAND_LINE_ONLY:
        raise ValueError(f"--config {path}: {key!r} is taken on the command line only (--{name.replace('_', '-')})")
    known = [f.name for f in option_fields()] + list(VLLM_GPU_OPTIONS) + list(_SERVER_SETTINGS)
    if name not in known:
        close = difflib.get_close_matches(str(name), known, n=1)
        hint = f"; did you mean {close[0]!r} (--{close[0].replace('_', '-')})?" if close else ""
        raise ValueError(
            f"--config {path}: unknown key {key!r}{hint} (keys are the long flag names of `infertune serve --help`, "
            "with dashes or underscores, and the engine options of the README's table)"
        )
    return name


def cmd_serve(args: argparse.Namespace) -> int:
    logging.getLogger("infertune").setLevel(logging.INFO)
    own_argv = args.argv[args.argv.index("serve") + 1 :]
    if args.data_parallel_size < 1:
        raise ValueError(
            f"--data-parallel-size {args.data_parallel_size}: give 1 (one server) or more (replicas behind a router)"
        )
    if args.pd_device is not None and (args.pd is None or not args.pd.strip().lower().startswith("auto")):
        raise ValueError(
            "--pd-device is the device that --pd auto[:N] splits the instances by; without --pd auto it would be "
            "ignored: drop it, or give --pd auto[:N]"
        )
    if args.pd is not None:  # P prefill + D decode instances in child processes (or Ray actors), the router here
        from infertune.router.launch import parse_pd, serve_pd

        if args.data_parallel_size > 1:
            raise ValueError("--pd and --data-parallel-size are two ways to run instances: give one of them")
        pd = parse_pd(args.pd)
        if args.kv_role is not None or "kv_role" in load_config_file(args.config):
            raise ValueError("--pd sets each instance's kv_role (producer / consumer) itself: drop kv_role")
        if pd == 2:  # auto on 2 instances: the one split there is (no device to measure)
            logging.getLogger("infertune.router").info("--pd auto: 2 instances split only as 1:1 (auto:N for more)")
            pd = (1, 1)
        elif isinstance(pd, int):  # auto:N
            from infertune.plan.pd import choose_pd

            pd = choose_pd(args.model, pd, args.pd_device or "local", args.max_model_len, args.max_num_seqs).split
        return serve_pd(own_argv, pd, args.host, args.port, args.placement, args.kv_connector_config)
    if args.data_parallel_size > 1:  # N replicas in child processes (or Ray actors), the router in this one
        from infertune.router.launch import serve_data_parallel

        return serve_data_parallel(own_argv, args.data_parallel_size, args.host, args.port, args.placement)
    if args.placement != "local":
        raise ValueError("--placement places the instances of --pd or --data-parallel-size: give one of them")
    from infertune.serve.launcher import serve

    # defaults < the --config file < the flags written on the command line (vLLM's order)
    given = flags_given(args)
    flags = engine_kwargs(args)
    options = {**flags, **load_config_file(args.config), **{k: v for k, v in flags.items() if k in given}}
    model = args.model if "model" in given else options.pop("model", None) or args.model
    options.pop("model", None)
    server = dict(
        host=args.host,
        port=args.port,
        api_key=args.api_key or os.environ.get("INFERTUNE_API_KEY") or os.environ.get("VLLM_API_KEY") or None,
        served_model_name=args.served_model_name,
        max_body_bytes=args.max_body_bytes,
        graceful_timeout_s=args.graceful_timeout,
        tool_call_parser=args.tool_call_parser,
        enable_auto_tool_choice=args.enable_auto_tool_choice,
        chat_template=args.chat_template,
    )
    # The server's own settings in a --config file (_SERVER_SETTINGS) go to the server, not the engine (they were
    # passed twice: a TypeError traceback), below the flags written on the command line as the engine options are
    aliases = {"graceful_timeout": "graceful_timeout_s"}
    for key in [k for k in options if aliases.get(k, k) in server]:
        value = options.pop(key)
        if key not in given:
            server[aliases.get(key, key)] = value
    return serve(model, **server, **options)


def _add_generate(sub) -> None:
    gen = sub.add_parser(
        "generate",
        help="generate text for one prompt and print one line of stats",
        description="Generate a completion for PROMPT and print it, then a stats line on stderr "
        "(prompt tokens, time to first token, decode tokens/s). With no --model the built-in demo "
        "model is used.",
    )
    gen.add_argument("prompt", help="the prompt text (with --chat: the user's message)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens to generate (default: 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: 1.0 = off)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (default: 0 = off)")
    gen.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed for reproducible output")
    gen.add_argument("--stop", action="append", help="stop string (repeatable); not included in the output")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument(
        "--token-healing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="take the prompt's last token off and make the output start with its text, so that a prompt ending in "
        "a space or half a word lets the model choose the token boundary (the printed text continues the prompt). "
        "Default: on for the built-in demo model's plain prompts, off otherwise (and for --chat)",
    )
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)


def _add_serve(sub) -> None:
    from infertune.config import port_number

    srv = sub.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API: /v1/completions, "
        "/v1/chat/completions (streaming with stream=true), /v1/models, /health and Prometheus "
        "/metrics (infertune_* and vLLM's vllm:* names, labelled model_name). With no --model the built-in demo "
        "model is served. SIGTERM stops accepting, lets in-flight requests finish within --graceful-timeout, then "
        "exits 0.",
    )
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    srv.add_argument("--port", type=port_number, default=8000, help="port, 0-65535 (0: any free one) (default: 8000)")
    srv.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on /v1/* routes; a wrong or missing key is a 401 with "
        "'WWW-Authenticate: Bearer' (default: $INFERTUNE_API_KEY, else $VLLM_API_KEY)",
    )
    srv.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="model names clients may send, as vLLM's: every one is accepted and listed by /v1/models, the first is "
        "the one responses and /metrics (model_name) report (default: the model folder's name)",
    )
    from infertune.serve.tool_parsers import TOOL_PARSERS

    srv.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how the model writes tool calls, to turn its output into OpenAI tool_calls: hermes (Hermes, Qwen2.5 / "
        "Qwen3; alias qwen2_5), llama3_json (Llama 3.x), mistral (docs/server.md)",
    )
    srv.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide to call tools (tool_choice "auto", the default with tools); needs --tool-call-parser',
    )
    srv.add_argument(
        "--chat-template",
        default=None,
        metavar="FILE|TEMPLATE",
        help="the Jinja chat template of chat requests that send none (a request's own chat_template still wins), "
        "in place of the checkpoint's, for /v1/chat/completions, /tokenize with messages and /tokenizer_info: a file, "
        "or the template itself (\\n read as a newline), as vLLM's (default: the checkpoint's; a model without one "
        "answers chat requests with a 400)",
    )
    srv.add_argument(
        "--max-body-bytes",
        type=int,
        default=4 * 2**20,
        help="largest request body accepted; larger gets 413 (default: 4 MiB)",
    )
    srv.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="options from a file, over the defaults (a flag given on the command line wins, as in vLLM): YAML as "
        "vLLM's --config (keys are the long flag names, "
        "with dashes or underscores: `max-num-seqs: 8`, `served-model-name: [a, b]`, `port: 8000`), or JSON for a "
        ".json file (e.g. from `infertune tune --out-config`); engine options without a flag are taken too; an "
        "unknown key is an error naming it",
    )
    srv.add_argument(
        "--graceful-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish after SIGTERM (default: 10)",
    )
    srv.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        help="replicas of this server, each in its own process with its share of the CPUs, behind `infertune "
        "router` on --host/--port (prefix-cache affinity, requests in flight; docs/distributed.md) (default: 1)",
    )
    srv.add_argument(
        "--pd",
        default=None,
        metavar="P:D|auto[:N]",
        help="prefill/decode disaggregation from one command: P prefill instances (kv_role producer) and D decode "
        "instances (kv_role consumer) with the local KV connector in a KV directory of their own, each with its "
        "share of the CPUs, behind `infertune router` on --host/--port; auto: N instances in all (default 2), split "
        "by the planner's prefill and decode requests/s on --pd-device (docs/distributed.md) (default: off)",
    )
    srv.add_argument(
        "--pd-device",
        default=None,  # (local; None tells a flag given without --pd auto, which nothing would read)
        help="the device whose roofline --pd auto splits by: a catalog name (infertune plan --list-devices) or "
        "local, measured first (a few seconds where bf16 matmuls are native; minutes on a CPU without them) "
        "(default: local)",
    )
    from infertune.router.launch import PLACEMENTS

    srv.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="local",
        help="where the instances of --pd / --data-parallel-size run: local = child processes on 127.0.0.1; ray = "
        "Ray actors on one node of the cluster ray.init() finds, or a local one (pip install 'infertune[ray]') "
        "(default: local)",
    )
    add_engine_args(srv)
    add_limits_args(srv)
    srv.set_defaults(func=cmd_serve)


def _tools() -> tuple:
    """(name, module, help, description) of the tools that bring their own add_arguments(parser) / run(args)."""
    from infertune.distill import command as distill_command
    from infertune.evaluate import command as eval_command
    from infertune.plan import command as plan_command
    from infertune.profile import audit, debug_layers, doctor, profile_cmd
    from infertune.router import command as router_command
    from infertune.tools import quantize as quantize_command
    from infertune.tune import command as tune_command
    from infertune.tune import ledger as ledger_command

    return (
        (
            "profile",
            profile_cmd,
            "where the time goes: categories for prefill and decode, top ops, hints",
            profile_cmd.DESCRIPTION,
        ),
        (
            "doctor",
            doctor,
            "check versions (torch / torch_npu / CANN / CUDA), CPU features, threads",
            "Check Python, torch, transformers, torch_npu and CANN, CUDA and driver against a compatibility matrix "
            "kept as data; CPU features and thread settings; what to fix. Exits 1 on a hard mismatch.",
        ),
        (
            "audit",
            audit,
            "list the aten ops a model step launches and how a backend runs each",
            "Trace a prefill and a decode step of the model, list every aten op with counts and example shapes, and "
            "mark which the target backend runs natively and which would fall back to the CPU, with mapping hints and "
            "dynamic-shape hazards. Needs no target hardware.",
        ),
        (
            "debug-layers",
            debug_layers,
            "find the first module that goes NaN/Inf or drifts from an fp32 run",
            "Run the prompt in the chosen dtype and in fp32 with hooks on every module and report the first module "
            "whose output is non-finite or diverges beyond --threshold (the equivalent of ASCEND_LAYER_DEBUG=1). "
            "Exits 1 when it finds one.",
        ),
        (
            "plan",
            plan_command,
            "capacity, speed and cost of a model on a device (no hardware needed)",
            plan_command.DESCRIPTION,
        ),
        (
            "tune",
            tune_command,
            "sweep batch settings under an SLO; recommend online and offline configs",
            tune_command.DESCRIPTION,
        ),
        (
            "router",
            router_command,
            "one OpenAI endpoint over prefill + decode instances (P/D) or replicas (data parallel)",
            router_command.DESCRIPTION,
        ),
        (
            "ledger",
            ledger_command,
            "the step-by-step optimization table, measured on this machine",
            ledger_command.DESCRIPTION,
        ),
        (
            "eval",
            eval_command,
            "accuracy against a reference: perplexity, KL, top-1 agreement, greedy prefix",
            eval_command.DESCRIPTION,
        ),
        (
            "quantize",
            quantize_command,
            "write a quantized checkpoint (w8a16 / w4a16 / w8a8, calibration), then eval it",
            quantize_command.DESCRIPTION,
        ),
        (
            "distill",
            distill_command,
            "distil a teacher into a small student (KD loss, checkpoints, resume)",
            distill_command.DESCRIPTION,
        ),
        (
            "train",
            distill_command.TRAIN,
            "train a model from scratch with cross-entropy (same data pipeline)",
            distill_command.TRAIN_DESCRIPTION,
        ),
    )


def _add_tools(sub) -> None:
    # Each module imports its heavy dependencies lazily inside run, so --help stays fast.
    for name, module, help_, description in _tools():
        tool = sub.add_parser(name, help=help_, description=description)
        module.add_arguments(tool)
        tool.set_defaults(func=module.run)


def _add_bench(sub) -> None:
    from infertune.bench import longctx, offline, serve_load, soak

    bench = sub.add_parser(
        "bench",
        help="benchmarks: bench throughput / latency (offline), bench serve / soak (HTTP), bench longctx",
        description="Benchmarks. `bench throughput` and `bench latency` run infertune beside HF "
        "transformers on the same model and workload; `bench serve` load-tests any OpenAI-compatible "
        "server.",
    )
    bench_sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCH")
    bench_serve = bench_sub.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (Poisson arrivals, TTFT/TPOT/ITL percentiles)",
        description="Send a workload to an OpenAI-compatible server (infertune, vLLM, llama.cpp) and report "
        "throughput, TTFT / TPOT / ITL / end-to-end latency percentiles, goodput under an SLO, and failures.",
    )
    serve_load.add_arguments(bench_serve)
    bench_serve.set_defaults(func=serve_load.run)
    bench_soak = bench_sub.add_parser(
        "soak",
        help="soak-test an infertune server: many requests, hanging-up clients, /health and RSS watched",
        description=soak.__doc__.split("\n\n")[0],
        epilog="\n\n".join(soak.__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    soak.add_arguments(bench_soak)
    bench_soak.set_defaults(func=soak.run)
    bench_longctx = bench_sub.add_parser(
        "longctx",
        help="long contexts on a fixed KV budget: full / window / SnapKV / the seeds' policy, memory, speed, accuracy",
        description=longctx.__doc__.split("\n\n")[0],
        epilog="\n\n".join(longctx.__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    longctx.add_arguments(bench_longctx)
    bench_longctx.set_defaults(func=longctx.run)
    for name, batches, help_ in (
        (
            "throughput",
            [1, 16],
            "offline throughput: infertune vs HF transformers (and quantized variants), side by side",
        ),
        ("latency", [1], "batch-1 latency: TTFT and decode tok/s, infertune vs HF transformers"),
    ):
        cmd = bench_sub.add_parser(
            name,
            help=help_,
            description=offline.__doc__.split("\n\n")[0],
            epilog="\n\n".join(offline.__doc__.split("\n\n")[1:]),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        offline.add_arguments(cmd, default_batch=batches)
        cmd.set_defaults(func=offline.run)


class _ExactParser(argparse.ArgumentParser):
    """A parser (and, through add_subparsers, every subcommand's) that takes flags as written only: argparse's
    prefix matching turned a ported `--tokenizer X` into the hidden `--tokenizer-mode X` (ignored, with a warning
    that named the wrong option)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    parser = _ExactParser(
        prog="infertune",
        description="LLM inference engine and tuning toolkit. Run `infertune COMMAND --help` for a command's options.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log engine details")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_generate(sub)
    _add_serve(sub)
    _add_tools(sub)
    _add_bench(sub)
    return parser


def _innermost(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command args names (`bench latency`'s, not infertune's)."""
    while True:
        sub = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
        chosen = getattr(args, sub.dest, None) if sub is not None else None
        if chosen not in getattr(sub, "choices", {}):
            return parser
        parser = sub.choices[chosen]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # (said by the subcommand's parser: its usage line, not the top-level one's)
        _innermost(parser, args).error(f"unrecognized arguments: {' '.join(extra)}")
    args.argv = list(sys.argv[1:] if argv is None else argv)  # (serve --data-parallel-size relaunches with them)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    from infertune.files import report_to_stderr

    try:
        with report_to_stderr(args):  # (a bare --json: stdout holds the JSON alone)
            return args.func(args)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"infertune {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
