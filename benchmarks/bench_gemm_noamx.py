#!/usr/bin/env python3
"""bf16 linears without AMX: the VDPBF16PS GEMM (csrc/x86/avx512/gemm_dpbf16.c) against the GEMV it replaces past
its crossover (the old path at every row count) and torch's GEMM (oneDNN), on the 386M model's four linear shapes.

The AVX-512 library with its AMX paths off (what a Zen 4 / 5 runs; on an AMX machine too, it_amx_disable). Each
path writes into a preallocated output (torch.matmul(out=)), so none pays for fresh pages, and each call takes the next
of enough copies of W to fill --stream-mb (96 MB: past the L3, so the weights stream from memory as a model's do);
per row count and shape the three take turns (gemv, gemm, torch, twice) and each reports the better of its two
medians. The header says from how many rows it_linear_bf16 takes the GEMM here (it_gemm_rows_noamx(), 4x that past
K = 2048) and up to how many the engine sends to the kernels (kernels.bf16_max_rows()).

    python benchmarks/bench_gemm_noamx.py --rows 1,2,4,8,16,64,128,256 --threads 2
"""

from __future__ import annotations

import argparse
import functools
import itertools
import os
import sys

from gemm_common import SHAPES, median_seconds

from infertune.bench.offline import cpu_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,16,64,128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=15)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--stream-mb", type=int, default=96, help="cycle through copies of W this large (0: one copy)")
    args = ap.parse_args()

    import torch

    from infertune.kernels import cpu as kernels

    lib = kernels.load_variant("avx512")
    if isinstance(lib, str):
        print(f"the AVX-512 kernels do not run here: {lib}")
        return 1
    if kernels.variant() == "avx512" and kernels.describe().endswith("amx"):
        lib.it_amx_disable()  # (the process's library: measure what a CPU without AMX runs)
    torch.set_num_threads(args.threads)
    flags = kernels._cpu_flags()
    print(f"$ python benchmarks/bench_gemm_noamx.py {' '.join(sys.argv[1:])}")
    print(
        f"CPU: {cpu_model()} ({'AMX present, switched off here' if 'amx_bf16' in flags else 'no AMX'}), "
        f"{args.threads} threads, load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}, torch "
        f"{torch.__version__} ({torch.backends.cpu.get_cpu_capability()})"
    )
    gemm_from = lib.it_gemm_rows_noamx(0)
    print(f"it_linear_bf16 takes the GEMM from {gemm_from} rows; the engine sends up to {kernels.bf16_max_rows()}")

    def timed(fn) -> float:
        return median_seconds(fn, args.iters)

    print("| rows | shape (K x N) | old GEMV GFLOP/s | new GEMM GFLOP/s | torch GFLOP/s | GEMM / torch | GEMM / GEMV |")
    print("|---:|---|---:|---:|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            x = torch.randn(m, k).bfloat16()
            # copies of W past the L3 (a model's weights stream from memory; one copy would stay in cache)
            copies = max(1, -(-args.stream_mb * 2**20 // (n * k * 2)))
            ws = [(torch.randn(n, k) / k**0.5).bfloat16() for _ in range(copies)]
            turn = itertools.cycle(ws)
            ys = {p: torch.empty(m, n, dtype=torch.bfloat16) for p in ("gemv", "gemm", "torch")}

            def c_call(fn, y, x=x, m=m, n=n, k=k, turn=turn):
                fn(x.data_ptr(), k, next(turn).data_ptr(), None, y.data_ptr(), n, m, n, k, args.threads)

            fns = {
                "gemv": functools.partial(c_call, lib.it_linear_bf16_gemv, ys["gemv"]),
                "gemm": functools.partial(c_call, lib.it_linear_bf16_gemm_noamx, ys["gemm"]),
                "torch": lambda y=ys["torch"], x=x, turn=turn: torch.matmul(x, next(turn).t(), out=y),
            }
            best = dict.fromkeys(fns, float("inf"))
            for _ in range(2):
                for p, fn in fns.items():
                    best[p] = min(best[p], timed(fn))
            w = ws[0]  # (each path once more on one copy, for the check below)
            for p, fn in (("gemv", lib.it_linear_bf16_gemv), ("gemm", lib.it_linear_bf16_gemm_noamx)):
                fn(x.data_ptr(), k, w.data_ptr(), None, ys[p].data_ptr(), n, m, n, k, args.threads)
            torch.matmul(x, w.t(), out=ys["torch"])
            ref = x.double() @ w.double().t()
            for p, y in ys.items():  # (every path within bf16 rounding of the float64 product)
                torch.testing.assert_close(y.double(), ref, rtol=2**-7, atol=2**-7, msg=p)
            fl = 2 * m * k * n
            g = {p: fl / t / 1e9 for p, t in best.items()}
            print(
                f"| {m} | {name} ({k} x {n}) | {g['gemv']:.0f} | {g['gemm']:.0f} | {g['torch']:.0f} | "
                f"{best['torch'] / best['gemm']:.2f}x | {best['gemv'] / best['gemm']:.2f}x |",
                flush=True,
            )
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
