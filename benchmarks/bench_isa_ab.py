#!/usr/bin/env python3
"""A/B of the CPU kernel variants: batch-1 and batch-16 decode with each ISA path this CPU can run, in alternating
processes (the variant, and whether AMX is on, is per process), the order reversed on odd rounds.

Variants (each a child process; the one that runs is printed from inside it, `kernels.cpu.describe()`):
  avx512        INFERTUNE_CPU_ISA=avx512        AVX-512 BF16 / VNNI + AMX where present, the fused step
  avx512-noamx  INFERTUNE_CPU_ISA=avx512-noamx  the same library with the AMX paths off (what a Zen 4 / 5 runs)
  noamx-gemv    ... and INFERTUNE_NOAMX_GEMM=0     without its VDPBF16PS GEMM (the GEMV to 16 rows, torch's GEMM past)
  avx2          INFERTUNE_CPU_ISA=avx2          the AVX2 + FMA GEMVs, FMA GEMM, elementwise kernels and fused step
  torch         INFERTUNE_CPU_KERNELS=0         torch's operators only
With --torch-avx2, the avx2 and torch rows also run torch limited to AVX2 (ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2): what an AVX2-only CPU gets.

    python benchmarks/bench_isa_ab.py --rounds 3                                  # 386M preset, bf16, b1 and b16
    python benchmarks/bench_isa_ab.py --quant w8a16 --torch-avx2 --rounds 3
    python benchmarks/bench_isa_ab.py --model /tmp/tiny --input-len 8 --output-len 4 --rounds 1 --batches 1,2

Timings on a shared machine mean nothing; compare ratios from one run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

VARIANTS = {
    "avx512": {"INFERTUNE_CPU_ISA": "avx512"},
    # (oneDNN limited too: on an AMX machine torch's bf16 GEMM would otherwise take the tiles a Zen lacks)
    "avx512-noamx": {"INFERTUNE_CPU_ISA": "avx512-noamx", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"},
    "noamx-gemv": {
        "INFERTUNE_CPU_ISA": "avx512-noamx",
        "INFERTUNE_NOAMX_GEMM": "0",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
    },
    "avx2": {"INFERTUNE_CPU_ISA": "avx2"},
    "torch": {"INFERTUNE_CPU_KERNELS": "0"},
}
TORCH_AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def runnable() -> list[str]:
    flags = _flags()
    out = []
    if {"avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"} <= flags:
        out += ["avx512", "avx512-noamx", "noamx-gemv"]
    if {"avx2", "fma", "f16c"} <= flags:
        out.append("avx2")
    return out + ["torch"]


def child(args) -> int:
    """One process, one variant: load the engine, one warm-up per batch size, then one timed generate each."""
    sys.path.insert(0, str(Path(__file__).parent))
    import torch
    from ab_common import bench_model, timed_generate

    from infertune import LLM
    from infertune.bench.offline import read_model_config
    from infertune.kernels import cpu

    torch.set_num_threads(args.threads)
    model = bench_model(args.model)
    vocab = read_model_config(model)["vocab_size"]
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(
        str(model),
        dtype="bfloat16",
        quantization=args.quant,
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=max(batches),
        kv_cache_memory_bytes=512 << 20,
        enable_prefix_caching=False,
    )
    runner = llm.engine.executor.runner
    kernels = runner.decode_kernels
    info = {
        "variant": cpu.describe(),
        "kernels": kernels.name if kernels is not None else None,
        "fused": runner.fused is not None,
        "torch_cap": torch.backends.cpu.get_cpu_capability(),
        "runs": {},
    }
    for b in batches:
        timed_generate(llm, b, args.input_len, args.output_len, vocab, -1)  # warm-up
        info["runs"][b] = timed_generate(llm, b, args.input_len, args.output_len, vocab, args.round)
    print("RESULT " + json.dumps(info))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF folder (default: the 386m preset of bench throughput)")
    ap.add_argument("--quant", default=None, choices=[None, "w8a16", "w4a16"])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--variants", default=None, help="comma list (default: every one this CPU runs)")
    ap.add_argument("--torch-avx2", action="store_true", help="limit torch to AVX2 for the avx2 and torch rows")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--round", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)

    names = args.variants.split(",") if args.variants else runnable()
    cmd = ["python", "benchmarks/bench_isa_ab.py", *sys.argv[1:]]
    print("$ " + " ".join(cmd))
    results: dict[str, list[dict]] = {n: [] for n in names}
    seen: dict[str, dict] = {}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            env = {**os.environ, **VARIANTS[name]}
            if args.torch_avx2 and name in ("avx2", "torch"):
                env.update(TORCH_AVX2)
            argv = [sys.executable, __file__, "--child", "--round", str(r)] + [
                a for a in sys.argv[1:] if a not in ("--torch-avx2",)
            ]
            proc = subprocess.run(argv, env=env, capture_output=True, text=True)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            if proc.returncode != 0 or line is None:
                print(f"[{name}] failed (rc {proc.returncode}): {proc.stderr.strip()[-1500:]}")
                continue
            info = json.loads(line[len("RESULT ") :])
            seen[name] = info
            results[name].append(info["runs"])
    print(f"quant {args.quant or 'bf16'}, {args.threads} threads, {args.input_len} + {args.output_len} tokens")
    print(
        "| variant | ISA path that ran | kernels | fused step | torch ISA | batch | TTFT s | decode tok/s | output tok/s |"
    )
    print("|---|---|---|---|---|---:|---:|---:|---:|")
    for name in names:
        if not results[name]:
            continue
        info = seen[name]
        for b in args.batches.split(","):
            rows = [runs[b] for runs in results[name]]
            med = {k: statistics.median(x[k] for x in rows) for k in ("ttft", "dec", "out")}
            print(
                f"| {name} | {info['variant']} | {info['kernels']} | {info['fused']} | {info['torch_cap']} | {b} | "
                f"{med['ttft']:.3f} | {med['dec']:.1f} | {med['out']:.1f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
