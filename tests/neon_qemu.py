"""The NEON kernels (infertune/kernels/csrc/arm/neon) on this x86 machine: built for AArch64 with Debian's
gcc-aarch64-linux-gnu and run under qemu-user, behind the same entry points as a ctypes library, so that
kernels/cpu.py's bindings (and every oracle of tests/test_kernels.py) run on them unchanged.

`QemuNeonLib` stands where a `ctypes.CDLL` of the kernels would: each `it_*` call copies its input buffers out of
this process's memory (the pointers cpu.py passes), runs tests/csrc/neon_harness.c under qemu-aarch64, and copies
the output buffer back. Slow (a process per call) and for correctness only: nothing here measures Arm speed."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "infertune" / "kernels" / "csrc"
HARNESS = Path(__file__).resolve().parent / "csrc" / "neon_harness.c"
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
# The library's flags (kernels/cpu.py VARIANTS["neon"]), for a static test binary instead of a shared library
FLAGS = ["-O2", "-std=c11", "-ffp-contract=off", "-fopenmp", "-Wall", "-Wextra", "-Werror", "-march=armv8-a"]


def missing_tools() -> str | None:
    absent = [t for t in (CROSS_CC, QEMU) if shutil.which(t) is None]
    return f"{' and '.join(absent)} not installed (apt-get install gcc-aarch64-linux-gnu qemu-user)" if absent else None


def build_harness(out_dir: Path) -> Path:
    exe = out_dir / "neon_harness"
    cmd = [CROSS_CC, *FLAGS, "-static", f"-I{CSRC}", str(HARNESS), "-o", str(exe), "-lm"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    # (the static libgomp's dlopen warning is the linker's, not ours; -Werror holds our code to no warnings)
    if r.returncode != 0:
        raise RuntimeError(f"cross-compiling the NEON kernels failed:\n{r.stderr}")
    return exe


class QemuNeonLib:
    """A stand-in for the kernels' ctypes library: the NEON entry points, each run under qemu-aarch64."""

    def __init__(self, harness: Path) -> None:
        self.harness = harness
        self.calls = 0

    def _run(self, op: str, scalars: list, buffers: list[tuple[int | None, int]]) -> None:
        """buffers: (pointer or None, bytes); the last is the output (read first, written back after)."""
        with tempfile.TemporaryDirectory() as tmp:
            paths = []
            for i, (ptr, size) in enumerate(buffers):
                if not ptr:
                    paths.append("-")
                    continue
                p = Path(tmp) / f"b{i}"
                p.write_bytes(ctypes.string_at(ptr, size))
                paths.append(str(p))
            cmd = [QEMU, str(self.harness), op, *map(str, scalars), *paths]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
            if r.returncode != 0:
                raise RuntimeError(f"{op} under qemu failed ({r.returncode}): {r.stderr}")
            out = Path(paths[-1]).read_bytes()
            ctypes.memmove(buffers[-1][0], out, len(out))
        self.calls += 1

    def _abi(self) -> list[int]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "abi"
            r = subprocess.run(
                [QEMU, str(self.harness), "it_abi", str(out)], capture_output=True, text=True, timeout=60
            )
            if r.returncode != 0:
                raise RuntimeError(f"it_abi under qemu failed: {r.stderr}")
            raw = out.read_bytes()
        return [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in range(0, len(raw), 8)]

    @property
    def it_abi(self):
        return _Fn(lambda: self._abi()[0])

    @property
    def it_struct_sizes(self):
        def sizes(out, n):
            v = self._abi()
            for i in range(min(n, v[1])):
                out[i] = v[2 + i]
            return v[1]

        return _Fn(sizes)

    # the signatures of csrc/arm/neon (the same as the x86 libraries'); nthreads is the harness's own (2)
    def it_linear_bf16(self, x, ldx, w, bias, y, ldy, m, n, k, nthreads):
        bufs = [(x, ((m - 1) * ldx + k) * 2), (w, n * k * 2), (bias, n * 2), (y, ((m - 1) * ldy + n) * 2)]
        self._run("it_linear_bf16", [ldx, ldy, m, n, k], bufs)

    def it_linear_w8(self, x, ldx, w, scale, scale_is_f32, bias, y, ldy, m, n, k, nthreads):
        bufs = [(x, ((m - 1) * ldx + k) * 2), (w, n * k), (scale, n * (4 if scale_is_f32 else 2)), (bias, n * 2)]
        self._run("it_linear_w8", [scale_is_f32, ldx, ldy, m, n, k], [*bufs, (y, ((m - 1) * ldy + n) * 2)])

    def it_linear_w4(self, x, ldx, w, scale, zero, gs, bias, y, ldy, m, n, k, nthreads):
        g = n * (k // gs) * 4
        bufs = [(x, ((m - 1) * ldx + k) * 2), (w, n * k // 2), (scale, g), (zero, g), (bias, n * 2)]
        self._run("it_linear_w4", [gs, ldx, ldy, m, n, k], [*bufs, (y, ((m - 1) * ldy + n) * 2)])

    def it_dequant_w8(self, q, scale, scale_is_f32, out, n, k, nthreads):
        bufs = [(q, n * k), (scale, n * (4 if scale_is_f32 else 2)), (out, n * k * 2)]
        self._run("it_dequant_w8", [scale_is_f32, n, k], bufs)

    def it_dequant_w4(self, packed, scale, zero, gs, out, n, k, nthreads):
        g = n * (k // gs) * 4
        self._run("it_dequant_w4", [gs, n, k], [(packed, n * k // 2), (scale, g), (zero, g), (out, n * k * 2)])

    def it_rmsnorm_mt(self, x, w, out, t, h, eps, nthreads):
        self._run("it_rmsnorm_mt", [t, h, repr(float(eps))], [(x, t * h * 2), (w, h * 2), (out, t * h * 2)])

    def it_silu_mul(self, gu, act, t, i, nthreads):
        self._run("it_silu_mul", [t, i], [(gu, t * 2 * i * 2), (act, t * i * 2)])

    def it_rotary(self, qk, ld, t, heads, d, cs, ld_cs, nthreads):
        bufs = [(cs, ((t - 1) * ld_cs + d) * 4), (qk, ((t - 1) * ld + heads * d) * 2)]
        self._run("it_rotary", [ld, t, heads, d, ld_cs], bufs)


class _Fn:
    """A callable that takes the argtypes / restype a ctypes function is given (cpu.check_abi sets them)."""

    def __init__(self, fn) -> None:
        self.fn, self.argtypes, self.restype = fn, None, None

    def __call__(self, *args):
        return self.fn(*args)
