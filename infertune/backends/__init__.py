"""Backends: resolve "auto" / "cpu" / "cuda" / "npu" to a Backend object."""

from __future__ import annotations

from infertune.backends.base import Backend
from infertune.backends.cpu import CPUBackend
from infertune.backends.cuda import CUDABackend
from infertune.backends.npu import NPUBackend

_BACKENDS: dict[str, type[Backend]] = {"cuda": CUDABackend, "npu": NPUBackend, "cpu": CPUBackend}


def get_backend(device: str = "auto") -> Backend:
    """ "auto" prefers CUDA, then NPU, then CPU. A forced device that is absent is a clear error."""
    name, _, index = device.partition(":")
    if name == "auto":
        for cls in _BACKENDS.values():
            if cls.is_available():
                return cls()
    if name not in _BACKENDS:
        raise ValueError(f"device={device!r} is unknown; choose one of auto, {', '.join(_BACKENDS)}")
    cls = _BACKENDS[name]
    if not cls.is_available():
        hint = {"npu": "install torch_npu and CANN", "cuda": "install a CUDA build of torch"}.get(name, "")
        raise RuntimeError(f"device={name!r} was requested but is not available here ({hint})")
    return cls(int(index) if index else 0)


__all__ = ["Backend", "CPUBackend", "CUDABackend", "NPUBackend", "get_backend"]
