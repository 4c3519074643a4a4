"""Facts about this machine's software and hardware, gathered once, as plain data that `doctor` judges.

Gathering never imports vendor packages (torch_npu) and never fails: what cannot be read is None.
Tests build EnvFacts by hand to plant a mismatch without touching the real environment.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field, fields

PACKAGES = ("torch", "transformers", "tokenizers", "safetensors", "infertune", "torch_npu")
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "KMP_BLOCKTIME", "OMP_WAIT_POLICY")
CPU_FLAGS = (
    "avx2",
    "avx512f",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "avx512vbmi",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)
ASCEND_HOME_VARS = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
ASCEND_DEFAULT_DIRS = (
    "/usr/local/Ascend/ascend-toolkit/latest",
    "/usr/local/Ascend/cann",
    os.path.expanduser("~/Ascend/ascend-toolkit/latest"),
)


@dataclass(slots=True)
class EnvFacts:
    python: str
    platform: str
    packages: dict[str, str | None]  # distribution versions; None = not installed
    requirements: list[str] = field(default_factory=list)  # infertune's declared requirements
    requires_python: str | None = None
    torch_cuda: str | None = None  # CUDA runtime torch was built with
    cuda_available: bool = False
    cuda_driver: str | None = None  # from nvidia-smi
    gpus: list[str] = field(default_factory=list)
    cann: str | None = None
    cann_source: str | None = None  # the file the CANN version came from
    ascend_driver: str | None = None
    cpu_model: str | None = None
    cpu_flags: list[str] = field(default_factory=list)  # the CPU_FLAGS present
    cpu_capability: str | None = None  # ATen's dispatch level: DEFAULT / AVX2 / AVX512 ...
    torch_threads: int | None = None
    affinity_cpus: int | None = None
    cgroup_cpus: float | None = None  # cpu.max quota in CPUs, None = unlimited / unknown
    os_cpus: int | None = None
    load_1m: float | None = None
    thread_env: dict[str, str] = field(default_factory=dict)
    mem_total: int | None = None
    mem_available: int | None = None
    # Linux's transparent huge pages: "always" / "madvise" / "never" / "off" / "unavailable" (kernels/hugepages.py)
    transparent_hugepages: str | None = None
    # infertune's CPU decode kernels: None = built and loaded, else why not (infertune.kernels.cpu)
    cpu_kernels_unavailable: str | None = None
    # W8A8: the kernels multiply int8 by int8 here (x86 without AMX); torch._int_mm's sums are exact here
    w8a8_kernel: bool | None = None
    int_mm_exact: bool | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> EnvFacts:
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown EnvFacts fields: {sorted(unknown)}")
        return cls(**d)

    @property
    def usable_cpus(self) -> int | None:
        """CPUs this process may really use: its affinity, capped by a cgroup quota."""
        n = self.affinity_cpus or self.os_cpus
        if n is not None and self.cgroup_cpus is not None:
            n = min(n, max(1, int(self.cgroup_cpus)))
        return n


def _version(dist: str) -> str | None:
    for name in (dist, dist.replace("_", "-")):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def read_cann_version(
    env: dict[str, str] | None = None, extra_dirs: tuple[str, ...] = ()
) -> tuple[str | None, str | None]:
    """(CANN version, file it came from), looking where set_env.sh points first, then the default install dirs."""
    env = os.environ if env is None else env
    dirs = [env[v] for v in ASCEND_HOME_VARS if env.get(v)] + list(extra_dirs) + list(ASCEND_DEFAULT_DIRS)
    for d in dirs:
        for info in sorted(glob.glob(os.path.join(d, "*-linux", "ascend_toolkit_install.info"))) + [
            os.path.join(d, "ascend_toolkit_install.info")
        ]:
            version = _read_key(info, "version")
            if version:
                return version, info
        cfg = os.path.join(d, "version.cfg")
        raw = _read_key(cfg, "toolkit_running_version") or _read_key(cfg, "runtime_running_version")
        if raw:  # "[7.3.0.1.231:8.0.RC2]": the CANN release follows the colon
            return raw.strip("[]").split(":")[-1], cfg
    return None, None


def _read_key(path: str, key: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                k, sep, v = line.partition("=")
                if sep and k.strip().lower() == key.lower():
                    return v.strip().strip('"')
    except OSError:
        return None
    return None


def _cpuinfo() -> tuple[str | None, list[str]]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None, []
    model = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    flags = re.search(r"^flags\s*:\s*(.+)$", text, re.M)
    present = set(flags.group(1).split()) if flags else set()
    return (model.group(1).strip() if model else None), [f for f in CPU_FLAGS if f in present]


def _cgroup_cpus() -> float | None:
    try:
        with open("/sys/fs/cgroup/cpu.max") as f:
            quota, period = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _nvidia_smi() -> tuple[str | None, list[str]]:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None, []
    try:
        out = subprocess.run(
            [exe, "--query-gpu=driver_version,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=15,
        )
    except (OSError, subprocess.SubprocessError):
        return None, []
    rows = [line.split(",", 1) for line in out.stdout.strip().splitlines() if "," in line]
    return (rows[0][0].strip() if rows else None), [r[1].strip() for r in rows]


def gather() -> EnvFacts:
    """Read the real environment."""
    import psutil
    import torch

    packages = {p: _version(p) for p in PACKAGES}
    try:
        requirements = importlib.metadata.requires("infertune") or []
        requires_python = importlib.metadata.metadata("infertune").get("Requires-Python")
    except importlib.metadata.PackageNotFoundError:
        requirements, requires_python = [], None
    model, flags = _cpuinfo()
    driver, gpus = _nvidia_smi()
    cann, cann_source = read_cann_version()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = None
    vm = psutil.virtual_memory()
    from infertune.kernels import cpu as cpu_kernels  # builds them on first use (about 1 s)
    from infertune.kernels import hugepages
    from infertune.quant.int8 import int_mm_is_exact

    return EnvFacts(
        python=platform.python_version(),
        platform=f"{platform.system()} {platform.machine()}",
        packages=packages,
        requirements=[r for r in requirements if "extra ==" not in r],
        requires_python=requires_python,
        torch_cuda=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
        cuda_driver=driver,
        gpus=gpus,
        cann=cann,
        cann_source=cann_source,
        ascend_driver=_read_key("/usr/local/Ascend/driver/version.info", "Version"),
        cpu_model=model,
        cpu_flags=flags,
        cpu_capability=torch.backends.cpu.get_cpu_capability(),
        torch_threads=torch.get_num_threads(),
        affinity_cpus=affinity,
        cgroup_cpus=_cgroup_cpus(),
        os_cpus=os.cpu_count(),
        load_1m=load,
        thread_env={k: os.environ[k] for k in THREAD_ENV if k in os.environ},
        mem_total=vm.total,
        mem_available=vm.available,
        transparent_hugepages=hugepages.mode(),
        cpu_kernels_unavailable=None if cpu_kernels.available() else cpu_kernels.unavailable_reason(),
        w8a8_kernel=cpu_kernels.available() and cpu_kernels.w8a8_supported() and not cpu_kernels.amx(),
        int_mm_exact=int_mm_is_exact(),
    )


if __name__ == "__main__":  # a quick look at the raw facts
    import json

    json.dump(gather().to_dict(), sys.stdout, indent=1)
