"""Read safetensors tensors one at a time with plain file reads (no mmap).

A memory-mapped checkpoint counts in the process's resident memory while it is open, so loading through
mmap peaks at about twice the weights. Reading each tensor into its own buffer keeps the peak at the
weights plus the largest single tensor (each buffer is an anonymous mapping of its own, so it leaves the
process when the tensor dies). The format: an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets: [begin, end]}} (offsets relative to the end of the header), the data.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Iterator
from pathlib import Path

import torch

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,  # fp8 checkpoints (quant/fp8.py)
    "F8_E5M2": torch.float8_e5m2,
}
_MAX_HEADER = 100 * 2**20
# Read buffers: private anonymous mappings, pre-faulted where the OS can (the read fills every page anyway, and
# faulting them in with the mapping is faster than one fault per page).
_ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)


class CorruptCheckpointError(ValueError):
    pass


def read_header(path: Path) -> tuple[dict, int]:
    """(tensor entries, byte offset of the data section); raises CorruptCheckpointError on a malformed file."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CorruptCheckpointError(f"{path} is too short to be a safetensors file ({size} bytes)")
        (n,) = struct.unpack("<Q", raw)
        if n > min(_MAX_HEADER, size - 8):
            raise CorruptCheckpointError(f"{path} has an invalid header length ({n} bytes in a {size}-byte file)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CorruptCheckpointError(f"{path} has a header that is not valid JSON ({e})") from e
    if not isinstance(header, dict):
        raise CorruptCheckpointError(f"{path} has a header that is not a JSON object")
    header.pop("__metadata__", None)
    data_start, data_size = 8 + n, size - 8 - n
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            dtype = _DTYPES[entry["dtype"]]
            numel = 1
            for d in entry["shape"]:
                numel *= int(d)
        except (KeyError, TypeError, ValueError) as e:
            raise CorruptCheckpointError(f"{path}: entry {name!r} is malformed ({e!r})") from e
        expected = numel * torch.empty((), dtype=dtype).element_size()
        if not 0 <= begin <= end <= data_size or end - begin != expected:
            raise CorruptCheckpointError(
                f"{path}: tensor {name!r} lies outside the file or has the wrong size (truncated or corrupt file?)"
            )
    return header, data_start


def iter_tensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) in file order, each read into a fresh CPU buffer."""
    header, data_start = read_header(path)
    with open(path, "rb", buffering=0) as f:
        for name, entry in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            begin, end = entry["data_offsets"]
            if begin == end:
                yield name, torch.empty(entry["shape"], dtype=_DTYPES[entry["dtype"]])
                continue
            buffer = mmap.mmap(-1, end - begin, flags=_ANONYMOUS)
            f.seek(data_start + begin)
            if f.readinto(buffer) != end - begin:
                raise CorruptCheckpointError(f"{path}: tensor {name!r} is truncated")
            yield name, _tensor_on(buffer, entry["shape"], _DTYPES[entry["dtype"]])


def _tensor_on(buffer: mmap.mmap, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor over an anonymous mapping of its own, unmapped as soon as the tensor dies. A malloc'd buffer of a
    few MiB is returned to the C heap instead, which keeps such buffers resident: over a load they added ~35 MiB
    to the peak (the weights are copied out of these buffers, so they are only transients)."""
    return torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(shape)
