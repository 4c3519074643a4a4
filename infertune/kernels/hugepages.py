"""Host memory on 2 MB pages (Linux transparent huge pages) for what a decode step streams: weights and KV cache.

A decode step reads every weight once, front to back. On 4 KB pages a stream crosses a page every 64 cache lines:
the hardware prefetchers stop at each boundary and every page costs a TLB walk. On 2 MB pages the same read runs
faster: on the Intel Xeon with AMX (model 167) of 2026-12-07 a plain 2-thread read of 1 GiB went 23.5 -> 27.9 GB/s;
generation with the weights and the cache here took 0.90x the time at batch 1 (the 386M model, 12-bit weights),
0.84x on the AVX2 kernels' bf16 weights, 0.92x with W4A16, 0.91x at 16 requests and 0.95x for the MoE preset's 16
requests (docs/kernels.md, "Weights and the KV cache on 2 MB pages").

Linux backs anonymous memory with 2 MB pages where the system allows it (/sys/kernel/mm/transparent_hugepage/enabled
"always", or "madvise" and the range advised MADV_HUGEPAGE, the common default) and only for 2 MB-aligned pieces
touched after the advice. So the memory comes from fresh anonymous mappings, advised before anything is written:

- `empty(shape, dtype)`: uninitialised, 64-byte aligned. Below `DEDICATED_BYTES` carved from a shared chunk of
  `CHUNK_BYTES` (one expert's 12-bit projection is ~1 MB: alone it could hold no 2 MB page), larger requests in a
  mapping of their own (2 MB-aligned start; the last partial 2 MB is left on small pages, so nothing is wasted).
  A chunk is unmapped when the last tensor carved from it dies (the allocator keeps only a weak reference), so only
  long-lived tensors should come from there: the weights the kernels pack at load (cpu.pack_bf16c, pack_w8a8,
  pack_w4, pack_w4p). own=True (the loader's weights, which packing may replace and free): from 2 MB up a mapping of
  its own, smaller ones torch's memory.
- `transient()`: a block inside which empty(own=False) is torch's memory (packs that are copied elsewhere and
  dropped at once must not pin a chunk).
- `zeros(shape, dtype)`: a mapping of its own, zero, every page touched now (the KV cache: allocated up front, as
  before, so no step faults its pages in).

Where the system has no transparent huge pages (not Linux, "never", or INFERTUNE_HUGEPAGES=0) both are torch.empty /
torch.zeros. `report()` says how much was placed and how much of it the kernel actually backs with 2 MB pages
(/proc/self/smaps; memory fragmentation can leave some of it on small pages), for the engine's start-up log and
`infertune doctor`.
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch

PAGE = 2 << 20  # the x86-64 / AArch64 (4 KB base pages) transparent huge page
CHUNK_BYTES = 64 << 20
DEDICATED_BYTES = 8 << 20
_ALIGN = 64
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@functools.lru_cache(maxsize=1)
def mode() -> str:
    """The system's transparent huge page setting: "always", "madvise" or "never"; "off" where INFERTUNE_HUGEPAGES=0;
    "unavailable" where the system has none (not Linux, no THP in the kernel, no madvise in Python)."""
    if os.environ.get("INFERTUNE_HUGEPAGES", "1").lower() in ("0", "false", "off", "no"):
        return "off"
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "unavailable"
    try:
        text = _THP.read_text()
    except OSError:
        return "unavailable"
    chosen = [w.strip("[]") for w in text.split() if w.startswith("[")]
    return chosen[0] if chosen else "unavailable"


def enabled() -> bool:
    """Whether empty() / zeros() place memory on fresh advised mappings (else they are torch.empty / torch.zeros)."""
    return mode() in ("always", "madvise")


def _mapping(nbytes: int, huge_bytes: int) -> tuple[torch.Tensor, _Placed]:
    """A fresh anonymous mapping holding nbytes from a 2 MB-aligned start, its first huge_bytes (a multiple of PAGE)
    advised onto 2 MB pages: (uint8 tensor over [start, start + nbytes), its record)."""
    mm = mmap.mmap(-1, nbytes + PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    whole = torch.frombuffer(mm, dtype=torch.uint8)  # (holds the mapping: it is unmapped when the last view dies)
    off = -whole.data_ptr() % PAGE
    if huge_bytes:
        mm.madvise(mmap.MADV_HUGEPAGE, off, huge_bytes)
    return whole[off : off + nbytes], _Placed(weakref.ref(mm), whole.data_ptr(), whole.data_ptr() + len(mm), off, 0)


@dataclass
class _Placed:
    mapping: weakref.ref  # the mmap (alive while any tensor over it is)
    lo: int  # the mapping's address range
    hi: int
    off: int  # where its 2 MB-aligned part starts
    used: int  # bytes handed out from there


class _Allocator:
    """The process's carving of advised mappings (an allocator, as malloc's arenas are: process-wide by nature)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._chunk: _Placed | None = None  # (held weakly: unmapped with the last tensor carved from it)
        self._placed: list[_Placed] = []

    def track(self, rec: _Placed, nbytes: int) -> None:
        with self._lock:
            rec.used = nbytes
            self._placed = [p for p in self._placed if p.mapping() is not None] + [rec]

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes >= DEDICATED_BYTES:
            t, rec = _mapping(nbytes, nbytes // PAGE * PAGE)
            self.track(rec, nbytes)
            return t
        need = -(-nbytes // _ALIGN) * _ALIGN
        with self._lock:
            rec = self._chunk
            mm = rec.mapping() if rec is not None and rec.used + need <= CHUNK_BYTES else None
            if mm is None:  # (a full chunk's rest is never touched: never resident)
                _, rec = _mapping(CHUNK_BYTES, CHUNK_BYTES)
                mm = rec.mapping()
                self._chunk = rec
                self._placed = [p for p in self._placed if p.mapping() is not None] + [rec]
            start = rec.off + rec.used
            rec.used += need
            return torch.frombuffer(mm, dtype=torch.uint8)[start : start + nbytes]

    def placed(self) -> list[_Placed]:
        """The live mappings (a chunk the allocator still carves counts while any tensor from it lives)."""
        with self._lock:
            self._placed = [p for p in self._placed if p.mapping() is not None and p.used]
            return list(self._placed)


_allocator = _Allocator()
_local = threading.local()  # .transient: depth of transient() blocks on this thread


@contextlib.contextmanager
def transient():
    """Inside the block, empty(own=False) (what the kernels' pack functions call) gives torch's memory, not a shared
    chunk: for packed tensors that die as soon as they are copied elsewhere (each expert's packing, copied into
    the [E, ...] stack the experts keep). Carved from a chunk, such a temporary keeps its pages resident for as
    long as any long-lived tensor carved beside it lives: a MoE model's W8A16 experts left ~0.9 GiB of dead
    packs resident that way."""
    _local.transient = getattr(_local, "transient", 0) + 1
    try:
        yield
    finally:
        _local.transient -= 1


def empty(shape: tuple[int, ...] | int, dtype: torch.dtype, own: bool = False) -> torch.Tensor:
    """An uninitialised contiguous CPU tensor on advised memory (see the module's docstring), 64-byte aligned.
    own=True: a tensor that may be freed long before its neighbours (the loader's bf16 weights, which the 12-bit
    layout or a quantization replaces): from 2 MB up in a mapping of its own (its whole 2 MB pages advised), below
    that torch's memory, never a shared chunk that it would keep mapped."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    if not enabled():
        return torch.empty(shape, dtype=dtype)
    numel = 1
    for s in shape:
        numel *= s
    nbytes = numel * dtype.itemsize
    if nbytes == 0 or (own and nbytes < PAGE) or (not own and getattr(_local, "transient", 0)):
        return torch.empty(shape, dtype=dtype)
    if own:
        t, rec = _mapping(nbytes, nbytes // PAGE * PAGE)
        _allocator.track(rec, nbytes)
        return t.view(dtype).view(shape)
    return _allocator.take(nbytes).view(dtype).view(shape)


def copy(t: torch.Tensor) -> torch.Tensor:
    """t's values in a contiguous tensor from empty() (a packed weight built by torch ops, moved to advised memory)."""
    out = empty(t.shape, t.dtype)
    out.copy_(t)
    return out


def zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero contiguous CPU tensor in a mapping of its own on advised memory (empty(own=True)), every page touched
    now (the KV cache: resident from the start, as torch.zeros would leave it; a fresh mapping reads as zero already,
    this faults its pages in, 2 MB at a time)."""
    return empty(shape, dtype, own=True).zero_()


@dataclass(frozen=True)
class Report:
    mode: str  # mode()
    placed_bytes: int  # on advised mappings now (live tensors' chunks and mappings)
    huge_bytes: int  # of those mappings, backed by 2 MB pages (AnonHugePages in /proc/self/smaps)

    def summary(self) -> str:
        if self.mode in ("off", "unavailable", "never"):
            why = {
                "off": "off (INFERTUNE_HUGEPAGES=0)",
                "unavailable": "unavailable on this system",
                "never": "off in the kernel (/sys/kernel/mm/transparent_hugepage/enabled is never)",
            }[self.mode]
            return f"2 MB pages: {why}; weights and KV cache on 4 KB pages"
        share = 100.0 * self.huge_bytes / self.placed_bytes if self.placed_bytes else 0.0
        return (
            f"2 MB pages ({self.mode}): {self.huge_bytes / 2**20:.0f} MiB of {self.placed_bytes / 2**20:.0f} MiB "
            f"of weights and KV cache ({share:.0f}%)"
        )


def _smaps_huge(placed: list[_Placed]) -> int:
    """Bytes of AnonHugePages in /proc/self/smaps over the VMAs inside these mappings (an advised range is a VMA of
    its own)."""
    if not placed:
        return 0
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    total, inside = 0, False
    for line in text.splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = any(p.lo <= lo and hi <= p.hi for p in placed)
        elif inside and head == "AnonHugePages:":
            total += int(line.split()[1]) * 1024
    return total


def report() -> Report:
    """What empty() / zeros() hold now, and how much of it Linux backs with 2 MB pages."""
    live = _allocator.placed() if enabled() else []
    placed = sum(p.used for p in live)
    return Report(mode(), placed, min(_smaps_huge(live), placed))
