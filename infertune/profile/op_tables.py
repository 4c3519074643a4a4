"""Per-backend operator tables (data files under profile/data/) and how an aten op resolves against one.

A table says which aten ops a backend runs with its own kernels. Facts that hold for every backend come
from torch itself (aten_ops.json, generated from the native_functions.yaml that ships with torch):
CompositeImplicitAutograd ops decompose before any backend sees them, CompositeExplicitAutograd ops have
one device-agnostic kernel, and a structured functional op (add.Tensor) runs wherever its out= variant
(add.out) has a kernel. Op keys use native_functions.yaml's spelling: "mm", "add.Tensor" (no ".default").

Regenerate the torch-derived files after a torch upgrade:  python -m infertune.profile.op_tables
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data"
BACKEND_TABLES = {"cpu": "ops_cpu.json", "cuda": "ops_cuda.json", "npu": "ops_npu.json"}
# What happens to an op the backend has no kernel for.
ON_MISSING = ("fallback-to-cpu", "unsupported")
STATUSES = ("native", "fallback", "unsupported", "unknown")
# How the audit orders its rows: what needs attention first.
SEVERITY = {"fallback": 0, "unsupported": 1, "unknown": 2, "decomposed": 3, "native": 4}


def op_key(func) -> str:
    """An OpOverload (torch.ops.aten.mm.default) -> its native_functions.yaml name ("mm", "add.Tensor")."""
    name = func._schema.name.split("::", 1)[-1]
    overload = func._overloadname
    return name if overload == "default" else f"{name}.{overload}"


def op_namespace(func) -> str:
    return func._schema.name.split("::", 1)[0]


@dataclass(slots=True)
class AtenFacts:
    """Backend-independent facts about aten ops, from torch's own operator registry file."""

    torch_version: str
    composite_implicit: frozenset[str]
    composite_explicit: frozenset[str]
    structured_delegate: dict[str, str]

    @classmethod
    def load(cls, path: Path | None = None) -> AtenFacts:
        d = json.loads((path or DATA_DIR / "aten_ops.json").read_text())
        return cls(
            d["torch_version"],
            frozenset(d["composite_implicit"]),
            frozenset(d["composite_explicit"]),
            dict(d["structured_delegate"]),
        )


@dataclass(slots=True)
class OpTable:
    backend: str
    source: str
    version: str
    complete: bool  # True: an op not listed has no kernel; False: an op not listed is "unknown"
    on_missing: str  # "fallback-to-cpu" (torch_npu's CPU fallback) or "unsupported" (an error)
    native: frozenset[str]
    status: dict[str, str] = field(default_factory=dict)  # explicit per-op status, wins over everything
    hints: dict[str, str] = field(default_factory=dict)
    dtype_notes: dict[str, str] = field(default_factory=dict)  # dtype name -> caveat on this backend
    coverage: str = ""
    path: str = ""
    # MoE / MLA stage (op_trace.STAGE_FRAMES) -> the backend's own fused op for it, with its source
    fused_stages: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.on_missing not in ON_MISSING:
            raise ValueError(f"op table {self.path or self.backend}: on_missing must be one of {ON_MISSING}")
        bad = {k: v for k, v in self.status.items() if v not in STATUSES}
        if bad:
            raise ValueError(f"op table {self.path or self.backend}: unknown status in {bad}; use one of {STATUSES}")

    @property
    def missing_status(self) -> str:
        if not self.complete:
            return "unknown"
        return "fallback" if self.on_missing == "fallback-to-cpu" else "unsupported"

    @classmethod
    def from_dict(cls, d: dict, path: str = "") -> OpTable:
        for key in ("backend", "source", "version", "complete", "on_missing"):
            if key not in d:
                raise ValueError(f"op table {path or '(dict)'} lacks the field {key!r}")
        native = d.get("native", [])
        if isinstance(native, dict):  # {"where it is registered": [ops]}
            native = [op for ops in native.values() for op in ops]
        return cls(
            backend=d["backend"],
            source=d["source"],
            version=d["version"],
            complete=bool(d["complete"]),
            on_missing=d["on_missing"],
            native=frozenset(native),
            status=dict(d.get("status", {})),
            hints=dict(d.get("hints", {})),
            dtype_notes=dict(d.get("dtype_notes", {})),
            coverage=d.get("coverage", ""),
            path=path,
            fused_stages=dict(d.get("fused_stages", {})),
        )

    @classmethod
    def load(cls, backend_or_path: str) -> OpTable:
        """A backend name ("npu") loads the shipped table; anything else is read as a JSON file path."""
        if backend_or_path in BACKEND_TABLES:
            path = DATA_DIR / BACKEND_TABLES[backend_or_path]
        else:
            path = Path(backend_or_path)
            if not path.is_file():
                raise FileNotFoundError(
                    f"op table {backend_or_path!r} not found; give a backend "
                    f"({', '.join(BACKEND_TABLES)}) or a JSON file"
                )
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"op table {path} is not valid JSON: {e}") from e
        return cls.from_dict(d, str(path))


@dataclass(slots=True)
class Resolution:
    status: str  # native | fallback | unsupported | unknown | decomposed
    basis: str  # why: "table", "composite", "structured out= variant mm.out", "decomposes", "not listed" ...


def resolve(key: str, namespace: str, table: OpTable, aten: AtenFacts, has_children: bool) -> Resolution:
    """Status of one op on the table's backend. has_children: the trace saw what it decomposes into."""
    if key in table.status:
        return Resolution(table.status[key], "listed in the table")
    if key in table.native:
        return Resolution("native", "listed in the table")
    if namespace != "aten":
        return Resolution("unknown", f"{namespace}:: op, not an aten op")
    if key in aten.composite_implicit:
        # Decomposed before the backend is reached: what matters is what it decomposes into. Without
        # children it returned its input unchanged (x.to(x.dtype), x.reshape(x.shape)): no kernel at all.
        if has_children:
            return Resolution("decomposed", "CompositeImplicitAutograd")
        return Resolution("native", "CompositeImplicitAutograd that launched no op here (a no-op)")
    if key in aten.composite_explicit:
        return Resolution("native", "CompositeExplicitAutograd (one kernel for every device)")
    delegate = aten.structured_delegate.get(key)
    if delegate and (delegate in table.native or table.status.get(delegate) == "native"):
        return Resolution("native", f"via its structured out= variant {delegate}")
    return Resolution(table.missing_status, "not listed in the table")


# ---- regenerating the torch-derived files ----------------------------------------------------------------


def _kernel_keys(entry: dict) -> set[str]:
    keys: set[str] = set()
    for k in entry.get("dispatch") or {}:
        keys.update(part.strip() for part in k.split(","))
    if "ufunc_inner_loop" in entry:  # ufunc codegen emits CPU and CUDA kernels
        keys.update(("CPU", "CUDA"))
    return keys


def generate_from_native_functions(yaml_path: str | Path, torch_version: str) -> dict[str, dict]:
    """Parse torch's native_functions.yaml into aten_ops.json and the CPU / CUDA tables (returned as dicts)."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    entries = yaml.load(Path(yaml_path).read_text(), Loader=loader)
    keys_of: dict[str, set[str]] = {}
    delegate: dict[str, str] = {}
    implicit, explicit = set(), set()
    for e in entries:
        name = e["func"].split("(", 1)[0]
        keys = _kernel_keys(e)
        if "structured_delegate" in e:
            delegate[name] = e["structured_delegate"]
        elif not keys or "CompositeImplicitAutograd" in keys:
            implicit.add(name)
        if keys & {"CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional"}:
            explicit.add(name)
        for out in [e["autogen"]] if isinstance(e.get("autogen"), str) else e.get("autogen") or []:
            for o in out.split(","):
                explicit.add(o.strip())  # generated out= wrappers call the functional op: device-agnostic
        keys_of[name] = keys
    for name, target in delegate.items():  # a structured op runs where its out= kernel runs
        keys_of[name] = keys_of[name] | keys_of.get(target, set())
    source_note = (
        f"torchgen/packaged/ATen/native/native_functions.yaml shipped with torch {torch_version} "
        "(dispatch keys per op; regenerate with `python -m infertune.profile.op_tables`)"
    )
    out = {
        "aten_ops.json": {
            "source": source_note,
            "torch_version": torch_version,
            "composite_implicit": sorted(implicit),
            "composite_explicit": sorted(explicit - implicit),
            "structured_delegate": dict(sorted(delegate.items())),
        }
    }
    for backend, key in (("cpu", "CPU"), ("cuda", "CUDA")):
        table = {
            "backend": backend,
            "source": source_note + f"; an op is native when it has a {key} kernel",
            "version": f"torch {torch_version}",
            "complete": True,
            "on_missing": "unsupported",
            "coverage": f"every aten op in native_functions.yaml with a {key} dispatch entry; composite ops "
            "are resolved from aten_ops.json",
            "native": sorted(n for n, k in keys_of.items() if key in k),
        }
        if backend != "cpu" and key in keys_of.get("_fused_sdp_choice", set()):
            # scaled_dot_product_attention decomposes into a kernel chosen per device; a CPU trace records the
            # CPU one, so judge the composite itself on devices that have their own choice function.
            table["status"] = {"scaled_dot_product_attention": "native"}
            table["hints"] = {
                "scaled_dot_product_attention": (
                    f"decomposed per device: _fused_sdp_choice has a {key} kernel and picks flash / memory-efficient / "
                    "cuDNN / math attention there; the CPU trace shows the CPU kernel instead"
                )
            }
        out[BACKEND_TABLES[backend]] = table
    return out


def main() -> None:
    import torch
    import torchgen

    yaml_path = Path(torchgen.__file__).parent / "packaged" / "ATen" / "native" / "native_functions.yaml"
    version = torch.__version__.split("+", 1)[0]
    for name, payload in generate_from_native_functions(yaml_path, version).items():
        path = DATA_DIR / name
        path.write_text(json.dumps(payload, indent=0, sort_keys=False) + os.linesep)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
