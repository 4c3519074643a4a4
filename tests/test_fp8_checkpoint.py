"""FP8 block-scaled checkpoints (DeepSeek-V3's and Qwen3-*-FP8's format): tiny random checkpoints converted to fp8
here (weights float8_e4m3fn, weight_scale_inv fp32 per block, partial blocks included), loaded dequantized and held
to Hugging Face transformers running the same dequantized weights (its own fp8 loader where the shapes let it), in
fp32; re-quantized to W8A16 equal to W8A16 of the dequantized weights; bad checkpoints named; plan's bytes equal to
the files' bytes."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import hf_model, make_checkpoint
from safetensors.torch import load_file, save_file

from infertune import LLM
from infertune.plan import ModelSpec, weight_breakdown
from infertune.quant.fp8 import dequantize_fp8

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The format's definition, written plainly: w[..., i, j] = q[..., i, j] * scale[..., i // bn, j // bk]."""
    n, k = q.shape[-2:]
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return q.float() * full[..., :n, :k]


def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] -> (float8_e4m3fn weight, fp32 scale_inv [..., ceil(N/bn), ceil(K/bk)]): each block's amax to 448."""
    n, k = w.shape[-2:]
    bn, bk = block
    rows, cols = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(*w.shape[:-2], rows * bn, cols * bk)
    padded[..., :n, :k] = w.float()
    amax = padded.unflatten(-1, (cols, bk)).unflatten(-3, (rows, bn)).abs().amax(dim=(-3, -1))
    scale = (amax / FP8_MAX).clamp(min=1e-12)
    q = (w.float() / reference_dequantize(torch.ones_like(w), scale, block)).to(torch.float8_e4m3fn)
    return q, scale


def is_projection(name: str) -> bool:
    """The tensors fp8 checkpoints quantize: the decoder layers' projections and experts (not the embeddings, the
    lm_head, norms or the router)."""
    return name.startswith("model.layers.") and (name.endswith("_proj.weight") or name.endswith("_proj"))


def to_fp8(
    src: Path,
    dst: Path,
    block: tuple[int, int],
    rest_dtype: torch.dtype = torch.float32,
    not_converted: tuple[str, ...] = (),
    fuse_experts: bool = False,
    **qc_extra,
) -> dict[str, torch.Tensor]:
    """Write src's weights as a block-scaled fp8 checkpoint at dst; returns the dequantized weights by name."""
    state = load_file(src / "model.safetensors")
    if fuse_experts:  # transformers v5's layout: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
        state = fused_experts(state)
    out, dequantized = {}, {}
    for name, w in state.items():
        module = name.removesuffix(".weight")
        if is_projection(name) and module not in not_converted:
            q, scale = quantize(w, block)
            out[name], out[name + "_scale_inv"] = q, scale
            dequantized[name] = reference_dequantize(q, scale, block)
        else:
            out[name] = w.to(rest_dtype)
            dequantized[name] = out[name].float()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
        **({"modules_to_not_convert": list(not_converted)} if not_converted else {}),
        **qc_extra,
    }
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dst / f.name)
    return dequantized


def fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out, experts = {}, {}
    for name, w in state.items():
        parts = name.split(".")
        if ".experts." in name and parts[-3].isdigit():  # model.layers.L.mlp.experts.N.proj.weight
            experts.setdefault(".".join(parts[:-3]), {})[(int(parts[-3]), parts[-2])] = w
        else:
            out[name] = w
    for prefix, got in experts.items():
        n = 1 + max(e for e, _ in got)
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([got[(e, "gate_proj")], got[(e, "up_proj")]]) for e in range(n)]
        )
        out[f"{prefix}.down_proj"] = torch.stack([got[(e, "down_proj")] for e in range(n)])
    return out


def plain_copy(src: Path, dst: Path, weights: dict[str, torch.Tensor]) -> Path:
    """A 16-bit-style (here fp32) checkpoint of `weights` with src's config minus its quantization_config."""
    dst.mkdir(parents=True, exist_ok=True)
    save_file({n: w.contiguous() for n, w in weights.items()}, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dst / f.name)
    return dst


PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [1], list(range(60, 83))]
BLOCK = 4


def infertune_logits(path: Path, **engine) -> list[torch.Tensor]:
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=BLOCK, **engine)
    runner = llm.engine.executor.runner
    return [runner.prompt_logits(p, list(range(-(-len(p) // BLOCK)))) for p in PROMPTS], runner.model


def hf_logits(model) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in PROMPTS]


def test_dequantize_matches_the_format_definition():
    g = torch.Generator().manual_seed(0)
    for shape, block in [((40, 70), (16, 32)), ((3, 40, 70), (16, 32)), ((64, 64), (128, 128)), ((33, 17), (1, 17))]:
        w = torch.randn(shape, generator=g)
        q, scale = quantize(w, block)
        ref = reference_dequantize(q, scale, block)
        assert (ref - w).abs().max() <= 0.07 * w.abs().max()  # e4m3 keeps 3 mantissa bits
        torch.testing.assert_close(dequantize_fp8(q, scale, block, torch.float32), ref, rtol=0, atol=0)
        torch.testing.assert_close(dequantize_fp8(q, scale, block, torch.bfloat16), ref.bfloat16(), rtol=0, atol=0)
    q, _ = quantize(torch.randn(8, 24, generator=g), (8, 24))  # weight_block_size null: one scale a tensor
    torch.testing.assert_close(dequantize_fp8(q, torch.tensor(0.5), None, torch.float32), q.float() * 0.5)


@pytest.mark.parametrize(
    "block,intermediate", [((32, 32), 80), ((16, 48), 96)], ids=["partial-rows-and-cols", "oblong-partial-cols"]
)
def test_llama_with_partial_blocks_matches_hf_on_dequantized_weights(tmp_path, block, intermediate):
    """80 = 2.5 blocks of 32 and 64 = 1.33 blocks of 48: the last block row / column is partial."""
    src = make_checkpoint(tmp_path / "src", "llama", intermediate_size=intermediate)
    weights = to_fp8(src, tmp_path / "fp8", block)
    hf = hf_model(src)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(weights[name])
    ours, model = infertune_logits(tmp_path / "fp8")
    for a, b in zip(ours, hf_logits(hf)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    qkv = model.model.layers[1].self_attn.qkv_proj.weight  # dequantized in place, q / k / v packed
    names = [f"model.layers.1.self_attn.{p}_proj.weight" for p in "qkv"]
    torch.testing.assert_close(qkv, torch.cat([weights[n] for n in names]), rtol=0, atol=0)


def test_llama_matches_transformers_own_fp8_loading(tmp_path):
    """transformers dequantizes the same fp8 files itself (its FineGrainedFP8 path, on CPU): the independent reading
    of weight_block_size and weight_scale_inv (its dequantizer needs whole blocks: 128 and 64 are multiples)."""
    src = make_checkpoint(tmp_path / "src", "llama", intermediate_size=128)
    to_fp8(src, tmp_path / "fp8", (32, 16))
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8", dtype=torch.float32).eval()
    assert hf.model.layers[0].mlp.down_proj.weight.dtype == torch.float32  # dequantized, not fp8
    ours, _ = infertune_logits(tmp_path / "fp8")
    for a, b in zip(ours, hf_logits(hf)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    """A tiny Qwen3-MoE in fp8 with per-expert tensors, and transformers' own dequantized reading of it."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("qwen3-moe-fp8")
    src = make_checkpoint(
        root / "src", "qwen3_moe", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, head_dim=16
    )
    weights = to_fp8(src, root / "fp8", (16, 16))
    hf = AutoModelForCausalLM.from_pretrained(root / "fp8", dtype=torch.float32).eval()
    return root, src, weights, hf_logits(hf)


def test_qwen3_moe_per_expert_fp8_matches_hf(qwen3_moe):
    root, _, weights, reference = qwen3_moe
    ours, model = infertune_logits(root / "fp8")
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)
    experts = model.model.layers[0].mlp.experts  # the fused 3-D weights hold each expert's dequantized slices
    gate, up = (weights[f"model.layers.0.mlp.experts.3.{p}_proj.weight"] for p in ("gate", "up"))
    torch.testing.assert_close(experts.gate_up_proj[3], torch.cat([gate, up]), rtol=0, atol=0)


def test_qwen3_moe_fused_fp8_experts_match_hf(qwen3_moe, tmp_path):
    """The same weights in the fused 3-D layout: experts.gate_up_proj [E, 2I, H] fp8 with gate_up_proj_scale_inv
    [E, 2I / 16, H / 16] (transformers v5's FP8Experts names)."""
    _, src, _, reference = qwen3_moe
    to_fp8(src, tmp_path / "fused", (16, 16), fuse_experts=True)
    ours, _ = infertune_logits(tmp_path / "fused")
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


def test_w8a16_on_fp8_requantizes_the_dequantized_weights(tmp_path):
    """quantization="w8a16" on an fp8 checkpoint: each dequantized projection re-quantized per channel, exactly as
    W8A16 of a checkpoint holding those weights; a module the checkpoint kept out of fp8 (modules_to_not_convert)
    stays in full precision."""
    src = make_checkpoint(tmp_path / "src", "llama", intermediate_size=80)
    kept = "model.layers.1.mlp.down_proj"
    weights = to_fp8(src, tmp_path / "fp8", (32, 32), not_converted=(kept,))
    plain = plain_copy(tmp_path / "fp8", tmp_path / "plain", weights)
    ours, model = infertune_logits(tmp_path / "fp8", quantization="w8a16")
    reference, ref_model = infertune_logits(plain, quantization="w8a16", keep_fp=("lm_head", kept))
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    layers = model.model.layers
    assert layers[0].mlp.down_proj.quant_method.name == "w8a16"
    assert layers[1].mlp.gate_up_proj.quant_method.name == "w8a16"
    assert not hasattr(layers[1].mlp.down_proj, "qweight")  # kept: plain weights
    torch.testing.assert_close(layers[1].mlp.down_proj.weight, weights[kept + ".weight"], rtol=0, atol=0)


@pytest.mark.parametrize("fuse", [False, True], ids=["per-expert", "fused"])
def test_quantize_command_takes_an_fp8_checkpoint(qwen3_moe, tmp_path, fuse):
    """`infertune quantize` on an fp8 checkpoint (the only form DeepSeek-V3 is published in; was refused as "already
    quantized"): its output holds, tensor for tensor, what quantizing a plain checkpoint of the format's dequantized
    weights writes (the module the fp8 checkpoint left unconverted kept in full precision there too), and the
    "before" bytes are the fp8 files' (weights + scales, read from the file)."""
    from infertune.tools.quantizer import quantize

    _, src, _, _ = qwen3_moe
    kept = "model.layers.1.self_attn.o_proj"
    weights = to_fp8(src, tmp_path / "fp8", (16, 16), not_converted=(kept,), fuse_experts=fuse)
    plain = plain_copy(tmp_path / "fp8", tmp_path / "plain", weights)
    for method in ("w8a16", "w4a16"):
        got = quantize(str(tmp_path / "fp8"), method, str(tmp_path / f"q-{method}"), group_size=32, show_progress=False)
        want = quantize(str(plain), method, str(tmp_path / f"r-{method}"), group_size=32, keep_fp=("lm_head", kept))
        a = load_file(tmp_path / f"q-{method}" / "model.safetensors")
        b = load_file(tmp_path / f"r-{method}" / "model.safetensors")
        assert a.keys() == b.keys() and not any(k.endswith("_scale_inv") for k in a)
        for name in a:
            assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name
        assert a[kept + ".weight"].dtype == torch.float32  # unconverted in the fp8 checkpoint: not quantized
        assert got.quantized == want.quantized and kept in got.kept
        files = load_file(tmp_path / "fp8" / "model.safetensors")
        fp8_bytes = sum(
            t.numel() * t.element_size()
            for n, t in files.items()
            if is_projection(n.removesuffix("_scale_inv")) and kept not in n
        )
        assert got.weight_bytes_before == fp8_bytes  # every fp8 projection (and its scales) is quantized
        qc, ref_qc = (
            json.loads((tmp_path / f"{d}-{method}" / "config.json").read_text())["quantization_config"] for d in "qr"
        )
        assert qc.pop("infertune")["source_model"] == str((tmp_path / "fp8").resolve())  # the fp8 config replaced
        ref_qc.pop("infertune")
        assert qc == ref_qc


def test_bad_fp8_checkpoints_are_named(tmp_path):
    src = make_checkpoint(tmp_path / "src", "llama")
    fp8 = tmp_path / "fp8"
    to_fp8(src, fp8, (32, 32))
    cfg = json.loads((fp8 / "config.json").read_text())

    def with_config(**qc):
        (fp8 / "config.json").write_text(
            json.dumps({**cfg, "quantization_config": {**cfg["quantization_config"], **qc}})
        )

    with_config(quant_method="awq")
    with pytest.raises(ValueError, match="quant_method='awq'"):
        LLM(str(fp8), dtype="float32")
    with_config(fmt="e5m2")
    with pytest.raises(ValueError, match="fmt='e5m2'"):
        LLM(str(fp8), dtype="float32")
    with_config(weight_block_size=[32, 16])  # scales are [ceil(N/32), ceil(K/32)]: the grid does not fit
    with pytest.raises(ValueError, match=r"model\.layers\.\d\.\S+_proj\.weight_scale_inv: shape"):
        LLM(str(fp8), dtype="float32")
    with_config()
    state = load_file(fp8 / "model.safetensors")
    del state["model.layers.1.self_attn.o_proj.weight_scale_inv"]
    save_file(state, fp8 / "model.safetensors")
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.o_proj\.weight_scale_inv'"):
        LLM(str(fp8), dtype="float32")
    save_file({n: t for n, t in state.items() if not n.endswith("_scale_inv")}, fp8 / "model.safetensors")
    (fp8 / "config.json").write_text(json.dumps({k: v for k, v in cfg.items() if k != "quantization_config"}))
    with pytest.raises(ValueError, match="float8_e4m3fn.*quant_method 'fp8'"):
        LLM(str(fp8), dtype="float32")


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_plan_counts_the_fp8_files_bytes(tmp_path, family):
    """plan on an fp8 checkpoint: one byte a weight plus its fp32 block scales, the rest 16-bit: exactly the bytes
    of the tensors in the file (embeddings, norms and the router stored in bf16, as the published ones are)."""
    extra = (
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=40, head_dim=16) if family != "llama" else {}
    )
    src = make_checkpoint(tmp_path / "src", family, intermediate_size=80, **extra)
    to_fp8(src, tmp_path / "fp8", (32, 32), rest_dtype=torch.bfloat16)
    stored = sum(t.numel() * t.element_size() for t in load_file(tmp_path / "fp8" / "model.safetensors").values())
    spec = ModelSpec.load(tmp_path / "fp8")
    assert spec.weight_format.name == "fp8" and spec.weight_format.block == (32, 32)
    w = weight_breakdown(spec, spec.weight_format)
    assert w.total_bytes == stored
    scales = load_file(tmp_path / "fp8" / "model.safetensors")
    assert w.bytes_quant_scales == sum(4 * t.numel() for n, t in scales.items() if n.endswith("_scale_inv"))


def test_deepseek_v3_fp8_loads_as_its_dequantized_weights(tmp_path):
    """DeepSeek-V3 as published: MLA's kv_b_proj, shared and routed experts in fp8 (group-limited routing with a
    correction bias), and an fp8 multi-token-prediction layer that is skipped, not dequantized. Oracle: the same
    model from a plain checkpoint of the dequantized weights (bit for bit), which DeepSeek's parity tests hold to
    transformers."""
    from conftest import make_tokenizer
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    tok = make_tokenizer()
    cfg = DeepseekV3Config(
        vocab_size=len(tok), hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=2, topk_group=1, q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=256, eos_token_id=tok.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.copy_(0.1 * torch.randn(8))
    model.save_pretrained(tmp_path / "src")
    tok.save_pretrained(tmp_path / "src")
    weights = to_fp8(tmp_path / "src", tmp_path / "fp8", (16, 16))
    plain = plain_copy(tmp_path / "fp8", tmp_path / "plain", weights)
    # An MTP layer (layer 3 of 3), its fp8 weights without scales: skipped untouched (dequantizing them would fail).
    fp8_state = load_file(tmp_path / "fp8" / "model.safetensors")
    mtp = {
        n.replace("layers.2.", "layers.3."): t.clone()
        for n, t in fp8_state.items()
        if n.startswith("model.layers.2.") and not n.endswith("_scale_inv")
    }
    save_file({**fp8_state, **mtp}, tmp_path / "fp8" / "model.safetensors")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    (tmp_path / "fp8" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    assert fp8_state["model.layers.1.self_attn.kv_b_proj.weight"].dtype == torch.float8_e4m3fn
    ours, model = infertune_logits(tmp_path / "fp8")
    reference, _ = infertune_logits(plain)
    for a, b in zip(ours, reference):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    kv_b = model.model.layers[1].self_attn.kv_b_proj.weight
    torch.testing.assert_close(kv_b, weights["model.layers.1.self_attn.kv_b_proj.weight"], rtol=0, atol=0)
