"""The AArch64 NEON kernels on this x86 machine, cross-compiled and run under qemu-user (tests/neon_qemu.py). Every
GEMV / dequantization / elementwise oracle of tests/test_kernels.py also runs on them (its `ks` fixture's "neon"
parameter); here: the library's ABI as AArch64 lays it out, and its choice on an Arm machine."""

from __future__ import annotations

import pytest
from neon_qemu import QemuNeonLib, build_harness, missing_tools

from infertune.kernels import cpu

pytestmark = pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools()))


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return QemuNeonLib(build_harness(tmp_path_factory.mktemp("neon")))  # (-Wall -Wextra -Werror: warning-free)


def test_the_aarch64_struct_layout_matches_the_ctypes_declarations(lib):
    """What cpu.check_abi holds a library to at load, for the NEON build as AArch64 lays out its structs."""
    assert cpu.check_abi(lib) is None


def test_an_arm_machine_picks_the_neon_variant(monkeypatch):
    class Uname:
        machine = "aarch64"

    monkeypatch.setattr(cpu.os, "uname", lambda: Uname())
    monkeypatch.delenv("INFERTUNE_CPU_ISA", raising=False)
    assert cpu._choose() == ("neon",)
    v = cpu.VARIANTS["neon"]
    assert v.machine == "aarch64" and "-ffp-contract=off" in v.cflags and v.required == ("asimd",)
    # and an x86 variant forced there says why it cannot run
    assert "for x86_64, this is aarch64" in cpu._load_variant(cpu.VARIANTS["avx2"])
