#!/usr/bin/env python3
"""The int8 products (W8A8's linear_w8a8 and the packed W8A16's linear_w8p) of two builds of the AVX-512 kernels,
side by side in one process, on the 386M model's four linear shapes.

Both sources are compiled with infertune/kernels/cpu.py's flags and loaded together (ab_common.load_build); each
product's calls alternate between the builds, the outputs preallocated (no page faults inside the timing). At
--copies copies of each layer the weights stream from memory (the 24 default: 343 MB, past this machine's caches at
1-16 rows); prompts' row counts are compute-bound, so fewer copies do there. Prints the median ms of B, the ratio
B / A and B's int8 TOP/s (W8A16: its two int8 passes counted) per row count and product; both builds' results are
checked equal, bit for bit.

    git archive <rev> infertune/kernels/csrc | tar -x -C /tmp/before
    python benchmarks/bench_i8_builds.py --a /tmp/before/infertune/kernels/csrc/x86/avx512/avx512.c --rows 1,16,2048
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from ab_common import load_build

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # (N, K): qkv, o_proj, gate_up, down


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="the baseline kernels source (a tree's csrc/x86/avx512/avx512.c)")
    ap.add_argument("--b", default="infertune/kernels/csrc/x86/avx512/avx512.c", help="the changed source")
    ap.add_argument("--rows", default="1,4,16,128,2048", help="rows of x (comma-separated)")
    ap.add_argument("--copies", type=int, default=24, help="copies of each layer at up to 16 rows (past: 2)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from infertune.kernels import cpu

    torch.set_num_threads(args.threads)
    if not cpu.available() or not cpu.w8p_supported():
        print(f"needs the AVX-512 library: {cpu.describe()}")
        return 1
    print(f"kernels: {cpu.describe()}, threads {args.threads}")
    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        libs = {"A": load_build(args.a, tmp, "A"), "B": load_build(args.b, tmp, "B")}
        print("| rows | product | B ms | B / A | B int8 TOP/s |\n|---:|---|---:|---:|---:|")
        for m in (int(r) for r in args.rows.split(",")):
            copies = args.copies if m <= 16 else 2
            layers = []
            for n, k in SHAPES:
                for _ in range(copies):
                    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
                    s = torch.rand(n, generator=g) * 0.01 + 0.001
                    x = torch.randn(m, k, generator=g).bfloat16()
                    layers.append((n, k, cpu.pack_w8a8(q), s, x, torch.empty(m, n, dtype=torch.bfloat16)))
            for kind in ("w8a8", "w8p"):

                def run(lib, kind=kind, layers=layers, m=m):
                    for n, k, p, s, x, y in layers:
                        head, tail = (x.data_ptr(), k, p.data_ptr(), s.data_ptr()), (y.data_ptr(), n, m, n, k)
                        if kind == "w8a8":  # (no static scale, no bias)
                            rc = lib.it_linear_w8a8(*head, None, None, *tail, args.threads)
                        else:
                            rc = lib.it_linear_w8p(*head, None, *tail, args.threads)
                        assert rc == 0, rc

                outs = []
                for name in ("A", "B"):
                    run(libs[name])
                    outs.append(layers[-1][5].clone())
                assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16)), (kind, m)
                times = {"A": [], "B": []}
                for r in range(args.rounds + 1):  # round 0 untimed; the order flips every round
                    for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
                        t = time.perf_counter()
                        run(libs[name])
                        if r:
                            times[name].append(time.perf_counter() - t)
                a, b = (statistics.median(times[name]) for name in ("A", "B"))
                ops = 2 * m * sum(n * k for n, k in SHAPES) * copies * (2 if kind == "w8p" else 1)
                print(f"| {m} | {kind} | {b * 1e3:.2f} | {b / a:.2f} | {ops / b / 1e12:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
