"""The quantized linears on their row layouts against the same integers packed in 64-feature blocks (one weight
stream a thread), on the AVX-512 library:

  --kind w8   linear_w8 on int8 [N, K] (4 weight rows side by side at 1-3 rows, a bf16 rebuild at 4-16, slabs past 16)
              against linear_w8p on W8A8's packed layout (gemm_w8p.c), with W8A8's packed GEMM (int8 activations) on
              the same bytes beside them;
  --kind w4   linear_w4 on pack_w4's rows against linear_w4p on pack_w4p's blocks (gemm_w4p.c), groups of 128.

The 386M model's four linears of a layer, `--copies` copies of each so the weights stream from memory, the paths
interleaved round by round; medians, and the bytes a second the weights streamed at.

    python benchmarks/bench_packed_quant.py --kind w8 --rows 1,2,4,16,128
    python benchmarks/bench_packed_quant.py --kind w4 --rows 1,2,4,8,16,64,128

tests/test_kernels.py holds each packed kernel to an exact oracle (W8A16: bit for bit linear_w8's at 1-3 rows)."""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from infertune.kernels import cpu

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # qkv, o, gate_up, down of the 386M preset
GROUP = 128


def _layers(kind: str, copies: int, g: torch.Generator) -> list[tuple]:
    layers = []
    for n, k in SHAPES:
        for _ in range(copies):
            if kind == "w8":
                q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
                s = torch.rand(n, generator=g) * 0.01 + 0.001
                layers.append((n, k, q, s.bfloat16(), cpu.pack_w8a8(q), s.bfloat16().float()))
            else:
                q = torch.randint(0, 16, (n, k), generator=g)
                s, z = torch.rand(n, k // GROUP, generator=g) * 0.01, torch.randn(n, k // GROUP, generator=g) * 0.1
                layers.append((n, k, cpu.pack_w4(q), s, z, cpu.pack_w4p(q, s, z, GROUP)))
    return layers


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kind", choices=("w8", "w4"), default="w8")
    ap.add_argument("--rows", default="1,4,16,128", help="rows of x (comma-separated)")
    ap.add_argument("--copies", type=int, default=24, help="copies of each layer (so the weights stream)")
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args()
    print("$ python " + " ".join(sys.argv))
    if not cpu.available() or not (cpu.w8p_supported() and cpu.w4p_supported()):
        sys.exit(f"needs the AVX-512 library: {cpu.describe()}")
    print(f"kernels: {cpu.describe()}, threads {torch.get_num_threads()}")
    g = torch.Generator().manual_seed(0)
    layers = _layers(args.kind, args.copies, g)
    nbytes = sum(n * k for n, k in SHAPES) * args.copies * (1 if args.kind == "w8" else 0.5)
    if args.kind == "w8":
        paths = {
            "w8 [N, K]": lambda x, n, k, q, sb, pk, s: cpu.linear_w8(x, q, sb),
            "w8p packed": lambda x, n, k, q, sb, pk, s: cpu.linear_w8p(x, pk, s),
            "w8a8 packed": lambda x, n, k, q, sb, pk, s: cpu.linear_w8a8(x, pk, s),
        }
    else:
        paths = {
            "w4 rows": lambda x, n, k, p4, s, z, pp: cpu.linear_w4(x, p4, s, z, GROUP),
            "w4p packed": lambda x, n, k, p4, s, z, pp: cpu.linear_w4p(x, *pp, GROUP, n),
        }
    base, packed = list(paths)[:2]
    print(f"| rows | {' | '.join(paths)} | packed / rows |")
    print("|---:|" + "---:|" * (len(paths) + 1))
    for m in (int(r) for r in args.rows.split(",")):
        xs = {k: torch.randn(m, k, generator=g).bfloat16() for _, k in SHAPES}
        times: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(args.rounds):
            for name, fn in paths.items():
                t = time.perf_counter()
                for layer in layers:
                    fn(xs[layer[1]], *layer)
                times[name].append(time.perf_counter() - t)
        med = {p: statistics.median(v) for p, v in times.items()}
        cells = [f"{med[p] * 1e3:.2f} ms ({nbytes / med[p] / 1e9:.1f} GB/s)" for p in paths]
        print(f"| {m} | {' | '.join(cells)} | {med[base] / med[packed]:.2f}x |")


if __name__ == "__main__":
    main()
