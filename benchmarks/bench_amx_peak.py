#!/usr/bin/env python3
"""What the AMX tiles of this CPU multiply at, with and without tile loads: the ceiling a bf16 GEMM on them can reach.

A small C loop (compiled here with the system's gcc, -mamx-tile -mamx-bf16) runs TDPBF16PS on the 2 x 2 block every
tile GEMM of infertune uses (csrc/x86/avx512/bf16c_gemm.c bf16c_block, gemm_amx.c): four accumulators (tiles 0-3),
two row tiles of x and two feature tiles of W (tiles 4-7), four products a k-step. It times, on --threads threads:

  registers  the four products a step on tiles loaded once (no memory: the tiles' own rate)
  A x B      the same with the two x tiles and the two W tiles loaded every step (TILELOADD, 64-byte rows) from
             buffers of A and B bytes cycled through (4 KB: L1; 128 KB: L2; 1 MB: past L2), as a GEMM's k-loop does

and prints GFLOP/s (2 x 16 x 16 x 32 a product). Compare a GEMM's rate (benchmarks/bench_gemm_rows.py, or
`infertune profile`'s fused-step parts over their FLOPs) with the "with loads" rows: a 2 x 2 block loads one tile a
product, and there is no larger block: eight tiles hold 4 accumulators, 2 x and 2 W.

A second table times the 12-bit tile GEMM's loop itself (bf16c_gemm.c tiles_gemm, without the decode and the
epilogue): a block of --rows packed rows of x (K = --k) by a decoded 64-feature chunk (two feature pairs), every row
pair over all of K, in passes of P k-steps that take both feature pairs before the next pass (the sums stored and
reloaded between passes; P = K / 32: one pass, both feature pairs one after the other over all of K). Passes of 7
read 1.2x here but left the engine's prefill level (docs/kernels.md, "Passes of k-steps"): the loop alone is not
the whole GEMM.

    python benchmarks/bench_amx_peak.py --threads 2
    python benchmarks/bench_amx_peak.py --threads 2 --k 1216   # down_proj's slab of K at 512 rows (386M model)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

SOURCE = r"""
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#include <omp.h>

typedef struct { uint8_t palette, start; uint8_t r[14]; uint16_t colsb[16]; uint8_t rows[16]; } cfg_t;

/* iters k-steps of the 2 x 2 block; loads: x and W tiles from a (amask + 1 bytes) and b (bmask + 1), else none */
__attribute__((target("amx-tile,amx-bf16"))) static double run(long iters, int loads, const char* a, long amask,
                                                               const char* b, long bmask) {
    cfg_t c;
    memset(&c, 0, sizeof c);
    c.palette = 1;
    for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
    _tile_loadconfig(&c);
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, a, 64); _tile_loadd(5, a + 1024, 64); _tile_loadd(6, b, 64); _tile_loadd(7, b + 1024, 64);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    for (long i = 0; i < iters; i++) {
        if (loads) {
            const long ao = (i * 2048) & amask, bo = (i * 2048) & bmask;
            _tile_loadd(4, a + ao, 64); _tile_loadd(5, a + ao + 1024, 64);
            _tile_loadd(6, b + bo, 64); _tile_loadd(7, b + bo + 1024, 64);
        }
        _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    clock_gettime(CLOCK_MONOTONIC, &t1);
    _tile_release();
    return (double)(t1.tv_sec - t0.tv_sec) + 1e-9 * (double)(t1.tv_nsec - t0.tv_nsec);
}

/* x packed (row tile t, k-step k at x + (t KS + k) 512), the chunk decoded (k-step k, feature tile j at w + 2048 k +
   512 j): one 2 x 2 block over k-steps [k0, k1), its sums from cin (or zero) to cout */
__attribute__((target("amx-tile,amx-bf16"))) static void pass_block(const uint16_t* a0, const uint16_t* a1,
                                                                      const uint16_t* wb, int k0, int k1,
                                                                      float (*cin)[256], float (*cout)[256]) {
    if (cin) {
        _tile_loadd(0, cin[0], 64); _tile_loadd(1, cin[1], 64); _tile_loadd(2, cin[2], 64); _tile_loadd(3, cin[3], 64);
    } else {
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    }
    for (int k = k0; k < k1; k++) {
        const uint16_t* b = wb + (long)k * 2048;
        _tile_loadd(6, b, 64); _tile_loadd(4, a0 + (long)k * 512, 64); _tile_dpbf16ps(0, 4, 6);
        _tile_loadd(7, b + 512, 64); _tile_dpbf16ps(1, 4, 7);
        _tile_loadd(5, a1 + (long)k * 512, 64); _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, cout[0], 64); _tile_stored(1, cout[1], 64); _tile_stored(2, cout[2], 64); _tile_stored(3, cout[3], 64);
}

static void gemm_passes(const uint16_t* x, const uint16_t* w, int tiles, int KS, int P, float (*sums)[4][256]) {
    for (int t = 0; t + 1 < tiles; t += 2)
        for (int k0 = 0; k0 < KS; k0 += P)
            for (int g = 0; g < 2; g++)
                pass_block(x + (long)t * KS * 512, x + (long)(t + 1) * KS * 512, w + g * 1024, k0,
                           k0 + P < KS ? k0 + P : KS, k0 ? sums[g] : NULL, sums[g]);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* the second table: passes of P k-steps (P = KS first), the slowest thread's time of reps blocks, best of 5 */
static void passes_table(int nt, int K, int rows, int reps) {
    const int KS = K / 32, tiles = rows / 16;
    const int Ps[6] = {KS, 14, 10, 7, 4, 2};
    double best[6] = {1e30, 1e30, 1e30, 1e30, 1e30, 1e30};
#pragma omp parallel num_threads(nt)
    {
        cfg_t c;
        memset(&c, 0, sizeof c);
        c.palette = 1;
        for (int i = 0; i < 8; i++) c.colsb[i] = 64, c.rows[i] = 16;
        _tile_loadconfig(&c);
        uint16_t* x = aligned_alloc(4096, (size_t)rows * K * 2);
        uint16_t* w = aligned_alloc(4096, (size_t)128 * K * 2);
        for (long i = 0; i < (long)rows * K; i++) x[i] = 0x3f80;
        for (long i = 0; i < 128L * K; i++) w[i] = 0x3f80;
        float sums[2][4][256] __attribute__((aligned(64)));
        for (int round = 0; round < 6; round++)
            for (int i = 0; i < 6; i++) {
#pragma omp barrier
                const double t0 = now_s();
                for (int r = 0; r < reps; r++) gemm_passes(x, w + (r & 1) * 64 * K, tiles, KS, Ps[i], sums);
#pragma omp barrier
                const double dt = now_s() - t0;
#pragma omp critical
                if (round && dt < best[i]) best[i] = dt;
            }
        free(x);
        free(w);
        _tile_release();
    }
    for (int i = 0; i < 6; i++)
        printf("passes %d|%.0f\n", Ps[i], 2.0 * rows * 64 * K * (double)reps * nt / best[i] / 1e9);
}

int main(int argc, char** argv) {
    const int nt = argc > 1 ? atoi(argv[1]) : 2;
    const long iters = argc > 2 ? atol(argv[2]) : 1000000;
    if (syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XTILEDATA */)) {
        printf("error: the kernel refused the AMX tile state\n");
        return 2;
    }
    const long sizes[4] = {4096, 131072, 1 << 20, 0};
    for (int ia = -1; ia < 3; ia++)
        for (int ib = (ia < 0 ? 2 : 0); ib < 3; ib++) {
            const long sa = ia < 0 ? 4096 : sizes[ia], sb = ia < 0 ? 4096 : sizes[ib];
            double worst = 0.0;
#pragma omp parallel num_threads(nt) reduction(max : worst)
            {
                char* a = aligned_alloc(4096, (size_t)sa);
                char* b = aligned_alloc(4096, (size_t)sb);
                memset(a, 1, (size_t)sa);
                memset(b, 1, (size_t)sb);
                run(iters / 10, ia >= 0, a, sa - 1, b, sb - 1); /* (warm-up) */
                worst = run(iters, ia >= 0, a, sa - 1, b, sb - 1);
                free(a);
                free(b);
            }
            const double gflops = 4.0 * 16 * 16 * 32 * 2 * (double)iters * nt / worst / 1e9;
            if (ia < 0)
                printf("registers|%.0f\n", gflops);
            else
                printf("%ld x %ld|%.0f\n", sa, sb, gflops);
        }
    if (argc > 4) passes_table(nt, atoi(argv[3]), atoi(argv[4]), 40);
    return 0;
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--iters", type=int, default=1_000_000, help="k-steps a thread (default: 1000000)")
    ap.add_argument("--rounds", type=int, default=3, help="runs of the whole table; the best of each row (default: 3)")
    ap.add_argument("--k", type=int, default=896, help="K of the second table's GEMM, a multiple of 32 (default: 896)")
    ap.add_argument(
        "--rows", type=int, default=512, help="rows of x of the second table, a multiple of 32 (default: 512)"
    )
    args = ap.parse_args()
    if "amx_tile" not in Path("/proc/cpuinfo").read_text():
        print("this CPU has no AMX (no amx_tile in /proc/cpuinfo)")
        return 1
    with tempfile.TemporaryDirectory() as d:
        src, exe = Path(d) / "amx_peak.c", Path(d) / "amx_peak"
        src.write_text(SOURCE)
        subprocess.run(["gcc", "-O2", "-fopenmp", "-mamx-tile", "-mamx-bf16", str(src), "-o", str(exe)], check=True)
        best: dict[str, float] = {}
        for _ in range(args.rounds):
            cmd = [str(exe), str(args.threads), str(args.iters), str(args.k), str(args.rows)]
            out = subprocess.run(cmd, capture_output=True, text=True)
            if out.returncode:
                print(out.stdout + out.stderr)
                return out.returncode
            for line in out.stdout.splitlines():
                name, rate = line.split("|")
                best[name] = max(best.get(name, 0.0), float(rate))
    print(f"AMX bf16, 2 x 2 tile block, {args.threads} threads, best of {args.rounds} runs")
    print("| tiles loaded each k-step from (x bytes x W bytes) | GFLOP/s |")
    print("|---|---:|")
    for name, rate in best.items():
        if name.startswith("passes"):
            continue
        label = (
            "none (tiles loaded once: the tiles' own rate)"
            if name == "registers"
            else name.replace(" x ", " B x ") + " B"
        )
        print(f"| {label} | {rate:.0f} |")
    ks = args.k // 32
    print(f"\nThe tile GEMM's loop: {args.rows} packed rows x a 64-feature chunk, K = {args.k}, {args.threads} threads")
    print("| k-steps a pass (both feature pairs a pass) | GFLOP/s | vs one pass over K |")
    print("|---|---:|---:|")
    one = best.get(f"passes {ks}")
    for name, rate in best.items():
        if name.startswith("passes"):
            p = int(name.split()[1])
            label = f"{p} (one pass over K)" if p == ks else str(p)
            print(f"| {label} | {rate:.0f} | {rate / one:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
