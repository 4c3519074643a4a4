#!/usr/bin/env python3
"""What each decode fast path gains, interleaved in one process so machine drift cancels out.

Engines on the same checkpoint with decode_kernels="off" (torch's matmuls, oneDNN-prepacked bf16 weights),
"linear" (infertune's GEMV / AMX kernels under the per-op PyTorch forward) and "auto" (the kernels plus the fused
decode step: every layer in one call, workspace allocated once, attention read straight from the paged blocks)
take turns, each a full generate of B prompts x (input + output) tokens, greedy, EOS ignored. Reports the median
TTFT, decode tok/s and output tok/s of each, and per-round ratios against "off". On this 2-core machine separate
processes minutes apart differ by more than some of these effects, which is why this script exists beside
`infertune bench throughput`.

    python benchmarks/bench_decode_ab.py --batch 1 --quantization none,w8a16,w4a16
    python benchmarks/bench_decode_ab.py --batch 16
"""

from __future__ import annotations

import argparse
import statistics

MODES = ("off", "linear", "auto")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the 386m preset of bench throughput)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds over every engine (default: 3)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="none", help="comma list of none, w8a16, w4a16 (default: none)")
    args = ap.parse_args()

    import torch

    from ab_common import interleave
    from infertune import LLM
    from infertune.bench.offline import ensure_model, read_model_config
    from pathlib import Path

    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else ensure_model("386m", Path("/tmp/infertune-bench"))
    vocab = read_model_config(model)["vocab_size"]
    print(f"$ python benchmarks/bench_decode_ab.py --batch {args.batch} --input-len {args.input_len} "
          f"--output-len {args.output_len} --rounds {args.rounds} --quantization {args.quantization}")
    print(f"model {model}, bf16, {args.threads} threads, batch {args.batch}")
    print("| weights | decode kernels | TTFT s | decode tok/s | output tok/s | decode vs off (per round) |")
    print("|---|---|---:|---:|---:|---|")
    for quant in args.quantization.split(","):
        q = None if quant == "none" else quant
        opts = dict(dtype="bfloat16", max_model_len=args.input_len + args.output_len, max_num_seqs=args.batch,
                    kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False, quantization=q)
        engines = {mode: LLM(str(model), decode_kernels=mode, **opts) for mode in MODES}
        res = interleave(engines, args.batch, args.input_len, args.output_len, vocab, args.rounds)
        for name, rows in res.items():
            ratio = ", ".join(f"{a['dec'] / b['dec']:.2f}" for a, b in zip(rows, res["off"]))
            print(f"| {quant} | {name} | {statistics.median(r['ttft'] for r in rows):.3f} | "
                  f"{statistics.median(r['dec'] for r in rows):.1f} | {statistics.median(r['out'] for r in rows):.1f} "
                  f"| {ratio} |", flush=True)
        del engines
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
