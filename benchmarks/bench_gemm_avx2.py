#!/usr/bin/env python3
"""bf16 linears on AVX2 + FMA: the FMA GEMM (csrc/x86/avx2/gemm.c) against the AVX2 GEMVs it takes over from (the
GEMV, and the GEMV on x widened once: gemv.c) and torch's GEMM limited to AVX2 (what an AVX2-only CPU gets), on the
386M model's four linear shapes.

torch is limited to AVX2 in this process (ATEN_CPU_CAPABILITY=avx2, ONEDNN_MAX_CPU_ISA=AVX2, set before torch is
imported; --torch-full-isa leaves it alone). Each path writes into a preallocated output, and each call takes the
next of enough copies of W to fill --stream-mb (96 MB: past the L3, so the weights stream from memory as a model's
do); per row count and shape the three take turns (gemv, gemm, torch, twice) and each reports the better of its two
medians. Every path is checked against the float64 product. The header says from how many rows it_linear_bf16 takes
the widened-x GEMV (it_gemvx_rows()) and the GEMM (it_gemm_rows_fma()), and up to how many the engine sends bf16
linears to the kernels on AVX2.

    python benchmarks/bench_gemm_avx2.py --rows 1,2,4,8,16,64,128,512 --threads 2
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
    ap.add_argument("--iters", type=int, default=9)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--stream-mb", type=int, default=96, help="cycle through copies of W this large (0: one copy)")
    ap.add_argument("--torch-full-isa", action="store_true", help="leave torch's ISA alone (default: AVX2)")
    ap.add_argument("--no-torch", action="store_true", help="skip torch's GEMM (slow at prefill sizes on AVX2)")
    args = ap.parse_args()
    if not args.torch_full_isa:
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")

    import torch

    from infertune.kernels import cpu as kernels
    from infertune.kernels import x86

    lib = kernels.load_variant("avx2")
    if isinstance(lib, str):
        print(f"the AVX2 kernels do not run here: {lib}")
        return 1
    torch.set_num_threads(args.threads)
    print(f"$ python benchmarks/bench_gemm_avx2.py {' '.join(sys.argv[1:])}")
    print(
        f"CPU: {cpu_model()}, {args.threads} threads, load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}, "
        f"torch {torch.__version__} ({torch.backends.cpu.get_cpu_capability()}, "
        f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', 'unset')})"
    )
    print(
        f"it_linear_bf16 takes the widened-x GEMV from {lib.it_gemvx_rows(0)} rows, the GEMM from "
        f"{lib.it_gemm_rows_fma(0)}; the engine sends bf16 linears of up to "
        f"{x86.Avx2Kernels(lib).max_rows('bf16')} rows to the kernels on AVX2"
    )

    def timed(fn) -> float:
        return median_seconds(fn, args.iters)

    print(
        "| rows | shape (K x N) | GEMV GFLOP/s | GEMV, x widened GFLOP/s | FMA GEMM GFLOP/s | torch GFLOP/s | "
        "GEMM / torch | GEMV x widened / GEMV | GEMM / GEMV x widened |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            x = torch.randn(m, k).bfloat16()
            copies = max(1, -(-args.stream_mb * 2**20 // (n * k * 2)))
            ws = [(torch.randn(n, k) / k**0.5).bfloat16() for _ in range(copies)]
            turn = itertools.cycle(ws)
            ys = {p: torch.empty(m, n, dtype=torch.bfloat16) for p in ("gemv", "gemvx", "gemm", "torch")}

            def c_call(fn, y, x=x, m=m, n=n, k=k, turn=turn):
                fn(x.data_ptr(), k, next(turn).data_ptr(), None, y.data_ptr(), n, m, n, k, args.threads)

            fns = {
                "gemv": functools.partial(c_call, lib.it_linear_bf16_gemv, ys["gemv"]),
                "gemvx": functools.partial(c_call, lib.it_linear_bf16_gemvx, ys["gemvx"]),
                "gemm": functools.partial(c_call, lib.it_linear_bf16_gemm_fma, ys["gemm"]),
            }
            if not args.no_torch:
                fns["torch"] = lambda y=ys["torch"], x=x, turn=turn: torch.matmul(x, next(turn).t(), out=y)
            best = dict.fromkeys(fns, float("inf"))
            for _ in range(2):
                for p, fn in fns.items():
                    best[p] = min(best[p], timed(fn))
            w = ws[0]
            for p, fn in (
                ("gemv", lib.it_linear_bf16_gemv),
                ("gemvx", lib.it_linear_bf16_gemvx),
                ("gemm", lib.it_linear_bf16_gemm_fma),
            ):
                fn(x.data_ptr(), k, w.data_ptr(), None, ys[p].data_ptr(), n, m, n, k, args.threads)
            if "torch" in fns:
                torch.matmul(x, w.t(), out=ys["torch"])
            ref = x.double() @ w.double().t()
            for p in fns:
                torch.testing.assert_close(ys[p].double(), ref, rtol=2**-7, atol=2**-7, msg=p)
            assert torch.equal(ys["gemv"], ys["gemvx"])  # (the same sums in the same order)
            fl = 2 * m * k * n
            g = {p: fl / t / 1e9 for p, t in best.items()}
            tg = f"{g['torch']:.1f}" if "torch" in g else "-"
            ratio = f"{best['torch'] / best['gemm']:.2f}x" if "torch" in g else "-"
            print(
                f"| {m} | {name} ({k} x {n}) | {g['gemv']:.1f} | {g['gemvx']:.1f} | {g['gemm']:.1f} | {tg} | {ratio} | "
                f"{best['gemv'] / best['gemvx']:.2f}x | {best['gemvx'] / best['gemm']:.2f}x |",
                flush=True,
            )
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
