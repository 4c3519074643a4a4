"""The GEMVs' weight prefetch (csrc/bf16.h pf_weights): near and far give the same bits, on every x86 variant, and
the setting is chosen and refused as documented (kernels/cpu.py prefetch_bytes)."""

from __future__ import annotations

import pytest
import torch

from infertune.kernels import cpu as kernels
from infertune.quant.int4 import quantize_int4_groupwise
from infertune.quant.int8 import quantize_int8_per_channel

# (M, N, K): one row and several; N leaving a partial block of 4 rows; K short (the far distance spans several
# blocks), long (one block is past the distance) and not a multiple of 32 / 64; enough blocks for both threads.
SHAPES = [(1, 37, 100), (1, 130, 896), (3, 64, 4864), (1, 1030, 128), (5, 21, 8200)]
W4_SHAPES = [(1, 37, 128, 64), (1, 130, 896, 128), (3, 64, 4864, 128), (1, 1030, 256, 128), (2, 40, 256, 64)]


@pytest.fixture(params=["avx512", "avx2"])
def lib(request):
    if request.param == "avx512" and kernels.variant() not in ("avx512", "avx512-noamx"):
        pytest.skip(f"the AVX-512 kernels are not this process's: {kernels.describe()}")
    got = kernels.load_variant(request.param) if request.param == "avx2" else kernels.library()
    if isinstance(got, str):
        pytest.skip(got)
    old = kernels.set_prefetch(0, lib=got)
    yield got
    kernels.set_prefetch(old, lib=got)


def _both(lib, fn):
    """fn() under near, then under far at two distances (shorter and longer than a block of rows)."""
    out = []
    for far in (0, kernels.PREFETCH_FAR_BYTES, 1 << 16):
        kernels.set_prefetch(far, lib=lib)
        out.append(fn())
    return out


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bf16_far_is_near_bit_for_bit_and_exact_on_integers(lib, m, n, k):
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    x[:, :64] = torch.randint(-2, 3, (m, min(k, 64)), generator=g).to(torch.bfloat16)
    w = torch.randint(-2, 3, (n, k), generator=g).to(torch.bfloat16)
    ref = (x.long() @ w.long().T).to(torch.bfloat16)  # |y| <= 256: exact in bf16
    for y in _both(lib, lambda: kernels.linear_bf16(x, w, lib=lib)):
        assert torch.equal(y, ref)
    xr = torch.randn(m, k, generator=g).bfloat16()
    wr = torch.randn(n, k, generator=g).bfloat16()
    near, *fars = _both(lib, lambda: kernels.linear_bf16(xr, wr, lib=lib))
    for y in fars:
        assert torch.equal(y.view(torch.int16), near.view(torch.int16))


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w8_far_is_near_bit_for_bit(lib, m, n, k):
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    q, s = quantize_int8_per_channel(torch.randn(n, k, generator=g))
    near, *fars = _both(lib, lambda: kernels.linear_w8(x, q, s, lib=lib))
    # and near itself is the exact-integer product to within the documented W8A16 bound (test_kernels.py)
    w = q.double() * s.double().unsqueeze(1)
    ref = x.double() @ w.T
    sx = x.double().abs().amax(dim=1, keepdim=True) / 32512
    bound = (
        (s.double() * q.double().abs().sum(1)) * sx / 2
        + 2.0**-8 * ref.abs()
        + (k * 2.0**-23 + 2.0**-8) * (x.double().abs() @ w.abs().T)
    )
    assert ((near.double() - ref).abs() <= bound * 1.01 + 1e-6).all()
    for y in fars:
        assert torch.equal(y.view(torch.int16), near.view(torch.int16))


@pytest.mark.parametrize("m,n,k,gs", W4_SHAPES)
def test_w4_far_is_near_bit_for_bit(lib, m, n, k, gs):
    g = torch.Generator().manual_seed(m + n * k)
    q, s, z = quantize_int4_groupwise(torch.randn(n, k, generator=g), gs)
    packed = kernels.pack_w4(q)
    x = torch.randn(m, k, generator=g).bfloat16()
    near, *fars = _both(lib, lambda: kernels.linear_w4(x, packed, s, z, gs, lib=lib))
    for y in fars:
        assert torch.equal(y.view(torch.int16), near.view(torch.int16))


def test_set_prefetch_returns_the_old_setting(lib):
    assert kernels.set_prefetch(12345, lib=lib) == 0
    assert kernels.set_prefetch(-7, lib=lib) == 12345  # a negative distance is near
    assert kernels.set_prefetch(0, lib=lib) == 0


@pytest.mark.parametrize(
    "env,vendor,want",
    [
        (None, "AuthenticAMD", kernels.PREFETCH_FAR_BYTES),
        (None, "GenuineIntel", 0),
        ("auto", "", 0),
        ("near", "AuthenticAMD", 0),
        ("far", "GenuineIntel", kernels.PREFETCH_FAR_BYTES),
        ("8192", "GenuineIntel", 8192),
        (" FAR ", "", kernels.PREFETCH_FAR_BYTES),
    ],
)
def test_prefetch_choice(monkeypatch, env, vendor, want):
    if env is None:
        monkeypatch.delenv("INFERTUNE_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("INFERTUNE_PREFETCH", env)
    monkeypatch.setattr(kernels, "_cpu_vendor", lambda: vendor)
    assert kernels.prefetch_bytes() == want


def test_a_bad_prefetch_setting_turns_the_kernels_off_with_the_reason(monkeypatch):
    monkeypatch.setenv("INFERTUNE_PREFETCH", "sideways")
    with pytest.raises(ValueError, match="INFERTUNE_PREFETCH='sideways'.*near, far"):
        kernels.prefetch_bytes()
    v = kernels.VARIANTS["avx2"]
    if v.machine != __import__("os").uname().machine or kernels._compiler() is None:
        pytest.skip("no x86 compiler here to build a variant")
    if any(f not in kernels._cpu_flags() for f in v.required):
        pytest.skip("this CPU cannot run the AVX2 variant")
    reason = kernels._load_variant(v)
    assert isinstance(reason, str) and "INFERTUNE_PREFETCH='sideways'" in reason
