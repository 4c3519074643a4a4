"""W8A16's linears on [N, K] (linear_w8: 4 weight rows side by side at 1-3 rows, a bf16 rebuild at 4-16, slabs past
16) against the same int8 weights packed (linear_w8p: W8A8's layout, one weight stream a thread), with W8A8's packed
GEMM (int8 activations) on the same bytes beside them. The 386M model's four linears of a layer, `--copies` copies
of each so the weights stream from memory, the three paths interleaved round by round; medians, and the bytes a
second the weights streamed at.

    python benchmarks/bench_w8p.py --rows 1,4,16,128

The two W8A16 paths give the same sums (bit for bit at 1-3 rows; tests/test_kernels.py holds both to an exact-integer
oracle). AVX-512 library only (the AVX2 / NEON ones keep W8A16 on [N, K])."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from infertune.kernels import cpu

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # qkv, o, gate_up, down of the 386M preset


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,16,128", help="rows of x (comma-separated)")
    ap.add_argument("--copies", type=int, default=24, help="copies of each layer (so the weights stream)")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    print("$ python " + " ".join(sys.argv))
    if not cpu.available() or not cpu.w8p_supported():
        sys.exit(f"needs the AVX-512 library: {cpu.describe()}")
    print(f"kernels: {cpu.describe()}, threads {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    layers = []
    for n, k in SHAPES:
        for _ in range(args.copies):
            q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
            s = torch.rand(n, generator=g) * 0.01 + 0.001
            layers.append((q, s.bfloat16(), cpu.pack_w8a8(q), s.bfloat16().float()))
    nbytes = sum(n * k for n, k in SHAPES) * args.copies
    paths = {
        "w8 [N, K]": lambda x, q, sb, pk, s: cpu.linear_w8(x, q, sb),
        "w8p packed": lambda x, q, sb, pk, s: cpu.linear_w8p(x, pk, s),
        "w8a8 packed": lambda x, q, sb, pk, s: cpu.linear_w8a8(x, pk, s),
    }
    print(f"| rows | {' | '.join(paths)} | w8p / w8 |")
    print("|---:|" + "---:|" * (len(paths) + 1))
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for _, k in SHAPES}
        times: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(args.rounds):
            for name, fn in paths.items():
                t = time.perf_counter()
                for q, sb, pk, s in layers:
                    fn(xs[q.shape[1]], q, sb, pk, s)
                times[name].append(time.perf_counter() - t)
        med = {p: statistics.median(v) for p, v in times.items()}
        cells = [f"{med[p] * 1e3:.2f} ms ({nbytes / med[p] / 1e9:.1f} GB/s)" for p in paths]
        print(f"| {m} | {' | '.join(cells)} | {med['w8 [N, K]'] / med['w8p packed']:.2f}x |")


if __name__ == "__main__":
    main()
