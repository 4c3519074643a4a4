#!/usr/bin/env python3
"""W8A8 linears (int8 weights, activations rounded to int8 per row, int32 sums): the AVX-512 VNNI kernel
(it_linear_w8a8: VPDPBUSD on the weight packed at load, csrc/x86/avx512/gemm_i8.c) against torch._int_mm
(W8A8Method's reference path, what the engine ran before the kernel), W8A16's kernel and the bf16 kernel, on the
386M model's four linear shapes.

The weights stream from memory as in a decode step: each call cycles through --layers copies of every shape (24:
the model's worth, far past the last-level cache), so a row count's time includes reading the weights. Each W8A8
path is first checked against exact integer arithmetic. Per row count the paths take turns, twice; each reports the
better of its two medians, as ms per set of the four shapes and GOP/s.

    python benchmarks/bench_w8a8.py --rows 1,4,8,16,32,64,128,512 --threads 2
    INFERTUNE_CPU_ISA=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/bench_w8a8.py --variant avx2
"""

from __future__ import annotations

import argparse
import os
import sys

from gemm_common import SHAPES, median_seconds

from infertune.bench.offline import cpu_model


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="1,4,8,16,32,64,128,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--layers", type=int, default=24, help="copies of each shape the calls cycle through (default 24)")
    ap.add_argument("--variant", default=None, help="a kernel library to load (avx2, avx512; default: this CPU's)")
    args = ap.parse_args()

    import torch

    from infertune.kernels import cpu
    from infertune.quant.int8 import int_mm_is_exact, quantize_int8_per_channel, quantize_int8_per_token

    lib = cpu.load_variant(args.variant) if args.variant else None
    if isinstance(lib, str):
        print(f"the {args.variant} kernels do not run here: {lib}")
        return 1
    if not cpu.available() or not cpu.w8a8_supported(lib):
        print(f"no W8A8 kernel here (kernels: {cpu.variant() if cpu.available() else cpu.unavailable_reason()})")
        return 1
    torch.set_num_threads(args.threads)
    print(f"$ python benchmarks/bench_w8a8.py {' '.join(sys.argv[1:])}")
    print(
        f"CPU: {cpu_model()}, {args.threads} threads, load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}, "
        f"kernels: {args.variant or cpu.variant()}{' + amx' if cpu.amx() and not args.variant else ''}, "
        f"torch {torch.__version__} (capability {torch.backends.cpu.get_cpu_capability()})"
    )
    g = torch.Generator().manual_seed(0)
    layers = []  # per copy: per shape (q, its packing, s fp32, s bf16, w bf16)
    for _ in range(args.layers):
        copy = []
        for k, n in SHAPES.values():
            w = torch.randn(n, k, generator=g)
            q, s = quantize_int8_per_channel(w)
            copy.append((q, cpu.pack_w8a8(q, lib=lib), s, s.bfloat16(), w.bfloat16()))
        layers.append(copy)

    def int_mm(x, q, qp, s, sb, wb):
        xq, xs = quantize_int8_per_token(x)
        return (torch._int_mm(xq, q.t()).float() * xs * s).bfloat16()

    paths = {
        "w8a8 kernel": lambda x, q, qp, s, sb, wb: cpu.linear_w8a8(x, qp, s, lib=lib),
        "torch._int_mm": int_mm,
        "w8a16 kernel": lambda x, q, qp, s, sb, wb: cpu.linear_w8(x, q, sb, lib=lib),
        "bf16 kernel": lambda x, q, qp, s, sb, wb: cpu.linear_bf16(x, wb, lib=lib),
    }
    exact_int_mm = int_mm_is_exact()
    # each W8A8 path is the exact product (the other paths round differently: they are timed only; torch._int_mm
    # only where it sums exactly: not with torch limited to AVX2, see quant/int8.py int_mm_is_exact)
    for m in (3, 40):
        for (k, n), (q, qp, s, _, _) in zip(SHAPES.values(), layers[0]):
            x = torch.randn(m, k, generator=g).bfloat16()
            xq, xs = quantize_int8_per_token(x.float())
            want = ((xq.long() @ q.long().t()).float() * xs * s).bfloat16()
            for name in ("w8a8 kernel", "torch._int_mm") if exact_int_mm else ("w8a8 kernel",):
                assert torch.equal(paths[name](x, q, qp, s, None, None), want), (name, m, k, n)
    flops_per_row = sum(2 * k * n for k, n in SHAPES.values())
    print("| rows | " + " | ".join(f"{p} ms (GOP/s)" for p in paths) + " | bf16 / w8a8 | w8a16 / w8a8 |")
    print("|---:|" + "---:|" * (len(paths) + 2))
    for m in (int(r) for r in args.rows.split(",")):
        xs = [torch.randn(m, k, generator=g).bfloat16() for k, _ in SHAPES.values()]

        def one(path, xs=xs):
            def call():
                for copy in layers:
                    for x, (q, qp, s, sb, wb) in zip(xs, copy):
                        path(x, q, qp, s, sb, wb)

            return call

        best = {p: float("inf") for p in paths}
        for _ in range(2):
            for p, fn in paths.items():
                best[p] = min(best[p], median_seconds(one(fn), args.iters) / args.layers)
        cells = [f"{best[p] * 1e3:.3f} ({m * flops_per_row / best[p] / 1e9:.0f})" for p in paths]
        w8 = best["w8a8 kernel"]
        print(
            f"| {m} | "
            + " | ".join(cells)
            + f" | {best['bf16 kernel'] / w8:.2f}x | {best['w8a16 kernel'] / w8:.2f}x |",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
