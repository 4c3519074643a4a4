"""The GEMVs' weight prefetch (csrc/bf16.h pf_weights): near and far give the same bits, on every x86 variant, and
the settings (int8 / int4 weights', bf16 weights') are chosen and refused as documented (kernels/cpu.py prefetch_bytes,
prefetch_bf16_bytes)."""

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
    old, old_bf16 = kernels.get_prefetch(lib=got)
    kernels.set_prefetch(0, lib=got)
    yield got
    kernels.set_prefetch(old, bf16_far_bytes=old_bf16, lib=got)


def _both(lib, fn):
    """fn() under near, then under far at two distances (shorter and longer than a block of rows), then with bf16
    weights' setting apart from the int8 / int4 GEMVs' (each way round)."""
    out = []
    for far, far_bf16 in ((0, 0), (kernels.PREFETCH_FAR_BYTES, None), (1 << 16, None), (4096, 0), (0, 8192)):
        kernels.set_prefetch(far, bf16_far_bytes=far_bf16, lib=lib)
        assert kernels.get_prefetch(lib=lib) == (far, far if far_bf16 is None else far_bf16)
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


FAR = kernels.PREFETCH_FAR_BYTES


@pytest.mark.parametrize(
    "env,vendor,family,want,want_bf16",
    [
        (None, "AuthenticAMD", 25, FAR, FAR),  # Zen 4: far for every weight
        (None, "AuthenticAMD", 26, FAR, 0),  # Zen 5: bf16 weights near
        ("auto", "AuthenticAMD", 27, FAR, 0),
        (None, "AuthenticAMD", -1, FAR, FAR),  # (no family in /proc/cpuinfo)
        (None, "GenuineIntel", 6, FAR, FAR),  # measured on a Xeon with AMX too
        ("auto", "", 6, FAR, FAR),
        ("near", "AuthenticAMD", 25, 0, 0),
        ("far", "AuthenticAMD", 26, FAR, FAR),  # an explicit setting is both weights'
        ("far", "GenuineIntel", 6, FAR, FAR),
        ("8192", "AuthenticAMD", 26, 8192, 8192),
        (" FAR ", "", 6, FAR, FAR),
    ],
)
def test_prefetch_choice(monkeypatch, env, vendor, family, want, want_bf16):
    if env is None:
        monkeypatch.delenv("INFERTUNE_PREFETCH", raising=False)
    else:
        monkeypatch.setenv("INFERTUNE_PREFETCH", env)
    monkeypatch.setattr(kernels, "_cpu_vendor", lambda: vendor)
    monkeypatch.setattr(kernels, "_cpu_family", lambda: family)
    assert kernels.prefetch_bytes() == want
    assert kernels.prefetch_bf16_bytes() == want_bf16


def test_the_loaded_library_has_the_chosen_settings():
    if not kernels.available():
        pytest.skip(kernels.describe())
    assert kernels.get_prefetch() == (kernels.prefetch_bytes(), kernels.prefetch_bf16_bytes())
    far, far_bf16 = kernels.get_prefetch()
    assert ("far prefetch" in kernels.describe()) == bool(far or far_bf16)
    assert ("bf16 near" in kernels.describe()) == bool(far and not far_bf16)


@pytest.mark.parametrize("m,n,k", [(1, 64, 64), (1, 1040, 896), (4, 192, 4864), (16, 64, 1024)])
def test_12bit_far_is_near_bit_for_bit(lib, m, n, k):
    if lib is not kernels.library() or not kernels.bf16c_supported(n, k):
        pytest.skip("12-bit weights: the process's AVX-512 library only")
    g = torch.Generator().manual_seed(m * k + n)
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    p = kernels.pack_bf16c(w)
    d = kernels.bf16c_struct(p)
    x = torch.randn(m, k, generator=g).bfloat16()
    near, *fars = _both(lib, lambda: kernels.linear_bf16c(x, d, n))
    ref = x.double() @ w.double().T  # and near is the product, to fp32 sums rounded once to bf16
    assert (
        (near.double() - ref).abs() <= 2.0**-8 * ref.abs() + k * 2.0**-23 * (x.double().abs() @ w.double().abs().T)
    ).all()
    for y in fars:
        assert torch.equal(y.view(torch.int16), near.view(torch.int16))


@pytest.mark.parametrize(
    "env,vendor,want",
    [
        (None, "GenuineIntel", 1),  # measured faster on a Xeon with AMX (model 167)
        (None, "AuthenticAMD", 4),  # the distance tuned first (Zen 4 / 5: not measured again)
        (None, "", 4),
        ("3", "GenuineIntel", 3),
        (" 8 ", "AuthenticAMD", 8),
    ],
)
def test_12bit_prefetch_distance_choice(monkeypatch, env, vendor, want):
    if env is None:
        monkeypatch.delenv("INFERTUNE_PREFETCH_12BIT_TILES", raising=False)
    else:
        monkeypatch.setenv("INFERTUNE_PREFETCH_12BIT_TILES", env)
    monkeypatch.setattr(kernels, "_cpu_vendor", lambda: vendor)
    assert kernels.prefetch_bf16c_tiles() == want


@pytest.mark.parametrize("bad", ["0", "-1", "two", "1.5"])
def test_a_bad_12bit_prefetch_distance_is_refused(monkeypatch, bad):
    monkeypatch.setenv("INFERTUNE_PREFETCH_12BIT_TILES", bad)
    with pytest.raises(ValueError, match="INFERTUNE_PREFETCH_12BIT_TILES=.*whole number"):
        kernels.prefetch_bf16c_tiles()


@pytest.mark.parametrize("m,n,k", [(1, 1040, 896), (4, 192, 4864), (16, 64, 1024), (40, 128, 512)])
def test_12bit_prefetch_distance_changes_no_bit(m, n, k):
    """The codec's prefetch distance (it_set_prefetch_bf16c), near and far: the same bits at 1, 2, 4 and 9 tiles, and
    the loaded library holds the distance chosen for this CPU."""
    if not kernels.available() or kernels.variant() not in ("avx512", "avx512-noamx"):
        pytest.skip(f"12-bit weights: the AVX-512 library only ({kernels.describe()})")
    lib = kernels.library()
    assert lib.it_get_prefetch_bf16c() == kernels.prefetch_bf16c_tiles()
    g = torch.Generator().manual_seed(m + n + k)
    w = (torch.randn(n, k, generator=g) * 0.02).bfloat16()
    p = kernels.pack_bf16c(w)
    d = kernels.bf16c_struct(p)
    x = torch.randn(m, k, generator=g).bfloat16()
    old_tiles, (old, old_bf16) = lib.it_get_prefetch_bf16c(), kernels.get_prefetch()
    outs = []
    try:
        for tiles in (1, 2, 4, 9):
            lib.it_set_prefetch_bf16c(tiles)
            assert lib.it_get_prefetch_bf16c() == tiles
            for far_bf16 in (0, 4096):
                kernels.set_prefetch(old, bf16_far_bytes=far_bf16)
                outs.append(kernels.linear_bf16c(x, d, n))
    finally:
        lib.it_set_prefetch_bf16c(old_tiles)
        kernels.set_prefetch(old, bf16_far_bytes=old_bf16)
    ref = (x.double() @ w.double().T).to(torch.bfloat16)  # (within a rounding: the test above pins the bound)
    assert (outs[0].double() - ref.double()).abs().max() <= 2.0**-6 * ref.double().abs().max()
    for y in outs[1:]:
        assert torch.equal(y.view(torch.int16), outs[0].view(torch.int16))


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
