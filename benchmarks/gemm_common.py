"""What the GEMM benchmarks (bench_gemm_rows.py, bench_gemm_noamx.py, bench_gemm_avx2.py) share: the 386M model's
linear shapes and the median wall time of a call."""

from __future__ import annotations

import statistics
import time

SHAPES = {"qkv": (896, 1152), "o_proj": (896, 896), "gate_up": (896, 9728), "down": (4864, 896)}  # (K, N)


def median_seconds(fn, iters: int) -> float:
    """One untimed call, then the median of `iters` timed ones."""
    fn()
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)
