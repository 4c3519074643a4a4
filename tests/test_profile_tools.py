"""The diagnosis tools: doctor (version matrix, CPU, threads), audit (op trace vs backend tables), debug-layers.

Oracles: planted facts and their sourced matrix rows (doctor); nn.Module call counts and the model's shape
arithmetic, and the fact that the CPU really ran every traced op (audit); a NaN planted in a known module
and bit-identical fp32 runs (debug-layers).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import pytest
import torch
from conftest import make_checkpoint

from infertune.profile import audit, debug_layers, doctor
from infertune.profile.doctor import check_all, check_cann, check_cuda, check_threads, check_torch_npu, load_compat
from infertune.profile.env_facts import EnvFacts, gather, read_cann_version
from infertune.profile.op_tables import DATA_DIR, AtenFacts, OpTable
from infertune.profile.op_trace import OpRecorder, trace_engine_steps

LAYERS = 3
PROMPT_LEN = 12


# ---- doctor ----------------------------------------------------------------------------------------------


def facts(**changes) -> EnvFacts:
    """A healthy CPU-only machine; tests change one fact at a time."""
    base = EnvFacts(
        python="3.11.7",
        platform="Linux x86_64",
        packages={
            "torch": "2.13.0+cpu",
            "transformers": "5.24.0",
            "tokenizers": "0.23.3",
            "safetensors": "0.8.0",
            "infertune": "0.1.0",
            "torch_npu": None,
        },
        requirements=["torch>=2.5", "transformers>=4.45", "tokenizers>=0.20", "safetensors>=0.4"],
        requires_python=">=3.10",
        cpu_model="test cpu",
        cpu_flags=["avx2", "avx512f"],
        cpu_capability="AVX512",
        torch_threads=2,
        affinity_cpus=2,
        os_cpus=2,
        load_1m=0.0,
        mem_total=16 * 2**30,
        mem_available=8 * 2**30,
    )
    return replace(base, **changes)


def npu_facts(torch_v: str, npu: str | None, cann: str | None) -> EnvFacts:
    f = facts(cann=cann)
    return replace(f, packages=f.packages | {"torch": torch_v, "torch_npu": npu})


@pytest.fixture(scope="module")
def compat():
    return load_compat()


def test_doctor_fails_on_torch_npu_built_for_another_torch(compat):
    bad = npu_facts("2.1.0", "2.3.1", None)
    assert check_torch_npu(bad, compat).status == "FAIL"
    assert doctor.exit_code(check_all(bad, compat)) == 1
    # A pair straight from the Ascend/pytorch README table passes; a patch-level difference only warns.
    readme_row = next(r for r in compat["cann_torch"] if r["cann"] == "8.0.RC2" and r["torch"] == "2.1.0")
    assert check_torch_npu(npu_facts("2.1.0", readme_row["torch_npu"], None), compat).status == "OK"
    assert check_torch_npu(npu_facts("2.3.0", "2.3.1", None), compat).status == "WARN"


def test_doctor_fails_on_a_cann_torch_pair_outside_the_seed_matrix(compat):
    # seeds: CANN 7.0.T10 <-> torch 2.1.0, T13 <-> 2.2.0, T15 <-> 2.3.0
    mismatch = check_cann(npu_facts("2.1.0", "2.1.0", "7.0.T13"), compat)
    assert mismatch.status == "FAIL"
    assert "2.2.0" in mismatch.detail and "torch==2.2.0" in mismatch.fix and "7.0.T10" in mismatch.fix
    assert doctor.exit_code(check_all(npu_facts("2.1.0", "2.1.0", "7.0.T13"), compat)) == 1
    for cann, torch_v in (("7.0.T10", "2.1.0"), ("7.0.T13", "2.2.0"), ("7.0.T15", "2.3.0")):
        assert check_cann(npu_facts(torch_v, torch_v, cann), compat).status == "OK", cann
    # README rows: CANN 8.0.RC1 ships torch_npu for 2.2.0 / 2.1.0 / 1.11.0, not 2.3.1.
    assert check_cann(npu_facts("2.3.1", "2.3.1", "CANN 8.0.RC1"), compat).status == "FAIL"
    assert check_cann(npu_facts("2.2.0", "2.2.0", "8.0.RC1"), compat).status == "OK"
    assert check_cann(npu_facts("2.2.0", "2.2.0", "9.9.X"), compat).status == "WARN"  # not in the matrix


def test_every_matrix_row_names_a_known_source_and_keeps_the_major_minor_rule(compat):
    for row in compat["cann_torch"] + compat["cuda_min_driver"]:
        assert row["source"] in compat["sources"], row
    for row in compat["cann_torch"]:
        if row["torch_npu"]:
            assert doctor.release(row["torch_npu"])[:2] == doctor.release(row["torch"])[:2], row


def test_cann_version_is_read_from_the_toolkit_files(tmp_path):
    home = tmp_path / "toolkit"
    (home / "aarch64-linux").mkdir(parents=True)
    (home / "aarch64-linux" / "ascend_toolkit_install.info").write_text(
        "package_name=Ascend-cann-toolkit\nversion=7.0.T13\ninnerversion=V100R001C15B100\n"
    )
    assert read_cann_version({"ASCEND_TOOLKIT_HOME": str(home)}) == (
        "7.0.T13",
        str(home / "aarch64-linux" / "ascend_toolkit_install.info"),
    )
    cfg_home = tmp_path / "old"
    cfg_home.mkdir()
    (cfg_home / "version.cfg").write_text(
        "runtime_running_version=[7.3.0.1.231:8.0.RC2]\ntoolkit_running_version=[7.3.0.1.231:8.0.RC2]\n"
    )
    assert read_cann_version({"ASCEND_HOME_PATH": str(cfg_home)})[0] == "8.0.RC2"


def test_doctor_cuda_driver_floor_and_threads(compat):
    assert check_cuda(facts(torch_cuda="12.4", cuda_driver="470.82.01", gpus=["A100"]), compat).status == "FAIL"
    assert (
        check_cuda(facts(torch_cuda="12.4", cuda_driver="550.54.15", gpus=["A100"], cuda_available=True), compat).status
        == "OK"
    )
    busy = {c.name: c for c in check_threads(facts(load_1m=1.5))}
    assert busy["threads.load"].status == "WARN" and "OMP_NUM_THREADS=1" in busy["threads.load"].fix
    assert {c.name: c.status for c in check_threads(facts(torch_threads=4))}["threads.count"] == "WARN"
    assert all(c.status == "OK" for c in check_threads(facts()))


def test_doctor_reports_the_decode_kernels():
    from infertune.profile.doctor import check_cpu

    kernels = lambda f: {c.name: c for c in check_cpu(f)}["cpu.kernels"]  # noqa: E731
    assert kernels(facts()).status == "OK" and "built and loaded" in kernels(facts()).detail
    assert "12 bits" not in kernels(facts()).detail  # no AMX in the default facts
    amx = kernels(facts(cpu_flags=["avx2", "avx512f", "avx512_bf16", "avx512vbmi", "amx_tile", "amx_bf16"]))
    assert "12 bits" in amx.detail and "compress_weights" in amx.detail
    no_cc = kernels(facts(cpu_kernels_unavailable="no C compiler (cc, gcc or clang) on PATH"))
    assert no_cc.status == "WARN" and "gcc" in no_cc.fix
    assert kernels(facts(cpu_kernels_unavailable="this CPU lacks avx512_bf16")).status == "OK"


def test_doctor_says_whether_weights_can_sit_on_2mb_pages():
    from infertune.kernels import hugepages
    from infertune.profile.doctor import check_hugepages

    got = {m: check_hugepages(facts(transparent_hugepages=m)) for m in ("madvise", "always", "never", "off", None)}
    assert got["madvise"].status == got["always"].status == "OK" and "2 MB pages" in got["madvise"].detail
    assert (
        got["never"].status == "WARN"
        and "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled" in got["never"].fix
    )
    assert got["off"].status == "OK" and "INFERTUNE_HUGEPAGES" in got["off"].fix
    assert got[None].status == "SKIP"
    assert gather().transparent_hugepages == hugepages.mode()  # the facts read this system's setting


def test_doctor_says_which_w8a8_product_runs():
    """W8A8: infertune's own int8 kernel; else torch._int_mm where its sums are exact; a warning where they are not
    (oneDNN without VNNI), which the real probe reproduces with torch limited to AVX2 (quant/int8.py)."""
    from infertune.profile.doctor import check_cpu

    def w8a8(f):
        return {c.name: c for c in check_cpu(f)}.get("cpu.w8a8")

    assert (
        w8a8(facts(w8a8_kernel=True)).status == "OK" and "infertune's kernels" in w8a8(facts(w8a8_kernel=True)).detail
    )
    assert w8a8(facts(w8a8_kernel=False, int_mm_exact=True)).status == "OK"
    bad = w8a8(facts(w8a8_kernel=False, int_mm_exact=False))
    assert bad.status == "WARN" and "float64" in bad.detail and "w8a16" in bad.fix
    assert w8a8(facts()) is None  # (facts from an older report: nothing said)


def test_doctor_passes_on_this_machine_and_its_json_round_trips(compat, capsys):
    real = gather()
    checks = check_all(real, compat)
    assert not [c for c in checks if c.status == "FAIL"], checks
    for c in checks:
        assert c.status == "OK" or c.status == "SKIP" or c.fix, c  # every warning says what to fix
    report = doctor.report_dict(real, checks)
    again = json.loads(json.dumps(report))
    assert again == report
    assert EnvFacts.from_dict(again["facts"]) == real
    assert [doctor.Check(**c) for c in again["checks"]] == check_all(EnvFacts.from_dict(again["facts"]), compat)

    parser = argparse.ArgumentParser()
    doctor.add_arguments(parser)
    assert doctor.run(parser.parse_args(["--json"])) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["exit_code"] == 0 and printed["facts"]["packages"]["torch"] == torch.__version__


# ---- audit -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama3"), "llama", num_hidden_layers=LAYERS)


@pytest.fixture(scope="module")
def engine_trace(tiny3):
    """One prefill + one decode of the 3-layer model, with every Linear module call counted by a hook."""
    from infertune.layers.linear import Linear
    from infertune.llm import LLM

    llm = LLM(str(tiny3), dtype="float32", device="cpu", max_model_len=64, max_num_seqs=1)
    model = llm.engine.executor.runner.model
    linear_calls = []
    hooks = [
        m.register_forward_hook(lambda *_: linear_calls.append(1)) for m in model.modules() if isinstance(m, Linear)
    ]
    try:
        trace = trace_engine_steps(llm, PROMPT_LEN)
    finally:
        for h in hooks:
            h.remove()
    return trace, len(linear_calls)


def _row(report, name, status=None):
    rows = [r for r in report.ops if r.op == name and (status is None or r.status == status)]
    assert rows, f"{name} not in the audit: {[r.op for r in report.ops]}"
    return rows[0]


def test_audit_op_counts_match_the_model(engine_trace):
    trace, linear_calls = engine_trace
    report = audit.audit_trace(trace, OpTable.load("cpu"))
    assert trace.phases["prefill"]["tokens_seen"] == PROMPT_LEN and trace.phases["decode"]["tokens_seen"] == 1
    per_step = LAYERS * 4 + 1  # qkv, o, gate_up, down per layer + lm_head
    mm = _row(report, "aten.mm.default")
    assert mm.counts == {"prefill": per_step, "decode": per_step}
    assert mm.total == linear_calls  # every Linear module call became exactly one mm
    assert _row(report, "aten.rsqrt.default").counts["prefill"] == 2 * LAYERS + 1  # RMSNorms
    assert _row(report, "aten._scaled_dot_product_flash_attention_for_cpu.default").counts["prefill"] == LAYERS
    assert mm.example_inputs[0].startswith(f"[{PROMPT_LEN}, 64]")


def test_audit_against_the_cpu_table_finds_nothing_missing(engine_trace):
    # The trace ran on the CPU, so a correct resolution must call every op the CPU ran native.
    report = audit.audit_trace(engine_trace[0], OpTable.load("cpu"))
    assert {r.status for r in report.ops} <= {"native", "decomposed"}, [
        (r.op, r.status) for r in report.ops if r.status not in ("native", "decomposed")
    ]


def test_audit_reports_an_op_missing_from_the_table_as_fallback_with_its_hint(engine_trace, tmp_path):
    table = json.loads((DATA_DIR / "ops_cpu.json").read_text())
    table["native"] = [op for op in table["native"] if op not in ("mm", "mm.out")]
    table |= {"backend": "fakenpu", "on_missing": "fallback-to-cpu", "hints": {"mm": "map mm to fake_matmul"}}
    path = tmp_path / "fake.json"
    path.write_text(json.dumps(table))
    report = audit.audit_trace(engine_trace[0], OpTable.load(str(path)))
    fallbacks = report.rows("fallback")
    assert [r.op for r in fallbacks] == ["aten.mm.default"]
    assert fallbacks[0].hint == "map mm to fake_matmul" and fallbacks[0].total == 2 * (LAYERS * 4 + 1)
    assert "aten.matmul.default" in fallbacks[0].called_from
    assert "FALLBACK    aten.mm.default" in audit.format_report(report)
    del table["hints"]
    path.write_text(json.dumps(table))
    generic = audit.audit_trace(engine_trace[0], OpTable.load(str(path))).rows("fallback")[0]
    assert "no fakenpu kernel" in generic.hint


def test_audit_against_the_npu_table(engine_trace):
    report = audit.audit_trace(engine_trace[0], OpTable.load("npu"))
    # The shipped NPU table is partial: nothing may be called a fallback, only native / decomposed / unknown.
    assert report.table["complete"] is False and not report.rows("fallback")
    sdpa = _row(report, "aten.scaled_dot_product_attention.default")
    assert sdpa.status == "native" and "op-plugin" in sdpa.hint  # registered by op-plugin, so not decomposed
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" not in {r.op for r in report.ops}
    assert _row(report, "aten.matmul.default").status == "native"  # op-plugin registers matmul itself


def test_audit_against_the_cuda_table(engine_trace):
    # Llama runs on CUDA with stock torch: everything must be native there, sdpa judged as a whole (the CPU
    # trace decomposed it into the CPU-only flash kernel, which CUDA does not have).
    report = audit.audit_trace(engine_trace[0], OpTable.load("cuda"))
    assert {r.status for r in report.ops} <= {"native", "decomposed"}
    assert _row(report, "aten.scaled_dot_product_attention.default").status == "native"


def test_audit_flags_shapes_that_change_between_prefill_and_decode(engine_trace):
    report = audit.audit_trace(engine_trace[0], OpTable.load("cpu"))
    varying = {d["op"]: d for d in report.hazards["shape_varies_between_steps"]}
    assert varying["aten.mm.default"]["prefill"][0].startswith(f"[{PROMPT_LEN}, ")
    assert varying["aten.mm.default"]["decode"][0].startswith("[1, ")
    assert not report.hazards["data_dependent_shape"] and not report.hazards["float64"]  # integer indices only


def test_audit_flags_troublemakers():
    a, b = torch.randn(4, 5), torch.randn(5, 3)
    x = torch.randn(16)
    recorder = OpRecorder()
    with torch.inference_mode(), recorder:  # as in the engine; with autograd on, composites decompose unseen
        torch.einsum("ij,jk->ik", a, b)
        x[x > 0]  # bool-mask indexing: data-dependent size
        x[torch.tensor([0, 3])]  # integer indexing: static
        torch.nonzero(x)
        x.double() * 2
        torch.ones(2, 2, dtype=torch.long) @ torch.ones(2, 2, dtype=torch.long)
    report = audit.audit_trace(recorder.trace, OpTable.load("cpu"))
    einsum = _row(report, "aten.einsum.default")
    assert einsum.status == "decomposed" and "aten.bmm.default" in einsum.decomposes_into and "matmul" in einsum.hint
    dynamic = {d["op"]: d["count"] for d in report.hazards["data_dependent_shape"]}
    assert dynamic == {"aten.index.Tensor": 1, "aten.nonzero.default": 1}
    assert report.hazards["float64"] and {d["op"] for d in report.hazards["integer_matmul"]} == {"aten.mm.default"}
    npu = audit.audit_trace(recorder.trace, OpTable.load("npu"))
    assert "seeds" in _row(npu, "aten.einsum.default").hint  # the NPU table's own, sourced hint wins


def test_aten_facts_agree_with_the_live_dispatcher():
    aten = AtenFacts.load()
    for key in ("linear", "matmul", "scaled_dot_product_attention", "einsum", "chunk"):
        assert key in aten.composite_implicit
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"aten::{key}", "CompositeImplicitAutograd")
    cpu = OpTable.load("cpu")
    for key in ("mm", "add.Tensor", "index.Tensor", "view", "nonzero"):
        name = "aten::" + key
        assert (key in cpu.native) == torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU"), key
    assert aten.structured_delegate["add.Tensor"] == "add.out"


def test_audit_command_json(tiny3, capsys):
    parser = argparse.ArgumentParser()
    audit.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny3), "--backend", "npu", "--prompt-len", "8", "--json"])
    assert audit.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["backend"] == "npu" and out["phases"]["prefill"]["tokens_seen"] == 8
    assert out["summary"]["fallback"] == 0 and any(
        op["op"] == "aten.mm.default" or op["op"] == "aten.matmul.default" for op in out["ops"]
    )


# ---- debug-layers ----------------------------------------------------------------------------------------

PROMPT_IDS = [5, 17, 42, 99, 7, 63, 120, 3]


@pytest.mark.parametrize("culprit", ["model.layers.1.mlp.down_proj", "model.layers.2.self_attn.o_proj"])
def test_debug_layers_names_the_module_with_a_planted_nan(tiny3, culprit):
    report = debug_layers.debug_layers(str(tiny3), PROMPT_IDS, dtype="float32", perturb=debug_layers.plant_nan(culprit))
    assert report.first_divergent == {
        "module": culprit,
        "index": report.first_divergent["index"],
        "reason": "non-finite",
    }
    before = report.modules[: report.first_divergent["index"]]
    assert before and all(m.nonfinite_share == 0 and m.max_abs == 0 for m in before)
    assert report.modules[-1].module == "lm_head" and report.modules[-1].nonfinite_share == 1.0


def test_debug_layers_clean_fp32_run_has_no_divergence(tiny3):
    report = debug_layers.debug_layers(str(tiny3), PROMPT_IDS, dtype="float32")
    assert report.first_divergent is None and report.first_nonfinite is None
    assert all(m.max_abs == 0 and m.nonfinite_share == 0 for m in report.modules)
    names = [m.module for m in report.modules]
    # Every decoder layer, its norms / attention / rotary / MLP, the final norm and lm_head, in execution order.
    for i in range(LAYERS):
        for part in (
            "input_layernorm",
            "self_attn.qkv_proj",
            "self_attn.rotary",
            "self_attn.o_proj",
            "post_attention_layernorm",
            "mlp.gate_up_proj",
            "mlp.down_proj",
        ):
            assert f"model.layers.{i}.{part}" in names
    assert names[0] == "model.embed_tokens" and names.index("model.norm") < names.index("lm_head")


def test_debug_layers_threshold_flags_bf16_rounding(tiny3, capsys):
    report = debug_layers.debug_layers(str(tiny3), PROMPT_IDS, dtype="bfloat16", threshold=1e-9)
    # bf16 rounds the embedding table itself, so the very first module already differs.
    assert report.first_divergent["module"] == "model.embed_tokens"
    assert report.first_divergent["reason"] == "error above threshold" and report.first_nonfinite is None
    assert all(0 < m.rel_max < 0.5 for m in report.modules)

    parser = argparse.ArgumentParser()
    debug_layers.add_arguments(parser)
    args = parser.parse_args(
        [
            "--model",
            str(tiny3),
            "--prompt",
            "hi there",
            "--dtype",
            "float32",
            "--plant-nan",
            "model.layers.0.mlp.down_proj",
            "--json",
        ]
    )
    assert debug_layers.run(args) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["first_divergent"]["module"] == "model.layers.0.mlp.down_proj"


def test_profiling_keeps_kinetos_start_and_stop_chatter_out_of_stderr(capfd):
    """torch's kineto writes `STAGE:` / `USDT:` lines to fd 2 at each profiler start and stop (between a tool's
    progress and its tables); quiet_profile drops those and nothing else, and the profile still records."""
    import os
    import sys

    from torch.profiler import ProfilerActivity, profile

    from infertune.profile.quiet import _kineto_chatter_dropped, quiet_profile

    def chatter(text):
        return [ln for ln in text.splitlines() if ln.startswith(("STAGE:", "USDT:"))]

    with _kineto_chatter_dropped():
        os.write(2, b"USDT:12:00 1:1 x.cpp:52] profiler_start\nan error kineto reports\nSTAGE:12:00 done\n")
    assert capfd.readouterr().err == "an error kineto reports\n"

    with profile(activities=[ProfilerActivity.CPU]):
        torch.ones(3).add_(1)
    if not chatter(capfd.readouterr().err):
        pytest.skip("this torch's profiler writes no STAGE / USDT lines to compare against")
    with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:
        print("written while profiling", file=sys.stderr)
        torch.ones(3).add_(1)
    err = capfd.readouterr().err
    assert chatter(err) == [] and "written while profiling" in err
    assert any(e.name == "aten::add_" for e in prof.events())
