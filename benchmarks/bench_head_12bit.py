#!/usr/bin/env python3
"""A decode step's LM head at one row: the bf16 GEMV against the same matrix's lossless 12-bit copy (what a tied head
multiplies with compress_weights=auto), the weights streamed from memory (a 256 MiB buffer written before each
call), interleaved in one process so machine drift cancels out. Prints the CPU's kernel variant and a bandwidth probe
per round, so rows from different CPUs are not mixed up.

    python benchmarks/bench_head_12bit.py
    python benchmarks/bench_head_12bit.py --shapes 32000x896,151936x1024 --rounds 3
"""

from __future__ import annotations

import argparse
import time


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", default="32000x896,32000x1024", help="vocab x hidden of the heads timed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=15, help="timed calls of each path a round (the median kept)")
    args = parser.parse_args()
    import torch

    from infertune.bench.offline import bandwidth_probe
    from infertune.kernels import cpu, x86

    k = x86.kernels()
    if k is None or not cpu.bf16c_supported(16, 32):
        print(f"the 12-bit layout does not run here: {cpu.describe()}")
        return 1
    print(f"kernels: {cpu.describe()}; {torch.get_num_threads()} threads")
    evict = torch.empty(256 << 20, dtype=torch.uint8)
    for shape in args.shapes.split(","):
        n, h = (int(v) for v in shape.split("x"))
        w = (torch.randn(n, h) * 0.02).bfloat16()
        packed = k.compress(w)
        x = torch.randn(1, h).bfloat16()

        def median_ms(fn) -> float:
            ts = []
            for _ in range(args.calls):
                evict.add_(1)
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return sorted(ts)[len(ts) // 2] * 1e3

        for r in range(args.rounds):
            plain = median_ms(lambda x=x, w=w: k.linear_bf16(x, w))
            compressed = median_ms(lambda x=x, packed=packed: packed.linear(x))
            print(
                f"{n} x {h}, round {r + 1}: bf16 GEMV {plain:.2f} ms, 12-bit {compressed:.2f} ms, "
                f"{plain / compressed:.2f}x; probe {bandwidth_probe(1.0, torch.get_num_threads(), 3):.1f} GB/s"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
