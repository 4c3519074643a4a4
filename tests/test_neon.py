"""The AArch64 NEON kernels on this x86 machine, cross-compiled and run under qemu-user (tests/neon_qemu.py). Every
GEMV / dequantization / elementwise oracle of tests/test_kernels.py also runs on them (its `ks` fixture's "neon"
parameter); here: the library's ABI as AArch64 lays it out, its choice on an Arm machine, and the bf16 GEMM against
the AVX2 GEMM's oracles (correctness only: nothing here measures Arm speed)."""

from __future__ import annotations

import pytest
import torch
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


# The NEON bf16 GEMM (csrc/arm/neon/gemm.c), called directly whatever the rows: row counts that leave each micro-kernel
# tail (6 rows a pass), more rows than one pass over a packed slab (96), feature counts off the 16- / 64-feature
# blocks, K off the 4-column transposes and past one 256-column slab. Small: every call is a qemu process.
NEON_GEMM_SHAPES = [(1, 64, 64), (4, 17, 5), (7, 50, 100), (13, 130, 600), (100, 70, 300)]


@pytest.mark.parametrize("m,n,k", NEON_GEMM_SHAPES)
def test_neon_gemm_is_the_sequential_fp32_sum(lib, m, n, k):
    """Bit for bit the fp32 sum of the exact products over k in order (+ bias, one rounding), the AVX2 GEMM's contract
    (so within test_bf16_matches_float64's float64 bound too); exact on small integers (an int64 matmul)."""
    from test_kernels import _bf16_ints, _sequential_fp32

    g = torch.Generator().manual_seed(m * 13 + n + k)
    x, w = torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    y = cpu.linear_bf16_path(x, w, bias, path="gemm", lib=lib)
    assert torch.equal(y.view(torch.int16), _sequential_fp32(x, w, bias).view(torch.int16))
    k_eff = min(k, 64)
    xi = torch.zeros(m, k, dtype=torch.bfloat16)
    xi[:, :k_eff] = _bf16_ints(m, k_eff, gen=g)
    wi, bi = _bf16_ints(n, k, gen=g), _bf16_ints(n, lo=-8, hi=8, gen=g)
    ref = xi.long() @ wi.long().T + bi.long()
    assert torch.equal(cpu.linear_bf16_path(xi, wi, bi, path="gemm", lib=lib).long(), ref)


def test_neon_gemm_keeps_nans_and_strided_rows(lib):
    """A NaN in a row of x makes that row's outputs NaN, and only that row's; x may be a strided view."""
    from test_kernels import _sequential_fp32

    g = torch.Generator().manual_seed(3)
    big = torch.randn(9, 300, generator=g).bfloat16()
    x = big[:, 10:266]  # [9, 256], row stride 300
    x[4, 17] = float("nan")
    w = torch.randn(70, 256, generator=g).bfloat16()
    y = cpu.linear_bf16_path(x, w, path="gemm", lib=lib)
    ok = torch.arange(9) != 4
    assert y[4].isnan().all() and not y[ok].isnan().any()
    assert torch.equal(y[ok], _sequential_fp32(x[ok], w, None))


def test_neon_linear_bf16_takes_the_gemv_then_the_gemm(lib):
    """it_linear_bf16 on NEON runs the GEMV below it_gemm_rows_fma() rows and the GEMM from there (bit for bit the one
    or the other, and the two differ here); NeonKernels keeps bf16 linears to MAX_ROWS (no Arm timing says more)."""
    from infertune.kernels.arm import NeonKernels

    start = lib.it_gemm_rows_fma(0)
    assert 1 < start <= cpu.MAX_ROWS
    assert NeonKernels(lib).max_rows("bf16") == cpu.MAX_ROWS
    g = torch.Generator().manual_seed(4)
    w = torch.randn(40, 640, generator=g).bfloat16()
    w[:, 0] = w[:, -1] = 1
    for m in (start - 1, start):
        # (+-2^20 in the first and the last column: the other products' sums round on the way, differently in the
        # GEMV's lane order and the GEMM's k order)
        x = torch.randn(m, 640, generator=g).bfloat16()
        x[:, 0], x[:, -1] = 2.0**20, -(2.0**20)
        paths = {p: cpu.linear_bf16_path(x, w, path=p, lib=lib).view(torch.int16) for p in ("gemv", "gemm")}
        want = "gemm" if m >= start else "gemv"
        assert torch.equal(cpu.linear_bf16(x, w, lib=lib).view(torch.int16), paths[want]), m
        assert not torch.equal(paths["gemv"], paths["gemm"])


def _fused_model(kind: str, pack_w4, pack_w8a8=None):
    """A 2-layer Llama-shaped FusedModel (GQA 4 / 2 heads of 16, a bf16 paged cache of 16 blocks of 4) with random
    weights (the same for every call), its projections all `kind`: bf16, int8 per row with fp32 scales (W8A16, or
    W8A8: packed by pack_w8a8), or int4 in groups of 64 (w = q * s + z) stored by pack_w4 (each implementation's own
    layout)."""
    from infertune.kernels.interface import FusedLayer, FusedModel, KernelLinear

    g = torch.Generator().manual_seed(5)
    hidden, heads, kv, d, inter, bs, blocks = 64, 4, 2, 16, 128, 4, 16

    def lin(n, k):
        w = (torch.randn(n, k, generator=g) * k**-0.5).bfloat16()
        if kind == "bf16":
            return KernelLinear("bf16", n, k, weight=w)
        if kind == "w4":
            q = torch.randint(0, 16, (n, k), generator=g)
            s = torch.rand(n, k // 64, generator=g) * 0.2 / k**0.5
            return KernelLinear("w4", n, k, qweight=pack_w4(q), scales=s, zero=-7.5 * s, group_size=64)
        s = w.float().abs().amax(dim=1) / 127
        q = torch.round(w.float() / s[:, None]).clamp(-127, 127).to(torch.int8)
        if kind == "w8a8":
            return KernelLinear("w8a8", n, k, qweight=pack_w8a8(q), scales=s)
        return KernelLinear("w8", n, k, qweight=q, scales=s)

    pos = torch.arange(64, dtype=torch.float32)[:, None] * 10000 ** (-torch.arange(0, d, 2) / d)
    m = FusedModel(
        hidden=hidden,
        n_heads=heads,
        n_kv_heads=kv,
        head_dim=d,
        inter=inter,
        block_size=bs,
        eps=1e-6,
        scale=d**-0.5,
        cos_sin=torch.cat([pos.cos(), pos.sin()], dim=1).contiguous(),
        kv_int8=False,
        embed=torch.randn(100, hidden, generator=g).bfloat16(),
        final_norm=(1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16(),
        final_eps=1e-6,
        max_context=8 * bs,
        step_rows=16,
    )
    for _ in range(2):
        m.layers.append(
            FusedLayer(
                input_norm=(1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16(),
                post_norm=(1 + 0.1 * torch.randn(hidden, generator=g)).bfloat16(),
                qkv=lin((heads + 2 * kv) * d, hidden),
                o=lin(hidden, heads * d),
                gate_up=lin(2 * inter, hidden),
                down=lin(hidden, inter),
                kv_cache=torch.randn(2, blocks, bs, kv, d, generator=g).bfloat16(),
            )
        )
    return m


@pytest.mark.parametrize("kind", ["bf16", "w8", "w4", "w8a8"])
def test_neon_fused_step_matches_the_pytorch_step(lib, kind):
    """it_decode_layers on NEON (csrc/arm/neon/fused.c under csrc/fused_step.h), through the same X86FusedDecoder the
    engine uses, for a decode step of 3 sequences (contexts of 6, 11 and 1 tokens over scattered blocks, the cache's
    earlier entries random): against a step in plain PyTorch from the same weights (tests/test_kernel_interface.py
    TorchFused, its int4 in a layout of its own), as close as the AVX2 library's own fused step on the same inputs;
    the new K/V rows land in the cache as the reference writes them; the engine's counters count the step."""
    from test_kernel_interface import TorchFused, TorchKernels

    from infertune.kernels.arm import NeonKernels
    from infertune.kernels.x86 import Avx2Kernels

    ref_kernels = TorchKernels()
    # (W8A8: packed by the NEON library, whose layout is the AVX2 one's: the AVX2 step below reads the same weights)
    neon_pack = lambda q: cpu.pack_w8a8(q, lib=lib)  # noqa: E731
    m, m_ref = (
        _fused_model(kind, cpu.pack_w4, neon_pack),
        _fused_model(kind, ref_kernels.pack_w4, ref_kernels.pack_w8a8),
    )
    caches = [layer.kv_cache.clone() for layer in m.layers]
    ids = torch.tensor([3, 41, 97])
    lens = torch.tensor([6, 11, 1])
    tables = torch.tensor([[5, 2, 0], [7, 1, 12], [9, 0, 0]])
    positions = lens - 1
    slots = tables.gather(1, (positions // 4)[:, None]).squeeze(1) * 4 + positions % 4

    def run(decoder, model=m):
        for layer, c in zip(model.layers, caches):
            layer.kv_cache.copy_(c)
        out = decoder(ids, positions, slots, tables, lens).float().clone()
        return out, [layer.kv_cache.clone() for layer in model.layers]

    ref, ref_cache = run(TorchFused(m_ref, ref_kernels), m_ref)
    neon_dec = NeonKernels(lib).fused_decoder(m)
    assert not isinstance(neon_dec, str), neon_dec
    got, got_cache = run(neon_dec)
    avx2 = cpu.load_variant("avx2")
    if isinstance(avx2, str):
        pytest.skip(avx2)
    base, _ = run(Avx2Kernels(avx2).fused_decoder(m))
    err, base_err = (got - ref).abs().max().item(), (base - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 1.5 * base_err + 2**-7 * scale, (err, base_err, scale)
    for c0, c_ref, c_got in zip(caches, ref_cache, got_cache):
        written = (c_ref != c0).any(dim=(-1, -2)) | (c_got != c0).any(dim=(-1, -2))  # [2, blocks, bs]
        assert written.sum() == 2 * 3  # K and V of the 3 new tokens, nowhere else
        torch.testing.assert_close(c_got.float(), c_ref.float(), rtol=2**-6, atol=2**-6 * c_ref.abs().max().item())
    timers = neon_dec.step_timers()
    assert (timers["calls"], timers["rows"]) == (1, 3) and timers["attention"] > 0, timers


def _fused_moe_only():
    from infertune.kernels.arm import NeonKernels

    class FusedMoeOnly(NeonKernels):
        """The prompts' per-module MoE layers decline the kernels (PyTorch's reference runs them: the harness has no
        per-module MoE ops); the fused step's MoE layers run in C under qemu."""

        def moe_route(self, logits, moe, correction_bias=None, tied=None):
            return None

        def moe_experts(self, x, experts, routing):
            return None

    return FusedMoeOnly


@pytest.mark.parametrize(
    "arch,kv",
    [
        ("llama", "auto"),
        ("llama", "int8"),
        ("llama", "int8+int4"),
        ("mistral", "auto"),
        ("qwen2", "auto"),
        ("gemma2", "auto"),
        ("gemma3", "auto"),
        ("deepseek", "auto"),
        ("deepseek", "int8"),
        ("deepseek-moe", "auto"),
        ("qwen3_moe-ties", "auto"),
        ("llama", "auto+w8a8"),
        ("deepseek-moe", "auto+w8a8"),
    ],
)
def test_the_engine_on_the_neon_kernels_matches_hf(lib, tmp_path, monkeypatch, arch, kv):
    """The bf16 engine on NeonKernels (every kernel call under qemu), its fused step taking the decode steps (and,
    with a bf16 cache, the prompts), against HF transformers in float32: HF's greedy tokens up to bf16
    noise (bf16 cache), and logprobs as close as the engine's without kernels on the same cache; the fused step ran
    every decode step (that engine's own counters). Mistral: a window of 3 on every layer; Qwen2: layer 1 windowed
    beside a full layer 0 (two KV cache groups, each with its own block tables); Gemma 2 / 3: test_gemma's models
    (sandwich norms, GeLU, soft-capping, each layer kind's rotary table, windows of 6 on alternate layers);
    int8+int4: the int4 tier, every two full blocks of 2 tokens packed (the fused step reads int4 entries);
    DeepSeek-V3's latent attention (csrc/mla.h: its 16-wide vectors as NEON registers) over a bf16 and an int8
    latent cache, every layer dense; deepseek-moe: with its MoE layers (the fp32 router with the correction bias and
    groups, the grouped experts, the shared expert; ties handed back to route()); +w8a8: quantization="w8a8" (the
    NEON int8 x int8 product in the fused step and the per-module linears, the experts too; HF's tokens are then not
    the oracle, the engine's own torch path on the same int8 weights is: as close to HF's logprobs); qwen3_moe-ties:
    a Qwen3-MoE whose experts 0 and 1 have the same router row (test_moe_kernels' checkpoint), so the fused step's
    layers hand the rows tied at the top-k boundary back to route() and resume with its picks (counted: some did)."""
    from conftest import hf_model, make_checkpoint
    from test_kernels import _hf_logprob_errors

    from infertune import LLM, SamplingParams
    from infertune.backends.cpu import CPUBackend
    from infertune.kernels.arm import NeonKernels

    _FusedMoeOnly = _fused_moe_only()

    window = {
        "deepseek": {},
        "deepseek-moe": {},
        "qwen3_moe-ties": {},
        "gemma2": {},
        "gemma3": {},
        "llama": {},
        "mistral": dict(sliding_window=3),
        "qwen2": dict(use_sliding_window=True, sliding_window=3, max_window_layers=1),
    }[arch]
    if arch == "qwen3_moe-ties":
        from safetensors.torch import load_file, save_file
        from test_moe_kernels import _attention_free_checkpoint

        model = _attention_free_checkpoint(tmp_path, "qwen3_moe", ties="some")
        state = load_file(model / "model.safetensors")  # (expert 1 far from expert 0: a tie decided the other way
        for name in state:  # shows in the tokens)
            if ".experts.1.down_proj." in name:
                state[name] = state[name] * -8
        save_file(state, model / "model.safetensors", metadata={"format": "pt"})
    elif arch.startswith("gemma"):
        from test_gemma import VARIANTS, make_gemma

        model = make_gemma(tmp_path / "m", **VARIANTS[arch])
    elif arch.startswith("deepseek"):
        from test_deepseek import LAYERS, VARIANTS, make_deepseek_checkpoint

        dense = {} if arch == "deepseek-moe" else {"first_k_dense_replace": LAYERS}
        model = make_deepseek_checkpoint(tmp_path / "m", **VARIANTS["v3"], **dense)
    else:
        model = make_checkpoint(
            tmp_path / "m",
            arch,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            tie_word_embeddings=True,
            dtype=torch.bfloat16,
            **window,
        )
    prompts = [{"prompt_token_ids": [3, 11, 25, 40]}, {"prompt_token_ids": [7, 9, 60]}]
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=1)
    hf = hf_model(model).float()
    worst = {}
    for mode in ("neon", "off"):
        moe = arch in ("deepseek-moe", "qwen3_moe-ties")
        ks = (_FusedMoeOnly if moe else NeonKernels)(lib) if mode == "neon" else None
        monkeypatch.setattr(CPUBackend, "decode_kernels", lambda self, ks=ks: ks)
        # (a small cache: the harness ships each layer's whole cache to qemu and back every step)
        llm = LLM(
            str(model),
            dtype="bfloat16",
            max_model_len=32,
            kv_cache_memory_bytes=1 << 18,
            max_num_seqs=2,
            kv_cache_dtype=kv.split("+")[0],
            **(dict(kv_int4_after=0, block_size=2) if kv == "int8+int4" else {}),
            **(dict(quantization="w8a8") if kv.endswith("+w8a8") else {}),
        )
        runner = llm.engine.executor.runner
        if mode == "neon":
            assert runner.decode_kernels is ks and runner.fused is not None
            runner.fused.step_timers(reset=True)
        worst[mode] = max(_hf_logprob_errors(llm, prompts, params, hf, argmax=kv == "auto"))
        if mode == "neon" and kv.endswith("+w8a8"):  # (the int8 x int8 product ran in the NEON library)
            lin = runner.model.model.layers[0].self_attn.o_proj
            assert lin.quant_method.own_layout and lin.quant_method.kernel_rows > 0
        if mode == "neon":  # the 4 decode steps at least (and the prompts' step with a bf16 cache)
            want = 5 if kv == "auto" and not arch.startswith("deepseek") and not moe else 4  # (decode steps only)
            assert runner.fused.step_timers()["calls"] >= want, runner.fused.step_timers()
            if arch == "qwen3_moe-ties":  # (the tied rows went to route(), the others kept the step's picks)
                dec = runner.fused.decoder
                assert dec.handbacks > 0 and 0 < dec.handback_rows, (dec.handbacks, dec.handback_rows)
            if kv == "int8+int4":
                assert llm.engine.block_manager.num_int4_packs == 2  # (each sequence its first two blocks)
    assert worst["neon"] <= 1.5 * worst["off"] + 0.02, worst


def test_neon_w8a8_without_the_dot_product_is_exact_too(lib, monkeypatch):
    """W8A8 on a baseline Armv8-A CPU (no FEAT_DotProd: SMULL + SADALP instead of SDOT; qemu has SDOT, so the
    library is told not to use it): the same exact-integer oracle as tests/test_kernels.py's (which runs the SDOT
    path on NEON)."""
    from test_kernels import test_w8a8_is_exact_integer_arithmetic_then_the_reference_rounding as exact_w8a8

    from infertune.kernels.arm import NeonKernels

    monkeypatch.setenv("INFERTUNE_NEON_DOTPROD", "0")  # (each call's qemu process reads it)
    exact_w8a8(NeonKernels(lib))
