"""Build, load and call infertune's CPU kernels (the C sources in csrc/, one library per ISA variant).

Each variant is one translation unit (csrc/x86/avx512/avx512.c, csrc/x86/avx2/avx2.c) that #includes its parts and
the shared headers (csrc/bf16.h, csrc/abi.h). It is compiled on first use with the system C compiler, with
-Wall -Wextra, into a per-user cache ($INFERTUNE_CACHE_DIR, else $XDG_CACHE_HOME/infertune, else
~/.cache/infertune), keyed by a hash of every file under csrc/, the flags and the compiler, so later runs load it in
milliseconds. At load the library's ABI version and the sizes and field offsets of every struct both sides share
are checked against the ctypes declarations here (`check_abi`): a mismatch disables the kernels with the reason.

Variants (`INFERTUNE_CPU_ISA` forces one; the default, auto, takes the first this CPU and torch's limits allow):
  avx512        AVX-512 BF16 / VNNI, AMX tiles where the CPU has them: every kernel and the fused step
  avx512-noamx  the same library with the AMX paths off (what a Zen 4 / 5 runs)
  avx2          AVX2 + FMA + F16C: the GEMVs (bf16, W8A16, W4A16), the bf16 FMA GEMM (prompts, batches),
                dequantization, the elementwise kernels and the fused step (no 12-bit weights)
  neon          AArch64 Advanced SIMD (csrc/arm/neon/neon.c): the same subset as avx2; tested under qemu-user for
                correctness (tests/test_neon.py), not yet measured on Arm hardware
Where none fits, no compiler is present, or INFERTUNE_CPU_KERNELS=0, `available()` is False, `unavailable_reason()`
says why, and the engine keeps torch's kernels.
"""

from __future__ import annotations

import contextlib
import ctypes
import enum
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from infertune.kernels import hugepages

log = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
# Rows (tokens in a step) up to which the engine calls these kernels; bigger steps are prefills, where torch's
# GEMMs (oneDNN / AMX) win. At 16 rows the AMX kernel still streams the weights at the speed of memory.
MAX_ROWS = 16
# Where the CPU has AMX, bf16 linears keep the kernels up to this many rows (the 2 x 2 blocked tile GEMM, against
# torch's GEMM on the 386M model's shapes, 2 threads: 1.4-1.8x at 64 rows, 1.1-1.4x at 128, 0.8-1.1x at 256;
# benchmarks/bench_gemm_rows.py): decode steps past 16 sequences, prompts up to 128 tokens, mixed steps.
AMX_GEMM_MAX_ROWS = 128
# Without AMX (Zen 4 / 5, INFERTUNE_CPU_ISA=avx512-noamx) bf16 linears keep the kernels up to this many rows too:
# from it_gemm_rows_noamx() rows the VDPBF16PS GEMM (csrc/x86/avx512/gemm_dpbf16.c, the weights repacked per thread
# a slab at a time), below it the GEMV (benchmarks/bench_gemm_noamx.py measures both against torch's oneDNN GEMM).
# INFERTUNE_NOAMX_GEMM=0 keeps the behaviour from before that GEMM: the GEMV up to MAX_ROWS, torch's GEMM past it.
NOAMX_GEMM_MAX_ROWS = 128
# Without AMX the W8A16 / W4A16 layers keep the kernels up to this many rows: past 16 rows each thread rebuilds its
# weight rows in bf16 a block (below the GEMM's crossover) or a 64 x 512 slab (from it) at a time and multiplies them
# there, instead of writing the whole layer in bf16 and reading it back (gemv_quant.c linear_q_gemm).
NOAMX_QUANT_MAX_ROWS = 1 << 16
# On AVX2 (no AVX-512: csrc/x86/avx2/gemm.c, the FMA GEMM from it_gemm_rows_fma() rows, the GEMV below) bf16 linears
# keep the kernels at every step size up to this: torch's bf16 GEMM limited to AVX2 is far slower at every size
# measured (benchmarks/bench_gemm_avx2.py, docs/kernels.md "AVX2"), so this only bounds a step, not a crossover.
AVX2_GEMM_MAX_ROWS = 1 << 16
# On AVX2 the W8A16 / W4A16 layers keep the integer kernels up to this many rows; past it they dequantize and run the
# FMA GEMM, whose blocking keeps x in the caches at any size (the GEMVs re-read all of x per 4 weight rows). It was
# 2048 while the FMA GEMM ran ~130 GFLOP/s (its accumulators spilled; the integer kernels then won at every size on a
# Zen 3); at 215-250 GFLOP/s, forced to AVX2 on a Zen 5 (benchmarks/bench_quant_rows.py --variant avx2, 2026-12-05),
# the integer kernels won 1.2-1.4x (W8A16) / 1.15-1.3x (W4A16) at 16 rows, were level (0.92-1.06x / 0.86-0.94x) at 32
# and lost from 64 (0.77-0.88x / 0.71-0.79x; 0.69-0.79x / 0.61-0.68x at 512).
AVX2_QUANT_MAX_ROWS = 24
# The AVX2 fused step takes steps of fresh prompts of up to this many tokens in all (bf16 weights, bf16 cache), as the
# AVX-512 library without AMX does (NOAMX_GEMM_MAX_ROWS): each prompt row's attention runs on its own.
AVX2_FUSED_PREFILL_ROWS = 128
# The C side's ABI (csrc/abi.h IT_ABI_VERSION): bump both together when a shared struct or a signature changes.
ABI_VERSION = 18
# The KV cache groups a fused step reads at most (csrc/abi.h IT_MAX_KV_GROUPS): layers grouped by sliding window
MAX_KV_GROUPS = 8
WARN_FLAGS = ["-Wall", "-Wextra", "-Wpointer-arith"]
COMMON_FLAGS = ["-O3", "-std=c11", "-shared", "-fPIC", "-fopenmp", *WARN_FLAGS, f"-I{CSRC}"]


@dataclass(frozen=True)
class Variant:
    """One build of the kernels for one ISA: its translation unit, its -m flags and the /proc/cpuinfo flags it needs."""

    name: str
    source: Path
    isa_flags: tuple[str, ...]
    required: tuple[str, ...]
    title: str  # the DecodeKernels name
    machine: str = "x86_64"  # os.uname().machine it runs on

    @property
    def cflags(self) -> list[str]:
        return [*COMMON_FLAGS, *self.isa_flags]


VARIANTS = {
    "avx512": Variant(
        "avx512",
        CSRC / "x86" / "avx512" / "avx512.c",
        ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vnni", "-mfma", "-mf16c"),
        ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512_vnni"),
        "x86 avx512-bf16/vnni",
    ),
    "avx2": Variant(
        "avx2", CSRC / "x86" / "avx2" / "avx2.c", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c"), "x86 avx2+fma"
    ),
    # Baseline Armv8-A: every AArch64 CPU has Advanced SIMD ("asimd" in /proc/cpuinfo's Features). No FMA
    # contraction, so the dequantization and rotary round as the PyTorch formulas (as on x86).
    "neon": Variant(
        "neon",
        CSRC / "arm" / "neon" / "neon.c",
        ("-march=armv8-a", "-ffp-contract=off"),
        ("asimd",),
        "arm neon",
        machine="aarch64",
    ),
}
# (kept for the scripts that build a second copy of the AVX-512 library: benchmarks/bench_kernel_builds.py)
SOURCE = VARIANTS["avx512"].source
REQUIRED_FLAGS = VARIANTS["avx512"].required
CFLAGS = VARIANTS["avx512"].cflags
ISA_CHOICES = ("auto", "avx512", "avx512-noamx", "avx2", "neon")

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_reason: str | None = None
_loaded = False
_amx = False  # it_amx_init said the tiles are usable
_noamx_gemm = False  # the AVX-512 library runs without AMX and its VDPBF16PS GEMM is on
_variant: str | None = None  # the ISA_CHOICES entry that loaded
_variant_libs: dict[str, ctypes.CDLL | str] = {}  # variant name -> its library, or why it cannot load


class WeightKind(enum.IntEnum):
    """it_lin.kind (csrc/abi.h it_kind): how a linear layer's weight is stored for the fused step."""

    BF16 = 0
    W8 = 1
    W4 = 2
    BF16C = 3
    W8A8 = 4  # (the libraries with a W8A8 kernel: gemm_i8.c)
    W8P = 5  # (W8A16 on W8A8's packed weight: the AVX-512 library's gemm_w8p.c)
    W4P = 6  # (W4A16 on a packed weight: the AVX-512 library's gemm_w4p.c)


def cache_dir() -> Path:
    root = os.environ.get("INFERTUNE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "infertune"
    )
    return Path(root) / "kernels"


def _cpuinfo_field(name: str) -> str:
    """The first /proc/cpuinfo line named `name`: its value ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.lru_cache(maxsize=1)
def _cpu_flags() -> frozenset[str]:
    return frozenset((_cpuinfo_field("flags") or _cpuinfo_field("Features")).split())  # (x86, AArch64)


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


def sources_digest() -> bytes:
    """Every file under csrc/ (names and contents): the cache key covers any header or part a variant includes."""
    h = hashlib.sha256()
    for f in sorted(p for p in CSRC.rglob("*") if p.is_file() and p.suffix in (".c", ".h")):
        h.update(str(f.relative_to(CSRC)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.digest()


def build_library(variant: Variant, cc: str, extra_flags: tuple[str, ...] = (), out_dir: Path | None = None) -> Path:
    """Compile one variant (cached by the sources' hash, the flags and the compiler); raises RuntimeError with the
    compiler's message. extra_flags (e.g. -Werror, in tests) are part of the key."""
    flags = [*variant.cflags, *extra_flags]
    version = subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256(sources_digest() + " ".join([variant.name, *flags, *version]).encode()).hexdigest()[:16]
    out = (out_dir or cache_dir()) / key / f"libinfertune_{variant.name}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        tmp_so = Path(tmp) / out.name
        proc = subprocess.run(
            [cc, *flags, str(variant.source), "-o", str(tmp_so), "-lm"], capture_output=True, text=True
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{cc} failed: {proc.stderr.strip()[-2000:]}")
        if proc.stderr.strip():
            log.warning("compiling the %s kernels warned: %s", variant.name, proc.stderr.strip()[-2000:])
        os.replace(tmp_so, out)  # atomic: a concurrent builder finds a whole file or none
    log.info("built the %s CPU kernels into %s", variant.name, out)
    return out


def _disabled() -> bool:
    return os.environ.get("INFERTUNE_CPU_KERNELS", "1").lower() in ("0", "false", "off", "no")


def load_variant(name: str) -> ctypes.CDLL | str:
    """The library of one variant ("avx512" or "avx2"), built and ABI-checked, or why it cannot run here. Cached:
    a process loads each variant once (tests and benchmarks use several side by side)."""
    with _lock:
        if name not in _variant_libs:
            _variant_libs[name] = _load_variant(VARIANTS[name])
        return _variant_libs[name]


def _load_variant(v: Variant) -> ctypes.CDLL | str:
    if os.uname().machine != v.machine:
        return f"the {v.name} kernels are for {v.machine}, this is {os.uname().machine}"
    missing = [f for f in v.required if f not in _cpu_flags()]
    if missing:
        return f"this CPU lacks {', '.join(missing)} (the {v.name} kernels)"
    cc = _compiler()
    if cc is None:
        return "no C compiler (cc, gcc or clang) on PATH"
    try:
        lib = ctypes.CDLL(str(build_library(v, cc)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as e:
        return f"building the {v.name} kernels failed: {e}"
    problem = check_abi(lib)
    if problem:
        return f"the {v.name} kernels do not match infertune/kernels/cpu.py: {problem}"
    declare(lib)
    try:
        apply_prefetch_settings(lib)
    except ValueError as e:
        return str(e)
    return lib


def apply_prefetch_settings(lib: ctypes.CDLL) -> None:
    """Give a declared library this process's prefetch settings (INFERTUNE_PREFETCH, INFERTUNE_PREFETCH_12BIT_TILES or
    the CPU's defaults), as the loader does; A/B scripts call it on the second build they load so that both run as
    the engine would. Raises ValueError on a bad setting, before changing anything."""
    prefetch, prefetch_bf16, bf16c_tiles = prefetch_bytes(), prefetch_bf16_bytes(), prefetch_bf16c_tiles()
    if hasattr(lib, "it_set_prefetch"):
        lib.it_set_prefetch(prefetch)
        lib.it_set_prefetch_bf16(prefetch_bf16)
    if hasattr(lib, "it_set_prefetch_bf16c"):  # (the 12-bit codec: the AVX-512 library only)
        lib.it_set_prefetch_bf16c(bf16c_tiles)


# How far ahead the GEMVs ask for their weights (csrc/bf16.h pf_weights): 0 is "near" (a fixed distance along each
# weight row, into L1: what the kernels were tuned with on Intel Xeons), > 0 is "far" (the same columns of the rows
# whole blocks ahead, at least this many bytes, into L2). On AMD Zen 4 far streams a batch-1 decode step's weights
# ~1.7x faster (benchmarks/bench_prefetch.py); on an Intel Xeon with AMX (2026-12-05) whole batch-1 decodes ran
# 1.03-1.06x (12-bit bf16), 1.14-1.19x (W8A16) and 1.19-1.24x (W4A16) faster with far, 16 requests level: far is
# the default on every vendor. The AVX-512
# library's bf16 weights (its bf16 GEMV and the 12-bit codec's stream; the AVX2 library's bf16 GEMV keeps the
# int8 / int4 setting, far being 1.07x there) have their own setting: on AMD Zen 5 (cpu family 26) near reads them
# faster (the 12-bit linears 1.1-1.4x at one row, a 12-bit batch-1 decode 1.03-1.07x) while W8A16's GEMV still
# wants far (1.26x), so there auto is far for int8 / int4 weights and near for bf16 ones.
PREFETCH_FAR_BYTES = 4096
PREFETCH_CHOICES = ("auto", "near", "far")
# AMD CPU families from which bf16 weights prefetch near under auto (Zen 5 is family 26 = 0x1A)
PREFETCH_BF16_NEAR_FROM_AMD_FAMILY = 26


@functools.lru_cache(maxsize=1)
def _cpu_vendor() -> str:
    return _cpuinfo_field("vendor_id")


@functools.lru_cache(maxsize=1)
def _cpu_family() -> int:
    v = _cpuinfo_field("cpu family")
    return int(v) if v.isdigit() else -1


def _prefetch_env() -> str:
    v = os.environ.get("INFERTUNE_PREFETCH", "auto").strip().lower() or "auto"
    if not v.isdigit() and v not in PREFETCH_CHOICES:
        raise ValueError(
            f"INFERTUNE_PREFETCH={v!r}: use auto, near, far or a distance in bytes (far is {PREFETCH_FAR_BYTES})"
        )
    return v


def prefetch_bytes() -> int:
    """The int8 / int4 GEMVs' prefetch for this process: INFERTUNE_PREFETCH=near|far|BYTES, else (auto) far (measured
    faster on AMD Zen 4 / 5 and on an Intel Xeon with AMX). Returns the bytes that it_set_prefetch takes (0: near)."""
    v = _prefetch_env()
    if v.isdigit():
        return int(v)
    return 0 if v == "near" else PREFETCH_FAR_BYTES


def prefetch_bf16_bytes() -> int:
    """bf16 weights' prefetch (the AVX-512 bf16 GEMV, the 12-bit codec): INFERTUNE_PREFETCH=near|far|BYTES sets it as it
    sets prefetch_bytes(); auto is near on AMD Zen 5 and later (cpu family >= 26), else prefetch_bytes()."""
    amd_near = _cpu_vendor() == "AuthenticAMD" and _cpu_family() >= PREFETCH_BF16_NEAR_FROM_AMD_FAMILY
    return 0 if _prefetch_env() == "auto" and amd_near else prefetch_bytes()


# How many 12-bit tiles (3 KB each) ahead the codec asks for its stream (csrc/x86/avx512/bf16c_codec.c): 4 was tuned
# first; on an Intel Xeon with AMX (model 167, 2026-12-07, two builds in one process) 1 tile ahead decoded faster
# on 2 MB and 4 KB pages alike: the 386M model's batch-1 generate 0.89x the time (0.80x on the AVX-512 path without
# AMX, forced), the MoE preset's 16 requests 0.95x (experts 0.93-0.97x), 16 requests of the 386M level; 8 tiles was
# 1.14x slower. So auto is 1 on Intel, and 4 elsewhere (AMD Zen 4 / 5, not measured again).
# INFERTUNE_PREFETCH_12BIT_TILES=n sets it.
PREFETCH_BF16C_TILES = {"GenuineIntel": 1}
PREFETCH_BF16C_TILES_DEFAULT = 4


def prefetch_bf16c_tiles() -> int:
    """The 12-bit codec's prefetch distance in tiles: INFERTUNE_PREFETCH_12BIT_TILES, else by CPU vendor."""
    v = os.environ.get("INFERTUNE_PREFETCH_12BIT_TILES", "").strip()
    if v:
        if not v.isdigit() or int(v) < 1:
            raise ValueError(f"INFERTUNE_PREFETCH_12BIT_TILES={v!r}: a whole number of 3 KB tiles, 1 or more")
        return int(v)
    return PREFETCH_BF16C_TILES.get(_cpu_vendor(), PREFETCH_BF16C_TILES_DEFAULT)


def set_prefetch(far_bytes: int, *, bf16_far_bytes: int | None = None, lib: ctypes.CDLL | None = None) -> int:
    """Set a loaded library's GEMV prefetch (0: near; > 0: far, at least that many bytes ahead) for int8 / int4 weights
    and, unless bf16_far_bytes says otherwise, for bf16 weights too; returns the old int8 / int4 setting
    (get_prefetch: both). For A/B benchmarks: call it between steps, never while a kernel runs."""
    lib = _pick(lib)
    old = int(lib.it_get_prefetch())
    lib.it_set_prefetch(int(far_bytes))
    if bf16_far_bytes is not None:
        lib.it_set_prefetch_bf16(int(bf16_far_bytes))
    return old


def get_prefetch(*, lib: ctypes.CDLL | None = None) -> tuple[int, int]:
    """A loaded library's prefetch settings: (int8 / int4 weights', bf16 weights')."""
    lib = _pick(lib)
    return int(lib.it_get_prefetch()), int(lib.it_get_prefetch_bf16())


def prefetch_name(far_bytes: int) -> str:
    return "near" if far_bytes <= 0 else f"far ({far_bytes} B, into L2)"


def _torch_capability_below_avx512() -> bool:
    return not torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def _choose() -> tuple[str, ...]:
    """The variants to try, best first (INFERTUNE_CPU_ISA, else what the CPU and torch's own ISA limit allow)."""
    forced = os.environ.get("INFERTUNE_CPU_ISA", "auto").strip().lower() or "auto"
    if forced not in ISA_CHOICES:
        raise ValueError(f"INFERTUNE_CPU_ISA={forced!r}: choose one of {', '.join(ISA_CHOICES)}")
    if forced != "auto":
        return (forced,)
    if os.uname().machine == "aarch64":
        return ("neon",)
    # torch limited to AVX2 (ATEN_CPU_CAPABILITY=avx2: what an AVX2-only CPU gets): the kernels follow it
    return ("avx2",) if _torch_capability_below_avx512() else ("avx512", "avx2")


def _load() -> None:
    global _lib, _reason, _loaded, _amx, _variant, _noamx_gemm
    if _loaded:
        return
    with _lock:
        if _loaded:
            return
        if _disabled():
            _reason, _loaded = "disabled by INFERTUNE_CPU_KERNELS=0", True
            return
    reasons, gemm_wanted = [], True
    try:
        choices, gemm_wanted = _choose(), _noamx_gemm_wanted()
    except ValueError as e:
        choices, reasons = (), [str(e)]
    for choice in choices:
        got = load_variant("avx512" if choice.startswith("avx512") else choice)
        if isinstance(got, str):
            reasons.append(got)
            continue
        amx = False
        if choice == "avx512":  # asks Linux for the tile state
            amx = bool(got.it_amx_init(int({"amx_tile", "amx_bf16"} <= _cpu_flags())))
        elif choice == "avx512-noamx":
            got.it_amx_init(0)
        noamx_gemm = choice.startswith("avx512") and not amx and gemm_wanted
        if choice.startswith("avx512") and not amx and not noamx_gemm:
            got.it_gemm_rows_noamx(1 << 62)  # the GEMV at every row count, as before the GEMM
        with _lock:
            _lib, _amx, _variant, _noamx_gemm = got, amx, choice, noamx_gemm
            _loaded = True
        if reasons:  # (a better variant for this CPU did not build or load: slower kernels, said out loud)
            log.warning(
                "CPU kernels: running the %s variant; the better ones did not load: %s", choice, "; ".join(reasons)
            )
        return
    with _lock:
        _reason, _loaded = "; ".join(reasons) or "no kernel variant fits this CPU", True
    log.warning("CPU kernels unavailable, using torch's: %s", _reason)


def _noamx_gemm_wanted() -> bool:
    v = os.environ.get("INFERTUNE_NOAMX_GEMM", "1").strip().lower()
    if v not in ("0", "1", "false", "true", "off", "on", "no", "yes", ""):
        raise ValueError(f"INFERTUNE_NOAMX_GEMM={v!r}: use 1 (the default) or 0 (the GEMV up to {MAX_ROWS} rows only)")
    return v not in ("0", "false", "off", "no")


def amx() -> bool:
    """Whether the process's kernels run AMX tiles."""
    _load()
    return _amx


def variant() -> str | None:
    """The variant the process's kernels run ("avx512", "avx512-noamx", "avx2"), or None."""
    _load()
    return _variant


def describe() -> str:
    """One line for start-up logs: which kernel variant runs, or why none."""
    _load()
    if _lib is None:
        return f"none ({_reason})"
    far, far_bf16 = get_prefetch(lib=_lib) if hasattr(_lib, "it_get_prefetch") else (0, 0)
    pf = ""
    if far:
        pf = " + far prefetch" + ("" if far_bf16 else " (bf16 near)")
    elif far_bf16:
        pf = " + far prefetch (bf16 only)"
    return f"{_variant}" + (" + amx" if _amx else "") + (" + vdpbf16ps gemm" if _noamx_gemm else "") + pf


def declare(lib: ctypes.CDLL) -> None:
    """Give a build of the kernels its functions' C signatures (benchmarks load a second build this way). A variant
    declares what it has: the AVX2 library has no 12-bit weights, attention or fused step."""
    i64, ptr, cint = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    model, step, layer, bf16c, lin = (ctypes.POINTER(c) for c in (ItModel, ItStep, ItLayer, Bf16c, ItLin))
    signatures = {
        "it_linear_bf16": ([ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, cint], None),
        "it_linear_bf16_gemv": ([ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, cint], None),
        "it_linear_bf16_gemm_noamx": ([ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, cint], cint),
        "it_gemm_rows_noamx": ([i64], i64),
        "it_px_gemm": ([cint], cint),
        "it_quantize_rows_i16": ([ptr, i64, i64, i64, i64, ptr, ptr, ptr, i64, cint], None),
        "it_split_rows_i16": ([ptr, i64, i64, ptr, ptr, ptr, ptr], None),
        "it_w4b_split_row": ([ptr, i64, ptr, ptr], None),
        "it_bf16c_reg_rows": ([i64], i64),
        "it_q_dq_rows": ([i64, i64], i64),
        "it_w4_amx_rows": ([i64], i64),
        "it_w4_tiles": ([cint], cint),
        "it_w8p_tiles": ([cint], cint),
        "it_w8p_tile_rows": ([i64], i64),
        "it_set_prefetch": ([i64], None),
        "it_get_prefetch": ([], i64),
        "it_set_prefetch_bf16": ([i64], None),
        "it_get_prefetch_bf16": ([], i64),
        "it_set_prefetch_bf16c": ([i64], None),
        "it_get_prefetch_bf16c": ([], i64),
        "it_linear_bf16_gemm_fma": ([ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, cint], cint),
        "it_gemm_rows_fma": ([i64], i64),
        "it_linear_bf16_gemvx": ([ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, cint], cint),
        "it_gemvx_rows": ([i64], i64),
        "it_linear_w8": ([ptr, i64, ptr, ptr, cint, ptr, ptr, i64, i64, i64, i64, cint], None),
        "it_linear_w8a8": ([ptr, i64, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, cint], cint),
        "it_linear_w8p": ([ptr, i64, ptr, ptr, ptr, ptr, i64, i64, i64, i64, cint], cint),
        "it_linear_w4p": ([ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, cint], cint),
        "it_pack_w8a8": ([ptr, i64, i64, ptr, cint], cint),
        "it_w8a8_block": ([], i64),
        "it_unpack_w8a8": ([ptr, i64, i64, ptr], None),
        "it_linear_w4": ([ptr, i64, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, cint], None),
        "it_dequant_w8": ([ptr, ptr, cint, ptr, i64, i64, cint], None),
        "it_dequant_w4": ([ptr, ptr, ptr, i64, ptr, i64, i64, cint], None),
        "it_rmsnorm_mt": ([ptr, ptr, ptr, i64, i64, ctypes.c_float, cint], None),
        "it_argmax_rows": ([ptr, i64, i64, i64, ptr, cint], None),
        "it_argmax_rows_bf16": ([ptr, i64, i64, i64, ptr, cint], None),
        "it_silu_mul": ([ptr, ptr, i64, i64, cint], None),
        "it_gelu_mul": ([ptr, ptr, i64, i64, cint], None),
        "it_rmsnorm_f32w": ([ptr, ptr, ptr, i64, i64, ctypes.c_float, cint], None),
        "it_rotary": ([ptr, i64, i64, i64, i64, ptr, i64, cint], None),
        "it_amx_init": ([cint], cint),
        "it_decode_workspace_bytes": ([model, i64, i64], i64),
        "it_decode_layers": ([model, layer, step, ptr], cint),
        "it_decode_attention": ([model, step, ptr, ptr, ptr, cint], cint),
        "it_linear_bf16c": ([ptr, i64, bf16c, ptr, ptr, i64, i64, i64, i64, cint, i64, cint], cint),
        "it_bf16c_slabs": ([i64, i64], i64),  # (an older build, loaded by bench_kernel_builds.py, lacks it)
        "it_unpack_bf16c": ([bf16c, ptr, i64, i64, cint], None),
        "it_bf16c_hist": ([ptr, i64, ptr, cint], None),
        "it_bf16c_pack": ([ptr, i64, i64, i64, ptr, ptr, ptr, cint], None),
        "it_bf16c_escapes": ([ptr, i64, i64, i64, ptr, ptr, ptr, ptr, cint], None),
        "it_moe_route": ([ptr, cint, i64, i64, ctypes.POINTER(ItMoe), ptr, ptr, ptr, ptr, ptr, cint], cint),
        "it_moe_route_rows": ([ptr, cint, i64, i64, ctypes.POINTER(ItMoe), ptr, ptr, ptr, ptr, cint], i64),
        "it_moe_topk_torch": ([ptr, i64, i64, i64, ptr], i64),
        "it_moe_experts": ([ptr, i64, i64, lin, lin, i64, i64, ptr, ptr, ptr, ptr, cint], cint),
        "it_moe_experts_part": ([ptr, i64, i64, lin, lin, i64, i64, i64, i64, ptr, ptr, ptr, ptr, cint], cint),
        "it_moe_experts_ws_bytes": ([i64, i64, i64, i64, i64, cint], i64),
        "it_moe_experts_ws": ([ptr, i64, i64, lin, lin, i64, i64, i64, i64, ptr, ptr, ptr, ptr, cint, ptr, i64], cint),
        "it_moe_max_experts": ([], i64),
    }
    for name, (args, res) in signatures.items():
        fn = getattr(lib, name, None)
        if fn is not None:
            fn.argtypes, fn.restype = args, res


# The structs of csrc/abi.h, field for field (check_abi holds the two sides to each other at load).
class ItLin(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int32),
        ("scale_is_f32", ctypes.c_int32),
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("N", ctypes.c_int64),
        ("K", ctypes.c_int64),
        ("zero", ctypes.c_void_p),
        ("group", ctypes.c_int64),
        ("inter", ctypes.c_int64),
    ]


class ItLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", ItLin),
        ("o", ItLin),
        ("gate_up", ItLin),
        ("down", ItLin),
        ("kv_cache", ctypes.c_void_p),
        ("q_norm", ctypes.c_void_p),
        ("k_norm", ctypes.c_void_p),
        ("moe", ctypes.c_void_p),  # an ItMoeLayer, or None: the dense MLP
        ("window", ctypes.c_int64),  # > 0: the layer's sliding window; 0: the whole context
        ("group", ctypes.c_int64),  # its KV cache group (ItStep.group_slots / group_tables)
        ("pre_ff_norm", ctypes.c_void_p),  # Gemma's MLP input norm (post_norm is then o_proj's output's); None: Llama's
        ("post_ff_norm", ctypes.c_void_p),  # Gemma's norm of the MLP's output
        ("cos_sin", ctypes.c_void_p),  # the layer's own rotary table (Gemma 3's sliding layers); None: the model's
        ("mla", ctypes.c_void_p),  # an ItMlaLayer (latent attention), or None: the heads' own K / V
    ]


class ItModel(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_int64)
        for name in ("hidden", "n_heads", "n_kv_heads", "head_dim", "inter", "num_blocks", "block_size")
    ] + [
        ("cos_sin", ctypes.c_void_p),
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("nthreads", ctypes.c_int32),
        ("n_layers", ctypes.c_int32),
        ("kv_int8", ctypes.c_int32),
        ("gate_up_fused", ctypes.c_int32),
        ("moe_experts", ctypes.c_int32),
        ("moe_top_k", ctypes.c_int32),
        ("act", ctypes.c_int32),  # ACT_SILU / ACT_GELU_TANH
        ("norm_f32", ctypes.c_int32),  # 1: every norm's weight is fp32 factors (Gemma's 1 + w)
        ("softcap", ctypes.c_float),  # > 0: attention scores soft-capped (Gemma 2)
        # latent attention (ItMlaLayer): the latent's, rotary key's, q's no-rotary part's and v's widths per head, q's
        # low rank; 0: none
        ("mla_rank", ctypes.c_int64),
        ("mla_rope", ctypes.c_int64),
        ("mla_nope", ctypes.c_int64),
        ("mla_v", ctypes.c_int64),
        ("mla_q_rank", ctypes.c_int64),
    ]


# The gated MLP's activation (csrc/abi.h it_model.act)
ACT_SILU, ACT_GELU_TANH = 0, 1
BF16C_EPI_STREAM = 2  # it_linear_bf16c's epi: a plain product written past the caches (csrc abi.h, bf16c_gemm.c)


class Bf16c(ctypes.Structure):
    """A bf16 weight in the kernels' lossless 12-bit layout (csrc/abi.h bf16c); see pack_bf16c."""

    _fields_ = [
        ("codes", ctypes.c_void_p),
        ("table", ctypes.c_void_p),
        ("esc_start", ctypes.c_void_p),
        ("esc_pos", ctypes.c_void_p),
        ("esc_val", ctypes.c_void_p),
    ]


class ItStep(ctypes.Structure):
    _fields_ = [
        ("T", ctypes.c_int64),
        ("positions", ctypes.c_void_p),
        ("slots", ctypes.c_void_p),
        ("block_tables", ctypes.c_void_p),
        ("context_lens", ctypes.c_void_p),
        ("max_blocks", ctypes.c_int64),
        ("work", ctypes.c_void_p),
        ("work_bytes", ctypes.c_int64),
        ("out_rows", ctypes.c_void_p),
        ("n_out", ctypes.c_int64),
        ("stats", ctypes.c_void_p),  # an ItStepStats the caller owns (one per engine), or None: not timed
        # mixture-of-experts layers: a tie at the top-k boundary hands the step back (csrc/abi.h it_step)
        ("router_logits", ctypes.c_void_p),
        ("first_layer", ctypes.c_int32),
        ("handed_back", ctypes.c_int32),
        ("route_rows", ctypes.c_int64),
        ("route_weights", ctypes.c_void_p),
        ("route_ids", ctypes.c_void_p),
        ("tied_rows", ctypes.c_void_p),
        ("expert_load", ctypes.c_void_p),
        ("n_groups", ctypes.c_int64),  # 0: every layer reads slots / block_tables; else its group's below
        ("group_slots", ctypes.c_void_p * MAX_KV_GROUPS),
        ("group_tables", ctypes.c_void_p * MAX_KV_GROUPS),
        # tensor parallel on one host: the shared-memory all-reduce after each row-parallel linear (csrc/abi.h)
        ("tp_shm", ctypes.c_void_p),
        ("tp_seq", ctypes.c_void_p),
        ("tp_rank", ctypes.c_int32),
        ("tp_size", ctypes.c_int32),
        ("tp_max_numel", ctypes.c_int64),
        ("tp_reduce_fn", ctypes.c_void_p),  # without the segment: the caller's all-reduce (TP_REDUCE_FN)
    ]


# it_step.tp_reduce_fn's type: int (*)(bf16* y, int64_t n), y summed over the ranks in place
TP_REDUCE_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_int64)

# The parts of the fused step that it_decode_layers times (csrc/abi.h IT_FT_*), in order
FUSED_PARTS = (
    "norm",
    "qkv",
    "rotary + K/V write",
    "attention",
    "o_proj",
    "residual adds",
    "gate_up (+ activation)",
    "down",
    "MoE router",
    "experts",
    "all-reduce (tensor parallel)",
)


class ItStepStats(ctypes.Structure):
    """The fused step's seconds per part (FUSED_PARTS), calls and rows, summed over the steps that point at it
    (csrc/abi.h it_step_stats): each fused decoder owns one, so engines in one process count apart."""

    _fields_ = [
        ("seconds", ctypes.c_double * len(FUSED_PARTS)),
        ("calls", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("allreduce_calls", ctypes.c_int64),
        ("allreduce_bytes", ctypes.c_int64),
        ("kv_read_bytes", ctypes.c_int64),  # latent attention: the cache rows' bytes its attention read
    ]


class ItMoe(ctypes.Structure):
    """A mixture-of-experts layer's routing rule (csrc/abi.h it_moe; MOE_SCORING / MOE_TOPK_METHOD give the codes)."""

    _fields_ = [
        (name, ctypes.c_int32)
        for name in ("num_experts", "top_k", "scoring", "topk_method", "n_group", "topk_group", "norm_topk_prob")
    ] + [("routed_scaling_factor", ctypes.c_float), ("torch_ties", ctypes.c_int32)]


class ItMoeLayer(ctypes.Structure):
    """A mixture-of-experts layer of the fused step (csrc/abi.h it_moe_layer): the routing rule, the router's weight,
    the routed experts (expert 0's ItLin of each stacked projection) and an optional shared expert."""

    _fields_ = [
        ("rule", ItMoe),
        ("router", ctypes.c_void_p),
        ("bias", ctypes.c_void_p),
        ("gate_up", ItLin),
        ("down", ItLin),
        ("shared_gate_up", ItLin),
        ("shared_down", ItLin),
        ("shared_gate", ctypes.c_void_p),
        ("expert_offset", ctypes.c_int64),
        ("local_experts", ctypes.c_int64),
        ("router_f32", ctypes.c_void_p),  # an fp32 router [E, hidden] (DeepSeek's; router unused), or None
    ]


class ItMlaLayer(ctypes.Structure):
    """A latent-attention layer of the fused step (csrc/abi.h it_mla_layer; the dims are ItModel.mla_*)."""

    _fields_ = [
        ("q_a", ItLin),  # N = 0: no low-rank q (q_b is q_proj)
        ("q_b", ItLin),
        ("kv_a", ItLin),
        ("q_a_norm", ctypes.c_void_p),
        ("kv_a_norm", ctypes.c_void_p),
        ("kv_up", ctypes.c_void_p),  # kv_b_proj [H, nope + v, rank] bf16
        ("latent_eps", ctypes.c_float),
        ("interleaved", ctypes.c_int32),
    ]


# it_moe.scoring and it_moe.topk_method (csrc/abi.h IT_MOE_*): MoeArch's names -> the C codes
MOE_SCORING = {"softmax": 0, "sigmoid": 1}
MOE_TOPK_METHOD = {"greedy": 0, "group_limited_greedy": 1, "noaux_tc": 2}


# What it_struct_sizes (csrc/abi.c) writes, in order: per struct its size and each field's offset and width, then the
# weight kinds and the MoE rules' codes.
def abi_layout(structs: dict[str, type[ctypes.Structure]] | None = None) -> list[tuple[str, int]]:
    """The (name, value) list the C side must report: from these ctypes classes (structs overrides some, in tests)."""
    structs = {
        "it_lin": ItLin,
        "it_layer": ItLayer,
        "it_model": ItModel,
        "it_step": ItStep,
        "it_step_stats": ItStepStats,
        "bf16c": Bf16c,
        "it_moe": ItMoe,
        "it_moe_layer": ItMoeLayer,
        "it_mla_layer": ItMlaLayer,
    } | (structs or {})
    fields = {
        "it_lin": ("kind", "scale_is_f32", "w", "scale", "bias", "N", "K", "zero", "group", "inter"),
        "it_layer": (
            "input_norm",
            "post_norm",
            "qkv",
            "o",
            "gate_up",
            "down",
            "kv_cache",
            "q_norm",
            "k_norm",
            "moe",
            "window",
            "group",
            "pre_ff_norm",
            "post_ff_norm",
            "cos_sin",
            "mla",
        ),  # fmt: skip
        "it_model": (
            "hidden",
            "n_heads",
            "n_kv_heads",
            "head_dim",
            "inter",
            "num_blocks",
            "block_size",
            "cos_sin",
            "eps",
            "scale",
            "nthreads",
            "n_layers",
            "kv_int8",
            "gate_up_fused",
            "moe_experts",
            "moe_top_k",
            "act",
            "norm_f32",
            "softcap",
            "mla_rank",
            "mla_rope",
            "mla_nope",
            "mla_v",
            "mla_q_rank",
        ),  # fmt: skip
        "it_step": (
            "T",
            "positions",
            "slots",
            "block_tables",
            "context_lens",
            "max_blocks",
            "work",
            "work_bytes",
            "out_rows",
            "n_out",
            "stats",
            "router_logits",
            "first_layer",
            "handed_back",
            "route_rows",
            "route_weights",
            "route_ids",
            "tied_rows",
            "expert_load",
            "n_groups",
            "group_slots",
            "group_tables",
            "tp_shm",
            "tp_seq",
            "tp_rank",
            "tp_size",
            "tp_max_numel",
            "tp_reduce_fn",
        ),  # fmt: skip
        "it_step_stats": ("seconds", "calls", "rows", "allreduce_calls", "allreduce_bytes", "kv_read_bytes"),
        "bf16c": ("codes", "table", "esc_start", "esc_pos", "esc_val"),
        "it_moe": tuple(f for f, _ in ItMoe._fields_),
        "it_moe_layer": tuple(f for f, _ in ItMoeLayer._fields_),
        "it_mla_layer": tuple(f for f, _ in ItMlaLayer._fields_),
    }
    out: list[tuple[str, int]] = []
    for sname, names in fields.items():
        cls = structs[sname]
        out.append((f"sizeof({sname})", ctypes.sizeof(cls)))
        for f in names:
            desc = getattr(cls, f, None)
            out.append((f"offsetof({sname}, {f})", desc.offset if desc is not None else -1))
            out.append((f"sizeof({sname}.{f})", desc.size if desc is not None else -1))
    out += [(f"it_kind {k.name}", int(k)) for k in WeightKind]
    out += [(f"it_moe.scoring {k}", v) for k, v in MOE_SCORING.items()]
    out += [(f"it_moe.topk_method {k}", v) for k, v in MOE_TOPK_METHOD.items()]
    out.append(("IT_FT_PARTS (the fused step's timed parts)", len(FUSED_PARTS)))
    out += [("IT_ACT_SILU", ACT_SILU), ("IT_ACT_GELU_TANH", ACT_GELU_TANH)]
    out.append(("IT_BF16C_EPI_STREAM", BF16C_EPI_STREAM))
    return out


def check_abi(lib: ctypes.CDLL, structs: dict[str, type[ctypes.Structure]] | None = None) -> str | None:
    """None where the library's ABI version, struct sizes, field offsets and weight kinds are those declared here;
    else what differs (a sentence). Nothing else of the library is called before this passes."""
    try:
        abi, sizes = lib.it_abi, lib.it_struct_sizes
    except AttributeError:
        return "the library has no it_abi / it_struct_sizes (built from an older source)"
    abi.argtypes, abi.restype = [], ctypes.c_int
    sizes.argtypes, sizes.restype = [ctypes.c_void_p, ctypes.c_int64], ctypes.c_int64
    if abi() != ABI_VERSION:
        return f"ABI version {abi()} in C, {ABI_VERSION} in Python"
    want = abi_layout(structs)
    n = int(sizes(None, 0))
    got = (ctypes.c_int64 * n)()
    sizes(got, n)
    if n != len(want):
        return f"the C side reports {n} struct sizes / offsets, Python expects {len(want)}"
    bad = [f"{name}: C {c}, Python {p}" for (name, p), c in zip(want, got) if c != p]
    return ("; ".join(bad[:6]) + (f" (and {len(bad) - 6} more)" if len(bad) > 6 else "")) if bad else None


def library() -> ctypes.CDLL:
    """The loaded kernel library (raises where it is unavailable)."""
    if not available():
        raise RuntimeError(f"the CPU kernels are unavailable: {unavailable_reason()}")
    return _lib


def bf16_max_rows() -> int:
    """Rows up to which linear_bf16 beats torch's GEMM here: AMX_GEMM_MAX_ROWS with AMX, NOAMX_GEMM_MAX_ROWS on the
    AVX-512 library without AMX (its VDPBF16PS GEMM), AVX2_GEMM_MAX_ROWS on AVX2 (its FMA GEMM), else MAX_ROWS
    (NEON, or INFERTUNE_NOAMX_GEMM=0)."""
    _load()
    if _variant == "avx2":
        return AVX2_GEMM_MAX_ROWS
    return AMX_GEMM_MAX_ROWS if _amx else NOAMX_GEMM_MAX_ROWS if _noamx_gemm else MAX_ROWS


def quant_max_rows() -> int:
    """Rows up to which a W8A16 / W4A16 layer calls linear_w8 / linear_w4 (past them it dequantizes the whole layer
    and runs the bf16 GEMM): NOAMX_QUANT_MAX_ROWS on the AVX-512 library without AMX with its GEMM on, where prompts
    multiply slabs rebuilt from the quantized weights (gemv_quant.c linear_q_gemm); AMX_GEMM_MAX_ROWS with AMX, where
    past 16 rows the tile GEMM of linear_bf16 takes its weight tiles from 32 rows rebuilt at a time (quant_amx.c
    linear_q_amx_gemm: the same bits, no dequantized copy; past 128 rows torch's GEMM on the copy is faster); else
    MAX_ROWS."""
    _load()
    if _variant == "avx512" and _amx:
        return AMX_GEMM_MAX_ROWS
    return NOAMX_QUANT_MAX_ROWS if _variant == "avx512" and not _amx and _noamx_gemm else MAX_ROWS


def _pick(lib: ctypes.CDLL | None) -> ctypes.CDLL:
    """The library a call runs on: the one given (a variant loaded by load_variant) or the process's."""
    if lib is not None:
        return lib
    _load()
    if _lib is None:
        raise RuntimeError(f"the CPU kernels are unavailable: {_reason}")
    return _lib


def available() -> bool:
    _load()
    return _lib is not None


def unavailable_reason() -> str | None:
    _load()
    return _reason


def profiled(name: str):
    """A torch.profiler range `infertune_kernels::<name>` while a profiler runs (the C calls are not aten ops, so
    `infertune profile` would otherwise see their time as Python), a no-op otherwise."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(f"infertune_kernels::{name}")
    return contextlib.nullcontext()


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x2.dtype is not torch.bfloat16 or x2.device.type != "cpu":
        raise ValueError(f"the CPU kernels take bf16 CPU activations, got {x2.dtype} on {x2.device}")
    if not w.is_contiguous() or w.shape[1] != x2.shape[1]:
        raise ValueError(f"weight {tuple(w.shape)} (contiguous: {w.is_contiguous()}) does not fit x {tuple(x2.shape)}")
    if bias is not None and (bias.dtype is not torch.bfloat16 or not bias.is_contiguous()):
        raise ValueError("bias must be a contiguous bf16 tensor")


def linear_bf16(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """x [..., K] bf16, weight [N, K] bf16 -> [..., N] bf16 (fp32 accumulation)."""
    lib = _pick(lib)
    x2 = _rows(x)
    _check(x2, weight, bias)
    if weight.dtype is not torch.bfloat16:
        raise ValueError(f"weight must be bf16, got {weight.dtype}")
    m, (n, k) = x2.shape[0], weight.shape
    y = torch.empty((m, n), dtype=torch.bfloat16)
    with profiled("linear_bf16"):
        lib.it_linear_bf16(
            x2.data_ptr(),
            x2.stride(0),
            weight.data_ptr(),
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            n,
            m,
            n,
            k,
            torch.get_num_threads(),
        )
    return y.view(*x.shape[:-1], n)


def linear_bf16_path(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    path: str,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """linear_bf16 through one of the non-AMX paths whatever the rows (tests, benchmarks): "gemm" (the AVX-512
    library's VDPBF16PS GEMM, K even; the AVX2 and NEON libraries' FMA GEMM, any K), "gemv" (the GEMV, what every
    row count ran before the GEMM) or, on AVX2, "gemvx" (the GEMV on x widened once, for a few rows)."""
    lib = _pick(lib)
    x2 = _rows(x)
    _check(x2, weight, bias)
    fma = getattr(lib, "it_linear_bf16_gemm_fma", None)
    fn = {
        "gemm": fma or getattr(lib, "it_linear_bf16_gemm_noamx", None),
        "gemv": getattr(lib, "it_linear_bf16_gemv", None),
        "gemvx": getattr(lib, "it_linear_bf16_gemvx", None),
    }
    if fn.get(path) is None:
        raise ValueError(f"path={path!r}: this library has {[p for p, f in fn.items() if f is not None]}")
    m, (n, k) = x2.shape[0], weight.shape
    if path == "gemm" and k % 2 and fma is None:
        raise ValueError(f"the VDPBF16PS GEMM needs an even K, got {k}")
    y = torch.empty((m, n), dtype=torch.bfloat16)
    b = bias.data_ptr() if bias is not None else None
    fn[path](x2.data_ptr(), x2.stride(0), weight.data_ptr(), b, y.data_ptr(), n, m, n, k, torch.get_num_threads())
    return y.view(*x.shape[:-1], n)


def linear_w8(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [..., K] bf16, qweight [N, K] int8, scales [N] (bf16 or fp32) -> [..., N] bf16.

    x is rounded per row to int16 (|x - x_q s_x| <= s_x / 2, s_x = max|x| / 32512) and multiplied exactly in int32.
    """
    lib = _pick(lib)
    x2 = _rows(x)
    _check(x2, qweight, bias)
    if (
        qweight.dtype is not torch.int8
        or scales.dtype not in (torch.bfloat16, torch.float32)
        or not scales.is_contiguous()
    ):
        raise ValueError(f"need int8 weights and contiguous bf16/fp32 scales, got {qweight.dtype} / {scales.dtype}")
    m, (n, k) = x2.shape[0], qweight.shape
    y = torch.empty((m, n), dtype=torch.bfloat16)
    with profiled("linear_w8"):
        lib.it_linear_w8(
            x2.data_ptr(),
            x2.stride(0),
            qweight.data_ptr(),
            scales.data_ptr(),
            int(scales.dtype is torch.float32),
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            n,
            m,
            n,
            k,
            torch.get_num_threads(),
        )
    return y.view(*x.shape[:-1], n)


# W8A8's int32 sums hold K up to this many columns (csrc/x86/avx512/gemm_i8.c I8_MAX_K)
W8A8_MAX_K = 1 << 16


def w8a8_supported(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library has the W8A8 kernel (AVX-512: VPDPBUSD; AVX2: VPMADDUBSW; NEON: SDOT or SMULL + SADALP)."""
    try:
        return getattr(_pick(lib), "it_linear_w8a8", None) is not None
    except RuntimeError:
        return False


def w8a8_packed_shape(n: int, k: int, lib: ctypes.CDLL | None = None) -> tuple[int, int, int]:
    """The packed W8A8 weight's shape (int32 words): [ceil(N / B), ceil(K / 64) * 16, B], B the library's block of
    features (it_w8a8_block: 64 on AVX-512, 16 on AVX2 and NEON)."""
    lib = _pick(lib)
    b = getattr(lib, "_w8a8_block", None)  # (asked once per library: this check runs on every linear_w8a8 call)
    if b is None:
        b = lib._w8a8_block = int(lib.it_w8a8_block())
    return (n + b - 1) // b, (k + 63) // 64 * 16, b


def pack_w8a8(q: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """int8 [N, K] in -127..127 (quantize_int8_per_channel's range; -128 raises ValueError) -> linear_w8a8's
    weight: int32 words [ceil(N / B), ceil(K / 64) * 16, B], word (b, p, l) the 4 columns 4p .. 4p + 3 of row B b + l
    (AVX-512: each byte + 128, VPDPBUSD's unsigned operand; AVX2 and NEON: as they are); padding holds q = 0."""
    lib = _pick(lib)
    if q.dtype is not torch.int8 or q.dim() != 2 or not q.is_contiguous():
        raise ValueError(f"need a contiguous int8 [N, K] weight, got {q.dtype} {tuple(q.shape)}")
    n, k = q.shape
    out = hugepages.empty(w8a8_packed_shape(n, k, lib), torch.int32)  # (streamed by every step: on 2 MB pages)
    if lib.it_pack_w8a8(q.data_ptr(), n, k, out.data_ptr(), torch.get_num_threads()) != 0:
        raise ValueError("the W8A8 kernels take weights in -127..127; this one holds -128")
    return out


def unpack_w8a8(packed: torch.Tensor, n: int, k: int, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """The inverse of pack_w8a8: int8 [N, K]."""
    lib = _pick(lib)
    if packed.dtype is not torch.int32 or tuple(packed.shape) != w8a8_packed_shape(n, k, lib):
        raise ValueError(f"not a packed [{n}, {k}] W8A8 weight: {packed.dtype} {tuple(packed.shape)}")
    q = torch.empty((n, k), dtype=torch.int8)
    lib.it_unpack_w8a8(packed.contiguous().data_ptr(), n, k, q.data_ptr())
    return q


def linear_w8a8(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    input_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [..., K] bf16, packed (pack_w8a8 of an int8 [N, K]), scales fp32 [N] -> [..., N] bf16: quant/int8.py
    W8A8Method's product bit for bit. x is rounded to int8 per row (s_x = max(max|x| / 127, 1e-12), round half to
    even, clamp to +-127), or by input_scale (fp32 [1], a calibrated static scale) where given; the int8 products sum
    exactly in int32; then bf16(float(sum) * s_x * s_w), and a bias added to that and rounded again."""
    lib = _pick(lib)
    x2, m, k, n = _packed_i8_args(lib, "it_linear_w8a8", x, packed, scales, bias)
    if input_scale is not None and (input_scale.dtype is not torch.float32 or input_scale.numel() != 1):
        raise ValueError(f"input_scale: one fp32 value, got {input_scale.dtype} {tuple(input_scale.shape)}")
    weights = (packed.data_ptr(), scales.data_ptr(), input_scale.data_ptr() if input_scale is not None else None)
    return _packed_linear_call(lib, "it_linear_w8a8", x, x2, weights, bias, n)


def _packed_linear_call(lib: ctypes.CDLL, symbol: str, x: torch.Tensor, x2: torch.Tensor, weights: tuple, bias, n: int):
    """Call one of the packed linears, symbol(x, ldx, *weights, bias, y, ldy, M, N, K, nthreads) -> 0 (else an error),
    and return y [..., N] bf16."""
    m, k = x2.shape
    y = torch.empty((m, n), dtype=torch.bfloat16)
    with profiled(symbol.removeprefix("it_")):
        rc = getattr(lib, symbol)(
            x2.data_ptr(),
            x2.stride(0),
            *weights,
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            n,
            m,
            n,
            k,
            torch.get_num_threads(),
        )
    if rc != 0:
        raise RuntimeError(f"{symbol} returned {rc}")
    return y.view(*x.shape[:-1], n)


def _packed_i8_args(
    lib: ctypes.CDLL, symbol: str, x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias
) -> tuple[torch.Tensor, int, int, int]:
    """linear_w8a8's / linear_w8p's checks of their arguments -> (x as rows [M, K], M, K, N)"""
    if getattr(lib, symbol, None) is None:
        raise ValueError(f"this library has no {symbol} kernel")
    x2 = _rows(x)
    if x2.dtype is not torch.bfloat16 or x2.device.type != "cpu":
        raise ValueError(f"the CPU kernels take bf16 CPU activations, got {x2.dtype} on {x2.device}")
    if scales.dtype is not torch.float32 or scales.dim() != 1 or not scales.is_contiguous():
        raise ValueError(f"need contiguous fp32 scales [N], got {scales.dtype} {tuple(scales.shape)}")
    m, k, n = x2.shape[0], x2.shape[1], scales.numel()
    if (
        packed.dtype is not torch.int32
        or tuple(packed.shape) != w8a8_packed_shape(n, k, lib)
        or not packed.is_contiguous()
    ):
        raise ValueError(f"not a packed [{n}, {k}] int8 weight (pack_w8a8): {packed.dtype} {tuple(packed.shape)}")
    if bias is not None and (bias.dtype is not torch.bfloat16 or not bias.is_contiguous() or bias.numel() != n):
        raise ValueError("bias must be a contiguous bf16 tensor [N]")
    if k > W8A8_MAX_K:
        raise ValueError(f"in_features={k}: the int32 sums hold {W8A8_MAX_K} at most")
    return x2, m, k, n


def w8p_supported(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library has W8A16 on the packed int8 weight (it_linear_w8p: the AVX-512 library)."""
    try:
        return getattr(_pick(lib), "it_linear_w8p", None) is not None
    except RuntimeError:
        return False


def linear_w8p(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [..., K] bf16, packed (pack_w8a8 of an int8 [N, K]), scales fp32 [N] -> [..., N] bf16: W8A16 with linear_w8's
    arithmetic (csrc/x86/avx512/gemm_w8p.c): x rounded to int16 per row (s_x = max|x| / 32512), the products summed
    exactly, y = bf16(sum * s_x * s_w + bias) in fp32; linear_w8's result on the unpacked weight bit for bit where
    linear_w8 runs its int16 kernels."""
    lib = _pick(lib)
    x2, m, k, n = _packed_i8_args(lib, "it_linear_w8p", x, packed, scales, bias)
    return _packed_linear_call(lib, "it_linear_w8p", x, x2, (packed.data_ptr(), scales.data_ptr()), bias, n)


def w4_supported(k: int, group_size: int) -> bool:
    """Shapes linear_w4 takes: the group size a multiple of 64, K a multiple of the group size."""
    return group_size % 64 == 0 and k % group_size == 0


def pack_w4(q: torch.Tensor) -> torch.Tensor:
    """q [N, K] integers in 0..15 (K a multiple of 64) -> uint8 [N, K / 2]: in each run of 64 columns, byte b
    (0..31) holds column b in its low nibble and column 32 + b in its high nibble (the layout linear_w4 widens
    with one 32-byte load)."""
    n, k = q.shape
    r = q.to(torch.uint8).view(n, k // 64, 2, 32)
    return hugepages.copy((r[:, :, 0] | (r[:, :, 1] << 4)).reshape(n, k // 2))  # (streamed: on 2 MB pages)


def unpack_w4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_w4: uint8 [N, K / 2] -> uint8 [N, K] in 0..15."""
    n, half = packed.shape
    r = packed.view(n, half // 32, 1, 32)
    return torch.cat([r & 0xF, r >> 4], dim=2).reshape(n, half * 2)


def w4p_supported(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the library has W4A16 on the packed int4 weight (it_linear_w4p: the AVX-512 library)."""
    try:
        return getattr(_pick(lib), "it_linear_w4p", None) is not None
    except RuntimeError:
        return False


def pack_w4p(
    q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [N, K] in 0..15, scale and zero fp32 [N, K / group_size] -> linear_w4p's weight (csrc/x86/avx512/gemm_w4p.c):
    int32 words [ceil(N / 64), K / 8, 64], the word (b, p, f) columns 8p .. 8p + 7 of feature 64 b + f (byte j: column
    8p + j in its low nibble, 8p + 4 + j in its high), and scale / zero fp32 [ceil(N / 64), K / group_size, 64];
    features past N zero."""
    n, k = q.shape
    if not w4_supported(k, group_size):
        raise ValueError(f"group_size={group_size} must be a multiple of 64 and K={k} a multiple of it")
    nb = (n + 63) // 64
    qp = torch.zeros((nb * 64, k), dtype=torch.uint8)  # (one byte a weight: a large layer's transients stay small)
    qp[:n] = q
    r = qp.view(nb, 64, k // 8, 2, 4)  # [block, feature, octet, low / high nibble, byte]
    b = r[:, :, :, 0] | (r[:, :, :, 1] << 4)  # the 4 bytes of each word, in memory order (little-endian)
    words = b.contiguous().view(torch.int32).view(nb, 64, k // 8)  # [block, feature, octet]

    def blocked(t: torch.Tensor) -> torch.Tensor:
        out = torch.zeros((nb * 64, t.shape[1]), dtype=torch.float32)
        out[:n] = t.float()
        return hugepages.copy(out.view(nb, 64, -1).transpose(1, 2))

    return hugepages.copy(words.transpose(1, 2)), blocked(scale), blocked(zero)  # (streamed: on 2 MB pages)


def unpack_w4p(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, n: int, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The inverse of pack_w4p: (q uint8 [N, K] in 0..15, scale, zero fp32 [N, K / group_size])."""
    nb = packed.shape[0]
    words = packed.transpose(1, 2)  # [block, feature, octet]
    shifts = torch.tensor([0, 8, 16, 24, 4, 12, 20, 28], dtype=torch.int32)
    q = (words.unsqueeze(-1) >> shifts) & 0xF  # [block, feature, octet, 8 columns]
    q = q.reshape(nb * 64, k)[:n].to(torch.uint8)
    return q, *(t.transpose(1, 2).reshape(nb * 64, -1)[:n].contiguous() for t in (scale, zero))


def linear_w4p(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    n: int,
    bias: torch.Tensor | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [..., K] bf16 times pack_w4p's weight of N features -> [..., N] bf16, w = q * scale + zero: x rounded to
    int16 per row as in linear_w4, exact integer sums per group, fp32 per feature group by group (gemm_w4p.c);
    from the bf16 GEMM's rows, that GEMM on slabs rebuilt in bf16 (linear_w4's prompt path, bit for bit)."""
    lib = _pick(lib)
    if getattr(lib, "it_linear_w4p", None) is None:
        raise ValueError("this library has no it_linear_w4p kernel")
    x2 = _rows(x)
    k = x2.shape[1]
    nb = (n + 63) // 64
    if x2.dtype is not torch.bfloat16 or x2.device.type != "cpu":
        raise ValueError(f"the CPU kernels take bf16 CPU activations, got {x2.dtype} on {x2.device}")
    if not w4_supported(k, group_size):
        raise ValueError(f"group_size={group_size} must be a multiple of 64 and K={k} a multiple of it")
    if packed.dtype is not torch.int32 or tuple(packed.shape) != (nb, k // 8, 64) or not packed.is_contiguous():
        raise ValueError(f"not a packed [{n}, {k}] int4 weight (pack_w4p): {packed.dtype} {tuple(packed.shape)}")
    for t in (scale, zero):
        if t.dtype is not torch.float32 or not t.is_contiguous() or tuple(t.shape) != (nb, k // group_size, 64):
            raise ValueError(f"scale and zero must be pack_w4p's contiguous fp32 [{nb}, {k // group_size}, 64]")
    if bias is not None and (bias.dtype is not torch.bfloat16 or not bias.is_contiguous() or bias.numel() != n):
        raise ValueError("bias must be a contiguous bf16 tensor [N]")
    weights = (packed.data_ptr(), scale.data_ptr(), zero.data_ptr(), group_size)
    return _packed_linear_call(lib, "it_linear_w4p", x, x2, weights, bias, n)


def linear_w4(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [..., K] bf16, packed (pack_w4) [N, K / 2], scale and zero fp32 [N, K / group_size] -> [..., N] bf16,
    with w = q * scale + zero. x is rounded to int16 per row as in linear_w8; the zero term uses the exact
    sums of x."""
    lib = _pick(lib)
    x2 = _rows(x)
    n, k = packed.shape[0], packed.shape[1] * 2
    if (
        x2.dtype is not torch.bfloat16
        or x2.shape[1] != k
        or packed.dtype is not torch.uint8
        or not packed.is_contiguous()
    ):
        raise ValueError(f"need bf16 x [.., {k}] and contiguous uint8 packed weights, got {x2.dtype} {tuple(x2.shape)}")
    if not w4_supported(k, group_size):
        raise ValueError(f"group_size={group_size} must be a multiple of 64 and K={k} a multiple of it")
    for t in (scale, zero):
        if t.dtype is not torch.float32 or not t.is_contiguous() or t.shape != (n, k // group_size):
            raise ValueError(f"scale and zero must be contiguous fp32 [{n}, {k // group_size}]")
    if bias is not None and (bias.dtype is not torch.bfloat16 or not bias.is_contiguous()):
        raise ValueError("bias must be a contiguous bf16 tensor")
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=torch.bfloat16)
    with profiled("linear_w4"):
        lib.it_linear_w4(
            x2.data_ptr(),
            x2.stride(0),
            packed.data_ptr(),
            scale.data_ptr(),
            zero.data_ptr(),
            group_size,
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            n,
            m,
            n,
            k,
            torch.get_num_threads(),
        )
    return y.view(*x.shape[:-1], n)


def dequant_w8(qweight: torch.Tensor, scales: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor:
    """int8 [N, K] and scales [N] (bf16 or fp32) -> bf16 [N, K], w = bf16(q * bf16(s)): a prefill's dense weight."""
    lib = _pick(lib)
    n, k = qweight.shape
    if (
        qweight.dtype is not torch.int8
        or not qweight.is_contiguous()
        or scales.dtype not in (torch.bfloat16, torch.float32)
    ):
        raise ValueError("need contiguous int8 weights and bf16 / fp32 scales")
    out = torch.empty((n, k), dtype=torch.bfloat16)
    with profiled("dequant_w8"):
        lib.it_dequant_w8(
            qweight.data_ptr(),
            scales.contiguous().data_ptr(),
            int(scales.dtype is torch.float32),
            out.data_ptr(),
            n,
            k,
            torch.get_num_threads(),
        )
    return out


def dequant_w4(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int, *, lib: ctypes.CDLL | None = None
) -> torch.Tensor:
    """pack_w4 nibbles [N, K / 2] with fp32 scale and zero [N, K / g] -> bf16 [N, K], w = bf16(q * s + z)."""
    lib = _pick(lib)
    n, k = packed.shape[0], packed.shape[1] * 2
    if not (w4_supported(k, group_size) and packed.is_contiguous() and scale.is_contiguous() and zero.is_contiguous()):
        raise ValueError("need contiguous pack_w4 weights, scale and zero, the group size a multiple of 64")
    out = torch.empty((n, k), dtype=torch.bfloat16)
    with profiled("dequant_w4"):
        lib.it_dequant_w4(
            packed.data_ptr(),
            scale.data_ptr(),
            zero.data_ptr(),
            group_size,
            out.data_ptr(),
            n,
            k,
            torch.get_num_threads(),
        )
    return out


# ---- greedy sampling


def argmax_rows(logits: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """logits [rows, n] fp32 or bf16 -> int64 [rows]: logits.float().nan_to_num(nan=-inf).argmax(-1) exactly (NaN
    counted as -inf, +-inf as +-fmax as nan_to_num maps them, the first index among equal values) without its copies
    (csrc/sample.h; bf16 read as the fp32 it widens to); None where the layout does not fit (the caller then runs the
    torch formula)."""
    if logits.dtype not in (torch.float32, torch.bfloat16):
        return None
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.device.type != "cpu":
        return None
    rows, n = logits.shape
    if rows == 0 or n == 0:
        return None
    lib = _pick(lib)
    fn = lib.it_argmax_rows if logits.dtype is torch.float32 else lib.it_argmax_rows_bf16
    out = torch.empty(rows, dtype=torch.int64)
    with profiled("argmax_rows"):
        fn(logits.data_ptr(), rows, n, logits.stride(0), out.data_ptr(), torch.get_num_threads())
    return out


# ---- the elementwise work of prefills: the same roundings as layers/norm.py, activation.py and rotary.py


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, lib: ctypes.CDLL | None = None
) -> torch.Tensor | None:
    """RMSNorm of bf16 rows (fp32 statistics, bf16(w * bf16(x / rms))); None where x does not fit (the caller
    then runs the PyTorch formula)."""
    if x.dtype is not torch.bfloat16 or x.dim() != 2 or not x.is_contiguous() or weight.dtype is not torch.bfloat16:
        return None
    lib = _pick(lib)
    out = torch.empty_like(x)
    with profiled("rms_norm"):
        lib.it_rmsnorm_mt(
            x.data_ptr(), weight.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads()
        )
    return out


def gemma_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, lib: ctypes.CDLL | None = None
) -> torch.Tensor | None:
    """Gemma's RMSNorm of bf16 rows: bf16((x / rms(x)) * (1 + w)), the factors and the product in fp32, one rounding
    (layers/norm.py GemmaRMSNorm); None where x does not fit."""
    if x.dtype is not torch.bfloat16 or x.dim() != 2 or not x.is_contiguous():
        return None
    lib = _pick(lib)
    factors = 1.0 + weight.float()  # (as the module computes them: exact for a bf16 w)
    out = torch.empty_like(x)
    with profiled("rms_norm"):
        lib.it_rmsnorm_f32w(
            x.data_ptr(), factors.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1], eps, torch.get_num_threads()
        )
    return out


def silu_and_mul(gate_up: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """[T, 2I] bf16 -> bf16(bf16(silu(gate)) * up) [T, I]; None where the input does not fit."""
    return _act_and_mul(gate_up, lib, gelu=False)


def gelu_and_mul(gate_up: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> torch.Tensor | None:
    """[T, 2I] bf16 -> bf16(bf16(gelu_tanh(gate)) * up) [T, I] (Gemma's MLP); None where the input does not fit."""
    return _act_and_mul(gate_up, lib, gelu=True)


def _act_and_mul(gate_up: torch.Tensor, lib: ctypes.CDLL | None, gelu: bool) -> torch.Tensor | None:
    if gate_up.dtype is not torch.bfloat16 or gate_up.dim() != 2 or not gate_up.is_contiguous():
        return None
    lib = _pick(lib)
    t, two_i = gate_up.shape
    out = torch.empty((t, two_i // 2), dtype=torch.bfloat16)
    with profiled("gelu_and_mul" if gelu else "silu_and_mul"):
        (lib.it_gelu_mul if gelu else lib.it_silu_mul)(
            gate_up.data_ptr(), out.data_ptr(), t, two_i // 2, torch.get_num_threads()
        )
    return out


def rotary_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, lib: ctypes.CDLL | None = None) -> bool:
    """Rotate qk [T, heads, D] (bf16, rows may be strided) in place with cos / sin [T, 1, D/2] fp32 views of one
    [T, D] table (cos half, then sin half); False, untouched, where the layout does not fit."""
    if (
        qk.dtype is not torch.bfloat16
        or qk.dim() != 3
        or qk.stride(2) != 1
        or qk.stride(1) != qk.shape[2]
        or cos.dtype is not torch.float32
        or cos.stride(-1) != 1
        or sin.stride(0) != cos.stride(0)
        or sin.data_ptr() != cos.data_ptr() + 4 * cos.shape[-1]
    ):
        return False
    lib = _pick(lib)
    t, heads, d = qk.shape
    with profiled("rotary"):
        lib.it_rotary(qk.data_ptr(), qk.stride(0), t, heads, d, cos.data_ptr(), cos.stride(0), torch.get_num_threads())
    return True


def decode_attention(
    q: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    n_kv_heads: int,
    scale: float,
    kv_int8: bool = False,
    use_amx: bool = True,
    *,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """The fused decode step's attention alone (for tests and benchmarks): q [T, Hq, D] bf16, one layer's paged
    cache ([2, num_blocks, block_size, Hkv, D] bf16, or the int8 rows of Int8PagedAttention as uint8 / int8
    [2, num_blocks, block_size, Hkv, D + 4]), block tables [T, max_blocks] and context lengths [T] (int64).
    Returns o [T, Hq, D] bf16. use_amx=False takes the AVX-512 path where the CPU has AMX. lib: a variant's library
    (load_variant; default the process's)."""
    lib = _pick(lib)
    t, hq, d = q.shape
    num_blocks, block_size = cache.shape[1], cache.shape[2]
    # the kernel reads the queries from rows of [q | k | v]; k and v are not read
    qkv = torch.zeros(t, (hq + 2 * n_kv_heads) * d, dtype=torch.bfloat16)
    qkv[:, : hq * d] = q.reshape(t, hq * d)
    tables = block_tables.to(torch.int64).contiguous()
    lens = context_lens.to(torch.int64).contiguous()
    cmodel = ItModel(
        hidden=hq * d,
        n_heads=hq,
        n_kv_heads=n_kv_heads,
        head_dim=d,
        inter=hq * d,
        num_blocks=num_blocks,
        block_size=block_size,
        scale=scale,
        nthreads=torch.get_num_threads(),
        n_layers=1,
        kv_int8=int(kv_int8),
    )
    nbytes = lib.it_decode_workspace_bytes(ctypes.byref(cmodel), t, tables.shape[1] * block_size)
    work = torch.empty(nbytes + 64, dtype=torch.uint8)
    step = ItStep(
        T=t,
        block_tables=tables.data_ptr(),
        context_lens=lens.data_ptr(),
        max_blocks=tables.shape[1],
        work=(work.data_ptr() + 63) // 64 * 64,
        work_bytes=nbytes,
    )
    o = torch.empty(t, hq, d, dtype=torch.bfloat16)
    cache = cache.contiguous()
    rc = lib.it_decode_attention(
        ctypes.byref(cmodel), ctypes.byref(step), qkv.data_ptr(), cache.data_ptr(), o.data_ptr(), int(use_amx)
    )
    if rc != 0:
        raise ValueError(f"it_decode_attention refused the shapes ({rc})")
    return o


def fused_step_timers(stats: ItStepStats, reset: bool = False) -> dict[str, float]:
    """Wall seconds of each part of the fused step (FUSED_PARTS), summed over the calls that wrote into stats (one
    engine's, it_step.stats) since its last reset, with "calls" and "rows" (tokens). reset=True zeroes them after
    reading. Read between steps: only the thread running a step writes them."""
    got = {**dict(zip(FUSED_PARTS, stats.seconds)), "calls": float(stats.calls), "rows": float(stats.rows)}
    if reset:
        ctypes.memset(ctypes.addressof(stats), 0, ctypes.sizeof(stats))
    return got


def take_fused_allreduce(stats: ItStepStats) -> tuple[int, int, float]:
    """Tensor parallel: the fused step's all-reduces in C since the last take (their pieces, the fp32 bytes this rank
    published, their seconds), and start those three from zero (the other timers stay). Read between steps."""
    part = FUSED_PARTS.index("all-reduce (tensor parallel)")
    got = (int(stats.allreduce_calls), int(stats.allreduce_bytes), float(stats.seconds[part]))
    stats.allreduce_calls = stats.allreduce_bytes = 0
    stats.seconds[part] = 0.0
    return got


# ---- bf16 weights in 12 bits, losslessly (csrc/x86/avx512/bf16c_*.c) ------------------------------------------------
BF16C_FIELDS = ("codes", "table", "esc_start", "esc_pos", "esc_val")


def bf16c_supported(n: int, k: int) -> bool:
    """Whether a [n, k] weight can take the 12-bit layout here (decoded onto AMX tiles, or without AMX multiplied by
    VDPBF16PS from the decoded tiles: csrc/x86/avx512/bf16c_noamx.c)."""
    _load()
    return (
        _lib is not None
        and _variant in ("avx512", "avx512-noamx")
        and "avx512vbmi" in _cpu_flags()  # the packer's VPERMB
        and n % 16 == 0
        and k % 32 == 0
        and n > 0
        and k > 0
    )


def bf16c_slabs(m: int, k: int) -> int:
    """The slabs of K that the 12-bit tile GEMM cuts an m x k activation into: past 16 rows, where a block of rows
    of x and a thread's two decoded 64-feature chunks over all of K would overflow 1.5 MB (of a 2 MB L2), it
    runs K in equal slabs, keeping the fp32 sums between slabs in memory; 1 otherwise."""
    return int(_lib.it_bf16c_slabs(m, k)) if _lib is not None else 1


def pack_bf16c(w: torch.Tensor, inter: int = 0) -> dict[str, torch.Tensor]:
    """A bf16 weight [N, K] -> the tensors of the 12-bit layout: each weight's low byte, plus a 4-bit code into a
    table of the 16 most common high bytes (sign and exponent); weights whose high byte is not in the table are
    listed aside (position, value) and patched in when a tile is decoded. Exact: unpack_bf16c gives w back.
    Layout: chunks of 64 output features (zero-padded), each K / 32 tiles of 64 features x 32 weights stored in
    the order the AMX B operand wants them (VNNI: per 16 features, row p holds their weights 2p and 2p + 1), as
    32 row pairs x 96 bytes (the 64 low bytes in the order the decoder's byte unpacks undo, bf16c_api.c
    BF16C_ORDER, then 32 bytes whose byte i holds the codes of low bytes i and i + 32 in its two nibbles). The
    kernels multiply x by decoded tiles as they are. Packed in C, ~2 ms per million weights on 2 threads.

    inter > 0: w is a gate_up [2 inter, K] (inter a multiple of 16), packed as interleave_gate_up(w) would be
    (for linear_bf16c's inter / silu), without the copy."""
    if w.dtype is not torch.bfloat16 or w.dim() != 2 or w.shape[1] % 32:
        raise ValueError(
            f"pack_bf16c takes a bf16 [N, K] weight with K a multiple of 32, got {w.dtype} {tuple(w.shape)}"
        )
    if inter and (w.shape[0] != 2 * inter or inter % 16):
        raise ValueError(
            f"pack_bf16c: inter={inter} needs a [2 inter, K] weight with inter a multiple of 16, got {tuple(w.shape)}"
        )
    _load()
    w = w.contiguous()
    n, k = w.shape
    threads = torch.get_num_threads()
    hist = torch.empty(256, dtype=torch.int64)
    _lib.it_bf16c_hist(w.data_ptr(), w.numel(), hist.data_ptr(), threads)
    table = hist.topk(16).indices.to(torch.uint8).contiguous()  # most common first
    code_of = torch.full((256,), -1, dtype=torch.int8)
    code_of[table.long()] = torch.arange(16, dtype=torch.int8)
    chunks, ks = -(-n // 64), k // 32
    codes = hugepages.empty(chunks * ks * 64 * 48, torch.uint8)  # (what a decode step streams: on 2 MB pages)
    count = torch.empty(chunks * ks, dtype=torch.int32)
    _lib.it_bf16c_pack(w.data_ptr(), n, k, inter, table.data_ptr(), codes.data_ptr(), count.data_ptr(), threads)
    start = torch.zeros(chunks * ks + 1, dtype=torch.int32)
    start[1:] = count.cumsum(0)
    total = int(start[-1])
    pos = torch.empty(total, dtype=torch.int16)
    val = torch.empty(total, dtype=torch.bfloat16)
    if total:
        _lib.it_bf16c_escapes(
            w.data_ptr(), n, k, inter, code_of.data_ptr(), start.data_ptr(), pos.data_ptr(), val.data_ptr(), threads
        )
    return {"codes": codes, "table": table, "esc_start": start, "esc_pos": pos, "esc_val": val}


def bf16c_struct(packed: dict[str, torch.Tensor]) -> Bf16c:
    """The C description of a packed weight (the tensors must outlive it)."""
    return Bf16c(**{f: packed[f].data_ptr() for f in BF16C_FIELDS})


def unpack_bf16c(desc: Bf16c, n: int, k: int) -> torch.Tensor:
    """The bf16 weight [n, k] back from its 12-bit layout (prefills' GEMMs)."""
    _load()
    w = torch.empty(n, k, dtype=torch.bfloat16)
    with profiled("unpack_bf16c"):
        _lib.it_unpack_bf16c(ctypes.byref(desc), w.data_ptr(), n, k, torch.get_num_threads())
    return w


def linear_bf16c(
    x: torch.Tensor,
    desc: Bf16c,
    n: int,
    bias: torch.Tensor | None = None,
    inter: int = 0,
    silu: bool = False,
    add_to: torch.Tensor | None = None,
    *,
    stream: bool = False,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """x [..., K] bf16 times a 12-bit packed weight [n, K] (+ bias) -> [..., n] bf16, on AMX: the very products of
    linear_bf16 on the unpacked weight (up to 16 rows one pass, more on the tile GEMM decoding 64 features at a
    time while it multiplies by the previous 64).

    inter > 0: the weight is a gate_up [2 inter, K] packed with its gate and up rows interleaved 16 by 16
    (interleave_gate_up); the result is still [..., 2 inter] in the usual order, or with silu=True act
    [..., inter] = silu(gate) * up, rounded as silu_and_mul rounds it, straight from the tiles.

    add_to ([..., n] bf16, contiguous; not with inter): the result is added into it in the tiles' epilogue,
    add_to += bf16(x W^T + bias), rounded as a bf16 residual add (the fused step's o_proj and down); returns it.

    stream=True (a plain product: no silu, no add_to): the same values, written past the caches where the tile GEMM
    can (past 16 rows, rows whole 64-byte lines): for a result read much later (csrc bf16c_gemm.c BF16C_EPI_STREAM,
    a MoE layer's experts' down rows)."""
    _load()
    x2 = _rows(x)
    m, k = x2.shape
    width = inter if silu else n
    if silu and not inter:
        raise ValueError("silu needs a gate_up packed with inter")
    if stream and (silu or add_to is not None):
        raise ValueError("stream takes a plain product (no silu, no add_to)")
    if add_to is not None:
        if inter or add_to.dtype is not torch.bfloat16 or not add_to.is_contiguous() or add_to.numel() != m * n:
            raise ValueError("add_to needs a contiguous bf16 [..., n] tensor, and no inter")
        y = add_to.view(m, n)
    else:
        y = torch.empty(m, width, dtype=torch.bfloat16)
    with profiled("linear_bf16c"):
        rc = (lib or _lib).it_linear_bf16c(
            x2.data_ptr(),
            x2.stride(0),
            ctypes.byref(desc),
            bias.data_ptr() if bias is not None else None,
            y.data_ptr(),
            width,
            m,
            n,
            k,
            torch.get_num_threads(),
            inter,
            BF16C_EPI_STREAM if stream else int(silu or add_to is not None),
        )
    if rc != 0:
        raise ValueError(
            f"it_linear_bf16c refused {m} x {k} -> {n} (needs AMX, N a multiple of 16, K of 32; with "
            f"inter: N = 2 inter, inter a multiple of 16, no bias)"
        )
    return add_to if add_to is not None else y.view(*x.shape[:-1], width)


def interleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """A gate_up weight [2I, ...] with its gate and up rows interleaved 16 by 16 (I % 16 == 0): gate 0-15, up 0-15,
    gate 16-31, ... so that one pair of AMX feature tiles holds the gate and the up of the same 16 features."""
    i = w.shape[0] // 2
    return w.reshape(2, i // 16, 16, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


def deinterleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """The inverse of interleave_gate_up."""
    i = w.shape[0] // 2
    return w.reshape(i // 16, 2, 16, *w.shape[1:]).transpose(0, 1).reshape(w.shape)


# ---- mixture-of-experts layers (csrc/moe.h) -------------------------------------------------------------------------
# The most experts a MoE layer may have for the kernels' router (csrc/moe.h IT_MOE_MAX_EXPERTS): past it, route()
MOE_MAX_EXPERTS = 1024


def moe_topk_torch(v: torch.Tensor, k: int, *, lib: ctypes.CDLL | None = None) -> tuple[torch.Tensor, int]:
    """The k largest of each row of v [rows, n] fp32 as torch.topk picks them where ties decide (csrc/moe.h
    moe_topk_torch: libstdc++'s nth_element step for step): (taken [rows, n] bool, all False in a row it cannot say
    for, how many such rows)."""
    v = v.float().contiguous()
    taken = torch.zeros(v.shape, dtype=torch.uint8)
    unsaid = int(_pick(lib).it_moe_topk_torch(v.data_ptr(), v.shape[0], v.shape[1], k, taken.data_ptr()))
    return taken.bool(), unsaid


# (n, k) of the check below: the expert counts and top-k / top-group sizes of the shipped MoE configs and tests, all
# on topk's nth_element path (k * 64 > n), ties from grids of 1 to 13 values
_TIE_CHECK_SHAPES = ((4, 1), (4, 2), (8, 1), (8, 2), (8, 4), (16, 2), (32, 4), (60, 4), (64, 6), (64, 8), (128, 8),
                     (160, 6), (256, 8))  # fmt: skip
_torch_ties: dict[int, bool] = {}


def torch_topk_ties(lib: ctypes.CDLL | None = None) -> bool:
    """Whether the kernels' router may settle a tie at the top-k boundary itself (it_moe.torch_ties): checked once
    per library against this process's torch.topk on rows full of ties (the picks must be topk's in every row; a
    torch whose CPU topk picks otherwise leaves such rows to route(), as before: the hand-back)."""
    lib = _pick(lib)
    key = id(lib)
    if key not in _torch_ties:
        ok = getattr(lib, "it_moe_topk_torch", None) is not None
        g = torch.Generator().manual_seed(2026)
        for n, k in _TIE_CHECK_SHAPES if ok else ():
            for levels in (1, 2, 3, 13):
                v = torch.randint(0, levels, (48, n), generator=g).float() / 8.0
                taken, unsaid = moe_topk_torch(v, k, lib=lib)
                want = torch.zeros_like(taken).scatter_(1, v.topk(k, dim=-1).indices, True)
                ok = ok and unsaid == 0 and torch.equal(taken, want)
        _torch_ties[key] = ok
        if not ok:
            log.info("MoE router: ties at the top-k boundary go to route() (this torch's topk picks otherwise)")
    return _torch_ties[key]


def _moe_route_call(
    name: str, logits: torch.Tensor, rule: ItMoe, bias: torch.Tensor | None, lib: ctypes.CDLL | None, grouped: bool
) -> tuple[int, torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...]] | None:
    """One call of it_moe_route (grouped: then counts [E] and order [T k] too) or it_moe_route_rows (then each row's
    tie flag [T]): (its return code, weights [T, k] fp32, ids [T, k], those), or None where the logits or the library
    do not fit; a refused rule raises."""
    e, k = rule.num_experts, rule.top_k
    if logits.dtype not in (torch.float32, torch.bfloat16) or logits.dim() != 2 or logits.stride(1) != 1:
        return None
    if e > MOE_MAX_EXPERTS:  # (the kernel's routing scratch is on the stack)
        return None
    if logits.shape[1] != e or (bias is not None and bias.numel() != e):
        return None
    fn = getattr(_pick(lib), name, None)
    if fn is None:
        return None
    t = logits.shape[0]
    bias = bias.float().contiguous() if bias is not None else None
    weights = torch.empty(t, k, dtype=torch.float32)
    ids = torch.empty(t, k, dtype=torch.int64)
    more = (
        (torch.empty(e, dtype=torch.int64), torch.empty(t * k, dtype=torch.int64))
        if grouped
        else (torch.empty(t, dtype=torch.uint8),)
    )
    with profiled("moe_route"):
        rc = fn(
            logits.data_ptr(),
            int(logits.dtype is torch.bfloat16),
            logits.stride(0),
            t,
            ctypes.byref(rule),
            bias.data_ptr() if bias is not None else None,
            weights.data_ptr(),
            ids.data_ptr(),
            *(m.data_ptr() for m in more),
            torch.get_num_threads(),
        )
    if rc < 0:
        raise ValueError(f"{name} refused the rule {rule_str(rule)}")
    return rc, weights, ids, more


def moe_route(
    logits: torch.Tensor, rule: ItMoe, bias: torch.Tensor | None = None, *, lib: ctypes.CDLL | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Router logits [T, E] (fp32 or bf16, rows may be strided) -> (weights [T, k] fp32, ids [T, k], order [T k],
    counts [E]) in one call (see csrc/moe.h it_moe_route); None where the logits do not fit, or where a tie at the
    top-k (or top group) boundary decides some token's experts (route() then decides, as torch.topk does)."""
    got = _moe_route_call("it_moe_route", logits, rule, bias, lib, grouped=True)
    if got is None or got[0] == 1:
        return None
    _, weights, ids, (counts, order) = got
    return weights, ids, order, counts


def moe_route_rows(
    logits: torch.Tensor, rule: ItMoe, bias: torch.Tensor | None = None, *, lib: ctypes.CDLL | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """Every row's routing without the grouping (csrc/moe.h it_moe_route_rows): (weights [T, k] fp32, ids [T, k],
    tied [n] int64: the rows where a tie at the top-k (or top group) boundary decides the experts, ascending, whose
    weights and ids are the kernel's pick for the caller to replace with route()'s). None where the logits or the
    library do not fit."""
    got = _moe_route_call("it_moe_route_rows", logits, rule, bias, lib, grouped=False)
    if got is None:
        return None
    _, weights, ids, (tie,) = got
    return weights, ids, tie.nonzero().view(-1)


def rule_str(rule: ItMoe) -> str:
    return ", ".join(f"{name}={getattr(rule, name)}" for name, _ in ItMoe._fields_)


def expert_lin(
    kind: WeightKind,
    num_experts: int,
    n: int,
    k: int,
    w: torch.Tensor,
    scales: torch.Tensor | None = None,
    zero: torch.Tensor | None = None,
    group_size: int = 0,
    *,
    lib: ctypes.CDLL | None = None,
) -> ItLin | str:
    """Expert 0's it_lin of a projection stacked over num_experts experts (csrc/moe.h moe_expert_lin steps to expert
    e), or why the tensors do not fit: bf16 w [E, n, k]; int8 w [E, n, k] with scales [E, n] (bf16 or fp32); int4
    pack_w4 bytes [E, n, k / 2] with fp32 scales and zero [E, n, k / group_size]; W8A8 and the packed W8A16 (W8P) each
    expert's pack_w8a8 (lib's layout) stacked [E, ...] with fp32 scales [E, n]; the packed W4A16 (W4P) each expert's
    pack_w4p words [E, ceil(n / 64), k / 8, 64] with its fp32 scale and zero [E, ceil(n / 64), k / group_size, 64].
    The tensors must outlive it."""
    want = {
        WeightKind.BF16: (torch.bfloat16, (num_experts, n, k)),
        WeightKind.W8: (torch.int8, (num_experts, n, k)),
        WeightKind.W4: (torch.uint8, (num_experts, n, k // 2)),
    }.get(kind)
    packed_ok = {WeightKind.W8A8: w8a8_supported, WeightKind.W8P: w8p_supported}.get(kind)
    if packed_ok is not None and packed_ok(lib):  # (each expert's pack_w8a8 of its int8 weight)
        want = (torch.int32, (num_experts, *w8a8_packed_shape(n, k, lib)))
    if kind == WeightKind.W4P and w4p_supported(lib) and w4_supported(k, group_size):
        want = (torch.int32, (num_experts, -(-n // 64), k // 8, 64))  # (each expert's pack_w4p words)
    if want is None:
        return (
            f"weight kind {kind.name} (experts take bf16, int8, int4, and W8A8 or the packed W8A16 / W4A16 where the "
            "library has them)"
        )
    if w.dtype is not want[0] or tuple(w.shape) != want[1] or not w.is_contiguous():
        return f"weights {w.dtype} {tuple(w.shape)}, need contiguous {want[0]} {want[1]}"
    lin = ItLin(kind=int(kind), w=w.data_ptr(), N=n, K=k)
    if kind in (WeightKind.W8A8, WeightKind.W8P):
        if scales is None or scales.dtype is not torch.float32 or tuple(scales.shape) != (num_experts, n):
            return f"{kind.name} experts need contiguous fp32 scales {(num_experts, n)}"
        if not scales.is_contiguous() or k > W8A8_MAX_K:
            return f"{kind.name} experts of K={k} (at most {W8A8_MAX_K}) with contiguous scales"
        lin.scale = scales.data_ptr()
    elif kind == WeightKind.W4P:
        shape = (num_experts, -(-n // 64), k // group_size, 64)
        for t in (scales, zero):
            if t is None or t.dtype is not torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
                return f"packed int4 experts need contiguous fp32 scales and zero {shape} (pack_w4p's, stacked)"
        lin.scale, lin.zero, lin.group = scales.data_ptr(), zero.data_ptr(), group_size
    elif kind == WeightKind.W8:
        if scales is None or scales.dtype not in (torch.bfloat16, torch.float32) or not scales.is_contiguous():
            return "int8 experts need contiguous bf16 / fp32 scales [E, N]"
        if tuple(scales.shape) != (num_experts, n):
            return f"scales {tuple(scales.shape)}, need {(num_experts, n)}"
        lin.scale, lin.scale_is_f32 = scales.data_ptr(), int(scales.dtype is torch.float32)
    elif kind == WeightKind.W4:
        if not w4_supported(k, group_size):
            return f"group_size={group_size} with K={k} (the int4 kernel needs a multiple of 64 dividing K)"
        for t in (scales, zero):
            shape = (num_experts, n, k // group_size)
            if t is None or t.dtype is not torch.float32 or not t.is_contiguous() or tuple(t.shape) != shape:
                return f"int4 experts need contiguous fp32 scales and zero {shape}"
        lin.scale, lin.zero, lin.group = scales.data_ptr(), zero.data_ptr(), group_size
    return lin


class _Workspace(threading.local):
    """moe_experts' scratch, one per calling thread, kept from call to call and grown to the largest need seen: a
    16 x 128-token prefill groups 16k expert rows a layer (~80 MB of them touched on the MoE preset), and a fresh
    allocation of that size comes back from the OS as new zeroed pages each call (~19k page faults a layer).
    It stays mapped while the thread lives: the peak of a prefill, held."""

    buf: torch.Tensor | None = None

    def get(self, nbytes: int) -> int:
        """The 64-byte aligned address of nbytes of scratch (the C side aligns it too)."""
        if self.buf is None or self.buf.numel() < nbytes + 64:
            self.buf = None  # (the old one goes first: no two at the peak)
            self.buf = torch.empty(nbytes + 64, dtype=torch.uint8)
        return (self.buf.data_ptr() + 63) // 64 * 64


_moe_workspace = _Workspace()


def moe_experts(
    x: torch.Tensor,
    gate_up: ItLin,
    down: ItLin,
    num_experts: int,
    weights: torch.Tensor,
    order: torch.Tensor,
    counts: torch.Tensor,
    *,
    first: int = 0,
    local: int | None = None,
    lib: ctypes.CDLL | None = None,
) -> torch.Tensor:
    """The routed experts of a step as one grouped GEMM (csrc/moe.h it_moe_experts): x [T, H] bf16, the experts'
    it_lin (expert_lin), the routing's weights [T, k] fp32, order [T k] and counts [E] int64 -> [T, H] bf16. Expert
    parallel: gate_up / down hold experts first .. first + local - 1 of the routing's num_experts, and the output is
    their part alone (it_moe_experts_part)."""
    x2 = _rows(x)
    t, h = x2.shape
    k = weights.shape[1]
    if x2.dtype is not torch.bfloat16 or h != gate_up.K or weights.shape[0] != t or order.numel() != t * k:
        raise ValueError(f"moe_experts: x {x2.dtype} {tuple(x2.shape)}, weights {tuple(weights.shape)} do not fit")
    for name, v, dtype in (
        ("weights", weights, torch.float32),
        ("order", order, torch.int64),
        ("counts", counts, torch.int64),
    ):
        if v.dtype is not dtype or not v.is_contiguous():
            raise ValueError(f"moe_experts: {name} must be contiguous {dtype}, got {v.dtype}")
    lib = _pick(lib)
    out = torch.empty(t, h, dtype=torch.bfloat16)
    nthreads = torch.get_num_threads()
    args = (
        x2.data_ptr(),
        x2.stride(0),
        t,
        ctypes.byref(gate_up),
        ctypes.byref(down),
        num_experts,
        first,
        num_experts if local is None else local,
        k,
        weights.data_ptr(),
        order.data_ptr(),
        counts.data_ptr(),
        out.data_ptr(),
        nthreads,
    )
    with profiled("moe_experts"):
        if hasattr(lib, "it_moe_experts_ws"):
            nbytes = lib.it_moe_experts_ws_bytes(t, k, num_experts, h, down.K, nthreads)
            rc = lib.it_moe_experts_ws(*args, _moe_workspace.get(nbytes), nbytes)
        else:  # (an older build, loaded by the A/B benchmarks: it allocates its own)
            rc = lib.it_moe_experts_part(*args)
    if rc != 0:
        raise ValueError(f"it_moe_experts refused {t} x {h} rows, top-{k}, the experts' shapes ({rc})")
    return out.view(*x.shape[:-1], h)
