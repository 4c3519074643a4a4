"""infertune's CPU decode kernels (infertune/kernels) against exact arithmetic and float64 references, and the
engine with them against the engine with torch's matmuls and against HF transformers."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from infertune.kernels import cpu as kernels
from infertune.kernels import x86
from infertune.layers.linear import DecodeKernelMethod, Linear
from infertune.quant.int8 import W8A16Method, quantize_int8_per_channel

needs_kernels = pytest.mark.skipif(not kernels.available(), reason=f"CPU kernels: {kernels.unavailable_reason()}")
# The AVX-512 library's own paths (the VDPBF16PS GEMM called directly): where the process runs the AVX2 variant (an
# AVX2-only CPU, or INFERTUNE_CPU_ISA=avx2) those tests skip.
needs_avx512 = pytest.mark.skipif(
    kernels.variant() not in ("avx512", "avx512-noamx"),
    reason=f"the AVX-512 kernels do not run here: {kernels.describe()}",
)
# The fused step: the AVX-512 library's, or the AVX2 one's (csrc/fused_step.h over csrc/x86/avx2/fused.c); the engine
# tests below run it on whichever variant the process loaded (.ci/run forces each).
needs_fused = pytest.mark.skipif(
    kernels.variant() not in ("avx512", "avx512-noamx", "avx2"),
    reason=f"no x86 fused step here: {kernels.describe()}",
)

# (M rows, N outputs, K inputs): one row (the AVX-512 path), several rows (AMX where the CPU has it), output
# counts that leave a partial 16- / 64-feature tile, K not a multiple of 32 (masked tails), K past the int8
# kernel's 4096-column flush.
SHAPES = [
    (1, 7, 45),
    (1, 64, 896),
    (2, 20, 64),
    (3, 130, 96),
    (5, 9, 100),
    (16, 80, 256),
    (16, 64, 4864),
    (17, 48, 128),
    (1, 33, 8200),
    # past 16 rows the 2 x 2 blocked AMX GEMM: an odd count of row tiles, a lone 16-feature tile, a feature
    # tail past the last 16, two blocks of rows (K = 64: 256 rows a block; K = 4864: 64)
    (33, 50, 128),
    (100, 96, 256),
    (300, 72, 64),
    (70, 40, 4864),
    # K so long that a block of 32 rows exceeds the L2 share (the scratch must still hold it)
    (40, 20, 16384),
]


# The kernel variants every GEMV / dequantization / elementwise oracle below runs on, each forced on where this CPU
# can run it: the AVX-512 library (AMX where present), the AVX2 + FMA one (built with -mavx2 -mfma -mf16c only), and
# the AArch64 NEON one, cross-compiled and run under qemu-user (tests/neon_qemu.py) where those tools are installed.
@pytest.fixture(scope="session")
def neon_harness(tmp_path_factory):
    from neon_qemu import build_harness, missing_tools

    why = missing_tools()
    if why:
        pytest.skip(why)
    return build_harness(tmp_path_factory.mktemp("neon"))


@pytest.fixture(params=["avx512", "avx2", "neon"])
def ks(request):
    if request.param == "neon":
        from neon_qemu import QemuNeonLib

        from infertune.kernels.arm import NeonKernels

        return NeonKernels(QemuNeonLib(request.getfixturevalue("neon_harness")))
    if request.param == "avx512":
        if kernels.variant() not in ("avx512", "avx512-noamx"):
            pytest.skip(f"the AVX-512 kernels are not this process's: {kernels.describe()}")
        return x86.kernels()
    lib = kernels.load_variant("avx2")
    if isinstance(lib, str):
        pytest.skip(lib)
    return x86.Avx2Kernels(lib)


def _bf16_ints(*shape, lo=-2, hi=2, gen=None):
    return torch.randint(lo, hi + 1, shape, generator=gen).to(torch.bfloat16)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bf16_exact_on_small_integers(ks, m, n, k):
    """Integer inputs whose sums stay within bf16's exact integers (|y| <= 256): the kernel must be exact."""
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    k_eff = min(k, 64)  # at most 64 nonzero columns of |x w| <= 4, so |y| <= 256
    x = torch.zeros(m, k, dtype=torch.bfloat16)
    x[:, :k_eff] = _bf16_ints(m, k_eff, gen=g)
    w = _bf16_ints(n, k, gen=g)
    bias = _bf16_ints(n, lo=-8, hi=8, gen=g)
    ref = x.long() @ w.long().T + bias.long()
    assert ref.abs().max() <= 256
    assert torch.equal(ks.linear_bf16(x, w, bias).long(), ref)


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_bf16_matches_float64(ks, m, n, k):
    g = torch.Generator().manual_seed(k)
    x = torch.randn(m, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    ref = x.double() @ w.double().T
    y = ks.linear_bf16(x, w).double()
    # bf16 products are exact in fp32; fp32 sums add at most k * 2^-24 of sum |x w|; rounding to bf16 (8
    # significant bits) moves the result by at most its unit roundoff, 2^-8 relative.
    bound = 2.0**-8 * ref.abs() + k * 2.0**-23 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((y - ref).abs() <= bound * 1.01).all(), float(((y - ref).abs() / bound).max())


def test_bf16_strided_rows_and_leading_dims(ks):
    """x may be a view with a row stride > K and extra leading dims (as the packed qkv slices are)."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(2, 3, 200, generator=g).bfloat16()
    x = big[..., 8:136]  # [2, 3, 128], row stride 200
    w = torch.randn(40, 128, generator=g).bfloat16()
    y = ks.linear_bf16(x, w)
    assert y.shape == (2, 3, 40)
    torch.testing.assert_close(y.float(), (x.double() @ w.double().T).float(), rtol=2**-7, atol=1e-3)


# The VDPBF16PS GEMM of the AVX-512 library without AMX (csrc/x86/avx512/gemm_dpbf16.c), called directly (so it runs
# on AMX machines too): row counts that leave each micro-kernel tail (6 rows a pass: 4, 7, 13), more rows than one
# pass over a packed slab (GEMM_MB, 512: 530; and past the 128 it was: 129, 300), feature counts that leave a
# partial 16- / 64-feature block, K past one
# 256-column slab with a partial last slab (600, 2050) and K not a multiple of 32 (100).
NOAMX_GEMM_SHAPES = [
    (4, 64, 64),
    (7, 50, 100),
    (13, 130, 600),
    (16, 1152, 896),
    (64, 17, 2050),
    (129, 80, 96),
    (300, 200, 256),
    (530, 80, 600),
]


@needs_avx512
@pytest.mark.parametrize("m,n,k", NOAMX_GEMM_SHAPES)
def test_noamx_gemm_exact_on_integers_and_within_the_float64_bound(m, n, k):
    g = torch.Generator().manual_seed(m * 7 + n + k)
    k_eff = min(k, 64)
    xi = torch.zeros(m, k, dtype=torch.bfloat16)
    xi[:, :k_eff] = _bf16_ints(m, k_eff, gen=g)
    wi, bias = _bf16_ints(n, k, gen=g), _bf16_ints(n, lo=-8, hi=8, gen=g)
    ref = xi.long() @ wi.long().T + bias.long()
    assert torch.equal(kernels.linear_bf16_path(xi, wi, bias, path="gemm").long(), ref)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    ref = x.double() @ w.double().T
    y = kernels.linear_bf16_path(x, w, path="gemm").double()
    bound = 2.0**-8 * ref.abs() + k * 2.0**-23 * (x.double().abs() @ w.double().abs().T) + 1e-30
    assert ((y - ref).abs() <= bound * 1.01).all(), float(((y - ref).abs() / bound).max())


@needs_avx512
def test_noamx_gemm_keeps_nans_and_strided_rows():
    """A NaN in a row of x makes that row's outputs NaN, as torch's (the rounding keeps NaN a NaN), and only that row;
    x may be a strided view, as the packed qkv slices are."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(9, 300, generator=g).bfloat16()
    x = big[:, 10:266]  # [9, 256], row stride 300
    x[4, 17] = float("nan")
    w = torch.randn(70, 256, generator=g).bfloat16()
    y = kernels.linear_bf16_path(x, w, path="gemm")
    assert y[4].isnan().all() and not y[torch.arange(9) != 4].isnan().any()
    ok = torch.arange(9) != 4
    torch.testing.assert_close(y[ok].double(), x[ok].double() @ w.double().T, rtol=2**-7, atol=1e-3)


@needs_avx512
@pytest.mark.skipif(kernels.amx(), reason="with AMX the tiles take every row count from 2 (the GEMM is not used)")
def test_linear_bf16_without_amx_takes_the_gemv_then_the_gemm():
    """Without AMX, it_linear_bf16 runs the GEMV below it_gemm_rows_noamx() rows and the GEMM from there (bit for bit
    the one or the other, short and long K alike), and the GEMV wherever K is odd; the engine sends bf16 linears of up
    to bf16_max_rows() rows (NOAMX_GEMM_MAX_ROWS) to it."""
    lib = kernels.library()
    start = lib.it_gemm_rows_noamx(0)
    assert 16 < start <= kernels.NOAMX_GEMM_MAX_ROWS and kernels.bf16_max_rows() == kernels.NOAMX_GEMM_MAX_ROWS
    g = torch.Generator().manual_seed(4)
    for k in (640, 2560):
        w = torch.randn(32, k, generator=g).bfloat16()
        w[:, 0] = w[:, -1] = 1
        for m in (16, start - 1, start, start + 7):
            # (+-2^20 in the first and the last column: the sums of the other products are rounded to that size on
            # the way, differently in the two summation orders, so the two paths' results differ in most places)
            x = torch.randn(m, k, generator=g).bfloat16()
            x[:, 0], x[:, -1] = 2.0**20, -(2.0**20)
            want = kernels.linear_bf16_path(x, w, path="gemm" if m >= start else "gemv").view(torch.int16)
            other = kernels.linear_bf16_path(x, w, path="gemv" if m >= start else "gemm").view(torch.int16)
            assert torch.equal(kernels.linear_bf16(x, w).view(torch.int16), want), (m, k)
            assert not torch.equal(want, other)  # (the two sum in different orders: the check tells them apart)
    x = torch.randn(40, 641, generator=g).bfloat16()
    w = torch.randn(96, 641, generator=g).bfloat16()
    assert torch.equal(kernels.linear_bf16(x, w), kernels.linear_bf16_path(x, w, path="gemv"))
    with pytest.raises(ValueError, match="even K"):
        kernels.linear_bf16_path(x, w, path="gemm")


# The FMA GEMM of the AVX2 library (csrc/x86/avx2/gemm.c), called directly on the AVX2 library (built with -mavx2
# -mfma -mf16c only; forced on where this CPU has AVX2): row counts that leave each micro-kernel tail (6 rows a pass:
# 1, 4, 7, 13) and more than one pass over a slab (132 rows: 133, 300), feature counts that leave a partial 8- / 16- /
# 64-feature block, K past one 256-column slab with a partial last one (600, 2050) and K not a multiple of 8 (5, 100).
FMA_GEMM_SHAPES = [
    (1, 64, 64),
    (4, 17, 5),
    (7, 50, 100),
    (13, 130, 600),
    (16, 1152, 896),
    (133, 70, 2050),
    (300, 9, 256),
]


@pytest.fixture(scope="module")
def avx2_lib():
    lib = kernels.load_variant("avx2")
    if isinstance(lib, str):
        pytest.skip(lib)
    return lib


def _sequential_fp32(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ bias) as one fp32 sum over k in order per output (each bf16 product exact in fp32), + bias in fp32,
    rounded once to bf16: what the FMA GEMM computes, bit for bit."""
    acc = torch.zeros(x.shape[0], w.shape[0], dtype=torch.float32)
    xf, wf = x.float(), w.float()
    for k in range(x.shape[1]):
        acc = acc + xf[:, k : k + 1] * wf[:, k][None, :]
    return (acc + bias.float() if bias is not None else acc).bfloat16()


@pytest.mark.parametrize("m,n,k", FMA_GEMM_SHAPES)
def test_avx2_gemm_is_the_sequential_fp32_sum(avx2_lib, m, n, k):
    """Bit for bit the fp32 sum of the exact products over k in order (+ bias, one rounding), which holds it within
    the float64 bound of test_bf16_matches_float64 too; exact on small integers."""
    g = torch.Generator().manual_seed(m * 13 + n + k)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    y = kernels.linear_bf16_path(x, w, bias, path="gemm", lib=avx2_lib)
    assert torch.equal(y.view(torch.int16), _sequential_fp32(x, w, bias).view(torch.int16))
    k_eff = min(k, 64)
    xi = torch.zeros(m, k, dtype=torch.bfloat16)
    xi[:, :k_eff] = _bf16_ints(m, k_eff, gen=g)
    wi, bi = _bf16_ints(n, k, gen=g), _bf16_ints(n, lo=-8, hi=8, gen=g)
    ref = xi.long() @ wi.long().T + bi.long()
    assert torch.equal(kernels.linear_bf16_path(xi, wi, bi, path="gemm", lib=avx2_lib).long(), ref)


def test_avx2_gemm_keeps_nans_and_strided_rows(avx2_lib):
    """A NaN in a row of x makes that row's outputs NaN (the rounding keeps NaN a NaN), and only that row's; x may be
    a strided view, as the packed qkv slices are."""
    g = torch.Generator().manual_seed(3)
    big = torch.randn(9, 300, generator=g).bfloat16()
    x = big[:, 10:266]  # [9, 256], row stride 300
    x[4, 17] = float("nan")
    w = torch.randn(70, 256, generator=g).bfloat16()
    y = kernels.linear_bf16_path(x, w, path="gemm", lib=avx2_lib)
    ok = torch.arange(9) != 4
    assert y[4].isnan().all() and not y[ok].isnan().any()
    assert torch.equal(y[ok], _sequential_fp32(x[ok], w, None))


@pytest.mark.parametrize("m,n,k", [(1, 7, 45), (2, 20, 64), (3, 130, 96), (5, 9, 100), (16, 80, 4864), (13, 33, 8200)])
def test_avx2_gemv_on_widened_x_is_the_gemv_bit_for_bit(avx2_lib, m, n, k):
    """The GEMV on x widened once (linear_bf16_gemvx) adds the same products in the same order per lane as the GEMV
    (the unpack order, lanes summed at the end, the columns past the last 16 in order): bit for bit, with bias; row
    and feature counts off its 4 x 2 blocks, K off its 16-column groups."""
    g = torch.Generator().manual_seed(m + n + k)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    got = kernels.linear_bf16_path(x, w, bias, path="gemvx", lib=avx2_lib)
    assert torch.equal(
        got.view(torch.int16), kernels.linear_bf16_path(x, w, bias, path="gemv", lib=avx2_lib).view(torch.int16)
    )


def test_avx2_linear_bf16_takes_the_gemv_then_the_gemm(avx2_lib):
    """it_linear_bf16 on AVX2 runs the GEMV below it_gemm_rows_fma() rows (on x widened once from it_gemvx_rows():
    the same bits) and the FMA GEMM from there (bit for bit the one or the other), and Avx2Kernels sends bf16 linears
    of every step size up to AVX2_GEMM_MAX_ROWS to it."""
    start = avx2_lib.it_gemm_rows_fma(0)
    assert 1 < avx2_lib.it_gemvx_rows(0) <= start <= 4 * kernels.MAX_ROWS
    assert x86.Avx2Kernels(avx2_lib).max_rows("bf16") == kernels.AVX2_GEMM_MAX_ROWS >= 2048
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 640, generator=g).bfloat16()
    w[:, 0] = w[:, -1] = 1
    for m in (1, start - 1, start, 3 * start + 1):
        # (+-2^20 in the first and the last column: the sums of the other products round on the way at that size,
        # differently in the GEMV's and the GEMM's orders, so the two paths differ in most places)
        x = torch.randn(m, 640, generator=g).bfloat16()
        x[:, 0], x[:, -1] = 2.0**20, -(2.0**20)
        paths = {p: kernels.linear_bf16_path(x, w, path=p, lib=avx2_lib).view(torch.int16) for p in ("gemv", "gemm")}
        want = "gemm" if m >= start else "gemv"
        assert torch.equal(kernels.linear_bf16(x, w, lib=avx2_lib).view(torch.int16), paths[want]), m
        assert not torch.equal(paths["gemv"], paths["gemm"])


@pytest.mark.parametrize("m,n,k", SHAPES)
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_w8_within_its_error_bound(ks, m, n, k, scale_dtype):
    """y = (x . q) s: at one row x is rounded to int16 per row, |x - x_q s_x| <= s_x / 2 with s_x = max|x| / 32512,
    so |y - y_exact| <= s * sum|q| * s_x / 2; at 2-16 rows on AMX (without AMX from it_q_dq_rows(1) rows) the
    weights are rounded to bf16 instead (as a prefill's), at most 2^-8 of sum |x w|. Plus the bf16 rounding of y and
    fp32 sums."""
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(m, k, generator=g).bfloat16()
    q, s = quantize_int8_per_channel(torch.randn(n, k, generator=g))
    s = s.to(scale_dtype)
    bias = torch.randn(n, generator=g).bfloat16()
    w = q.double() * s.double().unsqueeze(1)
    ref = x.double() @ w.T + bias.double()
    sx = x.double().abs().amax(dim=1, keepdim=True) / 32512
    xw = x.double().abs() @ w.abs().T
    bound = (s.double() * q.double().abs().sum(1)) * sx / 2 + 2.0**-8 * ref.abs() + (k * 2.0**-23 + 2.0**-8) * xw
    y = ks.linear_w8(x, q, s, bias).double()
    assert ((y - ref).abs() <= bound * 1.01 + 1e-6).all(), float(((y - ref).abs() - bound).max())


def test_w8_exact_when_activations_are_representable(ks):
    """x = +-max or 0 quantizes exactly (to +-32512) and the int32 sums stay below 2^24, so y = (sum q x) s is
    computed to within fp32 rounding of a value bf16 holds exactly (|sum| <= 192 times powers of two)."""
    g = torch.Generator().manual_seed(3)
    x = (torch.randint(-1, 2, (4, 64), generator=g) * 0.5).bfloat16()
    x[:, 0] = 0.5  # max|x| = 0.5 in every row
    q = torch.randint(-3, 4, (24, 64), generator=g, dtype=torch.int8)
    s = torch.full((24,), 2.0**-6)
    ref = (x.double() @ q.double().T) * 2.0**-6
    assert torch.equal(ref.to(torch.bfloat16).double(), ref)  # representable
    assert torch.equal(ks.linear_w8(x, q, s).double(), ref)


@pytest.mark.parametrize(
    "m,n,k,gs",
    [
        *[(1, 8, 128, 64), (3, 20, 256, 128), (16, 64, 896, 128), (5, 9, 4864, 128), (17, 33, 64, 64)],
        (130, 21, 4864, 128),
        # one row with groups of 128 or more: the AVX-512 library's nibbles-as-bytes GEMV (gemv_quant.c w4b_block)
        *[(1, 37, 896, 128), (1, 5, 4864, 128), (1, 130, 1024, 256), (1, 4, 128, 128)],
    ],
)
def test_w4_within_its_error_bound(ks, m, n, k, gs):
    """y = sum_g (x_g . q_g) s_g + (sum x_g) z_g: the int16 rounding of x moves it by at most
    sum_k |q_k s_g| s_x / 2 (at 2-16 rows on AMX, and without AMX from it_q_dq_rows(2) rows, the weights are rounded
    to bf16 instead: 2^-8 of sum |x w|);
    the rest is bf16 output rounding and fp32 sums. Also: the nibble layout round-trips."""
    from infertune.quant.int4 import dequantize_int4, quantize_int4_groupwise

    g = torch.Generator().manual_seed(m + n + k)
    q, s, z = quantize_int4_groupwise(torch.randn(n, k, generator=g), gs)
    packed = ks.pack_w4(q)
    assert packed.shape == (n, k // 2) and torch.equal(ks.unpack_w4(packed).int(), q)
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    w = dequantize_int4(q, s, z, gs).double()
    ref = x.double() @ w.T + bias.double()
    sx = x.double().abs().amax(dim=1, keepdim=True) / 32512
    qs = (q.double().view(n, -1, gs) * s.double().unsqueeze(-1)).view(n, k).abs().sum(1)
    bound = qs * sx / 2 + 2.0**-8 * ref.abs() + (k * 2.0**-23 + 2.0**-8) * (x.double().abs() @ w.abs().T)
    y = ks.linear_w4(x, packed, s.contiguous(), z.contiguous(), gs, bias).double()
    assert ((y - ref).abs() <= bound * 1.01 + 1e-6).all(), float(((y - ref).abs() - bound).max())


@pytest.mark.parametrize(
    "m,n,k,gs", [(4, 8, 256, 64), (12, 37, 896, 128), (16, 21, 4864, 128), (17, 9, 1024, 256), (24, 6, 512, 128)]
)
def test_avx2_w4_rows_give_each_rows_own_bits(m, n, k, gs):
    """The AVX2 library's W4A16 from 12 rows widens each block's nibbles once for all passes of rows
    (gemv.c w4_block2 with wide = 1; below, once a pass): every row's int32 lanes sum the same columns per group as the
    one-row kernel's, so a row's output must be its bits when it is multiplied alone (partial last blocks, an odd
    last row, groups of 64 to 256). A wrong column order in the widened block or a lost row changes them."""
    from infertune.quant.int4 import quantize_int4_groupwise

    lib = kernels.load_variant("avx2")
    if isinstance(lib, str):
        pytest.skip(lib)
    ks = x86.Avx2Kernels(lib)
    g = torch.Generator().manual_seed(m * n + k)
    q, s, z = quantize_int4_groupwise(torch.randn(n, k, generator=g), gs)
    packed, s, z = ks.pack_w4(q), s.contiguous(), z.contiguous()
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    together = ks.linear_w4(x, packed, s, z, gs, bias)
    alone = torch.cat([ks.linear_w4(x[i : i + 1], packed, s, z, gs, bias) for i in range(m)])
    assert torch.equal(together.view(torch.int16), alone.view(torch.int16))


@needs_avx512
@pytest.mark.skipif(kernels.amx(), reason="with AMX, 2-16 rows of quantized weights take the tiles")
def test_quantized_rows_without_amx_are_the_bf16_gemv_on_the_dequantized_weight():
    """Without AMX, W8A16 from it_q_dq_rows(1) rows and W4A16 from it_q_dq_rows(2) rows up to 16 rebuild each block of
    weight rows in bf16 (VCVTNE2PS2BF16 where no product can be denormal, the exact rounding elsewhere) and run the
    bf16 GEMV on them: bit for bit the GEMV on dequant_w8 / dequant_w4's weight (the PyTorch reference's), with a
    partial last block, K past the last full 32 (W8A16), bias; rows whose scales would make denormal products (there
    the fast rounding would flush what the reference rounds up to FLT_MIN) or that are zero, and W4A16 groups with
    tiny offsets or scales, take the exact rounding. Below the threshold the
    int16-activation kernels run (their results differ)."""
    from infertune.quant.int4 import quantize_int4_groupwise

    lib = kernels.library()
    w8_from, w4_from = lib.it_q_dq_rows(1, 0), lib.it_q_dq_rows(2, 0)
    assert 1 < w8_from <= 16 and 1 < w4_from <= 16
    g = torch.Generator().manual_seed(11)
    n, k8, k4 = 42, 200, 384
    q8, s8 = quantize_int8_per_channel(torch.randn(n, k8, generator=g))
    # row 3: +-16 times the denormal scale 2^-130 - 2^-149, products 2^-126 - 2^-145 (denormal) that the reference
    # rounds up to 2^-126 in bf16 (so they count: VDPBF16PS ignores only denormal operands) and VCVTNE2PS2BF16 would
    # flush to zero; row 7 a zero scale; row 9 the least normal one
    s8[3], s8[7], s8[9] = (2**19 - 1) * 2.0**-149, 0.0, -(2.0**-126)
    q8[3] = torch.where(torch.rand(k8, generator=g) < 0.5, 16, -16).to(torch.int8)
    qq, s4, z4 = quantize_int4_groupwise(torch.randn(n, k4, generator=g), 128)
    # row 6: 15 x (2^-126 / 15, rounded down), a denormal that bf16 rounds up to 2^-126, which VCVTNE2PS2BF16 would
    # flush (so the row's outputs would be zero); row 5: a group with a tiny offset
    z4[5, 1], qq[6], s4[6], z4[6] = 2.0**-110, 15, 559240 * 2.0**-149, 0.0
    packed = kernels.pack_w4(qq)
    w8 = kernels.dequant_w8(q8, s8)
    w4 = kernels.dequant_w4(packed, s4.contiguous(), z4.contiguous(), 128)
    assert (w8[3].abs() == 2.0**-126).all()
    bias = torch.randn(n, generator=g).bfloat16()
    bias[3] = bias[6] = 0  # (rows 3 and 6 sum denormal weights only: their outputs show a flush, a bias would hide it)
    for m in sorted({1, w8_from - 1, w8_from, w4_from - 1, w4_from, 16}):
        x8, x4 = (torch.randn(m, kk, generator=g).bfloat16() for kk in (k8, k4))
        got8, got4 = kernels.linear_w8(x8, q8, s8, bias), kernels.linear_w4(x4, packed, s4, z4, 128, bias)
        want8 = kernels.linear_bf16_path(x8, w8, bias, path="gemv")
        want4 = kernels.linear_bf16_path(x4, w4, bias, path="gemv")
        assert (want8[:, 3] != 0).all() and (want4[:, 6] != 0).all()
        assert torch.equal(got8.view(torch.int16), want8.view(torch.int16)) == (m >= w8_from), m
        assert torch.equal(got4.view(torch.int16), want4.view(torch.int16)) == (m >= w4_from), m


@needs_avx512
@pytest.mark.skipif(not kernels.amx(), reason="AMX's prompt path (without AMX: the test below)")
def test_quantized_prompts_with_amx_are_the_tile_gemm_on_the_dequantized_weight():
    """With AMX, W8A16 / W4A16 from 17 rows to kernels.quant_max_rows() (128) multiply on the tiles a 32-feature
    chunk rebuilt in bf16 at a time (quant_amx.c linear_q_amx_gemm), never the whole layer: bit for bit linear_bf16
    (the 2 x 2 tile GEMM) on dequant_w8 / dequant_w4's weight; at 2-16 rows (linear_q_amx: a chunk's 64 rows rebuilt
    at a time) linear_bf16's row tiles on it, W4A16 from it_w4_amx_rows() (5) rows: below, its int16 kernel
    (w4_block: other bits, held to its error bound by test_w4_within_its_error_bound; here forced to the tiles at
    2 rows). Features past a multiple of 16 (N % 16: linear_bf16's
    GEMV on their rebuilt rows), 300 rows (blocks of 128 rows at K = 4864, of 256 at 640 and 256, each rebuilding
    the weight: the fused step's W4A16 prompts of any size), int4 groups of 64 / 128, rows whose scales give denormal
    weights, and a bias. (The per-module path dequantizes a layer once for torch's GEMM past 128 rows.)"""
    from infertune.quant.int4 import quantize_int4_groupwise

    assert kernels.quant_max_rows() == kernels.AMX_GEMM_MAX_ROWS
    lib = kernels.library()
    w4_amx_rows = lib.it_w4_amx_rows(0)
    assert 2 < w4_amx_rows <= 16
    g = torch.Generator().manual_seed(13)
    for n, k, gs in ((70, 640, 64), (136, 4864, 128), (16, 256, 64)):
        q8, s8 = quantize_int8_per_channel(torch.randn(n, k, generator=g))
        s8[3] = (2**19 - 1) * 2.0**-149  # denormal products
        q8[3] = torch.where(torch.rand(k, generator=g) < 0.5, 16, -16).to(torch.int8)
        w8 = kernels.dequant_w8(q8, s8)
        qq, s4, z4 = quantize_int4_groupwise(torch.randn(n, k, generator=g), gs)
        qq[6], s4[6], z4[6] = 15, 559240 * 2.0**-149, 0.0  # a denormal that bf16 rounds up to 2^-126
        packed, s4, z4 = kernels.pack_w4(qq), s4.contiguous(), z4.contiguous()
        w4 = kernels.dequant_w4(packed, s4, z4, gs)
        bias = torch.randn(n, generator=g).bfloat16()
        bias[3] = bias[6] = 0  # (so the tiny rows' sums show, not the bias)
        for m in (2, w4_amx_rows, 9, 16, 17, 45, 128, 300):
            x = torch.randn(m, k, generator=g).bfloat16()
            want8, want4 = kernels.linear_bf16(x, w8, bias), kernels.linear_bf16(x, w4, bias)
            assert (want8[:, 3] != 0).float().mean() > 0.5 and (want4[:, 6] != 0).float().mean() > 0.5
            # (at 2-16 rows the tiles take the first N - N % 16 features, the int16 kernel the rest)
            cols = slice(None) if m > 16 else slice(0, n // 16 * 16)
            got8 = kernels.linear_w8(x, q8, s8, bias)
            assert torch.equal(got8[:, cols].view(torch.int16), want8[:, cols].view(torch.int16)), m
            if m < w4_amx_rows:  # the int16 kernel by default; the tiles where forced from m rows
                lib.it_w4_amx_rows(m)
                try:
                    got4 = kernels.linear_w4(x, packed, s4, z4, gs, bias)
                finally:
                    lib.it_w4_amx_rows(w4_amx_rows)
                int16 = kernels.linear_w4(x, packed, s4, z4, gs, bias)  # (test_w4_within_its_error_bound holds it)
                assert not torch.equal(int16[:, cols].view(torch.int16), want4[:, cols].view(torch.int16)), (n, k, m)
            else:
                got4 = kernels.linear_w4(x, packed, s4, z4, gs, bias)
            assert torch.equal(got4[:, cols].view(torch.int16), want4[:, cols].view(torch.int16)), (n, k, m)


@needs_avx512
@pytest.mark.skipif(kernels.amx(), reason="with AMX, quantized prompts take the tile GEMM (the test above)")
def test_quantized_prompts_without_amx_are_the_bf16_gemm_on_the_dequantized_weight():
    """Without AMX, W8A16 / W4A16 past 16 rows multiply weights rebuilt in bf16 a block (below the GEMM's crossover,
    it_gemm_rows_noamx) or a 64 x 512 slab (from it) at a time, never the whole layer: bit for bit the bf16 GEMV /
    VDPBF16PS GEMM on dequant_w8 / dequant_w4's weight. With a partial last feature block (N % 64), a partial last
    slab (K % 512), int4 groups of 64 / 128 / 256, rows whose scales give denormal weights (the exact rounding) and a
    bias. Int4 groups that do not divide a slab (192) take the GEMV on rebuilt blocks at every row count."""
    from infertune.quant.int4 import quantize_int4_groupwise

    lib = kernels.library()
    gemm_from = lib.it_gemm_rows_noamx(0)
    assert 16 < gemm_from <= 128
    g = torch.Generator().manual_seed(12)
    n, k8 = 70, 1000
    q8, s8 = quantize_int8_per_channel(torch.randn(n, k8, generator=g))
    s8[3], s8[7] = (2**19 - 1) * 2.0**-149, 0.0  # denormal products; a zero row
    q8[3] = torch.where(torch.rand(k8, generator=g) < 0.5, 16, -16).to(torch.int8)
    w8 = kernels.dequant_w8(q8, s8)
    assert (w8[3].abs() == 2.0**-126).all()
    int4 = {}
    for gs, k4 in ((64, 576), (128, 640), (256, 1536), (192, 1152)):
        qq, s4, z4 = quantize_int4_groupwise(torch.randn(n, k4, generator=g), gs)
        qq[6], s4[6], z4[6] = 15, 559240 * 2.0**-149, 0.0  # a denormal that bf16 rounds up to 2^-126
        z4[5, 1] = 2.0**-110
        packed, s4, z4 = kernels.pack_w4(qq), s4.contiguous(), z4.contiguous()
        int4[gs] = (packed, s4, z4, kernels.dequant_w4(packed, s4, z4, gs), k4)
    bias = torch.randn(n, generator=g).bfloat16()
    bias[3] = bias[6] = 0
    for m in (17, gemm_from - 1, gemm_from, 130, 301):
        path = "gemm" if m >= gemm_from else "gemv"
        x8 = torch.randn(m, k8, generator=g).bfloat16()
        want8 = kernels.linear_bf16_path(x8, w8, bias, path=path)
        assert (want8[:, 3] != 0).float().mean() > 0.5  # (sums under 2^-126 flush to zero)
        if path == "gemm":  # (the two paths sum in different orders: the test tells them apart)
            assert not torch.equal(want8, kernels.linear_bf16_path(x8, w8, bias, path="gemv"))
        assert torch.equal(kernels.linear_w8(x8, q8, s8, bias).view(torch.int16), want8.view(torch.int16)), m
        for gs, (packed, s4, z4, w4, k4) in int4.items():
            x4 = torch.randn(m, k4, generator=g).bfloat16()
            want4 = kernels.linear_bf16_path(x4, w4, bias, path=path if gs != 192 else "gemv")
            got4 = kernels.linear_w4(x4, packed, s4, z4, gs, bias)
            assert (want4[:, 6] != 0).float().mean() > 0.5
            assert torch.equal(got4.view(torch.int16), want4.view(torch.int16)), (m, gs)


def test_w8a8_is_exact_integer_arithmetic_then_the_reference_rounding(ks):
    """linear_w8a8 (AVX-512: VPDPBUSD, AVX2: VPMADDUBSW, on the weight packed by pack_w8a8, every row count) against
    exact integer arithmetic: x
    rounded to int8 per row as quantize_int8_per_token does (or by a static scale, values past it saturating), the
    int8 products summed in int64, then bf16(float(sum) * s_x * s_w) and a bias added to that: bit for bit, and equal
    to W8A8Method's torch._int_mm path. Partial feature blocks (N % 64), K not a multiple of 64 and longer than a slab
    (1024), row counts that leave every remainder of the 6-row micro-kernel and cross the 128-row blocks, a row of
    tiny values (the 1e-12 floor of s_x), rows of outliers, sums past 2^24 (their rounding to fp32)."""
    from infertune.quant.int8 import W8A8Method, quantize_int8_per_token

    if not kernels.w8a8_supported(ks.lib):
        pytest.skip(f"{ks.name}: no int8 x int8 kernel")
    g = torch.Generator().manual_seed(21)
    for n, k in ((64, 64), (70, 100), (131, 1100), (96, 2050)):
        q, s = quantize_int8_per_channel(torch.randn(n, k, generator=g))
        q[1] = 127  # (with x near +127 too: the largest sums)
        packed = ks.pack_w8a8(q)
        assert torch.equal(ks.unpack_w8a8(packed, n, k), q)
        bias = torch.randn(n, generator=g).bfloat16()
        for m in (1, 2, 3, 4, 5, 6, 7, 16, 131, 260, 530):  # (530 at K 2050: AMX's 480-row passes, then 50 rows)
            x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).bfloat16()
            x[0, : k // 2] = 7.5  # (x / s_x halfway between integers: round half to even)
            if m > 2:
                x[1] = torch.randn(k, generator=g) * 1e-11  # max|x| / 127 < 1e-12: s_x = 1e-12
                x[2, 3] = 900.0  # an outlier: the rest of the row rounds to few levels
            for static in (None, torch.tensor([0.05])):
                if static is None:
                    xq, sx = quantize_int8_per_token(x.float())
                else:
                    xq, sx = torch.round(x.float() / static).clamp(-127, 127).to(torch.int8), static
                exact = xq.long() @ q.long().t()  # int64: the exact sums
                assert exact.abs().max() < 2**31  # (int32 holds them; past 2^24 their rounding to fp32 shows)
                want = (exact.float() * sx * s).bfloat16()
                for b in (None, bias):
                    ref = want if b is None else want + b
                    got = ks.linear_w8a8(x, packed, s, static, b)
                    assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (n, k, m, static is None)
        layer = Linear(k, n, dtype=torch.bfloat16, quant_method=W8A8Method(kernels=None))
        layer.weight.data.copy_(torch.randn(n, k, generator=g))
        layer.quant_method.process_weights_after_loading(layer)
        x = torch.randn(40, k, generator=g).bfloat16()
        got = ks.linear_w8a8(x, ks.pack_w8a8(layer.qweight), layer.scales)
        assert torch.equal(got.view(torch.int16), layer(x).view(torch.int16))  # (torch._int_mm's product)
    with pytest.raises(ValueError, match="fp32 scales"):
        ks.linear_w8a8(x, packed, layer.scales.bfloat16())
    with pytest.raises(ValueError, match="not a packed"):
        ks.linear_w8a8(x, layer.qweight, layer.scales)
    q[0, 0] = -128  # (outside the kernels' range: AVX2's VPMADDUBSW would take it wrong)
    with pytest.raises(ValueError, match="-128"):
        ks.pack_w8a8(q)


def _w8p_oracle(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """W8A16's arithmetic in exact integers: x rounded to int16 per row as the kernels' act_i16.h does (s_x = max|x| /
    32512, or 1 for a zero row; x * (1 / s_x) rounded half to even, clamped), the products summed in int64, rounded
    once to fp32, then bf16(sum * s_x * s_w + bias) in fp32."""
    x32 = x.float()
    amax = x32.abs().amax(dim=1, keepdim=True)
    sx = torch.where(amax > 0, amax / 32512.0, torch.ones_like(amax))
    xq = torch.round(x32 * (1.0 / sx)).clamp(-32512, 32512).long()
    exact = xq @ q.long().t()
    assert exact.abs().max() < 2**53  # (fp64 holds them exactly; fp32 rounds them once)
    y = exact.double().float() * sx * s.float()
    return (y + (bias.float() if bias is not None else 0.0)).bfloat16()


def test_w8a16_on_the_packed_weight_is_linear_w8s_arithmetic(ks):
    """linear_w8p (W8A16 on pack_w8a8's weight: int16 activations' two bytes times the packed int8, VPDPBUSD) against
    exact integer arithmetic at every row count (each remainder of its 3-row micro-kernel, past the 128-row blocks),
    N not a multiple of 64, K not a multiple of 64 and past a 1024-column slab; a zero row (s_x = 1), values halfway
    between int16 levels, an outlier, sums far past 2^24; with and without a bias. At 1-3 rows linear_w8 on the
    unpacked weight runs the same integers through its int16 kernels: the two agree bit for bit there (at 2-3 rows
    only without AMX: with it linear_w8 multiplies the dequantized weight on the tiles from 2 rows). With AMX, past 16
    rows (it_w8p_tile_rows: 128) of a weight of a multiple of 16 features and K of 32 (gemm_w8p.c w8p_tiles_take),
    prompts take the 12-bit
    weights' tile GEMM on the packed words rebuilt in bf16: linear_bf16 on the dequantized weight bf16(q bf16(s)) (the
    PyTorch reference's), bit for bit, a feature whose scale makes denormal weights included (the rebuild's
    one-instruction rounding would flush them); with those tiles switched off (it_w8p_tiles(0)) the integers again."""
    if not kernels.w8p_supported(getattr(ks, "lib", None)):
        pytest.skip(f"{ks.name}: W8A16 keeps [N, K] here (no packed kernel)")
    amx = getattr(ks, "amx", False)
    lib = getattr(ks, "lib", None) or kernels.library()
    g = torch.Generator().manual_seed(29)
    for n, k in ((64, 64), (70, 100), (131, 1100), (96, 2050), (208, 1088)):
        q, s = quantize_int8_per_channel(torch.randn(n, k, generator=g))
        q[1] = 127
        if n == 208:  # a feature whose weights are denormal in bf16 (q s < 2^-126)
            s[5] = 2.0**-131
        s = s.bfloat16().float()  # (W8A16 keeps its scales in the model dtype)
        packed = ks.pack_w8a8(q)
        bias = torch.randn(n, generator=g).bfloat16()
        dequantized = q.bfloat16() * s.bfloat16()[:, None]  # (the reference's bf16 multiply)
        for m in (1, 2, 3, 4, 5, 7, 16, 17, 128, 131, 260):
            x = (torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 4).bfloat16()
            x[0, 0] = 32512.0 / 4  # (row 0: s_x = 1 / 4 exactly, so x / s_x = 4x:)
            x[0, 1 : k // 2] = 0.125  # (4 x 0.125 = 0.5, halfway: rounds to even, 0)
            x[0, 2] = 0.375  # (1.5: rounds to 2)
            if m > 2:
                x[1] = 0  # a zero row
                x[2, 3] = 900.0  # an outlier
            tiles = amx and m > lib.it_w8p_tile_rows(0) and n % 16 == 0 and k % 32 == 0
            for b in (None, bias):
                ref = ks.linear_bf16(x, dequantized, b) if tiles else _w8p_oracle(x, q, s, b)
                got = ks.linear_w8p(x, packed, s, b)
                assert torch.equal(got.view(torch.int16), ref.view(torch.int16)), (n, k, m, b is None)
                if m <= (1 if amx else 3):
                    assert torch.equal(got.view(torch.int16), ks.linear_w8(x, q, s, b).view(torch.int16))
                if tiles:  # (the integer path still there, for every row count)
                    lib.it_w8p_tiles(0)
                    try:
                        got = ks.linear_w8p(x, packed, s, b)
                    finally:
                        lib.it_w8p_tiles(1)
                    want = _w8p_oracle(x, q, s, b)
                    assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, k, m, "integers")
    with pytest.raises(ValueError, match="fp32 scales"):
        ks.linear_w8p(x, packed, s.bfloat16())
    with pytest.raises(ValueError, match="not a packed"):
        ks.linear_w8p(x, q, s)


def test_w8a16_packs_at_load_where_the_kernels_ask_and_keeps_its_results(ks):
    """W8A16Method keeps its weight in the packed layout where max_rows("w8p") > 0 (the AVX-512 library, AMX or
    not): every row count goes through linear_w8p (the exact-integer oracle above), the unpacked weight and its
    scales are exactly what quantize_int8_per_channel gives, the fused step's description says "w8p"; a stored
    weight holding -128 (which the packing refuses) keeps [N, K] and linear_w8, as elsewhere."""
    if ks.max_rows("w8p") <= 0:
        pytest.skip(f"{ks.name}: W8A16 keeps [N, K] here")
    g = torch.Generator().manual_seed(30)
    n, k = 200, 192
    w = torch.randn(n, k, generator=g)
    layer = Linear(k, n, bias=True, dtype=torch.bfloat16, quant_method=W8A16Method(kernels=ks))
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(n, generator=g))
    layer.quant_method.process_weights_after_loading(layer)
    q, s = quantize_int8_per_channel(layer_weight := w.bfloat16())
    del layer_weight
    assert layer.quant_method.own_layout and layer.qweight.dtype is torch.int32
    assert torch.equal(layer.quant_method.int8_weight(layer), q)
    assert torch.equal(layer.scales, s.bfloat16().float())
    assert layer.quant_method.kernel_weights(layer).kind == "w8p"
    for m in (1, 3, 16, 40):
        x = torch.randn(m, k, generator=g).bfloat16()
        ref = _w8p_oracle(x, q, layer.scales, layer.bias)
        assert torch.equal(layer(x).view(torch.int16), ref.view(torch.int16)), m
    stored = Linear(k, n, dtype=torch.bfloat16, quant_method=W8A16Method(kernels=ks))
    del stored.weight
    q_min = q.clone()
    q_min[5, 7] = -128
    stored.quant_method.pack_weights(stored, q_min, s, torch.bfloat16)
    assert not stored.quant_method.own_layout and torch.equal(stored.qweight, q_min)
    assert stored.quant_method.kernel_weights(stored).kind == "w8"
    x = torch.randn(1, k, generator=g).bfloat16()
    assert torch.equal(stored(x), ks.linear_w8(x, q_min, s.bfloat16()))


def _w4p_oracle(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, z: torch.Tensor, gs: int, bias) -> torch.Tensor:
    """gemm_w4p.c's arithmetic, emulated exactly: x rounded to int16 per row (act_i16.h), x's sums per group in fp32
    in column order, per group the exact integer sums (int64) of q x_q rounded once to fp32, then per feature group by
    group acc = acc + S s (fp32 multiply, then add) and z_acc = z_acc + z xsum; y = bf16(acc s_x + z_acc + bias)."""
    x32 = x.float()
    m, k = x32.shape
    amax = x32.abs().amax(dim=1, keepdim=True)
    sx = torch.where(amax > 0, amax / 32512.0, torch.ones_like(amax))
    xq = torch.round(x32 * (1.0 / sx)).clamp(-32512, 32512).long()
    acc = torch.zeros(m, q.shape[0])
    zacc = torch.zeros(m, q.shape[0])
    for g in range(k // gs):
        cols = slice(g * gs, (g + 1) * gs)
        xsum = torch.zeros(m)
        for c in range(g * gs, (g + 1) * gs):
            xsum = xsum + x32[:, c]
        exact = xq[:, cols] @ q[:, cols].long().t()
        assert exact.abs().max() < 2**31  # (the kernel's int32 256 H + L holds it)
        acc = acc + exact.float() * s[:, g]
        zacc = zacc + z[:, g] * xsum.unsqueeze(1)
    y = acc * sx + zacc
    return (y + (bias.float() if bias is not None else 0.0)).bfloat16()


def test_activation_rounding_and_its_byte_splits_are_the_portable_loops_bits():
    """The AVX-512 library rounds the W8A16 / W4A16 activations to int16 with its own vector loop
    (gemv_quant.c quantize_rows_i16_512): bit for bit act_i16.h's portable loop (which the AVX2 and NEON libraries
    run): x_q, s_x and each group's fp32 sum of x, added in column order (a row of mixed magnitudes, whose sums round);
    K not a multiple of 16, padding to Kp, a zero row, a huge value and a denormal. Its splits of x_q into signed bytes (split_rows_i16, and
    w4b_split_row in the nibbles' order of 128 columns) against the integer formula x_q = 256 h + l,
    l = ((x_q + 128) & 255) - 128, and their row sums."""
    if kernels.variant() not in ("avx512", "avx512-noamx"):
        pytest.skip(f"the AVX-512 kernels are not this process's: {kernels.describe()}")
    lib = kernels.library()
    g = torch.Generator().manual_seed(7)
    for m, k, kp, gs in ((3, 896, 896, 128), (2, 200, 224, 64), (1, 4864, 4864, 128), (4, 64, 64, 64)):
        x = (torch.randn(m, k, generator=g) * 3).bfloat16()
        x[0] = 0
        if m > 1:  # (magnitudes 1e-6 .. 1e3 side by side: the groups' fp32 sums round, so their order shows)
            x[1] = (torch.randn(k, generator=g) * 10.0 ** (torch.rand(k, generator=g) * 9 - 6)).bfloat16()
        if m > 2:
            x[2, 5] = 3.0e38
            x[2, 6] = -1e-40  # (a denormal)
        outs = []
        for impl in (0, 1):
            xq = torch.full((m, kp), 77, dtype=torch.int16)
            sx = torch.empty(m, dtype=torch.float32)
            xsum = torch.empty(m, k // gs, dtype=torch.float32)
            lib.it_quantize_rows_i16(x.data_ptr(), k, m, k, kp, xq.data_ptr(), sx.data_ptr(), xsum.data_ptr(), gs, impl)
            outs.append((xq, sx, xsum))
        for want, got in zip(*outs):
            assert torch.equal(
                want.view(torch.int32) if want.dtype == torch.float32 else want,
                got.view(torch.int32) if got.dtype == torch.float32 else got,
            ), (m, k, gs)
        xq = outs[1][0]
        assert (xq[:, k:] == 0).all() and (xq[0] == 0).all()
        v = xq.int()
        low = ((v + 128) & 255) - 128
        high = (v - low) // 256
        xh = torch.empty(m, kp, dtype=torch.int8)
        xl = torch.empty(m, kp, dtype=torch.int8)
        hs = torch.empty(m, dtype=torch.int32)
        ls = torch.empty(m, dtype=torch.int32)
        lib.it_split_rows_i16(xq.data_ptr(), m, kp, xh.data_ptr(), xl.data_ptr(), hs.data_ptr(), ls.data_ptr())
        assert torch.equal(xh.int(), high) and torch.equal(xl.int(), low)
        assert torch.equal(hs, high.sum(1).int()) and torch.equal(ls, low.sum(1).int())
        if k % 128 == 0:  # (w4b_split_row: per 128 columns [A | B], A the low nibbles' columns 0-31, 64-95)
            order = torch.cat([torch.arange(c, c + 32) for c in (0, 64, 32, 96)])
            order = torch.cat([order + c0 for c0 in range(0, k, 128)])
            for r in range(m):
                bh = torch.empty(k, dtype=torch.int8)
                bl = torch.empty(k, dtype=torch.int8)
                lib.it_w4b_split_row(xq[r].contiguous().data_ptr(), k, bh.data_ptr(), bl.data_ptr())
                assert torch.equal(bh.int(), high[r, order]) and torch.equal(bl.int(), low[r, order]), (m, k, r)


def test_w4a16_on_the_packed_weight_against_its_exact_emulation(ks):
    """linear_w4p (W4A16 on pack_w4p's 64-feature blocks: the nibbles as VPDPBUSD's unsigned bytes against x_q's two
    bytes) against an exact emulation of its arithmetic below the bf16 GEMM's rows, for group sizes 64 / 128 / 256 /
    192 (192: no slab of the GEMM holds whole groups, so the int kernel takes every row count), N not a multiple of
    64, one and two rows a pass and their remainders, a zero row; from the GEMM's rows, linear_w4's prompt path (the
    GEMM on the same bf16 weights, rebuilt from the packed blocks here; with AMX, where linear_w4 takes the tiles,
    that GEMM called on the reference's dequantized weight): bit for bit. With AMX, past 16 rows of a weight of a
    multiple of 16 features, the tile GEMM on the nibbles rebuilt in bf16 (gemm_w4p.c): the AMX bf16 linear on the
    reference's dequantized weight, bit for bit, 2048-row blocks and K in slabs included; a feature of denormal
    weights (the rebuild's one-instruction rounding flushes them: its group keeps the exact one). pack_w4p /
    unpack_w4p round-trip the integers and the scales."""
    from infertune.quant.int4 import dequantize_int4

    if ks.max_rows("w4p") <= 0 and not kernels.w4p_supported(getattr(ks, "lib", None)):
        pytest.skip(f"{ks.name}: W4A16 keeps pack_w4's rows here")
    lib = kernels.library()
    gemm_from = lib.it_gemm_rows_noamx(0)
    g = torch.Generator().manual_seed(31)
    amx = getattr(ks, "amx", False)
    cases = [(64, 128, 128), (70, 256, 64), (131, 512, 256), (96, 384, 192)]
    if amx:  # (a 12-bit-sized chunk count with a partial last chunk; K past the tile GEMM's one slab at 600 rows)
        cases += [(208, 4864, 128)]
    for n, k, gs in cases:
        q = torch.randint(0, 16, (n, k), generator=g)
        s = torch.rand(n, k // gs, generator=g) * 0.02
        z = torch.randn(n, k // gs, generator=g) * 0.1
        if n % 16 == 0:  # a feature whose weights are denormal (the rebuilds' fast rounding would flush them)
            q[5], s[5], z[5] = 15, 559240 * 2.0**-149, 0.0
        packed, sT, zT = ks.pack_w4p(q, s, z, gs)
        back = ks.unpack_w4p(packed, sT, zT, n, k)
        assert torch.equal(back[0].long(), q) and torch.equal(back[1], s) and torch.equal(back[2], z)
        bias = torch.randn(n, generator=g).bfloat16()
        for m in (1, 2, 3, 5, 16, 17, 33, gemm_from, 130) + ((600,) if amx else ()):
            x = (torch.randn(m, k, generator=g) * 3).bfloat16()
            if m > 2:
                x[1] = 0
            for b in (None, bias):
                got = ks.linear_w4p(x, packed, sT, zT, gs, n, b)
                if amx and m > 16 and n % 16 == 0:  # (the tiles on the rebuilt nibbles)
                    want = ks.linear_bf16(x, dequantize_int4(q, s, z, gs).bfloat16(), b)
                elif m >= gemm_from and 512 % gs == 0 and amx:  # (AMX: linear_w4 on the tiles)
                    want = kernels.linear_bf16_path(x, dequantize_int4(q, s, z, gs).bfloat16(), b, path="gemm")
                elif m >= gemm_from and 512 % gs == 0:  # (gemm_dpbf16.c GEMM_KC: slabs of 512 columns)
                    want = ks.linear_w4(x, ks.pack_w4(q), s, z, gs, b)
                else:
                    want = _w4p_oracle(x, q, s, z, gs, b)
                assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (n, k, gs, m, b is None)
    with pytest.raises(ValueError, match="not a packed"):
        ks.linear_w4p(x, ks.pack_w4(q), sT, zT, gs, n)


def test_w4a16_packs_at_load_where_the_kernels_ask(ks):
    """W4A16Method keeps pack_w4p's blocks where max_rows("w4p") > 0 (AVX-512 without AMX): a decode row through
    linear_w4p (the emulation above), the fused step's description says "w4p", the dense weight (prompts under
    torch.compile, other dtypes) is the reference's bf16(q s + z); experts take the same blocks."""
    from infertune.quant.experts import QuantizedExperts
    from infertune.quant.int4 import W4A16Method, quantize_int4_groupwise

    if ks.max_rows("w4p") <= 0:
        pytest.skip(f"{ks.name}: W4A16 keeps pack_w4's rows here")
    g = torch.Generator().manual_seed(32)
    n, k = 100, 256
    w = torch.randn(n, k, generator=g)
    layer = Linear(k, n, bias=True, dtype=torch.bfloat16, quant_method=W4A16Method(128, kernels=ks))
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(n, generator=g))
    layer.quant_method.process_weights_after_loading(layer)
    q, s, z = quantize_int4_groupwise(w.bfloat16(), 128)
    assert layer.quant_method.kernel_kind == "w4p" and layer.qweight.dtype is torch.int32
    assert layer.quant_method.kernel_weights(layer).kind == "w4p"
    x = torch.randn(1, k, generator=g).bfloat16()
    assert torch.equal(layer(x).view(torch.int16), _w4p_oracle(x, q, s, z, 128, layer.bias).view(torch.int16))
    dense = layer.quant_method._dense_weight(layer, torch.bfloat16)
    ref = (q.view(n, 2, 128).float() * s.unsqueeze(-1) + z.unsqueeze(-1)).view(n, k).bfloat16()
    assert torch.equal(dense, ref)
    from infertune.config import MoeArch
    from infertune.layers.moe import Experts

    experts = Experts(
        k, MoeArch(4, 2, 128, layers=(0,), norm_topk_prob=True), torch.bfloat16
    )  # [4, 256, k], [4, k, 128]
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(4, 256, k, generator=g))
        experts.down_proj.copy_(torch.randn(4, k, 128, generator=g))
    experts.quant_method = QuantizedExperts(lambda: W4A16Method(128, kernels=ks))
    experts.quant_method.process_weights_after_loading(experts)
    described = experts.quant_method.kernel_experts(experts)
    assert described.gate_up.kind == described.down.kind == "w4p"
    assert described.gate_up.qweight.shape == (4, 256 // 64, k // 8, 64)


@needs_kernels
def test_with_amx_w8a16_packs_and_w4a16_packs_in_moe_models(monkeypatch):
    """With AMX, W8A16 takes the packed layout too (its int8 words are AMX-INT8's B operand as they lie:
    gemm_i8_amx.c), and so does W8A8; W4A16 packs the layers of an MoE model, experts first (their prompts take the
    tile GEMM on the nibbles rebuilt in bf16 a chunk at a time, gemm_w4p.c), and keeps pack_w4's rows in a dense
    model (whose row kernels decode faster there: kernels/x86.py max_rows). (Run here by telling this library's
    kernels object it has AMX.)"""
    from infertune.layers.moe import Experts
    from infertune.quant.experts import QuantizedExperts
    from infertune.quant.int4 import W4A16Method

    if kernels.variant() not in ("avx512", "avx512-noamx"):
        pytest.skip(f"the AVX-512 kernels are not this process's: {kernels.describe()}")
    ks = x86.X86Kernels()
    monkeypatch.setattr(ks, "amx", True)
    assert ks.max_rows("w4p") == 0
    assert ks.max_rows("w4p", moe=True) == (kernels.NOAMX_QUANT_MAX_ROWS if kernels.w4p_supported() else 0) > 0
    assert ks.max_rows("w8p") == (kernels.NOAMX_QUANT_MAX_ROWS if kernels.w8p_supported() else 0) > 0
    assert ks.max_rows("w8a8") == (kernels.NOAMX_QUANT_MAX_ROWS if kernels.w8a8_supported() else 0)
    g = torch.Generator().manual_seed(33)
    for method, kind, dtype in (
        (W8A16Method(kernels=ks), "w8p", torch.int32),
        (W4A16Method(128, kernels=ks), "w4", torch.uint8),
    ):
        layer = Linear(256, 64, dtype=torch.bfloat16, quant_method=method)
        layer.weight.data.copy_(torch.randn(64, 256, generator=g))
        method.process_weights_after_loading(layer)
        assert layer.qweight.dtype is dtype and method.kernel_weights(layer).kind == kind
    from infertune.config import MoeArch

    experts = Experts(256, MoeArch(4, 2, 128, layers=(0,), norm_topk_prob=True), torch.bfloat16)
    with torch.no_grad():
        experts.gate_up_proj.copy_(torch.randn(4, 256, 256, generator=g))
        experts.down_proj.copy_(torch.randn(4, 256, 128, generator=g))
    experts.quant_method = QuantizedExperts(lambda: W4A16Method(128, kernels=ks))
    experts.quant_method.process_weights_after_loading(experts)
    described = experts.quant_method.kernel_experts(experts)
    assert described.gate_up.kind == described.down.kind == "w4p"


@needs_kernels
def test_the_packed_linears_profile_as_matmul():
    """The packed linears' profiler ranges (infertune_kernels::<name>) count as matmul in `infertune profile`'s
    categories, as linear_w8 / linear_w4 do, wherever they are called from."""
    from infertune.profile.profile_categories import category_by_op_name

    if not (kernels.w8p_supported() and kernels.w4p_supported()):
        pytest.skip(f"no packed W8A16 / W4A16 kernels here: {kernels.describe()}")
    q8 = torch.randint(-127, 128, (64, 128), dtype=torch.int8)
    q4 = torch.randint(0, 16, (64, 128))
    s = torch.rand(64)
    packed4 = kernels.pack_w4p(q4, torch.rand(64, 1), torch.rand(64, 1), 128)
    x = torch.randn(1, 128).bfloat16()
    with torch.profiler.profile() as prof:
        kernels.linear_w8p(x, kernels.pack_w8a8(q8), s)
        kernels.linear_w8a8(x, kernels.pack_w8a8(q8), s)
        kernels.linear_w4p(x, *packed4, 128, 64)
    names = {e.name.removeprefix("infertune_kernels::") for e in prof.events() if "infertune_kernels::" in e.name}
    assert {"linear_w8p", "linear_w8a8", "linear_w4p"} <= names, names
    assert {n: category_by_op_name(n) for n in names} == dict.fromkeys(names, "matmul")


def test_prefill_dequantization_matches_the_reference_rounding(ks):
    """The dense bf16 weights a quantized prefill multiplies: bit for bit the PyTorch formulas, denormal weights
    included (the AVX-512 library rounds 32 values an instruction where no value can be denormal, and keeps the
    exact rounding for rows with a denormal scale, or int4 groups whose scale or offset is below 2^-102)."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (40, 100), generator=g, dtype=torch.int8)
    for s in (torch.rand(40, generator=g).bfloat16(), torch.rand(40, generator=g)):
        s[3], s[4], s[5] = 2.0**-133, 0.0, 2.0**-126  # denormal weights; zeros of both signs; the least normal
        ref = q.to(torch.bfloat16) * s.to(torch.bfloat16).unsqueeze(1)
        assert (ref[3] != 0).any() and (ref[3].abs() < 2.0**-126).all()
        assert torch.equal(ks.dequant_w8(q, s).view(torch.int16), ref.view(torch.int16))
    q4 = torch.randint(0, 16, (24, 128), generator=g)
    scale, zero = torch.rand(24, 2, generator=g), torch.randn(24, 2, generator=g)
    # row 2: 15 x (2^-126 / 15, rounded down) is a denormal just under 2^-126, which bf16 rounds up to 2^-126
    q4[2], scale[2], zero[2] = 15, 559240 * 2.0**-149, 0.0
    scale[3, 1], zero[3, 1] = 2.0**-140, 2.0**-135  # a group of denormal weights
    ref = ((q4.float().view(24, 2, 64) * scale.unsqueeze(-1)) + zero.unsqueeze(-1)).view(24, 128).to(torch.bfloat16)
    assert (ref[2].abs() == 2.0**-126).all()
    got = ks.dequant_w4(ks.pack_w4(q4), scale, zero, 64)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))
    # many groups, each with every nibble value (a group has only 16 values to get right): a fused multiply-add in
    # place of the multiply, then add (one rounding fewer) gives about a dozen of these 2^21 values another bf16
    for gs, rows in ((64, 2048), (128, 256)):
        q4 = torch.arange(16).repeat(rows, 4096 // 16)[:, torch.randperm(4096, generator=g)]
        scale = torch.randn(rows, 4096 // gs, generator=g) * 0.02
        zero = torch.randn(rows, 4096 // gs, generator=g) * 0.1
        ref = (q4.float().view(rows, -1, gs) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(rows, 4096)
        got = ks.dequant_w4(ks.pack_w4(q4), scale, zero, gs)
        assert torch.equal(got.view(torch.int16), ref.to(torch.bfloat16).view(torch.int16)), gs
    # rows of 19 groups whose only denormal group lies past the first 16 (the AVX-512 check reads 16 groups a compare,
    # then the last 3 under a mask): row 1's group 17 and row 4's last group hold row 2's denormal above
    q4 = torch.randint(0, 16, (8, 19 * 128), generator=g)
    scale, zero = torch.rand(8, 19, generator=g) * 0.02, torch.randn(8, 19, generator=g) * 0.1
    for r, grp in ((1, 17), (4, 18)):
        q4[r, grp * 128 : (grp + 1) * 128], scale[r, grp], zero[r, grp] = 15, 559240 * 2.0**-149, 0.0
    ref = (q4.float().view(8, 19, 128) * scale.unsqueeze(-1) + zero.unsqueeze(-1)).view(8, -1).to(torch.bfloat16)
    assert (ref[1, 17 * 128 : 18 * 128] == 2.0**-126).all() and (ref[4, 18 * 128 :] == 2.0**-126).all()
    got = ks.dequant_w4(ks.pack_w4(q4), scale, zero, 128)
    assert torch.equal(got.view(torch.int16), ref.view(torch.int16))


@needs_kernels
def test_bad_inputs_are_refused():
    w = torch.zeros(8, 32, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16"):
        kernels.linear_bf16(torch.zeros(1, 32), w)
    with pytest.raises(ValueError, match="does not fit"):
        kernels.linear_bf16(torch.zeros(1, 16, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="int8"):
        kernels.linear_w8(torch.zeros(1, 32, dtype=torch.bfloat16), w, torch.ones(8))


@pytest.mark.skipif(os.environ.get("INFERTUNE_CPU_KERNELS") == "0", reason="kernels switched off")
def test_kernels_build_where_the_cpu_and_a_compiler_allow():
    """Where the CPU has the required AVX-512 features and a C compiler is present, the kernels must build and
    load: a source that fails to compile would otherwise only show as every kernel test skipped."""
    if not all(f in kernels._cpu_flags() for f in kernels.REQUIRED_FLAGS) or kernels._compiler() is None:
        pytest.skip("this CPU or machine cannot build the kernels")
    assert kernels.available(), kernels.unavailable_reason()
    # the best variant this CPU (and INFERTUNE_CPU_ISA / torch's ISA limit) allows, not a fallback: an AVX-512 source
    # that fails to build would otherwise leave the AVX2 library running every test
    assert kernels.variant() == kernels._choose()[0], kernels.describe()


def test_disabled_by_environment(monkeypatch):
    """INFERTUNE_CPU_KERNELS=0 is honoured with a reason, and the backend then offers no kernels."""
    from infertune.backends.cpu import CPUBackend

    monkeypatch.setattr(kernels, "_loaded", False)
    monkeypatch.setattr(kernels, "_lib", None)
    monkeypatch.setattr(kernels, "_reason", None)
    monkeypatch.setenv("INFERTUNE_CPU_KERNELS", "0")
    assert not kernels.available()
    assert "INFERTUNE_CPU_KERNELS" in kernels.unavailable_reason()
    assert CPUBackend().decode_kernels() is None


@needs_kernels
def test_methods_use_kernels_only_for_decode_rows(monkeypatch):
    """Up to bf16_max_rows() rows (AMX_GEMM_MAX_ROWS with AMX, NOAMX_GEMM_MAX_ROWS without, AVX2_GEMM_MAX_ROWS on
    AVX2) the layer calls the kernel; a bigger input takes F.linear; both agree."""
    calls = []
    real = kernels.linear_bf16
    monkeypatch.setattr(kernels, "linear_bf16", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    layer = Linear(64, 48, dtype=torch.bfloat16, quant_method=DecodeKernelMethod(x86.kernels()))
    layer.weight.data.copy_(torch.randn(48, 64))
    rows = kernels.bf16_max_rows()
    assert rows in (
        kernels.MAX_ROWS,
        kernels.AMX_GEMM_MAX_ROWS,
        kernels.NOAMX_GEMM_MAX_ROWS,
        kernels.AVX2_GEMM_MAX_ROWS,
    )
    small, edge = torch.randn(3, 64).bfloat16(), torch.randn(rows, 64).bfloat16()
    big = torch.randn(rows + 1, 64).bfloat16()
    torch.testing.assert_close(layer(small), torch.nn.functional.linear(small, layer.weight), rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(layer(edge), torch.nn.functional.linear(edge, layer.weight), rtol=2**-7, atol=1e-2)
    layer(big)
    assert calls == [small.shape, edge.shape]

    q8 = Linear(64, 48, dtype=torch.bfloat16, quant_method=W8A16Method(kernels=x86.kernels()))
    q8.weight.data.copy_(torch.randn(48, 64))
    q8.quant_method.process_weights_after_loading(q8)
    w = q8.quant_method.dequantized_weight(q8).double()
    ref = small.double() @ w.T
    xw = small.double().abs() @ w.abs().T  # the bound of test_w8_within_its_error_bound
    sx = small.double().abs().amax(dim=1, keepdim=True) / 32512
    bound = w.abs().sum(1) * sx / 2 + 2.0**-8 * ref.abs() + (64 * 2.0**-23 + 2.0**-8) * xw
    assert ((q8(small).double() - ref).abs() <= bound * 1.01).all()


def _hf_logprob_errors(llm, prompts, params, hf, argmax: bool, outputs: list | None = None) -> list[float]:
    """|engine logprob - HF transformers' (float32) logprob| of every generated token; with argmax, each token
    must also be HF's argmax up to bf16 noise (0.1 nats). outputs: where the engine's RequestOutputs go too."""
    errs = []
    for out in llm.generate(prompts, params, use_tqdm=False):
        if outputs is not None:
            outputs.append(out)
        ids = out.prompt_token_ids + out.outputs[0].token_ids
        with torch.no_grad():
            ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)
        p = len(out.prompt_token_ids)
        for j, lp in enumerate(out.outputs[0].logprobs):
            row = ref[p - 1 + j]
            if argmax:
                assert row.max() - row[lp.token_id] < 0.1, (j, "not HF's argmax beyond bf16 noise")
            errs.append(abs(lp.logprob - row[lp.token_id].item()))
    return errs


@needs_kernels
@needs_fused
@pytest.mark.parametrize(
    "arch,quant,kv,group,n_prompts",
    [
        ("llama", None, "auto", 64, 5),
        ("llama", "w8a16", "auto", 64, 5),
        ("llama", "w4a16", "auto", 64, 5),
        ("llama", "w4a16", "auto", 128, 1),  # one decode row, groups of 128: the nibbles-as-bytes W4A16 GEMV
        ("llama", None, "int8", 64, 5),
        ("qwen2", None, "auto", 64, 5),
    ],
)
def test_engine_with_kernels_matches_hf(tmp_path, arch, quant, kv, group, n_prompts):
    """bf16 engine, greedy decode of a batch through the fused decode step and the kernels, against HF
    transformers in float32 on the same weights: unquantized, every greedy token is HF's argmax (up to near-ties
    within bf16 noise); in every case the logprobs are as close to HF's as those of the engine on torch's
    matmuls (same quantization). The tied lm_head runs through the kernel too."""
    from conftest import hf_model, make_checkpoint

    from infertune import LLM, SamplingParams

    model = make_checkpoint(
        tmp_path / "m",
        arch,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        tie_word_embeddings=True,
        dtype=torch.bfloat16,
    )  # qwen2: q/k/v biases
    prompts = [{"prompt_token_ids": [3 + i, 11, 25, 40 + i]} for i in range(n_prompts)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    hf = hf_model(model).float()
    worst = {}
    for mode in ("auto", "off"):
        llm = LLM(
            str(model),
            dtype="bfloat16",
            decode_kernels=mode,
            quantization=quant,
            max_model_len=64,
            quant_group_size=group,
            kv_cache_dtype=kv,
        )
        runner = llm.engine.executor.runner
        methods = {type(m.quant_method).__name__ for m in runner.model.modules() if isinstance(m, Linear)}
        if mode == "auto":
            assert "DecodeKernelMethod" in methods and (quant is None or f"{quant.upper()}Method" in methods)
            assert runner.decode_kernels is x86.kernels() and runner.fused is not None
        else:
            assert "DecodeKernelMethod" not in methods and runner.fused is None
        # quantization moves logits by more than bf16 noise: see below
        worst[mode] = max(_hf_logprob_errors(llm, prompts, params, hf, argmax=quant is None and kv == "auto"))
    assert worst["auto"] <= 1.5 * worst["off"] + 0.02, worst


@needs_kernels
@needs_fused
def test_fused_decode_forward_allocates_nothing(tmp_path):
    """The seeds' "pre-allocate memory": a decode step's forward through the fused path allocates no tensor
    (torch.profiler's memory accounting); the PyTorch path allocates per op."""
    from conftest import make_checkpoint
    from torch.profiler import ProfilerActivity, profile

    from infertune import LLM, SamplingParams

    model = make_checkpoint(
        tmp_path / "m", "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, dtype=torch.bfloat16
    )
    counts = {}
    for mode in ("auto", "off"):
        llm = LLM(str(model), dtype="bfloat16", decode_kernels=mode, max_model_len=64)
        runner = llm.engine.executor.runner
        forward, seen = runner._forward, []

        def profiled(ids, pos, meta, rows=None, *, forward=forward, seen=seen):
            if meta.prefills:
                return forward(ids, pos, meta, rows)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                out = forward(ids, pos, meta, rows)
            seen.append(sum(1 for e in prof.events() if e.self_cpu_memory_usage > 0))
            return out

        runner._forward = profiled
        llm.generate(
            [{"prompt_token_ids": [3, 4, 5]}, {"prompt_token_ids": [6, 7]}],
            SamplingParams(max_tokens=4, ignore_eos=True),
            use_tqdm=False,
        )
        counts[mode] = seen
    assert len(counts["auto"]) >= 3 and all(n == 0 for n in counts["auto"]), counts
    assert all(n > 10 for n in counts["off"]), counts  # the probe does see the PyTorch path's allocations


def test_short_rows_normalize_as_each_row_alone(ks):
    """RMSNorm over many short rows (per-head q / k norms: rows of 64-256) is bit for bit each row normalized on its
    own (the AVX-512 library reduces 16 rows' sums at once in the single row's order: elementwise.c head_norm16),
    with a zero row, huge and tiny rows, 1-16 rows past a multiple of 16, and in place."""
    from infertune.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(17)
    for t, h in ((37, 64), (16, 128), (50, 256), (3, 64), (40, 80)):
        x = (torch.randn(t, h, generator=g) * 3).bfloat16()
        x[1] = 0
        x[2] *= 1e30
        if t > 4:
            x[4] *= 1e-30
        norm = RMSNorm(h, 1e-6, torch.bfloat16)
        norm.weight.data.copy_(torch.randn(h, generator=g))
        together = ks.rms_norm(x, norm.weight, 1e-6)
        alone = torch.cat([ks.rms_norm(x[i : i + 1], norm.weight, 1e-6) for i in range(t)])
        assert torch.equal(together.view(torch.int16), alone.view(torch.int16)), (t, h)


def test_elementwise_kernels_round_as_the_pytorch_formulas(ks):
    """Prefill elementwise kernels against layers/norm.py, activation.py and rotary.py in PyTorch: rotary bit for
    bit (the same fp32 products), GeLU-tanh too; RMSNorm (Llama's and Gemma's) and SiLU within one bf16 step (fp32
    sum order, exp polynomial), and almost everywhere identical."""
    from infertune.layers.activation import GeluAndMul, silu_and_mul
    from infertune.layers.norm import GemmaRMSNorm, RMSNorm
    from infertune.layers.rotary import RotaryEmbedding

    g = torch.Generator().manual_seed(9)

    def close_to_bf16(out, ref):
        ulp = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp(min=2.0**-100)
        assert ((out.float() - ref.float()).abs() <= ulp * 1.01 + 1e-30).all()
        assert (out == ref).float().mean() > 0.98

    for t, h in ((1, 64), (37, 200), (300, 896)):
        x = (torch.randn(t, h, generator=g) * 3).bfloat16()
        norm = RMSNorm(h, 1e-6, torch.bfloat16)
        norm.weight.data.copy_(torch.randn(h, generator=g))
        close_to_bf16(ks.rms_norm(x, norm.weight, 1e-6), norm(x))
        gu = (torch.randn(t, 2 * h, generator=g) * 4).bfloat16()
        close_to_bf16(ks.silu_and_mul(gu), silu_and_mul(gu))
        gemma = GemmaRMSNorm(h, 1e-6, torch.bfloat16)
        gemma.weight.data.copy_(torch.randn(h, generator=g) * 0.5)
        close_to_bf16(ks.gemma_rms_norm(x, gemma.weight, 1e-6), gemma.forward_native(x))
        assert torch.equal(ks.gelu_and_mul(gu), GeluAndMul().forward_native(gu))
    # GeLU-tanh bit for bit at every finite bf16 gate (torch's tanh is +-1 past |y| = 8.66: the kernels' too)
    gates = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    gates = gates[torch.isfinite(gates)]
    gu = torch.cat([gates, torch.full_like(gates, 1.5)]).view(1, -1)
    assert torch.equal(ks.gelu_and_mul(gu), GeluAndMul().forward_native(gu))
    rot = RotaryEmbedding(48, 64, 10000.0, None)
    rot.reset_buffers()
    qkv = torch.randn(9, 7, 48, generator=g).bfloat16()
    cos, sin = rot.cos_sin_at(torch.arange(3, 12))
    ref = rot(qkv[:, :5].clone(), cos, sin)
    mine = qkv.clone()
    assert ks.rotary_(mine[:, :5], cos, sin)
    assert torch.equal(mine[:, :5], ref) and torch.equal(mine[:, 5:], qkv[:, 5:])
    assert ks.rms_norm(x.float(), norm.weight, 1e-6) is None  # fp32: the caller's PyTorch path


def test_greedy_tokens_are_torchs_argmax_with_nan_as_minus_inf(ks):
    """greedy_tokens against logits.nan_to_num(nan=-inf).argmax(-1) exactly: random rows; ties (the first index wins);
    NaN anywhere, also where it would be the largest; +-inf, which nan_to_num takes to +-fmax (so -inf beats NaN and
    +inf ties with fmax); rows of only -inf, only NaN, or both; a strided view (rows apart more than their length);
    one row and many (the threaded split), lengths off any vector width."""
    g = torch.Generator().manual_seed(21)

    def check(logits):
        want = logits.nan_to_num(nan=float("-inf")).argmax(dim=-1)
        got = ks.greedy_tokens(logits)
        assert got is not None and got.dtype is torch.int64 and torch.equal(got, want), (got, want)
        # bf16 logits (a bf16 LM head's output, no fp32 copy): the argmax of the fp32 values they widen to
        half = logits.to(torch.bfloat16)
        want = half.float().nan_to_num(nan=float("-inf")).argmax(dim=-1)
        got = ks.greedy_tokens(half)
        assert got is not None and torch.equal(got, want), (got, want)

    for rows, n in ((1, 1), (1, 7), (3, 33), (16, 32000), (5, 1027)):
        check(torch.randn(rows, n, generator=g))
    x = torch.randint(-3, 4, (8, 97), generator=g).float()  # many ties at the max
    check(x)
    x = torch.randn(6, 500, generator=g)
    x[0, 3] = float("nan")
    x[1, :] = float("-inf")
    x[2, :] = float("nan")
    x[3, ::2] = float("nan")
    x[3, 1::2] = float("-inf")
    x[4, 17] = float("inf")
    x[4, 400] = float("inf")
    x[5, 250] = x[5].max() + 1
    x[5, 499] = x[5, 250]
    check(x)
    fmax = torch.finfo(torch.float32).max  # nan_to_num also takes +-inf to +-fmax: ties with them
    y = torch.full((3, 40), float("nan"))
    y[0, 30], y[0, 9] = fmax, float("inf")
    y[1, 20], y[1, 7] = -fmax, float("-inf")
    y[2, 33], y[2, 12] = float("inf"), fmax
    check(y)
    bmax = torch.finfo(torch.bfloat16).max  # bf16's largest finite value ties with nothing: +inf still wins over it
    z = torch.full((2, 40), float("nan"))
    z[0, 30], z[0, 9] = bmax, float("inf")
    z[1, 5], z[1, 6] = bmax, -bmax
    check(z)
    big = torch.randn(4, 300, generator=g)
    check(big[:, :257])  # rows 300 apart
    check(torch.randn(3, 16 * 5, generator=g).to(torch.bfloat16).float())  # exact in bf16: ties across the widths
    assert ks.greedy_tokens(torch.randn(2, 8, dtype=torch.float64)) is None  # not fp32: the torch formula
    assert ks.greedy_tokens(torch.randn(8, 2).t()) is None  # columns apart


@needs_kernels
@needs_fused
def test_profile_sees_the_kernels(tmp_path):
    """`infertune profile` on a bf16 model: the fused step's time lands in its own category, and the C linear
    calls count as matmul, not as Python (they are not aten ops; the kernels open profiler ranges)."""
    from conftest import make_checkpoint

    from infertune import LLM, SamplingParams
    from infertune.profile.timeline import profile_workload

    model = make_checkpoint(
        tmp_path / "m", "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, dtype=torch.bfloat16
    )
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    shares, fused = {}, {}
    for mode in ("auto", "linear"):
        llm = LLM(str(model), dtype="bfloat16", decode_kernels=mode, max_model_len=64, max_num_seqs=2)
        result = profile_workload(llm, 12, 4, 2, greedy, warmup=False)
        shares[mode] = result.phases["decode"].by_category
        fused[mode] = [(r.fused, r.wall_us) for r in result.records if r.phase == "decode"]
    assert shares["auto"]["fused_decode"] > 0 and shares["linear"]["fused_decode"] == 0
    # the fused step's own timers: every part of every decode step it ran, within the step's wall time
    assert all(f is None for f, _ in fused["linear"]) and len(fused["auto"]) >= 3
    for parts, wall_us in fused["auto"]:
        assert list(parts) == list(kernels.FUSED_PARTS) and all(v >= 0 for v in parts.values())
        assert 0 < sum(parts.values()) * 1e6 <= wall_us
    # Decode steps issue no aten matmul here (every linear, lm_head included, is a C call): without the kernels'
    # profiler ranges this would be exactly 0 and the GEMV time would sit in "host".
    assert shares["linear"]["matmul"] > 0.02 * sum(shares["linear"].values())


# (query heads, KV heads, head_dim, block size): a group of 7 (Qwen2.5-0.5B), multi-head attention in blocks of
# 8 (the rows are gathered, not loaded from one block), head_dim 48 (the AVX-512 path only) with a group of 9
# (two passes of heads there), a group of 20 (two passes on AMX) in blocks of 32, head_dim 128 (two passes of
# 64 dims).
ATTN_SHAPES = [(14, 2, 64, 16), (4, 4, 32, 8), (9, 1, 48, 16), (20, 1, 32, 32), (8, 2, 128, 16)]


@pytest.fixture(params=["avx512", "avx2"])
def attn_lib(request):
    """The library whose fused-step attention a test runs: None for the process's AVX-512 one (AMX and not), or the
    AVX2 library (csrc/x86/avx2/fused.c), forced on where this CPU has AVX2."""
    if request.param == "avx512":
        if kernels.variant() not in ("avx512", "avx512-noamx"):
            pytest.skip(f"the AVX-512 kernels are not this process's: {kernels.describe()}")
        return None
    lib = kernels.load_variant("avx2")
    if isinstance(lib, str):
        pytest.skip(lib)
    return lib


@pytest.mark.parametrize("hq,hkv,d,bs", ATTN_SHAPES)
@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_decode_attention_matches_float64(attn_lib, hq, hkv, d, bs, kv):
    """The fused step's paged decode attention, on AMX tiles, on AVX-512 and on AVX2, against softmax(q K^T s) V in
    float64 over the same cache rows: context lengths around the 8-, 16- and 32-key steps of the kernels, scattered
    blocks. AVX-512 and AVX2 keep P in fp32, so only the bf16 output rounds; AMX multiplies P as two bf16 parts (P_hi
    = bf16(p), P_lo = bf16(p - P_hi): p to about 2^-17 of itself), held to the same bound."""
    from infertune.layers.attention.paged import Int8PagedAttention

    gen = torch.Generator().manual_seed(hq * 1000 + d + bs)
    lens = torch.tensor([1, 15, 16, 17, 31, 33, 70])
    t = len(lens)
    max_blocks = -(-int(lens.max()) // bs) + 1
    num_blocks = t * max_blocks + 3
    tables = torch.randperm(num_blocks, generator=gen)[: t * max_blocks].view(t, max_blocks)
    q = (torch.randn(t, hq, d, generator=gen) * 2).to(torch.bfloat16)
    k = torch.randn(num_blocks * bs, hkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_blocks * bs, hkv, d, generator=gen).to(torch.bfloat16)
    if kv == "int8":
        attn = Int8PagedAttention(torch.bfloat16)
        cache = torch.empty(attn.kv_cache_shape(num_blocks, bs, hkv, d), dtype=torch.int8)
        attn.write_kv(cache, k, v, torch.arange(num_blocks * bs))
        k, v = (attn._decoded(cache[i].view(num_blocks * bs, hkv, d + 4)) for i in (0, 1))  # what is read
    else:
        cache = torch.stack([k.view(num_blocks, bs, hkv, d), v.view(num_blocks, bs, hkv, d)])
    scale = d**-0.5
    outs = {
        amx: kernels.decode_attention(
            q, cache, tables, lens, hkv, scale, kv_int8=kv == "int8", use_amx=amx, lib=attn_lib
        )
        for amx in ((True, False) if attn_lib is None else (False,))
    }
    for i in range(t):
        slots = (tables[i, :, None] * bs + torch.arange(bs)).flatten()[: lens[i]]
        ki = k[slots].double().repeat_interleave(hq // hkv, dim=1)  # [L, Hq, D]
        vi = v[slots].double().repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[i].double(), ki) * scale, dim=-1)
        ref = torch.einsum("hl,lhd->hd", p, vi)
        spread = torch.einsum("hl,lhd->hd", p, vi.abs())  # sum_l p_l |v_l|
        for amx, o in outs.items():
            err = (o[i].double() - ref).abs()
            # bf16 rounding (unit roundoff 2^-8) of the output, and P's (fp32, or AMX's two bf16 parts)
            bound = 2.0**-8 * ref.abs() + 1e-5 * spread
            assert (err <= bound).all(), (amx, i, float((err - bound).max()))
    if attn_lib is not None:
        return
    if kernels._amx and d % 32 == 0:
        if d > 32:  # the AMX path really ran: its tile sums move some bits (at 32 both may round to the same bf16)
            assert not torch.equal(outs[True], outs[False])
    else:  # no AMX path here: use_amx=True takes the AVX-512 one
        assert torch.equal(outs[True], outs[False])


# (head_dim 48: half a 32-dim step at the end of each row, the AVX-512 paths only; on AMX the rows go one by one there)
@pytest.mark.parametrize("hq,hkv,d,bs", [(14, 2, 64, 16), (4, 4, 32, 32), (18, 1, 128, 16), (6, 2, 48, 16)])
def test_prompt_rows_attention_matches_float64(attn_lib, hq, hkv, d, bs):
    """A step of prompts' rows (each row one more key of its prompt, through the prompt's block table): on AVX-512
    the rows go 16 at a time per query head (attn_rows_amx on AMX, attn_rows_dp without), on AVX2 one by one. Each
    against causal softmax attention in float64 over the prompt's scattered blocks, with the decode attention's
    bound (a block's rows multiply P rounded to bf16 on either AVX-512 path, so theirs is AMX's); prompts of 1, 16,
    21 and 40 rows (partial blocks of rows, a block of 16 exactly), and a lone decode row between them. Without
    AMX, the blocks' rows must differ from the same rows run one at a time (fp32 P): the block path really ran."""
    gen = torch.Generator().manual_seed(hq + d + bs)
    plens = [21, 1, 16, 40]
    max_blocks = -(-max(plens) // bs) + 1
    num_blocks = len(plens) * max_blocks + 2
    seq_tables = torch.randperm(num_blocks, generator=gen)[: len(plens) * max_blocks].view(len(plens), max_blocks)
    rows = [(i, j) for i, n in enumerate(plens) for j in range(n)]  # (prompt, position)
    rows.insert(30, (0, plens[0] + 5))  # a decode row of prompt 0 (its context 27 keys), between prompts' rows
    tables = torch.stack([seq_tables[i] for i, _ in rows])
    lens = torch.tensor([j + 1 for _, j in rows])
    q = (torch.randn(len(rows), hq, d, generator=gen) * 2).to(torch.bfloat16)
    k = torch.randn(num_blocks * bs, hkv, d, generator=gen).to(torch.bfloat16)
    v = torch.randn(num_blocks * bs, hkv, d, generator=gen).to(torch.bfloat16)
    cache = torch.stack([k.view(num_blocks, bs, hkv, d), v.view(num_blocks, bs, hkv, d)])
    scale = d**-0.5
    outs = {
        amx: kernels.decode_attention(q, cache, tables, lens, hkv, scale, use_amx=amx, lib=attn_lib)
        for amx in ((True, False) if attn_lib is None else (False,))
    }
    # the kernel's blocks: a row joins the previous row's block (up to 16 rows) where it is one more key of the same
    # prompt; rows in blocks of more than one take the block path on AVX-512
    block_of, sizes = [], []
    for r in range(len(rows)):
        joins = r > 0 and sizes[-1] < 16 and lens[r] == lens[r - 1] + 1 and torch.equal(tables[r], tables[r - 1])
        if not joins:
            sizes.append(0)
        sizes[-1] += 1
        block_of.append(len(sizes) - 1)
    in_block = [attn_lib is None and sizes[block_of[r]] > 1 for r in range(len(rows))]
    for r in range(len(rows)):
        slots = (tables[r, :, None] * bs + torch.arange(bs)).flatten()[: lens[r]]
        kr = k[slots].double().repeat_interleave(hq // hkv, dim=1)
        vr = v[slots].double().repeat_interleave(hq // hkv, dim=1)
        p = torch.softmax(torch.einsum("hd,lhd->hl", q[r].double(), kr) * scale, dim=-1)
        ref = torch.einsum("hl,lhd->hd", p, vr)
        spread = torch.einsum("hl,lhd->hd", p, vr.abs())
        for amx, o in outs.items():
            err = (o[r].double() - ref).abs()
            bf16_p = amx or in_block[r]
            bound = 2.0**-8 * ref.abs() + (1.01 * 2.0**-8 if bf16_p else 1e-5) * spread
            assert (err <= bound).all(), (amx, r, rows[r], float((err - bound).max()))
    if attn_lib is None and kernels._amx and d % 32 == 0:
        assert not torch.equal(outs[True], outs[False])
    if attn_lib is None:  # each row alone: the one-row path (fp32 P) on either AVX-512 path
        alone = torch.cat(
            [
                kernels.decode_attention(
                    q[r : r + 1], cache, tables[r : r + 1], lens[r : r + 1], hkv, scale, use_amx=False
                )
                for r in range(len(rows))
            ]
        )
        lone = [r for r in range(len(rows)) if not in_block[r]]
        assert torch.equal(outs[False][lone], alone[lone])
        blocked = [r for r in range(len(rows)) if in_block[r]]
        assert not torch.equal(outs[False][blocked], alone[blocked])


def _tiny_bf16_llama(tmp_path, arch="llama", **overrides):
    """The fused-step tests' checkpoint: a 2-layer bf16 Llama, hidden 128, tied embeddings (overrides: config keys;
    arch: another family of the same shape)."""
    from conftest import make_checkpoint

    return make_checkpoint(
        tmp_path / "m",
        arch,
        **{
            "hidden_size": 128,
            "intermediate_size": 256,
            "num_hidden_layers": 2,
            "tie_word_embeddings": True,
            "dtype": torch.bfloat16,
        }
        | overrides,
    )


needs_bf16c = pytest.mark.skipif(
    not (kernels.available() and kernels.bf16c_supported(16, 32)),
    reason=f"the 12-bit layout needs the AVX-512 library (with or without AMX): {kernels.describe()}",
)


def _bf16_twin(x, w, bias=None):
    """What the 12-bit linear equals bit for bit on the unpacked weight: with AMX the bf16 kernel's tile products
    (from 2 rows), without AMX the VDPBF16PS GEMM's sums (at every row count: csrc/x86/avx512/bf16c_noamx.c)."""
    if kernels.amx():
        return kernels.linear_bf16(x, w, bias)
    return kernels.linear_bf16_path(x, w, bias, path="gemm")


@needs_bf16c
@pytest.mark.parametrize("n,k", [(80, 64), (48, 96), (128, 32), (1152, 896)])
def test_bf16c_round_trip_is_bit_exact(n, k):
    """pack_bf16c / unpack_bf16c give back every bit: zeros of both signs, subnormals, infinities, NaN, huge and
    tiny values whose high bytes fall outside the 16-entry table (patched in), rows padded to 64."""
    gen = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    specials = torch.tensor([0.0, -0.0, 1e-40, -1e-39, float("inf"), float("-inf"), float("nan"), 3e38, -7.5, 1e-20])
    w.view(-1)[torch.randperm(n * k, generator=gen)[: len(specials)]] = specials.to(torch.bfloat16)
    packed = kernels.pack_bf16c(w)
    out = kernels.unpack_bf16c(kernels.bf16c_struct(packed), n, k)
    assert torch.equal(out.view(torch.int16), w.view(torch.int16))
    # every weight whose high byte is not in the table was stored aside (the specials among them)
    table = set(packed["table"].tolist())
    outside = [v for v in w.view(torch.int16).flatten().tolist() if (v >> 8) & 0xFF not in table]
    assert sorted(packed["esc_val"].view(torch.int16).tolist()) == sorted(outside) and len(outside) >= 3
    if n % 64 == 0 and n * k > 100_000:
        assert packed["codes"].numel() == n * k * 3 // 2  # 12 bits a weight


@needs_bf16c
@pytest.mark.parametrize(
    "m,k,n",
    [
        *[(m, k, None) for m, k in ((1, 896), (2, 896), (7, 896), (16, 896), (17, 896), (33, 896), (48, 896))],
        *[(m, k, None) for m, k in ((100, 896), (530, 896), (100, 4096), (47, 6144), (530, 2048))],
        (33, 896, 192),
        (530, 896, 192),
    ],
)
def test_bf16c_linear_is_the_bf16_kernel_bit_for_bit(m, k, n):
    """The 12-bit linear against the bf16 kernel on the unpacked weight: the same bits from 2 rows up (the same
    tile products; one row takes the tiles here where the bf16 kernel takes VDPBF16PS; without AMX the VDPBF16PS
    GEMM's bits at every row count), and within the float64
    bound of test_bf16_matches_float64 at every row count. Bias and a row count past one decode pass included;
    wide K cut into slabs whose fp32 sums wait in memory between slabs (at 530 rows, in two blocks of rows)."""
    gen = torch.Generator().manual_seed(m)
    # chunks of 4, 4, 1 feature tiles, or of 4, 4, 3 (two blocks, the last half); 192: rows 64-byte aligned, so the tile
    # GEMM (past 16 rows) writes them with non-temporal stores (bf16c_gemm.c stream_rows)
    n = n or (144 if m % 2 == 0 else 176)
    assert (kernels.bf16c_slabs(m, k) >= 2) == (k > 896)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
    w[3, 5] = 9.0  # an escape inside a tile
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    desc = kernels.bf16c_struct(packed := kernels.pack_bf16c(w))
    y = kernels.linear_bf16c(x, desc, n, bias)
    assert packed["esc_val"].numel() >= 1
    # written past the caches (past 16 rows on AMX, rows of whole lines: n 192), the same bits
    assert torch.equal(kernels.linear_bf16c(x, desc, n, bias, stream=True).view(torch.int16), y.view(torch.int16))
    if m > 1 or not kernels.amx():
        assert torch.equal(y.view(torch.int16), _bf16_twin(x, w, bias).view(torch.int16))
    ref = x.double() @ w.double().T + bias.double()
    bound = 2.0**-8 * ref.abs() + k * 2.0**-23 * (x.double().abs() @ w.double().abs().T) + 1e-6
    assert ((y.double() - ref).abs() <= bound).all()
    # the residual form (the fused step's o_proj and down): added into a given tensor in the epilogue, exactly the
    # bf16 sum PyTorch takes of the residual and the rounded product
    res = torch.randn(m, n, generator=gen).to(torch.bfloat16)
    out = kernels.linear_bf16c(x, desc, n, bias, add_to=res.clone())
    assert torch.equal(out.view(torch.int16), (res.float() + y.float()).to(torch.bfloat16).view(torch.int16))


@needs_bf16c
@pytest.mark.parametrize(
    "m,k,inter",
    [(1, 128, 96), (5, 128, 96), (16, 128, 96), (33, 128, 96), (530, 128, 96), (40, 8192, 96), (530, 128, 4000)],
)
def test_bf16c_gate_up_with_silu_is_the_unfused_mlp_bit_for_bit(m, k, inter):
    """A gate_up packed with gate and up rows interleaved 16 by 16: the plain call gives the bf16 kernel's gate_up
    on the original weight bit for bit (columns in the usual order), and silu=True gives exactly silu_and_mul of
    that (layers/activation.py, the PyTorch formula) from the tiles' epilogue. inter 96: three 64-feature chunks,
    the last one a single gate / up pair; 4000 (530 rows): an act past 4 MB, written with non-temporal stores on
    AMX (bf16c_gemm.c BF16C_STREAM_BYTES)."""
    from infertune.layers.activation import silu_and_mul

    gen = torch.Generator().manual_seed(m)
    assert (kernels.bf16c_slabs(m, k) >= 2) == (k > 128)  # (8192: SiLU after the last slab)
    w = (torch.randn(2 * inter, k, generator=gen) * 0.1).to(torch.bfloat16)
    x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
    packed = kernels.pack_bf16c(w, inter=inter)
    assert torch.equal(packed["codes"], kernels.pack_bf16c(kernels.interleave_gate_up(w))["codes"])
    desc = kernels.bf16c_struct(packed)
    assert torch.equal(kernels.deinterleave_gate_up(kernels.interleave_gate_up(w)), w)
    twin = m > 1 or not kernels.amx()
    ref = _bf16_twin(x, w) if twin else (x.float() @ w.float().T).to(torch.bfloat16)
    gate_up = kernels.linear_bf16c(x, desc, 2 * inter, inter=inter)
    if twin:
        assert torch.equal(gate_up.view(torch.int16), ref.view(torch.int16))
    act = kernels.linear_bf16c(x, desc, 2 * inter, inter=inter, silu=True)
    assert act.shape == (m, inter)
    assert torch.equal(act.view(torch.int16), silu_and_mul(gate_up).view(torch.int16))
    with pytest.raises(ValueError, match="inter"):
        kernels.linear_bf16c(x, desc, 2 * inter, torch.zeros(2 * inter, dtype=torch.bfloat16), inter=inter)


@needs_bf16c
@pytest.mark.skipif(kernels.amx(), reason="the register paths are the AVX-512 library's without AMX")
def test_bf16c_register_paths_without_amx_are_the_gemm_bit_for_bit():
    """Without AMX, 1-16 rows multiply each tile's rows straight from the registers they are decoded into (group-major,
    the tile's bytes in order), the escapes patched there. Against the slab GEMM on the same 12-bit
    weight (it_bf16c_reg_rows(0)) and the VDPBF16PS GEMM on the bf16 weight: the same bits, at every row count, with
    escapes in many tiles (in both rows of a pair, several in one row, the first and the last lane, every feature
    group) and in the epilogues (bias, residual add, gate_up in order and SiLU-and-multiply)."""
    lib = kernels.library()
    assert lib.it_bf16c_reg_rows(-1) == 16
    gen = torch.Generator().manual_seed(7)
    n, k, inter = 208, 160, 112  # 4 chunks, the last one with one feature group of 16; 5 tiles a chunk
    w = (torch.randn(2 * inter, k, generator=gen) * 0.02).to(torch.bfloat16)  # (gate_up: 2 inter rows, plain: n)
    # values whose high bytes miss the table: escapes all over (rows 2p and 2p + 1 of a tile, lanes 0 and 31)
    rows, cols = torch.randint(0, 2 * inter, (300,), generator=gen), torch.randint(0, k, (300,), generator=gen)
    w[rows, cols] = torch.randn(300, generator=gen).to(torch.bfloat16) * 1e4
    w[5, 64:96] = -3e5  # one whole tile row of one feature
    w[6, 64] = w[7, 95] = 7e6
    bias = torch.randn(n, generator=gen).to(torch.bfloat16)
    packed, gate_up = kernels.pack_bf16c(w[:n]), kernels.pack_bf16c(w, inter=inter)
    assert packed["esc_val"].numel() > 100 and (packed["esc_start"].diff() > 0).sum() >= 16  # (of 20 tiles)
    desc, desc_gu = kernels.bf16c_struct(packed), kernels.bf16c_struct(gate_up)
    try:
        for m in (*range(1, 17), 17):
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16)
            res = torch.randn(m, n, generator=gen).to(torch.bfloat16)
            got = {}
            for reg in (16, 0):
                lib.it_bf16c_reg_rows(reg)
                got[reg] = [
                    kernels.linear_bf16c(x, desc, n, bias),
                    kernels.linear_bf16c(x, desc, n, bias, add_to=res.clone()),
                    kernels.linear_bf16c(x, desc_gu, 2 * inter, inter=inter),
                    kernels.linear_bf16c(x, desc_gu, 2 * inter, inter=inter, silu=True),
                ]
            assert torch.equal(got[16][0].view(torch.int16), _bf16_twin(x, w[:n], bias).view(torch.int16)), m
            assert torch.equal(got[16][2].view(torch.int16), _bf16_twin(x, w).view(torch.int16)), m
            for a, b in zip(got[16], got[0]):
                assert torch.equal(a.view(torch.int16), b.view(torch.int16)), m
    finally:
        lib.it_bf16c_reg_rows(16)


@needs_bf16c
@pytest.mark.skipif(not kernels.amx(), reason="AMX's routing (without AMX: the test below)")
def test_engine_with_12bit_weights_is_the_engine_with_bf16_weights(tmp_path, monkeypatch):
    """compress_weights="auto" (the default) against "off" on one checkpoint: the plain bf16 projections are held
    in the 12-bit layout and the outputs are bit for bit the same. A batch of 4 short prompts, then one of 150
    tokens (past the 128 rows up to which bf16 weights as loaded keep the fused step). Through the per-module
    forward (decode_kernels="linear") the 12-bit engine runs the tile GEMM at every size, the MLP in row blocks
    taking SiLU-and-multiply from the gate_up GEMM's epilogue, where the bf16 one runs torch's GEMM past 128 rows
    and the separate activation: every output the same. With the fused step (the default) both run the short
    prompts and decode steps fused, the same again; the 12-bit engine runs the 150-token prefill fused too (its
    accuracy: test_fused_step_runs_prompts_as_accurately_as_pytorch). No weight is ever unpacked."""

    from infertune import LLM, SamplingParams
    from infertune.models import llama
    from infertune.runner.fused_decode import FusedDecode

    monkeypatch.setattr(llama, "MLP_CHUNK_ROWS", 64)
    unpacks, fused, steps = [], [], []
    real_unpack, real_linear, real_call = kernels.unpack_bf16c, kernels.linear_bf16c, FusedDecode.__call__
    monkeypatch.setattr(kernels, "unpack_bf16c", lambda *a: unpacks.append(a[1:]) or real_unpack(*a))
    monkeypatch.setattr(
        kernels,
        "linear_bf16c",
        lambda x, *a, **k: (fused.append(x.shape[0]) if k.get("silu") else None) or real_linear(x, *a, **k),
    )
    monkeypatch.setattr(
        FusedDecode, "__call__", lambda self, ids, *a: steps.append(ids.shape[0]) or real_call(self, ids, *a)
    )
    model = _tiny_bf16_llama(tmp_path)
    prompts = [{"prompt_token_ids": [5 + i, 17, 33, 2 + i, 60]} for i in range(4)]
    long = [{"prompt_token_ids": [(7 * i) % 250 + 3 for i in range(150)]}]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    runs = {}
    for mode, kernel_mode in (("auto", "auto"), ("auto", "linear"), ("off", "auto"), ("off", "linear")):
        llm = LLM(str(model), dtype="bfloat16", compress_weights=mode, decode_kernels=kernel_mode, max_model_len=192)
        runner = llm.engine.executor.runner
        methods = {type(m.quant_method).__name__ for m in runner.model.modules() if isinstance(m, Linear)}
        assert ("CompressedMethod" in methods) == (mode == "auto")
        fused.clear()
        steps.clear()
        runs[mode, kernel_mode] = [
            (o.outputs[0].token_ids, [(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs])
            for batch in (prompts, long)
            for o in llm.generate(batch, params, use_tqdm=False)
        ]
        if kernel_mode == "linear":  # 12-bit: every MLP call; the long prefill's: per layer 3 row blocks (64, 64, 22)
            assert steps == [] and (
                fused == [] if mode == "off" else [n for n in fused if n > 20] == [64, 64, 22] * 2 and 20 in fused
            ), fused
        else:  # the prefill steps fused: with 12-bit weights the long one too, as loaded only the short ones
            assert fused == [] and (150 in steps) == (mode == "auto") and 20 in steps, steps
    assert unpacks == []
    assert runs["auto", "linear"] == runs["off", "linear"]
    assert runs["auto", "auto"][:4] == runs["off", "auto"][:4]  # (the short prompts: fused in both)
    with pytest.raises(ValueError, match="compress_weights"):
        LLM(str(model), dtype="bfloat16", compress_weights="on")


@needs_bf16c
@pytest.mark.skipif(kernels.amx(), reason="the AVX-512 library without AMX (Zen 4 / 5; INFERTUNE_CPU_ISA=avx512-noamx)")
def test_engine_with_12bit_weights_without_amx_is_the_bf16_engine_on_the_gemm(tmp_path):
    """Without AMX the 12-bit linears multiply the decoded tiles with VDPBF16PS, each output's products summed in
    k order: the sums of the VDPBF16PS GEMM on the bf16 weights. With that GEMM taken at every row count (the
    library's it_gemm_rows_noamx(1); by default the GEMV takes fewer than 64 rows, summing in another order), the
    engine with compress_weights="auto" gives the bf16 engine's tokens and logprobs bit for bit, through the fused
    decode step and through the per-module forward (where the MLP takes SiLU-and-multiply from the gate_up's
    epilogue); prompts up to 128 tokens (past that the bf16 engine's per-module prefill takes torch's GEMM), fused
    (each prompt row's attention on its own) in both engines or per module in both. No weight is ever unpacked."""

    from infertune import LLM, SamplingParams
    from infertune.runner.fused_decode import FusedDecode

    lib = kernels.library()
    model = _tiny_bf16_llama(tmp_path)
    prompts = [{"prompt_token_ids": [5 + i, 17, 33, 2 + i, 60]} for i in range(4)]
    long = [{"prompt_token_ids": [(7 * i) % 250 + 3 for i in range(100)]}]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
    runs, old = {}, lib.it_gemm_rows_noamx(0)  # (0: only read it)
    lib.it_gemm_rows_noamx(1)
    real_unpack, unpacks, steps = kernels.unpack_bf16c, [], []
    real_call = FusedDecode.__call__
    try:
        kernels.unpack_bf16c = lambda *a: unpacks.append(a[1:]) or real_unpack(*a)
        FusedDecode.__call__ = lambda self, ids, *a: steps.append(ids.shape[0]) or real_call(self, ids, *a)
        for mode, kernel_mode in (("auto", "auto"), ("auto", "linear"), ("off", "auto"), ("off", "linear")):
            llm = LLM(
                str(model), dtype="bfloat16", compress_weights=mode, decode_kernels=kernel_mode, max_model_len=192
            )
            runner = llm.engine.executor.runner
            methods = {type(m.quant_method).__name__ for m in runner.model.modules() if isinstance(m, Linear)}
            assert ("CompressedMethod" in methods) == (mode == "auto")
            steps.clear()
            runs[mode, kernel_mode] = [
                (o.outputs[0].token_ids, [(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs])
                for batch in (prompts, long)
                for o in llm.generate(batch, params, use_tqdm=False)
            ]
            if kernel_mode == "auto":  # the prompts' steps (4 x 5 and 100 tokens) and the decode steps fused
                assert {20, 100, 4, 1} <= set(steps), steps
    finally:
        kernels.unpack_bf16c, FusedDecode.__call__ = real_unpack, real_call
        lib.it_gemm_rows_noamx(old)
    assert unpacks == []
    assert runs["auto", "auto"] == runs["off", "auto"]
    assert runs["auto", "linear"] == runs["off", "linear"]


@needs_bf16c
def test_tied_head_multiplies_a_12bit_copy_and_the_embedding_keeps_its_table(tmp_path):
    """compress_weights="auto" with tied embeddings: the head multiplies a lossless 12-bit copy of the shared matrix
    (0.76x the bytes a step streams through it), while the embedding keeps the bf16 table its lookups read; the
    tokens and logprobs are compress_weights="off"'s bit for bit (without AMX both sides' bf16 linears on the
    VDPBF16PS GEMM, whose sums the 12-bit path makes: as above)."""
    from infertune import LLM, SamplingParams
    from infertune.layers.linear import CompressedMethod, DecodeKernelMethod

    path = _tiny_bf16_llama(tmp_path, vocab_size=272)  # (a multiple of 16: the 12-bit layout's rows)
    prompts = [{"prompt_token_ids": [5 + i, 17, 33, 2 + i, 60]} for i in range(3)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)
    lib = kernels.library()
    runs, old = {}, lib.it_gemm_rows_noamx(0)  # (0: only read it)
    lib.it_gemm_rows_noamx(1)
    try:
        for mode in ("auto", "off"):
            llm = LLM(str(path), dtype="bfloat16", compress_weights=mode, max_model_len=64)
            model = llm.engine.executor.runner.model
            head, table = model.lm_head, model.model.embed_tokens.weight
            assert table.dtype is torch.bfloat16 and tuple(table.shape) == (272, 128)
            if mode == "auto":
                assert type(head.quant_method) is CompressedMethod and not hasattr(head, "weight")
                assert torch.equal(head.quant_method.dense_weight(head), table)
            else:
                assert type(head.quant_method) is DecodeKernelMethod and head.weight is table
            runs[mode] = [
                (o.outputs[0].token_ids, [(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs])
                for o in llm.generate(prompts, params, use_tqdm=False)
            ]
    finally:
        lib.it_gemm_rows_noamx(old)
    assert runs["auto"] == runs["off"]


@needs_bf16c
def test_fused_prefill_takes_only_the_read_rows_through_the_last_layers_mlp(tmp_path):
    """A step of three fresh prompts through the fused step with out_rows (their last tokens, what execute_model
    samples from): past the last layer's attention only those rows go on, and their hidden states are bit for bit
    those of the step computing every row (12-bit weights: the tile products of a row do not depend on how many
    rows multiply with it). One row alone too, as a batch-1 prefill's. The K / V of every row are still written:
    decoding after a step with out_rows gives the same tokens."""

    from infertune import LLM, SamplingParams

    model = _tiny_bf16_llama(tmp_path)
    llm = LLM(str(model), dtype="bfloat16", max_model_len=128, block_size=16, enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in (5, 21, 40)]
    entries = [(p, 0, len(p), [3 * i, 3 * i + 1, 3 * i + 2]) for i, p in enumerate(prompts)]
    input_ids, positions, meta, last_rows = runner._prepare(entries)
    assert runner.fused is not None and runner.fused.applicable(input_ids.shape[0], meta)
    full = runner._forward(input_ids, positions, meta).clone()
    for rows in (sorted(last_rows), [last_rows[1]]):
        part = runner._forward(input_ids, positions, meta, rows)
        assert torch.equal(part[rows].view(torch.int16), full[rows].view(torch.int16)), rows
    assert not torch.equal(part, full)  # (the other rows were not computed)
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=2)

    def run():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [(lp.token_id, lp.logprob) for lp in o.outputs[0].logprobs]) for o in outs]

    seen = []
    forward = runner._forward
    runner._forward = lambda ids, pos, meta, rows=None, *a: seen.append(rows) or forward(ids, pos, meta, rows, *a)
    sub = run()
    assert seen[0] == sorted(last_rows)  # (the prefill step read three rows)
    runner._forward = lambda ids, pos, meta, rows=None, *a: forward(ids, pos, meta, None, *a)
    assert sub == run()


@needs_bf16c
@pytest.mark.skipif(not kernels.amx(), reason="packed activations feed the AMX tile GEMM only")
@pytest.mark.parametrize(
    "arch, extra",
    [("llama", {}), ("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen3", {"head_dim": 32})],
    ids=["llama", "biases", "qwen3"],
)
def test_fused_prompts_on_packed_activations_are_the_row_layouts_bits(tmp_path, arch, extra):
    """With AMX a fused prompt step hands a dense layer's 12-bit qkv, gate_up and down their activations packed (16-row
    tiles of 1 KB A-operand tiles, written so by the norms and by gate_up's SiLU epilogue): the hidden states of every
    row are bit for bit those of the same steps with activations in rows (it_px_gemm(0)). Steps of 66 and 156 rows
    (last row tiles partial), and one of 17 (one row past a tile); with Qwen3's q / k norms, and with biases (qkv's
    on packed rows; an MLP with biases keeps its rows: its gate_up is not interleaved for the SiLU epilogue)."""
    from infertune import LLM

    lib = kernels.library()
    model = _tiny_bf16_llama(tmp_path, arch, intermediate_size=288, **extra)
    llm = LLM(str(model), dtype="bfloat16", max_model_len=128, block_size=16, enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    gen = torch.Generator().manual_seed(7)
    for lens in ((5, 21, 40), (5, 21, 40, 90), (17,)):
        prompts = [torch.randint(3, 250, (n,), generator=gen).tolist() for n in lens]
        blocks, entries = 0, []
        for p in prompts:
            need = (len(p) + 15) // 16
            entries.append((p, 0, len(p), list(range(blocks, blocks + need))))
            blocks += need
        input_ids, positions, meta, _ = runner._prepare(entries)
        assert runner.fused is not None and runner.fused.applicable(input_ids.shape[0], meta)
        try:
            assert lib.it_px_gemm(-1) == 1
            packed = runner._forward(input_ids, positions, meta).clone()
            lib.it_px_gemm(0)
            rows = runner._forward(input_ids, positions, meta).clone()
        finally:
            lib.it_px_gemm(1)
        assert torch.isfinite(packed.float()).all()
        assert torch.equal(packed.view(torch.int16), rows.view(torch.int16)), lens


@needs_kernels
@pytest.mark.skipif(
    kernels.bf16_max_rows() <= 16, reason="fused prompts need the AVX-512 GEMMs (AMX tiles, or VDPBF16PS without)"
)
@pytest.mark.parametrize("quant", [None, "w8a16", "w4a16", "w8a8"])
def test_fused_step_runs_prompts_as_accurately_as_pytorch(tmp_path, monkeypatch, quant):
    """A step of fresh prompts runs through the fused step (each token a row attending to its prompt up to itself,
    through the prompt's block table; on AMX 16 rows of a prompt at a time): with 12-bit weights (the default where
    the kernels compress) a step of any size, with the weights as loaded up to kernels.bf16_max_rows() tokens in all
    (without AMX through the VDPBF16PS GEMM, 12-bit too; W8A16 / W4A16 too, their slabs rebuilt in bf16 for that
    GEMM; with AMX W8A16 and W8A8 on AMX-INT8 tiles from their packed weights, a step of any size, and W4A16 in rows
    up to 128 rows, the tile GEMM on 32 features rebuilt at a time). Prompts of 5, 21,
    40 and 90 tokens (several blocks of 16, partial last blocks; 156 rows) in one step, then decoding.
    The logprobs against HF transformers in float32 are as close as those of the PyTorch forward
    (decode_kernels="linear", the same quantization)."""
    if quant == "w8a8" and not kernels.w8a8_supported():
        pytest.skip("W8A8 runs in the fused step where the library has its int8 GEMM")
    if quant == "w8a16" and kernels.variant() != "avx512":
        pytest.skip("W8A16 prompts run in the fused step on the AVX-512 library only")
    if quant == "w4a16" and kernels.variant() != "avx512":
        pytest.skip("W4A16 prompts run in the fused step on the AVX-512 library only")
    from conftest import hf_model

    from infertune import LLM, SamplingParams
    from infertune.runner.fused_decode import FusedDecode

    calls = []
    real = FusedDecode._step_tables
    monkeypatch.setattr(FusedDecode, "_step_tables", lambda self, meta, t: calls.append(t) or real(self, meta, t))
    model = _tiny_bf16_llama(tmp_path)
    gen = torch.Generator().manual_seed(11)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (5, 21, 40, 90)]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=1)
    hf = hf_model(model).float()
    worst = {}
    # (steps of any size: 12-bit weights, the default where the kernels compress, on AMX's tile GEMM or the slab
    # GEMM; without AMX W8A16 / W4A16 too, on slabs rebuilt from the quantized weights)
    # (W8A8 on AVX2: prompts of up to AVX2_FUSED_PREFILL_ROWS tokens in all, as bf16 there)
    # (W4A16 in rows on AMX: steps of any size too, linear_w4's tile GEMM on rebuilt chunks)
    twelve = kernels.bf16c_supported(16, 32) if quant is None else kernels.variant() == "avx512"
    for mode in ("auto", "linear"):
        calls.clear()
        llm = LLM(
            str(model),
            dtype="bfloat16",
            decode_kernels=mode,
            quantization=quant,
            quant_group_size=64,
            max_model_len=128,
            block_size=16,
            enable_prefix_caching=False,
        )  # (the second step's prompts fresh again)
        # (one step of 66 rows; quantization moves logits by more than bf16 noise)
        worst[mode] = max(_hf_logprob_errors(llm, prompts[:3], params, hf, argmax=quant is None))
        assert calls == ([66] if mode == "auto" else []), calls
        if twelve:  # and one of 156 rows
            calls.clear()
            worst[mode] = max(worst[mode], *_hf_logprob_errors(llm, prompts, params, hf, argmax=quant is None))
            assert calls == ([156] if mode == "auto" else []), calls
    assert worst["auto"] <= 1.5 * worst["linear"] + 0.02, worst


@pytest.mark.skipif(
    not (kernels.available() and kernels.variant() == "avx512" and kernels.amx()),
    reason=f"W8A16 prompts on the 12-bit tile GEMM need AMX: {kernels.describe()}",
)
def test_w8a16_prompts_on_the_tile_gemm_are_a_bf16_models_bits(tmp_path):
    """With AMX a W8A16 prompt's linears (the packed weight, gemm_w8p.c) run the 12-bit weights' tile GEMM on the
    words rebuilt in bf16 (bf16c_gemm.c w8p_group), the gate_up writing SiLU-and-multiply and o_proj / down adding
    into the residual in its epilogue: the fused step's prompt logprobs (every row through every layer) are bit for
    bit those of the bf16 model whose weights are the W8A16 model's dequantized ones, bf16(q bf16(s)) (its 12-bit
    weights on the same GEMM), for prompt steps of 66 and 156 rows; with the tiles off (the integer path) they are
    not. (A step's few sampled rows through its last layer, 16 or fewer,
    keep the integer kernels: hence the prompt logprobs, which send every row through.)"""
    from safetensors.torch import load_file, save_file

    from infertune import LLM, SamplingParams
    from infertune.quant.int8 import quantize_int8_per_channel

    lib = kernels.library()
    assert lib.it_w8p_tiles(-1) == 1
    rows = lib.it_w8p_tile_rows(0)
    lib.it_w8p_tile_rows(16)  # (the steps here are 66 and 156 rows: both on the tiles)
    model = _tiny_bf16_llama(tmp_path)
    twin = tmp_path / "dequantized"
    shutil.copytree(model, twin)
    (weights_file,) = twin.glob("*.safetensors")
    tensors = load_file(weights_file)
    linears = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    for name, w in tensors.items():
        if name.endswith(".weight") and name.split(".")[-2] in linears:  # (W8A16Method's quantization of each row)
            q, sc = quantize_int8_per_channel(w.bfloat16())
            tensors[name] = q.bfloat16() * sc.bfloat16()[:, None]
    save_file(tensors, weights_file, metadata={"format": "pt"})
    gen = torch.Generator().manual_seed(13)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (5, 21, 40, 90)]
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, prompt_logprobs=3)

    def prompt_logprobs(path, **engine):
        llm = LLM(str(path), dtype="bfloat16", max_model_len=192, enable_prefix_caching=False, **engine)
        assert llm.engine.executor.runner.fused is not None
        return [
            [sorted((t, lp.logprob) for t, lp in row.items()) for row in o.prompt_logprobs[1:]]
            for batch in (prompts[:3], prompts)
            for o in llm.generate(batch, params, use_tqdm=False)
        ]

    try:
        bf16 = prompt_logprobs(twin)
        assert prompt_logprobs(model, quantization="w8a16") == bf16
        lib.it_w8p_tiles(0)
        integers = prompt_logprobs(model, quantization="w8a16")
    finally:
        lib.it_w8p_tiles(1)
        lib.it_w8p_tile_rows(rows)
    assert integers != bf16  # (the exact-integer products, of the test above, differ from the bf16 weights' somewhere)


@pytest.mark.skipif(
    not (kernels.available() and kernels.variant() == "avx512" and kernels.amx()),
    reason=f"W4A16 prompts on the 12-bit tile GEMM need AMX: {kernels.describe()}",
)
def test_w4a16_prompts_on_the_12bit_tile_gemm_are_the_row_blocks_bits(tmp_path):
    """With AMX a W4A16 prompt's linears (pack_w4's rows) run the 12-bit weights' tile GEMM on the rows rebuilt in
    its VNNI order 16 features x 32 columns at a time (bf16c_gemm.c w4r_tile), the gate_up writing SiLU-and-multiply
    in its epilogue (gate and up tiles paired by the decoder): the fused step's logprobs bit for bit those of the 2 x 2
    row-block GEMM and the separate activation (it_w4_tiles(0)), prompt steps of 66 and 156 rows."""
    from infertune import LLM, SamplingParams

    lib = kernels.library()
    assert lib.it_w4_tiles(-1) == 1
    model = _tiny_bf16_llama(tmp_path)
    gen = torch.Generator().manual_seed(12)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (5, 21, 40, 90)]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=3)
    runs = {}
    for on in (1, 0):
        lib.it_w4_tiles(on)
        try:
            llm = LLM(
                str(model),
                dtype="bfloat16",
                quantization="w4a16",
                quant_group_size=64,
                max_model_len=192,
                enable_prefix_caching=False,
            )
            runs[on] = [
                (o.outputs[0].token_ids, [(lp.token_id, lp.logprob, lp.top) for lp in o.outputs[0].logprobs])
                for batch in (prompts[:3], prompts)
                for o in llm.generate(batch, params, use_tqdm=False)
            ]
        finally:
            lib.it_w4_tiles(1)
    assert runs[1] == runs[0]
