"""The CPU kernels by ISA: torch limited to AVX2 must not crash bf16 runs, the C and Python sides of the kernels
agree (ABI version, struct sizes and offsets, weight kinds), the sources build warning-free, and the AVX2 + FMA
variant is held to the same oracles as the AVX-512 one (forced on with INFERTUNE_CPU_ISA=avx2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from infertune.kernels import cpu

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(code: str, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess:
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")]), **env}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True, timeout=timeout
    )


def test_bf16_generates_with_torch_limited_to_avx2(tmp_path):
    """ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 (what an AVX2-only CPU gets) with the kernels off: the bf16
    engine must not ask oneDNN for its AVX-512 bf16 weight packing (it raises), and must generate."""
    from conftest import make_checkpoint

    model = make_checkpoint(
        tmp_path / "m", "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2, dtype=torch.bfloat16
    )
    code = f"""
        import json, torch
        from infertune import LLM, SamplingParams
        from infertune.backends.cpu import CPUBackend, cpu_supports_bf16
        llm = LLM({str(model)!r}, dtype="bfloat16", max_model_len=64)
        out = llm.generate([{{"prompt_token_ids": [3, 4, 5]}}], SamplingParams(max_tokens=4, ignore_eos=True),
                           use_tqdm=False)
        print(json.dumps({{"cap": torch.backends.cpu.get_cpu_capability(), "bf16": cpu_supports_bf16(),
                           "prepack": CPUBackend().can_prepack(torch.bfloat16, 64),
                           "tokens": out[0].outputs[0].token_ids}}))
    """
    env = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "INFERTUNE_CPU_KERNELS": "0"}
    proc = _run(code, env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["cap"] == "AVX2" and not got["bf16"] and not got["prepack"], got
    assert len(got["tokens"]) == 4


def test_onednn_limit_alone_disables_prepacking():
    """ONEDNN_MAX_CPU_ISA=AVX2 alone (ATen still AVX-512) is enough to make oneDNN refuse bf16 packing."""
    code = """
        import torch
        from infertune.backends.cpu import CPUBackend
        print(CPUBackend().can_prepack(torch.bfloat16, 64))
        CPUBackend().prepack_linear_weight(torch.zeros(16, 32, dtype=torch.bfloat16))
    """
    proc = _run(code, {"ONEDNN_MAX_CPU_ISA": "AVX2", "INFERTUNE_CPU_KERNELS": "0"}, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "False"


# ---- the C / Python agreement ----------------------------------------------------------------------------------

needs_x86 = pytest.mark.skipif(
    cpu._compiler() is None or os.uname().machine != "x86_64", reason="x86-64 + a C compiler"
)


def _variant_lib(name: str):
    lib = cpu.load_variant(name)
    if isinstance(lib, str):
        pytest.skip(lib)
    return lib


@pytest.mark.parametrize("name", ["avx512", "avx2"])
def test_abi_of_each_variant_matches_the_ctypes_declarations(name):
    lib = _variant_lib(name)
    assert cpu.check_abi(lib) is None
    assert lib.it_abi() == cpu.ABI_VERSION
    kinds = [v for k, v in cpu.abi_layout() if k.startswith("it_kind")]
    assert kinds == [int(k) for k in cpu.WeightKind] == [0, 1, 2, 3, 4, 5, 6]


def test_a_mismatched_struct_fails_the_abi_check_loudly():
    """A ctypes class with a field removed, or one of the wrong width (padding keeps the offsets: the widths are checked
    too), is reported field by field, never used."""
    import ctypes

    lib = cpu.load_variant("avx512")
    lib = _variant_lib("avx2") if isinstance(lib, str) else lib
    missing = [f for f in cpu.ItStep._fields_ if f[0] != "max_blocks"]
    ShortStep = type("ShortStep", (ctypes.Structure,), {"_fields_": missing})
    problem = cpu.check_abi(lib, {"it_step": ShortStep})
    assert problem and "sizeof(it_step)" in problem and "offsetof(it_step, max_blocks)" in problem, problem
    narrow = [(n, ctypes.c_int32 if n == "N" else t) for n, t in cpu.ItLin._fields_]
    NarrowLin = type("NarrowLin", (ctypes.Structure,), {"_fields_": narrow})
    problem = cpu.check_abi(lib, {"it_lin": NarrowLin})
    assert problem and "sizeof(it_lin.N): C 8, Python 4" in problem, problem
    # the engine's own step counters (it_step_stats): one timed part short
    short = [
        ("seconds", ctypes.c_double * (len(cpu.FUSED_PARTS) - 1)),
        ("calls", ctypes.c_int64),
        ("rows", ctypes.c_int64),
    ]
    ShortStats = type("ShortStats", (ctypes.Structure,), {"_fields_": short})
    problem = cpu.check_abi(lib, {"it_step_stats": ShortStats})
    assert problem and "sizeof(it_step_stats)" in problem and "offsetof(it_step_stats, calls)" in problem, problem


def test_an_abi_mismatch_disables_the_kernels_with_the_reason(monkeypatch):
    """At load, a mismatch is a reason (the engine then runs torch's kernels), not a crash or a corrupt call."""
    monkeypatch.setattr(cpu, "ABI_VERSION", cpu.ABI_VERSION + 100)
    got = cpu._load_variant(cpu.VARIANTS["avx2"])
    if "lacks" in str(got) or "compiler" in str(got):
        pytest.skip(str(got))
    assert isinstance(got, str) and "ABI version" in got and "do not match" in got, got


@needs_x86
@pytest.mark.parametrize("name", ["avx512", "avx2"])
def test_each_variant_builds_warning_free_with_werror(tmp_path, name):
    """-Wall -Wextra -Werror: a warning in any file of a variant fails here (the build itself only logs them)."""
    out = cpu.build_library(cpu.VARIANTS[name], cpu._compiler(), extra_flags=("-Werror",), out_dir=tmp_path)
    assert out.exists()


def test_the_cache_key_covers_every_source_file(tmp_path, monkeypatch):
    """A change to any header or part under csrc/ changes the digest the build cache is keyed by."""
    import shutil

    copy = tmp_path / "csrc"
    shutil.copytree(cpu.CSRC, copy)
    monkeypatch.setattr(cpu, "CSRC", copy)
    before = cpu.sources_digest()
    assert {p.name for p in copy.rglob("*.h")} >= {"bf16.h", "abi.h", "act_i16.h", "vec512.h", "vec256.h"}
    for f in (copy / "bf16.h", copy / "x86" / "avx2" / "gemv.c", copy / "x86" / "avx512" / "attention.c"):
        f.write_text(f.read_text() + "\n")
        after = cpu.sources_digest()
        assert after != before
        before = after


def test_the_avx2_library_is_avx2_only():
    """Built with -mavx2 -mfma -mf16c only: no AVX-512 register or mask anywhere in it."""
    lib = _variant_lib("avx2")
    objdump = shutil_which("objdump")
    if objdump is None:
        pytest.skip("no objdump")
    text = subprocess.run([objdump, "-d", lib._name], capture_output=True, text=True).stdout
    assert "ymm" in text and "zmm" not in text and "%k1" not in text


# The micro-kernels that take a prefetch plan and the attention that asks for K / V ahead: each must still hold
# prefetch instructions once built (GCC deleted a call to a helper whose only effect was a prefetch: bf16.h's
# IT_PREFETCH_FN)
_PREFETCHING = {
    "avx512": [f"gemm_micro_{r}" for r in range(1, 7)]
    + [f"i8_micro_{r}" for r in range(1, 7)]
    + [f"attn_heads_{g}" for g in range(1, 9)],
    "avx2": [f"fma_micro_{r}" for r in range(1, 7)] + ["attn2_heads"],
}


@needs_x86
@pytest.mark.parametrize("name", ["avx512", "avx2"])
def test_the_prefetching_kernels_keep_their_prefetches(name):
    """Disassembled, every function of _PREFETCHING holds a PREFETCHh instruction (a mutation: a prefetch helper
    without always_inline loses them from the GEMM micro-kernels)."""
    objdump = shutil_which("objdump")
    if objdump is None:
        pytest.skip("no objdump")
    lib = cpu.build_library(cpu.VARIANTS[name], cpu._compiler())
    text = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True).stdout
    found: dict[str, int] = {}
    fn = None
    for line in text.splitlines():
        if line.endswith(">:"):
            fn = line.split("<", 1)[1][:-2]
            found.setdefault(fn, 0)
        elif fn is not None and "\tprefetch" in line:
            found[fn] += 1
    missing = [f for f in _PREFETCHING[name] if f not in found]
    assert not missing, f"not in the library (renamed? update _PREFETCHING): {missing}"
    assert [f for f in _PREFETCHING[name] if found[f] == 0] == []


def shutil_which(name):
    import shutil

    return shutil.which(name)


# ---- choosing a variant -------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "env,variant,name",
    [
        ({"INFERTUNE_CPU_ISA": "avx2"}, "avx2", "x86 avx2+fma"),
        ({"INFERTUNE_CPU_ISA": "avx512-noamx"}, "avx512-noamx", "x86 avx512-bf16/vnni"),
        ({"ATEN_CPU_CAPABILITY": "avx2"}, "avx2", "x86 avx2+fma"),
        ({"INFERTUNE_CPU_ISA": "sve"}, None, None),  # not a variant: the reason lists the choices
        ({"INFERTUNE_CPU_ISA": "neon"}, None, "aarch64"),  # a variant for another machine: the reason says so
    ],
)
def test_the_variant_is_forced_by_the_environment(env, variant, name):
    needed = {"avx2": ("avx2", "fma", "f16c"), "avx512-noamx": cpu.REQUIRED_FLAGS, None: ()}[variant]
    other_machine = name if variant is None else None
    name = None if variant is None else name
    if not all(f in cpu._cpu_flags() for f in needed) or cpu._compiler() is None:
        pytest.skip("this CPU cannot run that variant")
    code = """
        import json
        from infertune.kernels import cpu, x86
        k = x86.kernels()
        print(json.dumps({"variant": cpu.variant(), "name": k.name if k else None, "reason": cpu.unavailable_reason(),
                          "bf16_rows": cpu.bf16_max_rows(), "describe": cpu.describe()}))
    """
    proc = _run(code, env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["variant"] == variant and got["name"] == name, got
    if other_machine:
        assert f"for {other_machine}, this is x86_64" in got["reason"], got
    elif variant is None:
        assert "INFERTUNE_CPU_ISA" in got["reason"] and "neon" in got["reason"], got
    else:
        # no AMX tile GEMM on either; without AMX the AVX-512 library's VDPBF16PS GEMM takes bf16 rows past the GEMV's,
        # on AVX2 the FMA GEMM (every step size)
        want = {"avx512-noamx": cpu.NOAMX_GEMM_MAX_ROWS, "avx2": cpu.AVX2_GEMM_MAX_ROWS}[variant]
        assert got["bf16_rows"] == want, got


def test_the_engine_says_at_start_up_which_variant_runs(tmp_path):
    from conftest import make_checkpoint

    if not all(f in cpu._cpu_flags() for f in ("avx2", "fma", "f16c")) or cpu._compiler() is None:
        pytest.skip("no AVX2 here")
    model = make_checkpoint(
        tmp_path / "m", "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1, dtype=torch.bfloat16
    )
    code = f"""
        import logging
        logging.basicConfig(level=logging.INFO)
        from infertune import LLM
        LLM({str(model)!r}, dtype="bfloat16", max_model_len=64)
    """
    proc = _run(code, {"INFERTUNE_CPU_ISA": "avx2"}, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if "decode kernels" in line]
    assert len(lines) == 1 and "avx2+fma" in lines[0], lines


# ---- the engine on the AVX2 variant against HF transformers --------------------------------------------------------


@pytest.mark.parametrize("quant", [None, "w8a16", "w4a16"])
def test_engine_on_the_avx2_kernels_matches_hf(tmp_path, monkeypatch, quant):
    """The bf16 engine with the AVX2 kernels against HF transformers in float32, both with the linear and elementwise
    kernels under the per-op forward (the fused step refused) and with the fused step (every decode step, and the
    prompt step, in one C call): unquantized every greedy token is HF's argmax up to bf16 noise; the logprobs are
    as close to HF's as those of the engine on torch's matmuls (tests/test_kernels.py's tolerances)."""
    from conftest import hf_model, make_checkpoint
    from test_kernels import _hf_logprob_errors

    from infertune import LLM, SamplingParams
    from infertune.backends.cpu import CPUBackend
    from infertune.kernels import x86
    from infertune.layers.linear import DecodeKernelMethod, Linear

    ks = x86.Avx2Kernels(_variant_lib("avx2"))
    fused_decoder = ks.fused_decoder
    calls = []
    for name in ("linear_bf16", "linear_w8", "linear_w4", "rms_norm", "silu_and_mul", "rotary_"):
        real = getattr(ks, name)
        setattr(ks, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    model = make_checkpoint(
        tmp_path / "m",
        "llama",
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=3,
        tie_word_embeddings=True,
        dtype=torch.bfloat16,
    )
    prompts = [{"prompt_token_ids": [3 + i, 11, 25, 40 + i]} for i in range(5)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=1)
    hf = hf_model(model).float()
    worst = {}
    for mode in ("avx2", "avx2-fused", "off"):
        monkeypatch.setattr(CPUBackend, "decode_kernels", lambda self, mode=mode: ks if mode != "off" else None)
        ks.fused_decoder = fused_decoder if mode == "avx2-fused" else (lambda model: "refused for this test")
        llm = LLM(str(model), dtype="bfloat16", quantization=quant, max_model_len=64, quant_group_size=64)
        runner = llm.engine.executor.runner
        methods = {type(m.quant_method).__name__ for m in runner.model.modules() if isinstance(m, Linear)}
        if mode != "off":
            assert runner.decode_kernels is ks and (runner.fused is None) == (mode == "avx2")
            assert DecodeKernelMethod.__name__ in methods
        worst[mode] = max(_hf_logprob_errors(llm, prompts, params, hf, argmax=quant is None))
        if mode == "avx2-fused":  # every decode step (5 sequences, 11 steps) ran through it (this engine's count)
            assert runner.fused.step_timers()["calls"] >= 11, runner.fused.step_timers()
        if mode == "avx2":
            used = set(calls)
            assert {"rms_norm", "silu_and_mul", "rotary_"} <= used, used
            assert {None: "linear_bf16", "w8a16": "linear_w8", "w4a16": "linear_w4"}[quant] in used, used
    assert worst["avx2"] <= 1.5 * worst["off"] + 0.02, worst
    assert worst["avx2-fused"] <= 1.5 * worst["off"] + 0.02, worst
