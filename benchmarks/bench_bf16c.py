#!/usr/bin/env python3
"""The linears of a decode step from bf16 weights as they are against the same weights in the kernels' lossless
12-bit layout (kernels/cpu.py pack_bf16c), on the 386M model's shapes.

Every layer has its own random weights (N(0, 0.02), as the benchmark model's), so a step streams 683 MB of bf16
weights (512 MB packed) from memory, as in a real decode step; the two layouts alternate step by step. Prints the
median ms per step's linears (qkv, o_proj, gate_up, down of every layer) for each row count and the speed-up.

    python benchmarks/bench_bf16c.py --rows 1,16
"""

from __future__ import annotations

import argparse
import statistics

from ab_common import alternating_ms

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # (N, K) of qkv, o_proj, gate_up, down


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from infertune.kernels import cpu as kernels

    if not kernels.available() or not kernels.bf16c_supported(16, 32):
        print(f"the 12-bit layout does not run here: {kernels.describe()}")
        return 1
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    raw, packed = [], []
    for _ in range(args.layers):
        for n, k in SHAPES:
            w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
            p = kernels.pack_bf16c(w)
            raw.append(w)
            packed.append((p, kernels.bf16c_struct(p), n))
    raw_mb = sum(w.numel() * 2 for w in raw) / 1e6
    packed_mb = sum(sum(t.numel() * t.element_size() for t in p.values()) for p, _, _ in packed) / 1e6
    print(f"$ python benchmarks/bench_bf16c.py --rows {args.rows} --layers {args.layers} --steps {args.steps}")
    print(
        f"{args.threads} threads; {raw_mb:.0f} MB of bf16 weights, {packed_mb:.0f} MB packed "
        f"({packed_mb / raw_mb:.3f}); median over {args.steps} steps, the layouts alternating"
    )
    print("| rows | bf16 ms per step | 12-bit ms per step | speed-up | bf16 GB/s | 12-bit GB/s (bf16-equivalent) |")
    print("|---:|---:|---:|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=gen).to(torch.bfloat16) for k in {k for _, k in SHAPES}}
        times = alternating_ms(
            {
                "bf16": lambda xs=xs: [kernels.linear_bf16(xs[w.shape[1]], w) for w in raw],
                "12-bit": lambda xs=xs: [
                    kernels.linear_bf16c(xs[w.shape[1]], desc, n) for (_, desc, n), w in zip(packed, raw)
                ],
            },
            args.steps,
        )
        a, b = statistics.median(times["bf16"]), statistics.median(times["12-bit"])
        print(f"| {m} | {a:.1f} | {b:.1f} | {a / b:.2f}x | {raw_mb / a:.1f} | {raw_mb / b:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
