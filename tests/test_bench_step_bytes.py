"""The bytes a batch-1 decode step reads, per system (bench/step_bytes.py): the counting rule on names (exact
arithmetic), the engine's own tensors against the checkpoint's headers (two independent sources: equal where the
engine holds the weights as loaded, the int4 format's arithmetic where it packs them), the GGUF file's tensors, and
the benchmark's decode GB/s and roofline % from them."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_checkpoint

from infertune.bench import step_bytes as sb
from infertune.plan.memory import ModelSpec, kv_bytes_per_token


def test_rule_reads_the_layers_the_head_and_k_of_e_routed_experts():
    dense_untied = [
        ("model.embed_tokens.weight", 1000),  # a row lookup: not read whole
        ("lm_head.weight", 500),
        ("model.layers.0.self_attn.q_proj.weight", 40),
        ("model.layers.0.input_layernorm.weight", 2),
        ("model.layers.0.self_attn.rotary_emb.inv_freq", 7),  # a lookup table
    ]
    assert sb.decode_step_weight_bytes(dense_untied) == 500 + 40 + 2
    tied = [x for x in dense_untied if not x[0].startswith("lm_head")]
    assert sb.decode_step_weight_bytes(tied) == 1000 + 40 + 2  # the tied table is the head
    moe = [
        ("model.embed_tokens.weight", 1000),
        *[(f"model.layers.0.mlp.experts.{e}.up_proj.weight", 64) for e in range(8)],
        ("model.layers.1.mlp.experts.gate_up_proj", 8 * 128),  # transformers v5's fused experts
        ("model.layers.0.mlp.shared_experts.up_proj.weight", 32),  # every token runs the shared expert
        ("model.layers.0.mlp.shared_expert.up_proj.weight", 16),
        ("model.layers.0.mlp.gate.weight", 8),
    ]
    assert sb.decode_step_weight_bytes(moe, num_experts=8, top_k=2) == 1000 + 2 * 64 + 2 * 128 + 32 + 16 + 8
    gguf_names = [
        ("token_embd.weight", 1000),
        ("output.weight", 300),
        ("blk.0.ffn_up_exps.weight", 8 * 10),
        ("blk.0.ffn_up_shexp.weight", 5),
        ("blk.0.ffn_gate_inp.weight", 3),
        ("rope_freqs.weight", 9),
    ]
    assert sb.decode_step_weight_bytes(gguf_names, num_experts=8, top_k=2) == 300 + 2 * 10 + 5 + 3
    assert sb.moe_shape({"num_experts": 8, "num_experts_per_tok": 2}) == dict(num_experts=8, top_k=2)
    assert sb.moe_shape({"n_routed_experts": 64, "num_experts_per_tok": 6}) == dict(num_experts=64, top_k=6)
    assert sb.moe_shape({"num_local_experts": 8, "num_experts_per_tok": 2}) == dict(num_experts=8, top_k=2)
    assert sb.moe_shape({"hidden_size": 64}) == dict(num_experts=0, top_k=0)


def _engine_step_bytes(model_dir, **options):
    from infertune import LLM

    llm = LLM(
        str(model_dir), dtype="bfloat16", max_model_len=64, max_num_seqs=1, kv_cache_memory_bytes=1 << 20, **options
    )
    cfg = json.loads((model_dir / "config.json").read_text())
    return sb.decode_step_weight_bytes(sb.engine_tensors(llm.engine.executor.runner.model), **sb.moe_shape(cfg))


@pytest.mark.parametrize(
    "arch, kw",
    [
        ("llama", {}),
        ("llama", dict(tie_word_embeddings=True)),
        (
            "qwen2_moe",
            dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
        ),
    ],
)
def test_engine_holding_the_weights_as_loaded_reads_the_checkpoints_bytes(tmp_path, arch, kw):
    """compress_weights off: the engine's tensors (fused qkv / gate_up, the experts stacked) hold exactly the
    checkpoint's elements, so both sources give the same bytes; its default 12-bit layout reads fewer, the oneDNN
    prepacked path (opaque tensors) the same."""
    model = make_checkpoint(tmp_path / arch, arch, dtype=torch.bfloat16, **kw)
    cfg = json.loads((model / "config.json").read_text())
    from_checkpoint = sb.decode_step_weight_bytes(sb.checkpoint_tensors(model, 2), **sb.moe_shape(cfg))
    assert _engine_step_bytes(model, compress_weights="off") == from_checkpoint
    assert _engine_step_bytes(model, compress_weights="off", decode_kernels="off") == from_checkpoint
    assert 0.6 * from_checkpoint < _engine_step_bytes(model) < 0.9 * from_checkpoint  # 12-bit codes + escapes


def test_w4a16_counts_its_packed_nibbles_and_group_scales(tmp_path):
    """W4A16 with group g: half a byte a weight plus a bf16 scale and zero per group in every layer linear; the
    embedding / head and the norms stay bf16 (compress_weights off). Exact arithmetic from the checkpoint's shapes."""
    model = make_checkpoint(tmp_path / "m", "llama", dtype=torch.bfloat16)
    g = 32
    expected = 0
    for name, nbytes in sb.checkpoint_tensors(model, 2):
        n = nbytes // 2
        if name.startswith("model.layers.") and name.endswith("proj.weight"):
            expected += n // 2 + 4 * n // g
        elif name != "model.embed_tokens.weight":  # untied here: a lookup
            expected += 2 * n
    got = _engine_step_bytes(model, quantization="w4a16", quant_group_size=g, compress_weights="off")
    assert got == expected


def test_gguf_counts_its_tensors_as_stored(tmp_path):
    """The exported BF16 GGUF holds the checkpoint's matrices in bf16 and its norms in f32: the same bytes plus two
    more per norm element."""
    pytest.importorskip("gguf")
    from infertune.bench import peers

    model = make_checkpoint(tmp_path / "m", "llama", tie_word_embeddings=True, dtype=torch.bfloat16)
    out = peers.export_gguf(model, tmp_path / "m.gguf", "bfloat16")
    ck = sb.checkpoint_tensors(model, 2)
    norm_elems = sum(n // 2 for name, n in ck if "norm" in name)
    assert sb.decode_step_weight_bytes(sb.gguf_tensors(out)) == sb.decode_step_weight_bytes(ck) + 2 * norm_elems


def test_bench_reports_each_systems_step_bytes_rate_and_roofline(tmp_path, monkeypatch, capsys):
    """The table's decode GB/s is the system's own step bytes (weights as it holds them + the KV of the mean decode
    context) x decode tok/s; roofline % divides it by the probe."""
    from infertune.bench import offline

    model = make_checkpoint(tmp_path / "m", "llama", dtype=torch.bfloat16)
    monkeypatch.setattr(offline, "bandwidth_probe", lambda gib, threads, iters=5, huge=False: 30.0 if huge else 40.0)
    workload = "--input-len 6 --output-len 4 --batch 1 --repeats 1 --systems infertune,infertune-bf16".split()
    rc = offline.main(["--model", str(model), *workload, "--json", str(tmp_path / "r.json")])
    assert rc == 0
    doc = json.loads((tmp_path / "r.json").read_text())
    by = {r["system"]: r for r in doc["results"]}
    cfg = json.loads((model / "config.json").read_text())
    weights_bf16 = sb.decode_step_weight_bytes(sb.checkpoint_tensors(model, 2))
    kv = (6 + 4 / 2) * kv_bytes_per_token(ModelSpec.from_dict(cfg))  # (the planner's: 2 bf16 planes a KV head)
    bf16, packed = by["infertune-bf16"], by["infertune"]
    assert bf16["step_weight_bytes"] == weights_bf16 and bf16["step_kv_bytes"] == kv
    assert packed["step_weight_bytes"] < 0.9 * weights_bf16  # the 12-bit layout's own bytes, not bf16's
    for r in (bf16, packed):
        m = r["median"]
        assert m["decode_gb_s"] == pytest.approx(r["step_bytes"] * m["decode_tok_s"] / 1e9, rel=1e-12)
        assert m["roofline_pct"] == pytest.approx(100 * m["decode_gb_s"] / 40.0, rel=1e-12)
    out = capsys.readouterr().out
    assert "| step MiB | decode GB/s | roofline % | probe GB/s |" in out
    # the probe on 2 MB pages (where the packed weights sit) is reported beside it, not used for roofline %
    assert doc["probe_end_2mb_pages_gb_s"] == 30.0 and "on 2 MB pages" in out and "30.0 GB/s" in out


def test_deepseek_mtp_layers_are_neither_read_nor_counted(tmp_path):
    """A DeepSeek-V3 checkpoint with a multi-token-prediction layer (model.layers.{num_hidden_layers}.*, as published):
    no system loads it, so the checkpoint's step bytes and the benchmark's parameter count leave it out. Oracle: the
    file without that layer (the same tensors and bytes; its elements counted from the file's tensors)."""
    from safetensors.torch import load_file, save_file
    from test_deepseek import LAYERS, VARIANTS, make_deepseek_checkpoint

    from infertune.bench.offline_models import checkpoint_param_count

    plain = make_deepseek_checkpoint(tmp_path / "plain", **{**VARIANTS["v3"], "torch_dtype": "bfloat16"})
    mtp = tmp_path / "mtp"
    mtp.mkdir()
    for f in plain.iterdir():
        (mtp / f.name).write_bytes(f.read_bytes())
    state = load_file(plain / "model.safetensors")
    extra = {
        k.replace(f"layers.{LAYERS - 1}.", f"layers.{LAYERS}."): v.clone()
        for k, v in state.items()
        if f"layers.{LAYERS - 1}." in k
    }
    extra[f"model.layers.{LAYERS}.eh_proj.weight"] = torch.zeros(64, 128)
    save_file({**state, **extra}, mtp / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((mtp / "config.json").read_text())
    (mtp / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))

    assert sb.checkpoint_tensors(mtp, 2) == sb.checkpoint_tensors(plain, 2)
    assert checkpoint_param_count(mtp) == sum(t.numel() for t in state.values())
