"""The tools on MoE and MLA models: the ledger's MoE steps, the audit's MoE / MLA stages, profile's count of the KV
bytes a decode step reads, torch.compile of a MoE decode, and the GGUF export of Qwen3-MoE for llama.cpp.

Oracles: the kernels' own call counts (the ledger's switch takes the MoE kernels off, stage by stage); op tables
and the stage's own code (which ops a router, a grouping, an expert loop and MLA's absorbed decode issue); exact
arithmetic from config.json for the KV bytes (the block tables' latent rows, not decompressed K / V); the eager
engine's greedy tokens for the compiled one; the checkpoint's own tensors for the GGUF file, and HF transformers'
greedy tokens through llama.cpp.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import hf_model, make_checkpoint, make_tokenizer, read_config
from parity_utils import BLOCK, MAX_LEN, NEW_TOKENS, prompts_for, run
from test_deepseek import MLA_DIMS, make_deepseek_checkpoint

from infertune import LLM, SamplingParams
from infertune.config import ArchConfig

QWEN3_MOE = dict(
    arch="qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True, std=0.2
)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("qwen3-moe"), **QWEN3_MOE)


@pytest.fixture(scope="module")
def deepseek_v2_lite(tmp_path_factory):
    path = tmp_path_factory.mktemp("v2-lite")
    return make_deepseek_checkpoint(path, v3=False, q_lora_rank=None, topk_method="greedy", n_shared_experts=2)


# ---- ledger ------------------------------------------------------------------------------------------------------


def test_ledger_steps_follow_the_model(qwen3_moe, deepseek_v2_lite):
    from infertune.tune import ledger

    dense_arch = dataclasses.replace(ArchConfig.from_model_dir(str(qwen3_moe)), moe=None)
    dense = [k for k, *_ in ledger.steps_for(dense_arch)]
    moe = {k: (label, adds) for k, label, adds, _ in ledger.steps_for(ArchConfig.from_model_dir(str(qwen3_moe)))}
    mla = [k for k, *_ in ledger.steps_for(ArchConfig.from_model_dir(str(deepseek_v2_lite)))]
    assert "moe_router" not in dense and "mla_latent" not in dense
    # the kernels step leaves the MoE layers in PyTorch, then the two MoE fusions, one at a time
    steps = ["kernels", "moe_router", "moe_experts", "moe_fused"]
    assert list(moe)[list(moe).index("kernels") :][:4] == steps
    assert [moe[k][1]["moe_kernels"] for k in steps] == ["none", "router", "experts", "all"]
    assert "experts" in moe["w4a16"][0] and "mla_latent" not in moe
    assert "mla_latent" in mla and "moe_experts" in mla  # DeepSeek is both
    # MLA: the steps up to the kernels keep each head's K / V (the seeds' start); the latent cache next, before the
    # MoE fusions (whose fused step reads latent rows)
    mla_steps = {k: adds for k, _, adds, _ in ledger.steps_for(ArchConfig.from_model_dir(str(deepseek_v2_lite)))}
    assert mla_steps["eager"]["mla_cache"] == "decompressed" and mla_steps["mla_latent"] == {"mla_cache": "latent"}
    assert mla.index("kernels") + 1 == mla.index("mla_latent") < mla.index("moe_router")
    assert all("mla_cache" not in (adds or {}) for adds in moe.values() for adds in [adds[1]])
    # W4A16's group size: the largest of 32 / 64 / 128 dividing every quantized input width (64 and 32 here)
    assert ledger.quant_group_size(ArchConfig.from_model_dir(str(qwen3_moe)), None) == 32
    assert ledger.quant_group_size(ArchConfig.from_model_dir(str(deepseek_v2_lite)), 64) == 64
    # the MLA row's bytes: the latent row against decompressed K / V, from config.json
    cfg = read_config(deepseek_v2_lite)
    latent = cfg["num_hidden_layers"] * (MLA_DIMS["kv_lora_rank"] + MLA_DIMS["qk_rope_head_dim"]) * 2
    full = (
        cfg["num_hidden_layers"]
        * cfg["num_attention_heads"]
        * (MLA_DIMS["qk_nope_head_dim"] + MLA_DIMS["qk_rope_head_dim"] + MLA_DIMS["v_head_dim"])
        * 2
    )
    assert ledger.mla_note(ArchConfig.from_model_dir(str(deepseek_v2_lite)), 2) == ledger.MLA_NOTE.format(
        latent=latent, full=full
    )


def test_ledger_moe_switch_takes_the_kernels_off_stage_by_stage(qwen3_moe, monkeypatch):
    """measure_infertune's moe_kernels: "none" runs route() and the per-expert loop, "router" the fused top-k with
    the loop, "experts" both kernels per module, "all" the fused decode step too (which runs both inside its C call);
    counted at the kernels' own entry points and the fused step's calls over one generate call."""
    from infertune.tune import measure

    llm = LLM(str(qwen3_moe), dtype="bfloat16", max_model_len=64, decode_kernels="auto")
    runner = llm.engine.executor.runner
    if runner.decode_kernels is None:
        pytest.skip("no decode kernels on this machine: the ledger reports the MoE steps as not available")
    ks = runner.decode_kernels
    calls = {"moe_route": 0, "moe_experts": 0}
    for name in calls:
        inner = getattr(ks, name)

        def counted(*a, _inner=inner, _name=name, **kw):
            calls[_name] += 1
            return _inner(*a, **kw)

        monkeypatch.setattr(ks, name, counted)  # (the process's kernels: undone after the test)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    seen = {}
    outs = {}
    fused = runner.fused
    for stages in ("all", "experts", "router", "none"):  # each takes more kernels off the same engine
        measure.limit_moe_kernels(runner, stages)
        calls.update(moe_route=0, moe_experts=0)
        before = fused.step_timers()["calls"] if fused is not None else 0
        outs[stages] = llm.generate({"prompt_token_ids": list(range(3, 11))}, params, use_tqdm=False)[0]
        seen[stages] = dict(calls, fused=(fused.step_timers()["calls"] - before) if fused is not None else 0)
        assert (runner.fused is not None) == (stages == "all" and fused is not None)
    layers = len(ArchConfig.from_model_dir(str(qwen3_moe)).moe.layers)
    decode_steps = 3  # 4 tokens: a prefill and 3 one-token decodes, each through every MoE layer
    if fused is not None:  # (a bf16 model with the x86 kernels: the decode steps in the fused step, the prompt too
        # where it takes prompts: AMX)
        assert seen["all"]["fused"] == decode_steps + (fused.decoder.max_prefill_rows >= 8)
    per_module = seen["experts"]
    assert per_module["moe_route"] >= layers * decode_steps and per_module["moe_experts"] >= layers * decode_steps
    assert seen["router"]["moe_route"] == per_module["moe_route"] and seen["router"]["moe_experts"] == 0
    assert seen["none"] == {"moe_route": 0, "moe_experts": 0, "fused": 0}
    assert measure.limit_moe_kernels(runner, "none") == 0  # nothing left to take off


# ---- audit -------------------------------------------------------------------------------------------------------


def _audit(path, backend: str):
    from infertune.profile.audit import audit_trace
    from infertune.profile.op_tables import OpTable
    from infertune.profile.op_trace import trace_engine_steps

    llm = LLM(str(path), dtype="float32", max_model_len=64, decode_kernels="off", prepack_weights=False)
    return audit_trace(trace_engine_steps(llm, 12), OpTable.load(backend))


def _ops(report, stage: str) -> dict[str, dict]:
    return {r["op"]: r for r in report.stages[stage]}


def test_audit_lists_the_moe_stages_with_npu_fused_ops(qwen3_moe):
    report = _audit(qwen3_moe, "npu")
    assert list(report.stages)[:3] == ["moe_router", "moe_grouping", "moe_experts"]
    router, grouping, experts = (_ops(report, s) for s in ("moe_router", "moe_grouping", "moe_experts"))
    layers = read_config(qwen3_moe)["num_hidden_layers"]
    for phase in ("prefill", "decode"):  # one top-k, one grouping and one scatter back per MoE layer and step
        assert router["aten.topk.default"]["counts"][phase] == layers
        assert router["aten.softmax.int"]["counts"][phase] == layers
        assert grouping["aten.bincount.default"]["counts"][phase] == layers
        assert experts["aten.index_add_.default"]["counts"][phase] == layers
    # (op-plugin's yaml @ a110bc30 registers bincount and floor_divide: the grouping is native on the NPU)
    assert all(r["status"] == "native" for s in ("moe_router", "moe_grouping", "moe_experts") for r in report.stages[s])
    assert "aten.topk.default" not in experts and "aten.index_add_.default" not in router
    assert "npu_moe_gating_top_k" in report.fused_stages["moe_router"]
    assert "npu_grouped_matmul" in report.fused_stages["moe_experts"]
    # the one-decode-token step runs one gate_up and one down matmul per picked expert: top_k experts at most
    k = QWEN3_MOE["num_experts_per_tok"]
    mm = experts["aten.matmul.default"]["counts"]["decode"]  # (the table has matmul: its parts are not the NPU's)
    assert 2 * layers <= mm <= 2 * k * layers


def test_audit_lists_the_mla_stages(deepseek_v2_lite):
    from infertune.profile.audit import format_report

    report = _audit(deepseek_v2_lite, "npu")
    decode, decompress = _ops(report, "mla_decode"), _ops(report, "mla_decompress")
    layers = read_config(deepseek_v2_lite)["num_hidden_layers"]
    # the absorbed decode reads the block tables' latent rows (one gather a layer) and multiplies by W_UK / W_UV;
    # only a prefill decompresses
    assert decode["aten.index_select.default"]["counts"] == {"decode": layers}
    assert decode["aten.bmm.default"]["counts"]["decode"] == 2 * layers
    assert all(r["counts"].get("decode", 0) == 0 for r in decompress.values())
    assert _ops(report, "mla_cache_write")["aten.index_copy_.default"]["counts"] == {
        "prefill": layers,
        "decode": layers,
    }
    text = format_report(report)
    assert "MLA absorbed decode" in text and "npu_fused_infer_attention_score" in text


# ---- profile: the KV bytes of a decode step ------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["deepseek_v2_lite", "qwen3_moe"])
def test_profile_counts_the_kv_bytes_a_decode_step_reads(model, request):
    from infertune.profile.kv_bytes import format_kv_reads, measure_decode_kv_reads

    path = request.getfixturevalue(model)
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=BLOCK, decode_kernels="off")
    cfg, input_len, seqs = read_config(path), 13, 3
    prompts = [[(7 * i + 31 * s) % cfg["vocab_size"] for i in range(input_len)] for s in range(seqs)]
    r = measure_decode_kv_reads(llm, input_len, seqs, prompts)
    layers, ctx = cfg["num_hidden_layers"], input_len + 1
    if model == "deepseek_v2_lite":  # one latent row a token and layer: kv_lora_rank + qk_rope_head_dim values
        per_token = layers * (MLA_DIMS["kv_lora_rank"] + MLA_DIMS["qk_rope_head_dim"]) * 4
        heads = cfg["num_attention_heads"]
        dims = MLA_DIMS["qk_nope_head_dim"] + MLA_DIMS["qk_rope_head_dim"] + MLA_DIMS["v_head_dim"]
        assert r.decompressed_bytes == seqs * ctx * layers * heads * dims * 4
    else:  # K and V
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
        per_token = layers * 2 * cfg["num_key_value_heads"] * head_dim * 4
        assert r.decompressed_bytes is None
    assert r.bytes_per_token == per_token and r.context_bytes == seqs * ctx * per_token
    # a paged read gathers the block tables' whole blocks, nothing else
    assert r.read_bytes == seqs * math.ceil(ctx / BLOCK) * BLOCK * per_token == r.block_bytes
    assert 1.0 <= r.ratio <= math.ceil(ctx / BLOCK) * BLOCK / ctx
    assert set(r.readers) == {"index_select"}
    assert "read" in "\n".join(format_kv_reads(r.to_dict()))
    assert not llm.engine.has_unfinished_requests()  # its requests are gone again


# ---- compile ------------------------------------------------------------------------------------------------------


def test_compiled_moe_decode_matches_eager(qwen3_moe):
    """Each MoE block runs eager between compiled graphs (o_proj and the norm before it; the residual and the next
    layer's projections after it, or the final norm): the greedy tokens of a batch are the eager engine's."""
    path = qwen3_moe
    prompts = prompts_for(read_config(path)["vocab_size"])
    _, eager = run(path, prompts)
    llm, compiled = run(path, prompts, compile="on")
    runner = llm.engine.executor.runner
    assert runner.compiled is not None and runner.compiled.moe_layers == {0, 1}
    assert compiled == eager and all(len(o) == NEW_TOKENS for o in compiled)


# ---- GGUF export for llama.cpp ---------------------------------------------------------------------------------------


def test_qwen3_moe_gguf_holds_the_checkpoint(qwen3_moe, tmp_path):
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    from infertune.bench.gguf_export import export_gguf

    out = export_gguf(qwen3_moe, tmp_path / "m.gguf", "float32")
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    hf = load_file(str(qwen3_moe / "model.safetensors"))
    cfg = read_config(qwen3_moe)
    e = QWEN3_MOE["num_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        for proj in ("gate", "up", "down"):
            stacked = torch.stack([hf[f"model.layers.{layer}.mlp.experts.{i}.{proj}_proj.weight"] for i in range(e)])
            assert torch.equal(tensors[f"blk.{layer}.ffn_{proj}_exps.weight"].reshape(stacked.shape), stacked)
        router = hf[f"model.layers.{layer}.mlp.gate.weight"]
        assert torch.equal(tensors[f"blk.{layer}.ffn_gate_inp.weight"].reshape(router.shape), router)
        q = hf[f"model.layers.{layer}.self_attn.q_proj.weight"]  # NeoX rotary in llama.cpp's qwen3moe: unpermuted
        assert torch.equal(tensors[f"blk.{layer}.attn_q.weight"].reshape(q.shape), q)
        assert torch.equal(
            tensors[f"blk.{layer}.attn_k_norm.weight"], hf[f"model.layers.{layer}.self_attn.k_norm.weight"]
        )
    fields = reader.fields
    assert int(fields["qwen3moe.expert_count"].parts[-1][0]) == e
    assert int(fields["qwen3moe.expert_used_count"].parts[-1][0]) == QWEN3_MOE["num_experts_per_tok"]
    assert int(fields["qwen3moe.expert_feed_forward_length"].parts[-1][0]) == QWEN3_MOE["moe_intermediate_size"]


def test_qwen3_moe_gguf_refuses_what_llama_cpp_would_run_differently(tmp_path):
    pytest.importorskip("gguf")
    from infertune.bench.gguf_export import PeerUnavailable, export_gguf

    src = make_checkpoint(tmp_path / "raw", **QWEN3_MOE | dict(norm_topk_prob=False))
    with pytest.raises(PeerUnavailable, match="norm_topk_prob"):
        export_gguf(src, tmp_path / "raw.gguf")


def _llama_cpp_follows_hf(model, tmp_path) -> None:
    """Export `model` (f32), run it through llama.cpp one sequence at a time: every greedy token is HF's top on the
    same prefix."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the llama.cpp peer is optional)")
    import inspect

    import llama_cpp
    from parity_utils import assert_teacher_forced

    from infertune.bench.gguf_export import export_gguf

    out = export_gguf(model, tmp_path / "m.gguf", "float32")
    # f32 all the way: llama.cpp's default f16 KV cache (and flash attention's f16 products) would round what the
    # oracle compares at 1e-3
    opts = dict(type_k=0, type_v=0, flash_attn=False)  # 0 = GGML_TYPE_F32
    known = inspect.signature(llama_cpp.Llama.__init__).parameters
    opts = {k: v for k, v in opts.items() if k in known}
    llm = llama_cpp.Llama(model_path=str(out), n_ctx=MAX_LEN, n_threads=2, verbose=False, **opts)
    hf = hf_model(model)
    for prompt in prompts_for(read_config(model)["vocab_size"])[1:3]:
        tokens = []
        for tok in llm.generate(prompt, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
            tokens.append(int(tok))
            if len(tokens) == NEW_TOKENS:
                break
        assert_teacher_forced(hf, prompt, tokens)


def test_llama_cpp_runs_the_exported_qwen3_moe_greedy_like_hf(qwen3_moe, tmp_path):
    """The exported file through llama.cpp (f32, one sequence): every greedy token is HF's top on the same prefix."""
    _llama_cpp_follows_hf(qwen3_moe, tmp_path)


@pytest.fixture(scope="module")
def deepseek_v3_one_group(tmp_path_factory):
    """DeepSeek-V3 (queries through a low rank, sigmoid scores with a correction bias, renormalised and scaled top-k,
    a shared expert, the first layer dense) in one expert group: what llama.cpp's deepseek2 runs."""
    return make_deepseek_checkpoint(tmp_path_factory.mktemp("v3-g1"), v3=True, n_group=1, topk_group=1)


def test_deepseek_gguf_holds_the_checkpoint(deepseek_v3_one_group, tmp_path):
    """kv_b_proj splits per head into W_UK transposed ([H, rank, nope]) and W_UV ([H, v, rank]); the latent
    attention's sizes, the routing and the dense first layer go in as llama.cpp's deepseek2 metadata."""
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    from infertune.bench.gguf_export import export_gguf

    src = deepseek_v3_one_group
    out = export_gguf(src, tmp_path / "m.gguf", "float32")
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: torch.from_numpy(t.data.copy()) for t in reader.tensors}
    hf = load_file(str(src / "model.safetensors"))
    cfg = read_config(src)
    h, nope, v, rank = (cfg[k] for k in ("num_attention_heads", "qk_nope_head_dim", "v_head_dim", "kv_lora_rank"))
    for layer in range(cfg["num_hidden_layers"]):
        kv_b = hf[f"model.layers.{layer}.self_attn.kv_b_proj.weight"].view(h, nope + v, rank)
        k_b, v_b = tensors[f"blk.{layer}.attn_k_b.weight"], tensors[f"blk.{layer}.attn_v_b.weight"]
        assert torch.equal(k_b.reshape(h, rank, nope), kv_b[:, :nope].transpose(1, 2))
        assert torch.equal(v_b.reshape(h, v, rank), kv_b[:, nope:])
        assert f"blk.{layer}.attn_kv_b.weight" not in tensors
        q_a = hf[f"model.layers.{layer}.self_attn.q_a_proj.weight"]  # (adjacent-pair rotary: as HF stores it)
        assert torch.equal(tensors[f"blk.{layer}.attn_q_a.weight"].reshape(q_a.shape), q_a)
    bias = hf["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(tensors["blk.1.exp_probs_b.bias"], bias.float())
    assert "blk.0.ffn_gate.weight" in tensors and "blk.1.ffn_gate_shexp.weight" in tensors

    def field(key):
        return reader.fields[f"deepseek2.{key}"].parts[-1][0]

    assert int(field("attention.head_count_kv")) == 1
    assert int(field("attention.key_length")) == rank + cfg["qk_rope_head_dim"]
    assert int(field("attention.value_length")) == rank
    assert int(field("attention.kv_lora_rank")) == rank and int(field("attention.q_lora_rank")) == cfg["q_lora_rank"]
    assert int(field("leading_dense_block_count")) == 1
    assert int(field("expert_gating_func")) == int(gguf.ExpertGatingFuncType.SIGMOID)
    assert float(field("expert_weights_scale")) == cfg["routed_scaling_factor"] and bool(field("expert_weights_norm"))


def test_deepseek_gguf_refuses_what_llama_cpp_would_run_differently(deepseek_v2_lite, tmp_path):
    pytest.importorskip("gguf")
    from infertune.bench.gguf_export import PeerUnavailable, export_gguf

    with pytest.raises(PeerUnavailable, match="q_lora_rank is null"):
        export_gguf(deepseek_v2_lite, tmp_path / "lite.gguf")
    grouped = make_deepseek_checkpoint(tmp_path / "grouped", v3=True)  # n_group 8, topk_group 4
    with pytest.raises(PeerUnavailable, match="group-limited routing"):
        export_gguf(grouped, tmp_path / "grouped.gguf")


def test_llama_cpp_runs_the_exported_deepseek_greedy_like_hf(deepseek_v3_one_group, tmp_path):
    """The exported V3 through llama.cpp (f32): every greedy token is HF's top on the same prefix, so the latent
    attention, the absorbed weights and the routing in the file are the checkpoint's."""
    _llama_cpp_follows_hf(deepseek_v3_one_group, tmp_path)


# ---- eval and bench on MoE checkpoints ----------------------------------------------------------------------------


def test_eval_scores_a_deepseek_checkpoint_as_hf_does(deepseek_v2_lite, tmp_path, capsys):
    """`infertune eval --quantization w8a16 --json` on DeepSeek (MLA + MoE): the reference (the same checkpoint
    unquantized) scores the text with HF transformers' perplexity over the same windows, every token once; the int8
    candidate is a little worse, close but not identical in its next-token distributions."""
    import json

    from infertune.cli import main
    from infertune.evaluate.accuracy import sliding_windows

    path = deepseek_v2_lite
    text = tmp_path / "held.txt"
    text.write_text("def route(x, experts):\n    return sorted(experts, key=x.score)[:2]\n" * 3)
    argv = ["--data", str(text), "--context", "32", "--stride", "16", "--num-prompts", "2", "--greedy-tokens", "6"]
    rc = main(["eval", "--model", str(path), "--quantization", "w8a16", "--dtype", "float32", *argv, "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["quantization"] == "w8a16" and report["reference_quantization"] is None
    tok = make_tokenizer()
    ids = tok.encode(text.read_text(), add_special_tokens=False) + [tok.eos_token_id]
    assert report["num_tokens"] == len(ids) - 1 and (report["context"], report["stride"]) == (32, 16)
    hf = hf_model(path)
    total = 0.0
    with torch.no_grad():
        for w in sliding_windows(len(ids), 32, 16):
            logits = hf(torch.tensor([ids[w.begin : w.end]])).logits[0]
            rows = logits[w.score_from - 1 - w.begin : w.end - 1 - w.begin].double()
            total += float(
                torch.nn.functional.cross_entropy(rows, torch.tensor(ids[w.score_from : w.end]), reduction="sum")
            )
    assert report["ref_perplexity"] == pytest.approx(math.exp(total / report["num_tokens"]), rel=1e-5)
    assert report["perplexity"] != report["ref_perplexity"]
    assert abs(report["perplexity"] / report["ref_perplexity"] - 1) < 0.1
    assert 0 < report["kl_mean"] <= report["kl_max"] < 0.5
    assert 0.5 <= report["top1_agreement"] <= 1.0
    assert len(report["greedy_prefix"]) == 2 and all(0 <= n <= 6 for n in report["greedy_prefix"])


def test_bench_latency_runs_a_moe_checkpoint_beside_hf(qwen3_moe, tmp_path, capsys):
    """`infertune bench latency` on Qwen3-MoE in fp32, infertune and HF transformers side by side: the model's
    parameters are HF's count, both produce --output-len tokens, the greedy sequences are identical, and the
    rates are the token counts over the measured times."""
    import json

    from infertune.cli import main

    out = tmp_path / "r.json"
    workload = ["--input-len", "7", "--output-len", "5", "--repeats", "1", "--probe-gib", "0"]
    rc = main(
        ["bench", "latency", "--model", str(qwen3_moe), "--dtype", "float32", "--compile", "off", "--hf-attn", "eager"]
        + [*workload, "--json", str(out)]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    hf = hf_model(qwen3_moe)
    assert doc["model"]["params"] == sum(p.numel() for p in hf.parameters())
    assert doc["workload"]["batches"] == [1]  # latency: batch 1
    by = {r["system"]: r for r in doc["results"]}
    assert set(by) == {"infertune", "hf"} and all("error" not in r and "skipped" not in r for r in by.values())
    for r in by.values():
        (run_,) = r["runs"]
        assert 0 < run_["ttft_s"] <= run_["total_s"]
        assert run_["output_tok_s"] == pytest.approx(5 / run_["total_s"])
        assert run_["decode_tok_s"] == pytest.approx(4 / (run_["total_s"] - run_["ttft_s"]))
    assert doc["greedy_agreement"]["1"] == dict(
        identical_sequences=1, sequences=1, mean_common_prefix=5.0, tokens_per_sequence=5
    )
    row = next(
        line for line in capsys.readouterr().out.splitlines() if line.startswith("| infertune | HF transformers")
    )
    assert row.endswith("| 1/1 identical, mean common prefix 5.0/5 |")
