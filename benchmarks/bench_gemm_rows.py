#!/usr/bin/env python3
"""infertune's bf16 linear kernel against torch's GEMM at 16-128 rows, on the 386M model's four linear shapes.

Rows between a decode step and a prefill: decode batches past 16, short prompts, mixed steps. Both write into
preallocated outputs (torch.matmul(out=)), so neither pays for fresh pages; each size and shape takes turns
(kernel, torch, kernel, torch) and reports the better of two medians. The engine sends bf16 linears of up to
kernels.bf16_max_rows() rows to the kernel.

    python benchmarks/bench_gemm_rows.py --rows 16,32,48,64,96,128
"""

from __future__ import annotations

import argparse

from gemm_common import SHAPES, median_seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16,32,48,64,96,128")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()

    import torch

    from infertune.kernels import cpu as kernels

    if not kernels.available():
        print(f"kernels unavailable: {kernels.unavailable_reason()}")
        return 1
    torch.set_num_threads(args.threads)
    lib = kernels.library()

    def timed(fn) -> float:
        return median_seconds(fn, args.iters)

    print(f"$ python benchmarks/bench_gemm_rows.py --rows {args.rows} --threads {args.threads}")
    print(f"kernel's row limit here: {kernels.bf16_max_rows()}")
    print("| rows | shape (K x N) | kernel GFLOP/s | torch GFLOP/s | kernel / torch |")
    print("|---:|---|---:|---:|---:|")
    for m in (int(r) for r in args.rows.split(",")):
        for name, (k, n) in SHAPES.items():
            x = torch.randn(m, k).bfloat16()
            w = (torch.randn(n, k) / k**0.5).bfloat16()
            y_k, y_t = torch.empty(m, n, dtype=torch.bfloat16), torch.empty(m, n, dtype=torch.bfloat16)

            def run_k(x=x, w=w, y_k=y_k, m=m, n=n, k=k):
                lib.it_linear_bf16(x.data_ptr(), k, w.data_ptr(), None, y_k.data_ptr(), n, m, n, k, args.threads)

            def run_t(x=x, w=w, y_t=y_t):
                torch.matmul(x, w.t(), out=y_t)

            tk, tt = timed(run_k), timed(run_t)
            tk, tt = min(tk, timed(run_k)), min(tt, timed(run_t))
            torch.testing.assert_close(y_k.float(), y_t.float(), rtol=2**-6, atol=2**-6)
            fl = 2 * m * k * n
            print(
                f"| {m} | {name} ({k} x {n}) | {fl / tk / 1e9:.0f} | {fl / tt / 1e9:.0f} | {tt / tk:.2f}x |", flush=True
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
