"""Backend selection and dtype resolution: automatic choice, forced devices, clear errors."""

from __future__ import annotations

import pytest
import torch

from infertune.backends import CPUBackend, CUDABackend, NPUBackend, get_backend
from infertune.backends.cpu import cpu_supports_bf16
from infertune.config import DeviceConfig


def test_auto_picks_an_available_backend():
    backend = get_backend("auto")
    expected = "cuda" if torch.cuda.is_available() else ("npu" if NPUBackend.is_available() else "cpu")
    assert backend.name == expected
    assert get_backend("cpu").device == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA; the error path needs its absence")
def test_forced_missing_cuda_is_a_clear_error():
    with pytest.raises(RuntimeError, match="cuda.*not available"):
        get_backend("cuda")


def test_forced_missing_npu_is_a_clear_error():
    if NPUBackend.is_available():
        pytest.skip("torch_npu and an NPU are present; the error path needs their absence")
    with pytest.raises(RuntimeError, match="torch_npu"):
        get_backend("npu")


def test_unknown_device_names_the_choices():
    with pytest.raises(ValueError, match="auto, cuda, npu, cpu"):
        get_backend("tpu")
    with pytest.raises(ValueError, match="cuda:1"):
        DeviceConfig("gpu")
    assert DeviceConfig("cuda:1").device == "cuda:1"


def test_cpu_dtype_resolution():
    cpu = CPUBackend()
    assert cpu.resolve_dtype("float32", "bfloat16") is torch.float32
    assert cpu.resolve_dtype("auto", "float32") is torch.float32
    assert cpu.resolve_dtype("auto", "bfloat16") is torch.bfloat16
    # fp16 checkpoints run in the CPU's preferred dtype; asking for fp16 explicitly is refused with a hint.
    assert cpu.resolve_dtype("auto", "float16") is (torch.bfloat16 if cpu_supports_bf16() else torch.float32)
    with pytest.raises(ValueError, match="bfloat16"):
        cpu.resolve_dtype("float16", None)


def test_backends_name_their_distributed_backend():
    assert (CPUBackend.dist_backend, CUDABackend.dist_backend, NPUBackend.dist_backend) == ("gloo", "nccl", "hccl")
