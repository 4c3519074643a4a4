"""An all-reduce between the tensor-parallel ranks of one host through shared memory, for the small activations a
decode step sums after each row-parallel layer (gloo's TCP round trip costs ~0.3-0.6 ms each on this 2-core
machine; this costs tens of microseconds).

Layout: two buffers (alternating by call, so no rank overwrites a slot another may still read) of one fp32 slot per
rank, and one int64 sequence counter per rank. A call: write this rank's values into its slot of buffer seq % 2,
publish seq in its counter, wait until every counter reaches seq, sum the slots in rank order (every rank computes
the same sum, bit for bit). A rank writes buffer seq % 2 again only at seq + 2, after every rank has published
seq + 1, which each does only after it finished reading at seq.

The order of a rank's plain stores and loads is what x86's memory model gives (stores are seen in program order);
the executor only builds it on x86-64 hosts (elsewhere gloo runs every all-reduce). Spinning suits ranks pinned to
cores of their own; with more ranks than CPUs the wait yields the core.
"""

from __future__ import annotations

import os
import time
from multiprocessing import resource_tracker, shared_memory

import numpy as np
import torch

# After this many polls of the counters, a waiting rank yields its core at each poll.
SPINS_BEFORE_YIELD = 2000


class ShmAllReduce:
    def __init__(self, name: str, rank: int, size: int, max_numel: int, create: bool = False) -> None:
        self.rank, self.size, self.max_numel = rank, size, max_numel
        nbytes = 8 * size + 2 * size * max_numel * 4
        if create:
            self._shm = shared_memory.SharedMemory(name=name, create=True, size=nbytes)
            self._shm.buf[: 8 * size] = bytes(8 * size)
        else:
            self._shm = _attach(name)
        buf = self._shm.buf
        self._counters = np.ndarray((size,), dtype=np.int64, buffer=buf)
        flat = torch.frombuffer(buf, dtype=torch.float32, offset=8 * size, count=2 * size * max_numel)
        self._slots = flat.view(2, size, max_numel)
        # the last call's sequence number, in memory the fused C step (csrc/fused_step.h tp_allreduce) advances too
        # when it runs the same protocol between these calls
        self._seq_cell = torch.zeros(1, dtype=torch.int64)
        self.address = self._counters.ctypes.data  # (the segment's start: the counters come first)
        self.seq_address = self._seq_cell.data_ptr()

    @classmethod
    def connect(cls, rank: int, size: int, max_numel: int, barrier, tag: str) -> ShmAllReduce:
        """Rank 0 creates the segment, the others map it, then rank 0 unlinks its name (the mappings keep it alive
        until the last rank exits, however it exits). barrier(): torch.distributed's, over the same ranks."""
        name = f"infertune-tp-{tag}"
        shm = cls(name, rank, size, max_numel, create=True) if rank == 0 else None
        barrier()
        if rank != 0:
            shm = cls(name, rank, size, max_numel)
        barrier()
        if rank == 0:
            shm._shm.unlink()
        return shm

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() <= self.max_numel

    def _exchange(self, x: torch.Tensor) -> torch.Tensor:
        """Publish x in this rank's slot, wait for every rank's, and return the [size, x.numel()] fp32 slots (valid
        until this rank's next call but one)."""
        n = x.numel()
        self._seq_cell += 1
        seq = int(self._seq_cell)
        slots = self._slots[seq % 2, :, :n]  # [size, n]
        slots[self.rank].copy_(x.reshape(-1))
        self._counters[self.rank] = seq
        spins = 0
        while int(self._counters.min()) < seq:
            spins += 1
            if spins > SPINS_BEFORE_YIELD:
                os.sched_yield() if hasattr(os, "sched_yield") else time.sleep(0)
        return slots

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over the ranks, in place (summed in fp32, rank order, then rounded once to x's dtype)."""
        slots = self._exchange(x)
        total = slots.sum(dim=0) if self.size > 2 else slots[0] + slots[1]
        return x.copy_(total.view(x.shape))

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on each rank -> [..., size * n] in rank order (through fp32: exact for fp32 / bf16 / fp16)."""
        slots = self._exchange(x)
        parts = slots.view(self.size, -1, x.shape[-1])  # [size, rows, n]
        out = parts.permute(1, 0, 2).reshape(*x.shape[:-1], self.size * x.shape[-1])
        return out.to(x.dtype)  # a copy: the slots are reused

    def close(self) -> None:
        self._slots = self._counters = None
        self.address = 0
        self._shm.close()


def _attach(name: str) -> shared_memory.SharedMemory:
    """Map an existing segment without handing it to this process's resource tracker: the creating rank unlinks it,
    and a tracker that also held it would unlink it again (or warn of a leak) when this process exits."""
    try:
        return shared_memory.SharedMemory(name=name, track=False)  # Python >= 3.13
    except TypeError:
        pass
    register = resource_tracker.register
    resource_tracker.register = lambda *args, **kwargs: None  # (start-up, one thread: restored at once)
    try:
        return shared_memory.SharedMemory(name=name)
    finally:
        resource_tracker.register = register
