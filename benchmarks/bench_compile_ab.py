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

import argparse
import statistics
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the 386m preset of bench throughput)")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=4, help="timed (eager, compiled) pairs (default: 4)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from ab_common import interleave
    from infertune import LLM
    from infertune.bench.offline import ensure_model, read_model_config
    from pathlib import Path

    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else ensure_model("386m", Path("/tmp/infertune-bench"))
    vocab = read_model_config(model)["vocab_size"]
    opts = dict(dtype="bfloat16", max_model_len=args.input_len + args.output_len, max_num_seqs=args.batch,
                kv_cache_memory_bytes=512 << 20, enable_prefix_caching=False)
    engines = {"eager": LLM(str(model), compile="off", **opts)}
    t0 = time.perf_counter()
    engines["compiled"] = LLM(str(model), compile="on", **opts)
    load_compiled = time.perf_counter() - t0
    compile_s = engines["compiled"].engine.executor.runner.compile_seconds
    res = interleave(engines, args.batch, args.input_len, args.output_len, vocab, args.rounds)
    print(f"$ python benchmarks/bench_compile_ab.py --batch {args.batch} --input-len {args.input_len} "
          f"--output-len {args.output_len} --rounds {args.rounds}")
    print(f"model {model}, bf16, {args.threads} threads; compiled engine load {load_compiled:.1f} s "
          f"(compile {compile_s:.1f} s)")
    print("| engine | TTFT s | decode tok/s | output tok/s |\n|---|---:|---:|---:|")
    for name, rows in res.items():
        print(f"| {name} | {statistics.median(r['ttft'] for r in rows):.3f} | "
              f"{statistics.median(r['dec'] for r in rows):.1f} | {statistics.median(r['out'] for r in rows):.1f} |")
    ratios = {k: [c[k] / e[k] for c, e in zip(res["compiled"], res["eager"])] for k in ("ttft", "dec", "out")}
    print("per-round compiled / eager: " + "; ".join(
        f"{k} " + ", ".join(f"{v:.2f}" for v in vals) for k, vals in ratios.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
