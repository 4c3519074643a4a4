#!/usr/bin/env python3
"""W8A16 / W4A16 linears at prefill sizes: the integer kernels (int16 activations times int8 / int4 weights,
VPMADDWD into int32: it_linear_w8 / it_linear_w4) against dequantizing the weight to bf16 and running the kernels'
bf16 GEMM, on the 386M model's four linear shapes, on the library this CPU loads (or --variant).

This is what decides up to how many rows the engine keeps a quantized layer on the integer kernels
(X86Kernels / Avx2Kernels.max_rows("w8" / "w4")); past that the layer dequantizes and multiplies in bf16. Each
path is checked against the float64 product of the dequantized weight; per row count and shape the paths take
turns, twice, and each reports the better of its two medians.

    python benchmarks/bench_quant_rows.py --rows 1,16,64,128,512 --threads 2
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

from gemm_common import SHAPES, median_seconds

from infertune.bench.offline import cpu_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,16,32,64,128,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=7)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--group-size", type=int, default=128, help="W4A16 group size (default: 128)")
    ap.add_argument("--variant", default=None, help="a kernel library to load (avx2, avx512; default: this CPU's)")
    args = ap.parse_args()

    import torch

    from infertune.kernels import cpu
    from infertune.quant.int4 import dequantize_int4, quantize_int4_groupwise
    from infertune.quant.int8 import quantize_int8_per_channel

    lib = cpu.load_variant(args.variant) if args.variant else None
    if isinstance(lib, str):
        print(f"the {args.variant} kernels do not run here: {lib}")
        return 1
    torch.set_num_threads(args.threads)
    print(f"$ python benchmarks/bench_quant_rows.py {' '.join(sys.argv[1:])}")
    print(
        f"CPU: {cpu_model()}, {args.threads} threads, load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}, "
        f"kernels: {args.variant or cpu.variant()}, torch {torch.__version__}"
    )
    print(
        "| rows | shape (K x N) | w8 int GFLOP/s | w8 dequant + bf16 GEMM | w8 int / dequant | w4 int | "
        "w4 dequant + bf16 GEMM | w4 int / dequant | bf16 GEMM, weights stored bf16 |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for m in (int(r) for r in args.rows.split(",")):
        for name in args.shapes.split(","):
            k, n = SHAPES[name]
            w = torch.randn(n, k, generator=g) / k**0.5
            q8, s8 = quantize_int8_per_channel(w)
            s8 = s8.bfloat16()
            q4, s4, z4 = quantize_int4_groupwise(w, args.group_size)
            p4, s4, z4 = cpu.pack_w4(q4), s4.float().contiguous(), z4.float().contiguous()
            x = torch.randn(m, k, generator=g).bfloat16()
            gs = args.group_size

            def w8_deq(x=x, q8=q8, s8=s8):
                return cpu.linear_bf16(x, cpu.dequant_w8(q8, s8, lib=lib), None, lib=lib)

            def w4_deq(x=x, p4=p4, s4=s4, z4=z4, gs=gs):
                return cpu.linear_bf16(x, cpu.dequant_w4(p4, s4, z4, gs, lib=lib), None, lib=lib)

            fns = {
                "w8": functools.partial(cpu.linear_w8, x, q8, s8, None, lib=lib),
                "w8 deq": w8_deq,
                "w4": functools.partial(cpu.linear_w4, x, p4, s4, z4, gs, None, lib=lib),
                "w4 deq": w4_deq,
                "bf16": functools.partial(cpu.linear_bf16, x, cpu.dequant_w8(q8, s8, lib=lib), None, lib=lib),
            }
            refs = {
                "w8": x.double() @ (q8.double() * s8.double().unsqueeze(1)).t(),
                "w4": x.double() @ dequantize_int4(q4, s4, z4, gs).double().t(),
            }
            refs["bf16"] = refs["w8"]
            for p, fn in fns.items():
                ref = refs[p.split()[0]]
                torch.testing.assert_close(fn().double(), ref, rtol=2**-6, atol=2**-6 * ref.abs().max().item(), msg=p)
            best = dict.fromkeys(fns, float("inf"))
            for _ in range(2):
                for p, fn in fns.items():
                    best[p] = min(best[p], median_seconds(fn, args.iters))
            gf = {p: 2 * m * k * n / t / 1e9 for p, t in best.items()}
            print(
                f"| {m} | {name} ({k} x {n}) | {gf['w8']:.1f} | {gf['w8 deq']:.1f} | {best['w8 deq'] / best['w8']:.2f}x "
                f"| {gf['w4']:.1f} | {gf['w4 deq']:.1f} | {best['w4 deq'] / best['w4']:.2f}x | {gf['bf16']:.1f} |",
                flush=True,
            )
    print(f"load average after: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
