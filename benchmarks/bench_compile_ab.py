#!/usr/bin/env python3
"""A/B of the compiled forward against eager, interleaved in one process so machine drift cancels out.

Two engines on the same checkpoint (compile="off" and compile="on") take turns: eager run, compiled run, eager,
compiled, ... each a full generate of B prompts x (input + output) tokens, greedy, EOS ignored. Reports the
median TTFT, decode tok/s and output tok/s of each, the per-run ratios compiled / eager, and the compile time.
On this 2-core machine separate processes minutes apart differ by more than the effect measured here, which is
why this script exists beside `infertune bench throughput`.

    python benchmarks/bench_compile_ab.py --batch 16 --rounds 4      # 386M preset (built by bench throughput)
"""

from __future__ import annotations

import statistics
import time

from ab_common import ab_parser, bench_model, interleave


def main() -> int:
    ap = ab_parser(__doc__, batch=16, output_len=128, rounds=4, rounds_help="timed (eager, compiled) pairs")
    args = ap.parse_args()

    import torch

    from infertune import LLM
    from infertune.bench.offline import read_model_config

    torch.set_num_threads(args.threads)
    model = bench_model(args.model)
    vocab = read_model_config(model)["vocab_size"]
    opts = dict(
        dtype="bfloat16",
        max_model_len=args.input_len + args.output_len,
        max_num_seqs=args.batch,
        kv_cache_memory_bytes=512 << 20,
        enable_prefix_caching=False,
    )
    engines = {"eager": LLM(str(model), compile="off", **opts)}
    t0 = time.perf_counter()
    engines["compiled"] = LLM(str(model), compile="on", **opts)
    load_compiled = time.perf_counter() - t0
    compile_s = engines["compiled"].engine.executor.runner.compile_seconds
    res = interleave(engines, args.batch, args.input_len, args.output_len, vocab, args.rounds)
    print(
        f"$ python benchmarks/bench_compile_ab.py --batch {args.batch} --input-len {args.input_len} "
        f"--output-len {args.output_len} --rounds {args.rounds}"
    )
    print(
        f"model {model}, bf16, {args.threads} threads; compiled engine load {load_compiled:.1f} s "
        f"(compile {compile_s:.1f} s)"
    )
    print("| engine | TTFT s | decode tok/s | output tok/s |\n|---|---:|---:|---:|")
    for name, rows in res.items():
        print(
            f"| {name} | {statistics.median(r['ttft'] for r in rows):.3f} | "
            f"{statistics.median(r['dec'] for r in rows):.1f} | {statistics.median(r['out'] for r in rows):.1f} |"
        )
    ratios = {k: [c[k] / e[k] for c, e in zip(res["compiled"], res["eager"])] for k in ("ttft", "dec", "out")}
    print(
        "per-round compiled / eager: "
        + "; ".join(f"{k} " + ", ".join(f"{v:.2f}" for v in vals) for k, vals in ratios.items())
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
