#!/usr/bin/env python3
"""W8A16 at one row (a decode step's linears): the AVX-512 library's two ways of reading the int8 weights, and W8A8's
packed GEMM on the same bytes, for the 386M model's four linear shapes.

  blocks  w8_block: 4 weight rows side by side, 64 columns at a time (4 streams a thread); it_w8_row1(0)
  rows    w8_row1: each weight row whole before the next (one sequential run a thread); the default
  w8a8    it_linear_w8a8 on the weights packed at load (one stream a thread; int8 activations)

Each call cycles through 24 copies of its shape (the weights stream from memory, as in a decode step); the three
paths take turns, --rounds times, each round timing --iters passes over the copies; medians per shape, in GB/s of
int8 weights, and the four shapes' sum (a layer's set).

    python benchmarks/bench_w8_one_row.py --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--iters", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from infertune.bench.offline import cpu_model
    from infertune.kernels import cpu
    from infertune.quant.int8 import quantize_int8_per_channel

    torch.set_num_threads(args.threads)
    if cpu.variant() not in ("avx512", "avx512-noamx"):
        print(f"the AVX-512 kernels do not run here: {cpu.describe()}")
        return 1
    lib = cpu.library()
    print(f"CPU: {cpu_model()}; kernels: {cpu.describe()}; {args.threads} threads")
    g = torch.Generator().manual_seed(0)
    shapes = ((1152, 896), (896, 896), (9728, 896), (896, 4864))  # qkv, o, gate_up, down
    data = {}
    for n, k in shapes:
        qs = [quantize_int8_per_channel(torch.randn(n, k, generator=g)) for _ in range(24)]
        data[n, k] = (qs, [cpu.pack_w8a8(q.contiguous()) for q, _ in qs], torch.randn(1, k, generator=g).bfloat16())

    def timed(fn) -> float:
        t = time.perf_counter()
        for _ in range(args.iters):
            for i in range(24):
                fn(i)
        return (time.perf_counter() - t) / args.iters / 24

    times = {s: {"blocks": [], "rows": [], "w8a8": []} for s in shapes}
    try:
        for _ in range(args.rounds):
            for s, (qs, packed, x) in data.items():
                lib.it_w8_row1(0)
                times[s]["blocks"].append(timed(lambda i, x=x, qs=qs: cpu.linear_w8(x, qs[i][0], qs[i][1])))
                lib.it_w8_row1(1)
                times[s]["rows"].append(timed(lambda i, x=x, qs=qs: cpu.linear_w8(x, qs[i][0], qs[i][1])))
                times[s]["w8a8"].append(timed(lambda i, x=x, p=packed, qs=qs: cpu.linear_w8a8(x, p[i], qs[i][1])))
    finally:
        lib.it_w8_row1(1)
    print("| shape [N, K] | blocks GB/s | rows GB/s | w8a8 GB/s |")
    print("|---|---:|---:|---:|")
    total = dict.fromkeys(("blocks", "rows", "w8a8"), 0.0)
    for (n, k), by in times.items():
        med = {p: statistics.median(v) for p, v in by.items()}
        for p in total:
            total[p] += med[p]
        print(f"| [{n}, {k}] | " + " | ".join(f"{n * k / med[p] / 1e9:.1f}" for p in total) + " |")
    print(
        f"\na layer's set: blocks {total['blocks'] * 1e6:.0f} us, rows {total['rows'] * 1e6:.0f} us, "
        f"w8a8 {total['w8a8'] * 1e6:.0f} us; rows {total['blocks'] / total['rows']:.2f}x blocks, "
        f"w8a8 {total['rows'] / total['w8a8']:.2f}x rows"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
