"""`infertune audit` on an engine whose decode steps run in the fused C step (x86 CPU kernels).

Oracles: a counting proxy put in place of runner.fused (how many times the engine really called the fused step,
per step), a TorchDispatchMode written here (no matmul reaches the dispatcher while the fused step and the
kernels do the work), and the model's shape arithmetic (the torch-path audit still sees every linear: 4 per layer
plus lm_head, per step).
"""

from __future__ import annotations

import argparse
import json

import pytest
from conftest import make_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from infertune.kernels import cpu as cpu_kernels
from infertune.llm import LLM
from infertune.profile import audit
from infertune.profile.op_trace import trace_native_steps

LAYERS, PROMPT_LEN, DECODE_STEPS = 3, 8, 3
LINEARS_PER_STEP = LAYERS * 4 + 1  # qkv, o, gate_up, down per layer + lm_head
MATMULS = {"mm", "addmm", "matmul", "linear", "bmm"}
# The op one bf16 linear becomes on the CPU's torch path (torch's GEMM, or oneDNN's with prepacked weights).
LINEAR_OPS = {"aten.mm.default", "aten.addmm.default", "mkldnn._linear_pointwise.default"}

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason=f"infertune's CPU kernels are unavailable here: {cpu_kernels.unavailable_reason()}",
)


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("fused-audit"), "llama", num_hidden_layers=LAYERS)


class CountingFused:
    """Stands in for runner.fused: counts the engine's calls, forwards everything to the real fused step."""

    def __init__(self, real) -> None:
        self.real, self.calls = real, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.real(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)


class Dispatched(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.keys: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.keys.append(func.name().split("::")[-1].split(".")[0])
        return func(*args, **(kwargs or {}))


@needs_kernels
def test_native_steps_match_the_engines_own_calls_of_the_fused_step(tiny3):
    llm = LLM(str(tiny3), dtype="bfloat16", device="cpu", max_model_len=PROMPT_LEN + DECODE_STEPS + 1, max_num_seqs=1)
    engine, runner = llm.engine, llm.engine.executor.runner
    if runner.fused is None:
        pytest.skip("the kernels load but the fused step is not built for this model here")
    proxy = CountingFused(runner.fused)
    runner.fused = proxy
    real_step = engine.step
    calls_per_step: list[int] = []
    dispatched: list[list[str]] = []

    def step():
        before = proxy.calls
        mode = Dispatched()
        with mode:
            out = real_step()
        calls_per_step.append(proxy.calls - before)
        dispatched.append(mode.keys)
        return out

    engine.step = step
    try:
        native = trace_native_steps(llm, PROMPT_LEN, decode_steps=DECODE_STEPS)
    finally:
        del engine.step
        runner.fused = proxy.real
    assert native.decode_kernels and native.fused_built
    assert [s.phase for s in native.steps] == ["prefill"] + [f"decode{i + 1}" for i in range(DECODE_STEPS)]
    assert [s.fused for s in native.steps] == [n > 0 for n in calls_per_step]
    assert all(calls_per_step[1:]), "every decode step of one sequence runs in the fused step"
    for s, n, keys in zip(native.steps, calls_per_step, dispatched):
        assert s.kernels.get("fused_decode_layers", 0) == n  # its profiler range, once per real call
        if s.fused:
            assert s.fused_rows == s.tokens and set(s.fused_ms) and all(v >= 0 for v in s.fused_ms.values())
        # Everything that did reach the dispatcher: no matmul, the native kernels did them all.
        assert not MATMULS & set(keys), (s.phase, sorted(MATMULS & set(keys)))
        assert s.aten_ops > 0  # the embedding lookup and the sampler still dispatch aten ops


@needs_kernels
def test_audit_reports_the_fused_step_and_still_audits_the_torch_path(tiny3, capsys):
    parser = argparse.ArgumentParser()
    audit.add_arguments(parser)
    base = ["--model", str(tiny3), "--backend", "cpu", "--dtype", "bfloat16", "--prompt-len", str(PROMPT_LEN)]
    assert audit.run(parser.parse_args(base + ["--json"])) == 0
    out = json.loads(capsys.readouterr().out)
    native = out["default_path"]
    if not native["fused_built"]:
        pytest.skip("the kernels load but the fused step is not built for this model here")
    assert native["decode_kernels"] and native["decode_steps"] == audit.NATIVE_DECODE_STEPS
    assert native["fused_decode_steps"] == native["decode_steps"]
    assert native["kernels"]["fused_decode_layers"] == sum(s["fused"] for s in native["steps"])
    assert all(s["kernels"] for s in native["steps"])
    # The torch path: a second engine without the kernels, every linear visible again (oracle: shape arithmetic).
    assert out["torch_path"]["engine"] == "second" and out["torch_path"]["decode_kernels"] == "off"
    assert out["context"]["decode_kernels"] == "auto"
    linear = {"prefill": 0, "decode": 0}
    for row in out["ops"]:
        if row["op"] in LINEAR_OPS:
            for phase in linear:
                linear[phase] += row["counts"].get(phase, 0)
    assert linear == {"prefill": LINEARS_PER_STEP, "decode": LINEARS_PER_STEP}
    assert out["phases"]["prefill"]["tokens_seen"] == PROMPT_LEN

    assert audit.run(parser.parse_args(base)) == 0
    text = capsys.readouterr().out
    n = native["decode_steps"]
    assert f"fused C step: {n} of {n} decode steps ran in it" in text
    line = next(ln for ln in text.splitlines() if "fused C step:" in ln)
    # Every kernel that ran is named with its calls; the prompt step's own kernels (where it is not fused: no
    # AMX) are listed beside the fused step's.
    listed = dict(item.rsplit(" x", 1) for item in line.split("native kernels: ", 1)[1].split(", "))
    assert {k: int(v) for k, v in listed.items()} == native["kernels"]
    assert listed["fused_decode_layers"] == str(native["kernels"]["fused_decode_layers"])
    assert 'torch path audited below: a second engine with decode_kernels="off"' in text
    assert "torch-path steps: prefill" in text and "status " in text  # the op table's audit follows


def test_without_native_kernels_the_audit_says_the_torch_path_is_the_path(tiny3, capsys):
    parser = argparse.ArgumentParser()
    audit.add_arguments(parser)
    prompt_len = 40  # past two 16-token blocks: the traced prefill must not hit the native run's prefix cache
    args = parser.parse_args(
        ["--model", str(tiny3), "--backend", "cpu", "--dtype", "float32", "--prompt-len", str(prompt_len), "--json"]
    )
    assert audit.run(args) == 0
    out = json.loads(capsys.readouterr().out)
    # The same engine ran the native steps and then the traced ones: the trace still prefilled the whole prompt.
    assert out["phases"]["prefill"]["tokens_seen"] == prompt_len
    assert out["default_path"]["steps"][0]["tokens"] == prompt_len
    native = out["default_path"]
    assert not native["decode_kernels"] and not native["fused_built"] and native["fused_decode_steps"] == 0
    assert native["kernels"] == {} and all(not s["fused"] for s in native["steps"])
    assert out["torch_path"]["engine"] == "same"
    mm = next(r for r in out["ops"] if r["op"] == "aten.mm.default")
    assert mm["counts"] == {"prefill": LINEARS_PER_STEP, "decode": LINEARS_PER_STEP}
