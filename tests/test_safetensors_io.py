"""The mmap-free safetensors reader against the safetensors library itself."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from infertune.models.safetensors_io import CorruptCheckpointError, iter_tensors


def test_reads_what_the_library_wrote(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {
        "a.bf16": torch.randn(7, 5, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(3, generator=g),
        "c.i8": torch.randint(-128, 127, (4, 4), generator=g, dtype=torch.int8),
        "d.i64": torch.arange(6).view(2, 3),
        "e.f16": torch.randn(2, 2, 2, generator=g).half(),
        "f.bool": torch.tensor([True, False, True]),
        "g.empty": torch.empty(0, 3),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    ours = dict(iter_tensors(path))
    reference = load_file(str(path))
    assert ours.keys() == reference.keys()
    for name, t in reference.items():
        assert ours[name].dtype == t.dtype and torch.equal(ours[name], t), name


@pytest.mark.parametrize("damage", ["truncate", "garbage", "short"])
def test_damaged_files_raise(tmp_path, damage):
    path = tmp_path / "x.safetensors"
    save_file({"w": torch.randn(64, 64)}, str(path))
    data = path.read_bytes()
    path.write_bytes({"truncate": data[: len(data) - 100], "garbage": b"\x07" * 500, "short": data[:5]}[damage])
    with pytest.raises(CorruptCheckpointError, match=str(path.name)):
        list(iter_tensors(path))
