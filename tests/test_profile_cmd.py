"""`infertune profile`: time by category under torch.profiler, ops per decode step, hints.

Oracles: the profiler's own step totals (key_averages) for "the categories add up"; the profiler's own parent
links (FunctionEvent.cpu_parent) for which module range an op ran in; a TorchDispatchMode written here for the
number of ops a decode step dispatches; hand-built spans and summaries for the pure attribution and the hints.
"""

from __future__ import annotations

import argparse
import json

import pytest
from conftest import make_checkpoint
from torch.utils._python_dispatch import TorchDispatchMode

from infertune.llm import LLM
from infertune.profile import profile_cmd
from infertune.profile.profile_categories import (
    CATEGORIES,
    Span,
    attribute_cpu,
    attribute_device,
    classify,
    module_scope_kind,
    scope_kind,
)
from infertune.profile.profile_hints import derive_hints
from infertune.profile.timeline import STEP_RANGE, profile_workload
from infertune.sampling_params import SamplingParams

INPUT_LEN, OUTPUT_LEN, BATCH = 12, 4, 2
GREEDY = SamplingParams(max_tokens=OUTPUT_LEN, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("profile-llama"), "llama")


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(str(ckpt), device="cpu", max_model_len=64, max_num_seqs=BATCH, kv_cache_memory_bytes=2**20)


@pytest.fixture(scope="module")
def result(llm):
    return profile_workload(llm, INPUT_LEN, OUTPUT_LEN, BATCH, GREEDY, warmup=False)


# ---- the real engine under the profiler --------------------------------------------------------------------


def test_categories_add_up_to_the_profiled_step_time(result):
    assert {r.phase for r in result.records} == {"prefill", "decode"}
    assert result.phases["prefill"].steps == 1 and result.phases["decode"].steps == OUTPUT_LEN - 1
    # The profiler's own total time of the step ranges, independent of the attribution.
    own = {e.key: e.cpu_time_total for e in result.prof.key_averages() if e.key.startswith(STEP_RANGE)}
    phase_of = {f"{STEP_RANGE}{r.index}": r.phase for r in result.records}
    for name, ph in result.phases.items():
        total = sum(us for key, us in own.items() if phase_of[key] == name)
        attributed = sum(ph.by_category.values())
        assert attributed == pytest.approx(total, rel=0.01)
        assert set(ph.by_category) == set(CATEGORIES)
        assert ph.by_category["moe_router"] == 0 and ph.by_category["communication"] == 0  # dense, one process
        for cat in ("attention", "kv_cache", "matmul", "norm", "rotary", "sampling", "host"):
            assert ph.by_category[cat] > 0, (name, cat)
    # A step's range encloses the timer the driver reads around engine.step().
    for r in result.records:
        step = next(e for e in result.prof.events() if e.name == f"{STEP_RANGE}{r.index}")
        assert step.time_range.elapsed_us() >= r.wall_us * 0.99


def test_known_ops_get_the_category_of_the_module_they_run_in(result):
    op_category = {}
    for step in result.steps:
        op_category |= step.op_category
    expected = {
        "aten::mm": "matmul",
        "aten::scaled_dot_product_attention": "attention",
        "aten::index_copy_": "kv_cache",
        "aten::rsqrt": "norm",
        "aten::argmax": "sampling",
    }
    innermost = {
        "aten::mm": "linear",
        "aten::scaled_dot_product_attention": "attention_backend",
        "aten::index_copy_": "kv_write",
        "aten::rsqrt": "norm",
        "aten::argmax": "sampler",
    }
    seen = {name: 0 for name in expected}
    qkv_mm = 0
    for e in result.prof.events():
        if e.name not in expected or e.id not in op_category:
            continue
        parent = e.cpu_parent  # the profiler's own nesting
        while parent is not None and scope_kind(parent.name) is None:
            parent = parent.cpu_parent
        assert parent is not None and scope_kind(parent.name) == innermost[e.name], (e.name, parent)
        assert op_category[e.id] == expected[e.name], (e.name, parent.name)
        seen[e.name] += 1
        qkv_mm += e.name == "aten::mm" and parent.name.endswith("self_attn.qkv_proj")
    layers = 2
    steps = len(result.steps)
    assert seen["aten::index_copy_"] == 2 * layers * steps  # K and V, every layer, every step
    assert seen["aten::rsqrt"] == (2 * layers + 1) * steps
    assert qkv_mm == layers * steps
    # Decode reads K/V back from the cache (the block gathers); prefill only writes it.
    assert result.phases["decode"].kv_detail["read"] > 0 and result.phases["decode"].kv_detail["write"] > 0
    assert "read" not in result.phases["prefill"].kv_detail
    assert ("aten::index_select", "kv_cache") in result.phases["decode"].ops


class CountOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.name())
        return func(*args, **(kwargs or {}))


def test_ops_per_decode_step_match_a_dispatch_mode_count(llm, result):
    engine = llm.engine
    prompts = [[(7 + 31 * i + 101 * b) % 200 for i in range(INPUT_LEN)] for b in range(BATCH)]
    for b, prompt in enumerate(prompts):
        engine.add_request(f"count-{b}", {"prompt_token_ids": prompt}, GREEDY)
    try:
        engine.step()  # the prefill
        mode = CountOps()
        with mode:
            engine.step()  # one decode step of BATCH sequences, like the profiled ones
    finally:
        for b in range(BATCH):
            engine.abort_request(f"count-{b}")
    aten = [n for n in mode.names if n.startswith("aten::")]
    # torch.tensor(data) reaches a dispatch mode as lift_fresh (+ detach_); the allocation and copy it makes first
    # (aten::empty, aten::to) run below the Python dispatch key, where the profiler sees them and the mode does not.
    oracle = len(aten) + 2 * aten.count("aten::lift_fresh")
    counts = result.phases["decode"].ops_per_step
    assert counts == [oracle] * len(counts)


def test_instrumentation_leaves_the_engine_as_it_was(llm, result):
    engine = llm.engine
    runner = engine.executor.runner
    assert result.missing == []
    for owner, attr in [
        (engine, "_on_new_token"),
        (engine, "_output"),
        (engine.scheduler, "schedule"),
        (engine.scheduler, "update"),
        (engine.executor, "execute_model"),
        (runner, "_prepare"),
        (runner.attn, "forward"),
        (runner.attn, "write_kv"),
        (runner.model, "compute_logits"),
    ]:
        assert attr not in vars(owner), attr
    assert type(runner.sampler).__name__ == "Sampler"
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in runner.model.modules())


def test_cli_writes_json_trace_and_explains_a_missing_matplotlib(ckpt, tmp_path, capsys):
    parser = argparse.ArgumentParser()
    profile_cmd.add_arguments(parser)
    out_json, out_trace = tmp_path / "s.json", tmp_path / "t.json"
    args = parser.parse_args(
        [
            "--model",
            str(ckpt),
            "--device",
            "cpu",
            "--input-len",
            "10",
            "--output-len",
            "3",
            "--batch",
            "2",
            "--json",
            str(out_json),
            "--trace",
            str(out_trace),
        ]
    )
    assert profile_cmd.run(args) == 0
    summary = json.loads(out_json.read_text())
    for ph in summary["phases"].values():
        assert sum(ph["share"].values()) == pytest.approx(1.0, abs=1e-9)
    assert summary["phases"]["decode"]["unprofiled_ms_per_step"] > 0  # the warm-up timed the steps
    assert summary["launch"]["launches_per_decode_step"] == summary["phases"]["decode"]["ops_per_step"]
    names = {e["name"] for e in json.loads(out_trace.read_text())["traceEvents"]}
    assert any(n.startswith(STEP_RANGE) and " decode (2 seqs, 2 tokens)" in n for n in names)
    assert any(n.startswith("infertune::linear model.layers.0.self_attn.qkv_proj") for n in names)
    report = capsys.readouterr().out
    assert "KV-cache read/write" in report and "aten ops per decode step" in report
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        plot = parser.parse_args(["--model", str(ckpt), "--plot", str(tmp_path / "p.png")])
        with pytest.raises(RuntimeError, match="pip install matplotlib"):
            profile_cmd.run(plot)
    else:
        profile_cmd.write_plot(summary, str(tmp_path / "p.png"))
        assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"


# ---- attribution and classification, pure --------------------------------------------------------------


def test_attribution_gives_each_microsecond_to_one_category():
    step = Span("infertune::step#0", 0.0, 100.0)
    spans = [
        Span("infertune::schedule", 1.0, 5.0),
        Span("infertune::forward LlamaForCausalLM", 10.0, 80.0),
        Span("infertune::linear model.layers.0.self_attn.qkv_proj", 12.0, 40.0),
        Span("aten::linear", 13.0, 39.0, id=1),
        Span("aten::mm", 15.0, 35.0, id=2),
        Span("infertune::norm model.layers.0.input_layernorm", 41.0, 50.0),
        Span("aten::rsqrt", 42.0, 48.0, id=3),
        Span("infertune::attention_backend", 50.0, 70.0),
        Span("aten::index", 51.0, 55.0, id=4),  # a block gather: KV read
        Span("aten::scaled_dot_product_attention", 56.0, 66.0, id=5),
        Span("aten::_scaled_dot_product_flash_attention_for_cpu", 57.0, 75.0, id=6),  # overlaps its parent's end
        Span("infertune::sampler", 82.0, 95.0),
        Span("aten::argmax", 83.0, 90.0, id=7),
        Span("aten::add", 150.0, 160.0),  # after the step: ignored
    ]
    prof = attribute_cpu(step, spans)
    assert sum(prof.by_category.values()) == pytest.approx(100.0)
    assert prof.by_category["matmul"] == pytest.approx(26.0)  # linear 13..39
    assert prof.by_category["norm"] == pytest.approx(6.0)
    assert prof.by_category["kv_cache"] == pytest.approx(4.0)
    assert prof.by_category["attention"] == pytest.approx(10.0)  # sdpa 56..66, its child clipped to it
    assert prof.by_category["sampling"] == pytest.approx(7.0)
    assert prof.by_category["host"] == pytest.approx(100.0 - 26 - 6 - 4 - 10 - 7)
    assert prof.op_category == {
        1: "matmul",
        2: "matmul",
        3: "norm",
        4: "kv_cache",
        5: "attention",
        6: "attention",
        7: "sampling",
    }
    assert prof.num_ops == 5  # linear, rsqrt, index, sdpa, argmax: nested ops are not dispatched from Python
    assert prof.host_detail["schedule"] == pytest.approx(4.0)
    # On a device timeline the same step splits by kernel time; the device's idle time is host overhead.
    kernels = [
        Span("gemm_kernel", 20.0, 30.0, id=2),
        Span("flash_fwd", 60.0, 64.0, id=6),
        Span("argmax_kernel", 84.0, 85.0, id=7),
    ]
    dev = attribute_device(step, kernels, prof)
    assert dev.num_kernels == 3
    assert (dev.by_category["matmul"], dev.by_category["attention"], dev.by_category["sampling"]) == (10.0, 4.0, 1.0)
    assert sum(dev.by_category.values()) == pytest.approx(100.0) and dev.by_category["host"] == pytest.approx(85.0)


@pytest.mark.parametrize(
    "root, scopes, category",
    [
        ("aten::mm", ("forward", "layer", "attention_block", "linear"), "matmul"),
        ("aten::mul", ("forward", "layer", "norm"), "norm"),
        ("aten::mul", ("forward", "layer", "mlp"), "activation"),
        ("aten::cat", ("forward", "layer", "attention_block", "rotary"), "rotary"),
        ("aten::index", ("forward", "layer", "attention_block", "attention_backend"), "kv_cache"),
        ("aten::index_copy_", ("forward", "layer", "attention_block"), "kv_cache"),
        # MoE: the router module is router time (its matmul too); inside the experts, matmuls are matmul, the
        # activation is activation, the gathers / scatters around them are dispatch (router time); a shared expert
        # is an MLP like any other
        ("aten::mm", ("forward", "layer", "moe_block", "moe_router"), "moe_router"),
        ("aten::topk", ("forward", "layer", "moe_block", "moe_router"), "moe_router"),
        ("aten::linear", ("forward", "layer", "moe_block", "experts"), "matmul"),
        ("aten::silu", ("forward", "layer", "moe_block", "experts"), "activation"),
        ("aten::index_add_", ("forward", "layer", "moe_block", "experts"), "moe_router"),
        ("aten::argsort", ("forward", "layer", "moe_block", "experts"), "moe_router"),
        ("infertune_kernels::moe_experts", ("forward", "layer", "moe_block", "experts"), "matmul"),
        ("aten::mm", ("forward", "layer", "moe_block", "mlp", "linear"), "matmul"),
        ("aten::sigmoid", ("forward", "layer", "moe_block"), "activation"),
        ("aten::add", ("forward", "layer", "moe_block"), "other"),
        ("aten::bincount", ("forward", "layer", "moe_block", "instrumentation"), "host"),
        ("aten::sort", ("execute", "sampler"), "sampling"),
        ("aten::empty", ("execute", "prepare_inputs"), "host"),
        ("c10d::allreduce_", ("forward", "layer"), "communication"),
        ("aten::add", ("forward", "layer"), "other"),
        ("aten::_weight_int8pack_mm", (), "matmul"),  # no scope: the name decides
        ("aten::_fused_rms_norm", (), "norm"),
    ],
)
def test_classify(root, scopes, category):
    assert classify(root, scopes) == category


@pytest.mark.parametrize(
    "names, kind",
    [
        (["LlamaRotaryEmbedding"], "rotary"),
        (["RotaryEmbedding"], "rotary"),
        (["RMSNorm"], "norm"),
        (["PackedLinear", "Linear"], "linear"),
        (["Linear"], "linear"),
        (["LlamaAttention"], "attention_block"),
        (["LlamaMLP"], "mlp"),
        (["Qwen2MoeSparseMoeBlock"], "moe_block"),
        (["MoE"], "moe_block"),
        (["Router"], "moe_router"),
        (["Qwen3MoeTopKRouter"], "moe_router"),
        (["MoEGate"], "moe_router"),
        (["Experts"], "experts"),
        (["Qwen2MoeExperts"], "experts"),
        (["Qwen2MoeMLP"], "mlp"),  # a MoE family's dense MLP / shared expert
        (["Qwen3MoeAttention"], "attention_block"),
        (["Qwen3MoeRMSNorm"], "norm"),
        (["LlamaDecoderLayer"], "layer"),
        (["Embedding"], "embedding"),
        (["SiLU"], "activation"),
        (["ModuleList"], None),
        (["LlamaModel"], None),
    ],
)
def test_module_scope_kind(names, kind):
    assert module_scope_kind(names) == kind


# ---- hints, pure --------------------------------------------------------------------------------------------


def summary(
    decode: dict | None = None,
    prefill: dict | None = None,
    seqs: float = 4,
    launch_share: float = 0.02,
    instrumentation: float = 0.0,
    quantization=None,
    **decode_extra,
) -> dict:
    """A synthetic profile summary: unnamed categories share what is left as 'host' (below its threshold)."""

    def phase(shares: dict) -> dict:
        share = dict.fromkeys(CATEGORIES, 0.0) | shares
        share["other"] += 1.0 - sum(share.values())
        return {
            "share": share,
            "ms_per_step": 10.0,
            "ms_per_step_by_category": {k: 10 * v for k, v in share.items()},
            "seqs_per_step": seqs,
            "kv_detail_share": {"read": share["kv_cache"] * 0.8, "write": share["kv_cache"] * 0.2},
            "host_detail_share": {"python_in_forward": share["host"]},
            "top_ops": [],
        }

    balanced = {"matmul": 0.4, "attention": 0.15, "kv_cache": 0.1, "norm": 0.05, "sampling": 0.05, "host": 0.15}
    dec = phase(decode or balanced) | decode_extra
    return {
        "context": {"batch": seqs, "input_len": 128, "quantization": quantization, "torch_threads": 2},
        "phases": {"decode": dec, "prefill": phase(prefill or {"matmul": 0.5, "attention": 0.2, "host": 0.2})},
        "launch": {
            "share_of_decode_step": launch_share,
            "launches_per_decode_step": 380,
            "per_launch_us": 2.0,
            "overhead_us_per_decode_step": 760.0,
            "counted": "aten ops",
        },
        "instrumentation": {"share_of_decode_step": instrumentation},
    }


def rules(s: dict) -> set[str]:
    return {h["rule"] for h in derive_hints(s)}


def test_a_balanced_profile_gets_no_hints():
    assert derive_hints(summary()) == []


@pytest.mark.parametrize(
    "decode, rule, words",
    [
        ({"attention": 0.38}, "attention_decode", "attention is 38% of decode"),
        ({"kv_cache": 0.27}, "kv_cache", "kv_cache_dtype=int8"),
        ({"matmul": 0.85}, "matmul_memory_bound", "quantization=w8a16"),
        ({"sampling": 0.2}, "sampling", "sampling is 20% of decode"),
        ({"norm": 0.1, "activation": 0.06, "rotary": 0.06}, "elementwise", "22% of decode"),
        ({"host": 0.45}, "host_overhead", "larger batch"),
        ({"other": 0.5, "attention": 0.2, "matmul": 0.3}, "unclassified", "50% of decode"),
        ({"moe_router": 0.2}, "moe_router", "fused gating top-k"),
        ({"communication": 0.15}, "communication", "communication is 15%"),
    ],
)
def test_each_hint_fires_on_its_figure_and_names_it(decode, rule, words):
    hints = {h["rule"]: h for h in derive_hints(summary(decode=decode, seqs=1))}
    assert rule in hints and words in hints[rule]["text"]
    assert hints[rule]["figure"] >= hints[rule]["threshold"]


def test_hint_thresholds_and_conditions():
    assert "attention_decode" not in rules(summary(decode={"attention": 0.2}))
    # A matmul-heavy decode is memory-bound only at a small batch; quantized already, the advice is the batch.
    assert "matmul_memory_bound" not in rules(summary(decode={"matmul": 0.85}, seqs=32))
    quantized = {
        h["rule"]: h["text"] for h in derive_hints(summary(decode={"matmul": 0.85}, seqs=1, quantization="w8a16"))
    }
    assert "raise the batch" in quantized["matmul_memory_bound"]
    # Launch overhead: fires on its share, and says the count.
    launch = {h["rule"]: h["text"] for h in derive_hints(summary(launch_share=0.3))}
    assert (
        "380 aten ops per decode step" in launch["launch_overhead"] and "compiled decode" in launch["launch_overhead"]
    )
    # The profiler's own ranges are not the engine's host overhead.
    assert "host_overhead" not in rules(summary(decode={"host": 0.35}, instrumentation=0.1))
    assert "host_overhead" in rules(summary(decode={"host": 0.35}, instrumentation=0.0))
    # Prefill: quadratic attention at long prompts, compute-bound matmuls.
    assert "attention_prefill" in rules(summary(prefill={"attention": 0.35}))
    assert "matmul_prefill" in rules(summary(prefill={"matmul": 0.7}))
    assert not {"attention_prefill", "matmul_prefill"} & rules(summary(prefill={"attention": 0.25, "matmul": 0.55}))
    assert "step_jitter" in rules(summary(step_ms_p50=2.0, step_ms_p90=5.0))
    assert "step_jitter" not in rules(summary(step_ms_p50=2.0, step_ms_p90=2.5))
    assert "profiler_inflation" in rules(summary(unprofiled_ms_per_step=4.0))  # 10 ms profiled vs 4 unprofiled


def test_page_fault_hint_fires_on_its_figure():
    s = summary()
    s["phases"]["prefill"]["page_faults_per_step"] = 50_000
    s["phases"]["decode"]["page_faults_per_step"] = 12
    hints = [h for h in derive_hints(s) if h["rule"] == "page_faults"]
    assert [h["phase"] for h in hints] == ["prefill"]
    assert "50,000 fresh pages" in hints[0]["text"] and "INFERTUNE_KEEP_HOST_MEMORY" in hints[0]["text"]
    s["phases"]["prefill"]["page_faults_per_step"] = 1_999
    assert "page_faults" not in rules(s)


def test_steps_count_the_pages_they_fault_in(llm):
    """A step that touches 16 MiB of fresh anonymous memory (4096 pages of 4 KiB) is charged those faults."""
    import mmap

    from infertune.profile.timeline import Instrumentation

    real = llm.engine.step

    def touching_step():
        buf = mmap.mmap(-1, 16 << 20)
        for off in range(0, 16 << 20, 4096):
            buf[off] = 1
        buf.close()
        return real()

    llm.engine.step = touching_step
    try:
        with Instrumentation(llm, ranges=False) as ins:
            rec = ins.step()
    finally:
        del llm.engine.step
    assert 4096 <= rec.page_faults < 4096 + 2000, rec.page_faults


def test_an_output_in_a_missing_folder_is_refused_before_the_run(ckpt, tmp_path, monkeypatch):
    parser = argparse.ArgumentParser()
    profile_cmd.add_arguments(parser)
    ran = []
    monkeypatch.setattr(profile_cmd, "_engine", lambda *a, **k: ran.append(1))  # (no engine is built)
    for flag in ("--trace", "--json"):
        args = parser.parse_args(["--model", str(ckpt), flag, str(tmp_path / "nowhere" / "out.json")])
        with pytest.raises(ValueError, match="does not exist"):
            profile_cmd.run(args)
    assert not ran


def test_a_quantized_checkpoint_is_profiled_as_quantized(ckpt, tmp_path):
    """profile on a folder `infertune quantize` wrote (no --quantization): the report's context says its method, and
    a memory-bound decode does not get the hint to quantize (it said 'try quantization=w8a16 ... or w4a16' to a
    W4A16 checkpoint)."""
    from infertune.tools.quantizer import quantize

    out = tmp_path / "w4"
    quantize(str(ckpt), "w4a16", str(out), group_size=32, show_progress=False)
    parser = argparse.ArgumentParser()
    profile_cmd.add_arguments(parser)
    argv = ["--model", str(out), "--device", "cpu", "--input-len", "10", "--output-len", "3", "--batch", "2"]
    out_json = tmp_path / "s.json"
    assert profile_cmd.run(parser.parse_args([*argv, "--no-warmup", "--json", str(out_json)])) == 0
    summary_ = json.loads(out_json.read_text())
    assert summary_["context"]["quantization"] == "w4a16"
    forced = summary(decode={"matmul": 0.85}, seqs=1, quantization=summary_["context"]["quantization"])
    hints = {h["rule"]: h["text"] for h in derive_hints(forced)}  # (a matmul-bound decode, this run's context)
    assert "raise the batch" in hints["matmul_memory_bound"] and "try quantization" not in hints["matmul_memory_bound"]


def test_profile_takes_quantize_lm_head(ckpt):
    """profile --quantize-lm-head (generate, serve and bench take it; profile refused it as an unknown argument): the
    engine it profiles runs the head in int8."""
    from infertune.quant import W8A16Method

    parser = argparse.ArgumentParser()
    profile_cmd.add_arguments(parser)
    args = parser.parse_args(["--model", str(ckpt), "--device", "cpu", "--quantization", "w4a16", "--quantize-lm-head"])
    args.quant_group_size = 32
    llm = profile_cmd._engine(args, 64)
    assert llm.config.quant.quantize_lm_head
    assert isinstance(llm.engine.executor.runner.model.lm_head.quant_method, W8A16Method)
