"""`infertune doctor`: check versions, the CANN / torch / torch_npu / CUDA matrix, CPU features, threads, memory.

check_all(facts, compat) is pure: it judges an EnvFacts (gathered by env_facts.gather(), or built by hand in
tests) against compat.json, the compatibility matrix kept as data with a source per row. Each check is
OK, WARN, FAIL or SKIP (not applicable here), and every non-OK check says what to fix. The command exits
1 when any check FAILs (a hard mismatch), 0 otherwise.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from infertune.files import add_json_flag, print_report
from infertune.profile.env_facts import EnvFacts

COMPAT_PATH = Path(__file__).parent / "data" / "compat.json"
STATUSES = ("OK", "WARN", "FAIL", "SKIP")
GiB = 2**30

# What each CPU feature means for infertune (torch's CPU kernels, oneDNN and MKL pick them up at run time).
CPU_FEATURES = {
    "avx2": ("avx2", "vectorized fp32 kernels (ATen's AVX2 level); without it every CPU op runs the slow default path"),
    "avx512": ("avx512f", "AVX-512 kernels (ATen's AVX512 level): wider fp32 vectors for matmul, norms, softmax"),
    "vnni": (
        "avx512_vnni|avx_vnni",
        "int8 dot-product instructions: fast int8 matmuls for weight-only / W8A8 quantized models (oneDNN)",
    ),
    "bf16": (
        "avx512_bf16|amx_bf16",
        "native bf16 math: bf16 checkpoints run in bfloat16 (half the memory traffic of fp32), and dtype=auto "
        "runs fp16 ones in bfloat16 too (fp32 ones stay float32 unless you pass --dtype bfloat16)",
    ),
    "amx": (
        "amx_tile",
        "AMX tile units: oneDNN's bf16 / int8 matmuls run several times faster than with "
        "AVX-512, most visible in prefill",
    ),
}


@dataclass(slots=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""

    def __post_init__(self) -> None:
        assert self.status in STATUSES, self.status


def load_compat(path: str | Path | None = None) -> dict:
    p = Path(path) if path else COMPAT_PATH
    try:
        data = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read the compatibility matrix {p}: {e}") from e
    for key in ("cann_torch", "cuda_min_driver", "sources"):
        if key not in data:
            raise ValueError(f"compatibility matrix {p} lacks {key!r}")
    return data


def release(version: str | None) -> tuple[int, ...]:
    """'2.1.0.post6' -> (2, 1, 0); '2.13.0+cpu' -> (2, 13, 0); '525.60.13' -> (525, 60, 13)."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version or "")
    return tuple(int(x) for x in m.group(1).split(".")) if m else ()


def _base(version: str | None, n: int = 3) -> tuple[int, ...]:
    r = release(version)
    return r[:n] + (0,) * (n - len(r[:n]))


def _norm_cann(v: str) -> str:
    return re.sub(r"^CANN\s*", "", v.strip(), flags=re.I).upper()


def _fmt(v: tuple[int, ...]) -> str:
    return ".".join(map(str, v))


# ---- the checks ------------------------------------------------------------------------------------------


def check_python(f: EnvFacts) -> Check:
    spec = f.requires_python
    if not spec:
        return Check("python", "SKIP", f"Python {f.python}; infertune's Requires-Python is unknown (not installed?)")
    ok = _satisfies(f.python, spec)
    if ok is None:
        return Check("python", "SKIP", f"Python {f.python}; cannot parse Requires-Python {spec!r}")
    if ok:
        return Check("python", "OK", f"Python {f.python} satisfies {spec}")
    return Check(
        "python",
        "FAIL",
        f"Python {f.python} does not satisfy infertune's {spec}",
        f"use a Python {spec} interpreter (e.g. pyenv install 3.11)",
    )


def _satisfies(version: str, spec: str) -> bool | None:
    try:
        from packaging.specifiers import InvalidSpecifier, SpecifierSet
        from packaging.version import InvalidVersion, Version
    except ImportError:
        return None
    try:
        return Version(version) in SpecifierSet(spec, prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return None


def check_requirements(f: EnvFacts) -> list[Check]:
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:
        return [Check("packages", "SKIP", "the 'packaging' module is missing; cannot read requirement specifiers")]
    checks = []
    for line in f.requirements:
        try:
            req = Requirement(line)
        except InvalidRequirement:
            continue
        name = req.name.replace("-", "_")
        if name not in f.packages:
            continue  # only the packages doctor reports on
        installed = f.packages[name]
        if installed is None:
            checks.append(
                Check(
                    f"package.{name}",
                    "FAIL",
                    f"{name} is not installed (infertune needs {req})",
                    f"pip install '{req}'",
                )
            )
        elif _satisfies(installed, str(req.specifier) or ">=0") is False:
            checks.append(
                Check(f"package.{name}", "FAIL", f"{name} {installed} does not satisfy {req}", f"pip install '{req}'")
            )
        else:
            checks.append(Check(f"package.{name}", "OK", f"{name} {installed} ({req})"))
    return checks


def check_torch_npu(f: EnvFacts, compat: dict) -> Check:
    npu, torch_v = f.packages.get("torch_npu"), f.packages.get("torch")
    if npu is None:
        return Check("torch_npu~torch", "SKIP", "torch_npu not installed (no Ascend NPU stack)")
    if torch_v is None:
        return Check(
            "torch_npu~torch",
            "FAIL",
            f"torch_npu {npu} is installed but torch is not",
            f"pip install torch=={_fmt(_base(npu))}",
        )
    src = "Ascend/pytorch README: torch_npu is versioned after the torch it supports"
    if _base(npu, 2) != _base(torch_v, 2):
        return Check(
            "torch_npu~torch",
            "FAIL",
            f"torch_npu {npu} is built for torch {_fmt(_base(npu))}, but torch {torch_v} is installed: "
            f"major.minor must match ({src})",
            f"pip install torch=={_fmt(_base(npu))} (or the torch_npu release for torch {_fmt(_base(torch_v, 2))})",
        )
    if _base(npu) != _base(torch_v):
        return Check(
            "torch_npu~torch",
            "WARN",
            f"torch_npu {npu} targets torch {_fmt(_base(npu))}; torch {torch_v} differs in the patch version ({src})",
            f"pip install torch=={_fmt(_base(npu))}",
        )
    return Check("torch_npu~torch", "OK", f"torch_npu {npu} matches torch {torch_v}")


def check_cann(f: EnvFacts, compat: dict) -> Check:
    npu, torch_v = f.packages.get("torch_npu"), f.packages.get("torch")
    if f.cann is None:
        if npu is not None:
            return Check(
                "cann~torch",
                "WARN",
                f"torch_npu {npu} is installed but no CANN toolkit was found "
                "(ASCEND_TOOLKIT_HOME unset, no ascend_toolkit_install.info / version.cfg in the default dirs)",
                "install CANN and `source /usr/local/Ascend/ascend-toolkit/set_env.sh` before running",
            )
        return Check("cann~torch", "SKIP", "no CANN toolkit found (not an Ascend machine)")
    cann = _norm_cann(f.cann)
    rows = [r for r in compat["cann_torch"] if _norm_cann(r["cann"]) == cann]
    matched = cann
    if not rows:  # a patch build of a listed release, e.g. 8.0.RC2.10 -> 8.0.RC2
        known = {_norm_cann(r["cann"]) for r in compat["cann_torch"]}
        prefixes = sorted((k for k in known if cann.startswith(k + ".")), key=len, reverse=True)
        if prefixes:
            matched = prefixes[0]
            rows = [r for r in compat["cann_torch"] if _norm_cann(r["cann"]) == matched]
    where = f" (read from {f.cann_source})" if f.cann_source else ""
    if not rows:
        known = sorted({r["cann"] for r in compat["cann_torch"]})
        return Check(
            "cann~torch",
            "WARN",
            f"CANN {f.cann}{where} is not in the compatibility matrix, so torch "
            f"{torch_v} cannot be verified against it (known: {', '.join(known)})",
            "check the Ascend/pytorch README table for this CANN release and add a row to compat.json",
        )
    sources = sorted({r["source"] for r in rows})
    supported = sorted({r["torch"] for r in rows}, key=release)
    if torch_v is None or _base(torch_v) not in {_base(t) for t in supported}:
        other = sorted({r["cann"] for r in compat["cann_torch"] if torch_v and _base(r["torch"]) == _base(torch_v)})
        alt = f", or a CANN that supports torch {torch_v}: {', '.join(other)}" if other else ""
        npu_for = {r["torch"]: r["torch_npu"] for r in rows if r.get("torch_npu")}
        pin = f" with torch_npu=={npu_for[supported[-1]]}" if supported[-1] in npu_for else ""
        return Check(
            "cann~torch",
            "FAIL",
            f"CANN {f.cann}{where} pairs with torch {', '.join(supported)} ({', '.join(sources)}), but torch "
            f"{torch_v} is installed: a CANN / PyTorch mismatch is a known cause of NaN output",
            f"pip install torch=={supported[-1]}{pin}{alt}",
        )
    row = next(r for r in rows if _base(r["torch"]) == _base(torch_v))
    note = f" (matched as {matched})" if matched != cann else ""
    if npu is not None and row.get("torch_npu") and npu != row["torch_npu"]:
        return Check(
            "cann~torch",
            "WARN",
            f"CANN {f.cann}{note} + torch {torch_v} is a listed pair, whose torch_npu "
            f"is {row['torch_npu']}; {npu} is installed ({row['source']})",
            f"pip install torch_npu=={row['torch_npu']}",
        )
    return Check("cann~torch", "OK", f"CANN {f.cann}{note}{where} supports torch {torch_v} ({row['source']})")


def check_cuda(f: EnvFacts, compat: dict) -> Check:
    if f.torch_cuda is None:
        if f.cuda_driver:
            return Check(
                "cuda",
                "WARN",
                f"an NVIDIA driver {f.cuda_driver} ({', '.join(f.gpus)}) is present but torch is a CPU-only build",
                "install a CUDA build of torch (https://pytorch.org/get-started/locally/)",
            )
        return Check("cuda", "SKIP", "torch is a CPU build and no NVIDIA driver was found")
    if f.cuda_driver is None:
        status = "WARN" if not f.cuda_available else "OK"
        return Check(
            "cuda",
            status,
            f"torch built with CUDA {f.torch_cuda}; nvidia-smi not found"
            + ("" if f.cuda_available else " and CUDA is not available"),
            "" if f.cuda_available else "install the NVIDIA driver, or use --device cpu",
        )
    need = next((r for r in compat["cuda_min_driver"] if r["cuda_major"] == _base(f.torch_cuda, 1)[0]), None)
    if need is None:
        return Check(
            "cuda",
            "WARN",
            f"CUDA {f.torch_cuda} is not in the matrix; driver {f.cuda_driver}",
            "check NVIDIA's CUDA compatibility guide and add a row to compat.json",
        )
    if release(f.cuda_driver) < release(need["min_driver"]):
        return Check(
            "cuda",
            "FAIL",
            f"torch's CUDA {f.torch_cuda} needs driver >= {need['min_driver']}, found "
            f"{f.cuda_driver} ({need['source']})",
            f"upgrade the NVIDIA driver to >= {need['min_driver']}, or install a torch built for an older CUDA",
        )
    if not f.cuda_available:
        return Check(
            "cuda",
            "WARN",
            f"driver {f.cuda_driver} is new enough for CUDA {f.torch_cuda}, but torch cannot use the GPU",
            "check CUDA_VISIBLE_DEVICES and that the GPU is not in use by another container",
        )
    return Check(
        "cuda",
        "OK",
        f"CUDA {f.torch_cuda}, driver {f.cuda_driver} (>= {need['min_driver']}): {', '.join(f.gpus) or 'GPU'}",
    )


def check_cpu(f: EnvFacts) -> list[Check]:
    if not f.cpu_flags and f.cpu_model is None:
        return [Check("cpu.features", "SKIP", "/proc/cpuinfo unreadable (not Linux?)")]
    out = []
    for name, (flags, meaning) in CPU_FEATURES.items():
        present = [x for x in flags.split("|") if x in f.cpu_flags]
        if present:
            out.append(Check(f"cpu.{name}", "OK", f"{'/'.join(present)}: {meaning}"))
        elif name == "avx2":
            out.append(
                Check(
                    "cpu.avx2",
                    "WARN",
                    f"no AVX2: {meaning}",
                    "run on a newer CPU, or check that the VM/container exposes AVX2",
                )
            )
        elif name == "bf16":
            out.append(
                Check(
                    "cpu.bf16",
                    "OK",
                    "no native bf16: bf16 is emulated and slow; dtype=auto runs float32 "
                    "here, avoid --dtype bfloat16 on this CPU",
                )
            )
        else:
            out.append(Check(f"cpu.{name}", "OK", f"absent ({meaning})"))
    if f.cpu_kernels_unavailable is None:
        twelve = (
            "; with AMX and VBMI here, plain bf16 projections are also kept losslessly in 12 bits a weight "
            "(compress_weights=auto: a decode step reads 0.76x the bytes)"
            if {"amx_tile", "amx_bf16", "avx512vbmi"} <= set(f.cpu_flags)
            else ""
        )
        if "amx_int8" in f.cpu_flags:
            twelve += "; W8A8 and W8A16 multiply on the AMX-INT8 tiles (prompts too, in the fused step)"
        out.append(
            Check(
                "cpu.kernels",
                "OK",
                "infertune's decode kernels (bf16 / W8A16 / W4A16 GEMV, W8A8 int8 GEMM, fused decode "
                f"step) are built and loaded: bf16 models decode on them{twelve}",
            )
        )
    elif "disabled" in f.cpu_kernels_unavailable or "lacks" in f.cpu_kernels_unavailable:
        out.append(Check("cpu.kernels", "OK", f"decode kernels off: {f.cpu_kernels_unavailable}; torch's matmuls run"))
    else:
        out.append(
            Check(
                "cpu.kernels",
                "WARN",
                f"decode kernels unavailable: {f.cpu_kernels_unavailable}",
                "install a C compiler with OpenMP (gcc) so infertune can build its decode kernels "
                "(1.4-2x faster batch-1 decode in bf16 / W8A16 / W4A16)",
            )
        )
    if f.w8a8_kernel:
        out.append(
            Check(
                "cpu.w8a8",
                "OK",
                "quantization=w8a8 multiplies int8 by int8 in infertune's kernels here (bf16 models): prompts at about "
                "twice a bf16 GEMM's speed, exact integer sums",
            )
        )
    elif f.int_mm_exact is False:
        out.append(
            Check(
                "cpu.w8a8",
                "WARN",
                "torch._int_mm sums int8 products wrong on this CPU (oneDNN without VNNI saturates pairs of "
                "products): quantization=w8a8 sums in float64 on torch's path instead, exact but slow",
                "run W8A8 models in bfloat16 with infertune's kernels built (a C compiler), where W8A8 has its own "
                "exact int8 kernel, or use w8a16",
            )
        )
    elif f.int_mm_exact:
        out.append(Check("cpu.w8a8", "OK", "quantization=w8a8 runs torch._int_mm (oneDNN), exact here"))
    if "avx512f" in f.cpu_flags and f.cpu_capability and "AVX512" not in f.cpu_capability.upper():
        out.append(
            Check(
                "cpu.capability",
                "WARN",
                f"the CPU has AVX-512 but torch dispatches at {f.cpu_capability}",
                "unset ATEN_CPU_CAPABILITY (it caps the kernel level) unless you set it on purpose",
            )
        )
    return out


def check_threads(f: EnvFacts) -> list[Check]:
    cpus = f.usable_cpus
    if cpus is None or f.torch_threads is None:
        return [Check("threads", "SKIP", "CPU count or torch thread count unknown")]
    out = []
    limit = f"{cpus} usable CPU(s)" + (f" (cgroup quota {f.cgroup_cpus:g})" if f.cgroup_cpus else "")
    if f.torch_threads > cpus:
        out.append(
            Check(
                "threads.count",
                "WARN",
                f"torch uses {f.torch_threads} threads on {limit}: threads preempt each other",
                f"export OMP_NUM_THREADS={cpus} (or torch.set_num_threads({cpus}))",
            )
        )
    else:
        out.append(Check("threads.count", "OK", f"torch uses {f.torch_threads} threads on {limit}"))
    bad = []
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        v = f.thread_env.get(var)
        if v is not None and (not v.strip().isdigit() or int(v) > cpus or int(v) < 1):
            bad.append(f"{var}={v}")
    if bad:
        out.append(
            Check("threads.env", "WARN", f"{', '.join(bad)} on {limit}", f"set them to an integer between 1 and {cpus}")
        )
    else:
        shown = (
            ", ".join(f"{k}={v}" for k, v in f.thread_env.items())
            or "no thread variables set (torch uses one thread per core)"
        )
        out.append(Check("threads.env", "OK", shown))
    if f.load_1m is not None:
        free = cpus - f.load_1m
        if f.torch_threads > 1 and f.torch_threads > free + 0.5:
            fit = max(1, int(free))
            out.append(
                Check(
                    "threads.load",
                    "WARN",
                    f"load average {f.load_1m:.1f} on {limit} leaves about {max(free, 0):.1f} CPU(s) idle, but "
                    f"torch runs {f.torch_threads} OpenMP threads: they spin-wait on each other while another "
                    "process holds a core, which can make small models many times slower",
                    f"export OMP_NUM_THREADS={fit} while the machine is shared (or free the CPUs)",
                )
            )
        else:
            out.append(Check("threads.load", "OK", f"load average {f.load_1m:.1f} on {limit}"))
    return out


def check_memory(f: EnvFacts) -> Check:
    if f.mem_available is None:
        return Check("memory", "SKIP", "free memory unknown")
    detail = f"{f.mem_available / GiB:.1f} GiB available of {(f.mem_total or 0) / GiB:.1f} GiB"
    if f.mem_available < GiB:
        return Check(
            "memory",
            "WARN",
            detail + ": models and the KV cache may not fit",
            "close other processes, or give the engine kv_cache_memory_bytes explicitly",
        )
    return Check("memory", "OK", detail + " (the KV cache takes kv_cache_memory_fraction of what is free)")


def check_hugepages(f: EnvFacts) -> Check:
    """Whether the weights and the KV cache can sit on 2 MB pages (kernels/hugepages.py): a decode step streams
    them, and on 4 KB pages the same read is slower (23.5 against 27.9 GB/s on a Xeon with AMX, 2026-12-07)."""
    m = f.transparent_hugepages
    if m is None or m == "unavailable":
        return Check("memory.hugepages", "SKIP", "transparent huge pages unavailable here (not Linux, or no THP)")
    if m == "off":
        return Check(
            "memory.hugepages",
            "OK",
            "2 MB pages off (INFERTUNE_HUGEPAGES=0): weights and KV cache on 4 KB pages",
            "unset INFERTUNE_HUGEPAGES: decode streams its weights faster from 2 MB pages",
        )
    if m == "never":
        return Check(
            "memory.hugepages",
            "WARN",
            "transparent huge pages are off in the kernel: weights and KV cache stay on 4 KB pages",
            "as root: echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (decode reads its weights faster "
            "from 2 MB pages: 0.84-0.95x the generation time measured on a Xeon with AMX)",
        )
    return Check(
        "memory.hugepages",
        "OK",
        f"transparent huge pages ({m}): weights and KV cache are placed on 2 MB pages",
    )


def check_all(f: EnvFacts, compat: dict) -> list[Check]:
    return (
        [check_python(f)]
        + check_requirements(f)
        + [check_torch_npu(f, compat), check_cann(f, compat), check_cuda(f, compat)]
        + check_cpu(f)
        + check_threads(f)
        + [check_memory(f), check_hugepages(f)]
    )


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.status == "FAIL" for c in checks) else 0


def report_dict(facts: EnvFacts, checks: list[Check]) -> dict:
    counts = {s: sum(c.status == s for c in checks) for s in STATUSES}
    return {
        "facts": facts.to_dict(),
        "checks": [asdict(c) for c in checks],
        "summary": counts,
        "exit_code": exit_code(checks),
    }


def format_report(facts: EnvFacts, checks: list[Check]) -> str:
    p = facts.packages
    torch_build = f"CUDA {facts.torch_cuda}" if facts.torch_cuda else "CPU build"
    lines = [
        "infertune doctor",
        f"  Python {facts.python} ({facts.platform}) | torch {p.get('torch') or '-'} ({torch_build}) | transformers "
        f"{p.get('transformers') or '-'} | tokenizers {p.get('tokenizers') or '-'} | safetensors "
        f"{p.get('safetensors') or '-'} | infertune {p.get('infertune') or '-'}",
        f"  torch_npu {p.get('torch_npu') or '-'} | CANN {facts.cann or '-'}"
        + (f" ({facts.cann_source})" if facts.cann_source else "")
        + f" | Ascend driver {facts.ascend_driver or '-'} | NVIDIA driver {facts.cuda_driver or '-'}"
        + (f" | GPUs: {', '.join(facts.gpus)}" if facts.gpus else ""),
        f"  CPU {facts.cpu_model or '-'} | ATen level {facts.cpu_capability or '-'} | torch threads "
        f"{facts.torch_threads} | usable CPUs {facts.usable_cpus} | load "
        f"{'-' if facts.load_1m is None else round(facts.load_1m, 2)}",
        "",
        f"{'status':<6} {'check':<20} detail",
        "-" * 100,
    ]
    for c in checks:
        lines.append(f"{c.status:<6} {c.name:<20} {c.detail}")
    todo = [c for c in checks if c.status in ("WARN", "FAIL") and c.fix]
    if todo:
        lines += ["", "what to fix:"]
        lines += [f"  {c.status} {c.name}: {c.fix}" for c in todo]
    code = exit_code(checks)
    lines += [
        "",
        "result: "
        + ("FAIL (a hard mismatch; exit 1)" if code else "no hard mismatch" + (" (see the warnings)" if todo else "")),
    ]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from infertune.profile import consistency

    add_json_flag(p, "the facts and checks (or the --consistency report)")
    p.add_argument("--compat", default=None, help="compatibility matrix JSON to use instead of the shipped one")
    consistency.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    from infertune.profile.env_facts import gather

    if getattr(args, "consistency", False) or getattr(args, "long", None) is not None:
        from infertune.profile import consistency

        return consistency.run(args)
    from infertune.profile.consistency import _user_options

    given = sorted(_user_options(args)[1]) + (["model"] if getattr(args, "model", None) else [])
    given += [f for f in ("prompts", "plot", "pair", "batch") if getattr(args, f, None) is not None]
    if given:  # (they shape the consistency check alone: not silently dropped)
        raise ValueError(
            f"--{', --'.join(g.replace('_', '-') for g in given)} only apply with --consistency (or --long N); "
            "plain `infertune doctor` checks the machine and the installed packages"
        )
    facts = gather()
    checks = check_all(facts, load_compat(args.compat))
    print_report(args, format_report(facts, checks), report_dict(facts, checks))
    return exit_code(checks)
