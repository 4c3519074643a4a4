"""The `local` device: this machine's memory bandwidth and matmul FLOP/s, measured on the fly (~1 s in all).

Bandwidth: summing a tensor far larger than the caches reads every byte once. Compute: square bf16 and fp32
matmuls. Each probe repeats for a short time budget and keeps the median. torch is imported here only, lazily,
and the device is resolved by infertune's backends (the one place that names hardware).
"""

from __future__ import annotations

import datetime
import statistics
import time

from infertune.plan.catalog import Device


def _timed(fn, sync, budget_s: float, min_reps: int = 3) -> float:
    fn()  # warm-up: allocation, kernel selection, page faults
    sync()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_reps or time.perf_counter() - start < budget_s:
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
        if len(times) >= 200:
            break
    return statistics.median(times)


def measure_bandwidth(torch, device, sync, nbytes: int = 256 * 2**20, budget_s: float = 0.3) -> float:
    """Read bandwidth in bytes/s from summing an fp32 tensor of `nbytes`."""
    x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    t = _timed(lambda: x.sum(), sync, budget_s)
    return x.numel() * 4 / t


def measure_gemv_bandwidth(torch, device, sync, dtype, nbytes: int = 128 * 2**20, budget_s: float = 0.3) -> float:
    """Bytes/s a matrix-vector product streams from a weight of `nbytes`: the access pattern of a decode step.

    Eager decode rarely reaches the bandwidth of a plain sum (here about half of it), so a roofline built on
    the sum over-predicts tokens/s; built on this, it predicts what the engine's matmuls can actually do.
    """
    elem = torch.empty((), dtype=dtype).element_size()
    k = 4096
    n = nbytes // (elem * k)
    w = torch.randn(n, k, device=device).to(dtype)
    x = torch.randn(1, k, device=device).to(dtype)
    t = _timed(lambda: torch.nn.functional.linear(x, w), sync, budget_s)
    return n * k * elem / t


def measure_matmul(torch, device, sync, dtype, n: int = 2048, budget_s: float = 0.3) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` (2 n^3 FLOPs).

    n shrinks (down to 256) where one matmul of this dtype would take more than a quarter of the budget: torch's
    bf16 matmul on a CPU without AVX-512 (an AVX2-only x86, e.g. AMD Zen 3) runs near 1 GFLOP/s, where one
    2048^3 product takes ~20 s and the probe would take minutes."""
    size = 256
    while size < n:
        a = torch.randn(size, size, device=device).to(dtype)
        (a @ a).sum().item()  # first call: allocation, kernel selection
        t0 = time.perf_counter()
        a @ a
        sync()
        if (time.perf_counter() - t0) * 8 > budget_s / 4:  # the next size takes 8x as long
            break
        size *= 2
    n = min(n, size)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    t = _timed(lambda: a @ b, sync, budget_s)
    return 2 * n**3 / t


def probe_local(device: str = "auto", budget_s: float = 0.3) -> Device:
    """A Device with measured figures for this machine (`device`: auto, cpu, cuda, npu, as for the engine)."""
    import torch

    from infertune.backends import get_backend

    backend = get_backend(device)
    dev, sync = backend.device, backend.synchronize
    has_bf16 = torch.bfloat16 in backend.supported_dtypes()
    raw_bandwidth = measure_bandwidth(torch, dev, sync, budget_s=budget_s)
    bandwidth = measure_gemv_bandwidth(
        torch, dev, sync, torch.bfloat16 if has_bf16 else torch.float32, budget_s=budget_s
    )
    fp32 = measure_matmul(torch, dev, sync, torch.float32, budget_s=budget_s)
    bf16 = measure_matmul(torch, dev, sync, torch.bfloat16, budget_s=budget_s) if has_bf16 else fp32
    today = datetime.date.today().isoformat()
    return Device(
        name="local",
        display_name=f"this machine ({backend.describe()}, measured {today})",
        vendor="",
        memory_bytes=int(backend.total_memory_bytes()),
        free_memory_bytes=int(backend.free_memory_bytes()),
        memory_bandwidth_bytes_per_s=bandwidth,
        bf16_tflops=bf16 / 1e12,
        fp32_tflops=fp32 / 1e12,
        source=(
            f"measured by infertune.plan.probe on {today}: bandwidth = what a 128 MiB matrix-vector product "
            f"streams (decode's pattern; a plain 256 MiB sum read {raw_bandwidth / 1e9:.1f} GB/s), "
            f"2048^3 bf16 / fp32 matmuls (median of ~{budget_s:g} s each), torch {torch.__version__}",
        ),
        notes="Measured, so efficiency factors default to 1.0. Memory is the device total (system RAM on CPU). "
        "Bandwidth on shared machines moves from run to run; re-run or calibrate with --measured-decode-tps.",
        measured=True,
        origin="probe",
    )
