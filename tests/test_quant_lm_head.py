"""quantize_lm_head: the LM head in int8 per output channel (tied or not), against HF transformers running the same
dequantized weights; the tied embedding keeps the checkpoint's values."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_model, make_checkpoint

from infertune import LLM
from infertune.config import QuantConfig
from infertune.layers.linear import Linear, PackedLinear
from infertune.quant import W8A16Method
from infertune.quant.int4 import dequantize_int4, quantize_int4_groupwise
from infertune.quant.int8 import quantize_int8_per_channel


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("tied"), "llama", tie_word_embeddings=True)


@pytest.fixture(scope="module")
def untied(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("untied"), "qwen2", tie_word_embeddings=False)


def _hf_with_dequantized(ckpt, method: str, group: int):
    """HF in fp32 with every projection replaced by its dequantized weights (int8 per channel or int4 per group, as
    the engine's quantizers round them) and the head by its int8 per-channel dequantization, untied from the
    embedding, which keeps the checkpoint's values."""
    hf = hf_model(ckpt)
    for name, p in hf.named_parameters():
        if name.endswith("proj.weight"):
            if method == "w8a16":
                q, s = quantize_int8_per_channel(p.data)
                p.data.copy_(q.float() * s.float().unsqueeze(1))
            else:
                q, scale, low = quantize_int4_groupwise(p.data, group)
                p.data.copy_(dequantize_int4(q, scale, low, group))
    head = hf.get_output_embeddings().weight.data.clone()
    q, s = quantize_int8_per_channel(head)
    hf.lm_head.weight = torch.nn.Parameter(q.float() * s.float().unsqueeze(1))  # (unties it)
    return hf


@pytest.mark.parametrize("which", ["tied", "untied"])
@pytest.mark.parametrize("method,group", [("w8a16", 128), ("w4a16", 32)])
def test_quantized_head_matches_hf_with_the_same_dequantized_weights(request, which, method, group):
    ckpt = request.getfixturevalue(which)
    llm = LLM(
        str(ckpt),
        dtype="float32",
        max_model_len=64,
        quantization=method,
        quant_group_size=group,
        quantize_lm_head=True,
    )
    model = llm.engine.executor.runner.model
    head = model.lm_head
    assert isinstance(head.quant_method, W8A16Method) and not hasattr(head, "weight")
    assert head.qweight.dtype == torch.int8  # int8 whatever the method
    hf = hf_model(ckpt)
    # the embedding is still the checkpoint's, in full precision
    assert torch.equal(model.model.embed_tokens.weight.float(), hf.get_input_embeddings().weight.float())
    ref_model = _hf_with_dequantized(ckpt, method, group)
    prompt = torch.randint(0, hf.config.vocab_size, (13,), generator=torch.Generator().manual_seed(7)).tolist()
    ours = llm.engine.executor.runner.prompt_logits(prompt, list(range(5)))
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0]
        fp = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
    # and the int8 head moves the logits by more than kernel noise: the oracle tells the two heads apart
    plain = LLM(str(ckpt), dtype="float32", max_model_len=64, quantization=method, quant_group_size=group)
    theirs = plain.engine.executor.runner.prompt_logits(prompt, list(range(5)))
    assert (theirs - ref).abs().max() > 1e-3
    if method == "w8a16":  # int8 everywhere stays near the full-precision model (int4 on these weights does not)
        assert (ours - fp).abs().max() < 0.05 * fp.abs().max()


def test_the_head_stays_full_precision_by_default(tied):
    llm = LLM(str(tied), dtype="float32", max_model_len=64, quantization="w8a16")
    model = llm.engine.executor.runner.model
    assert hasattr(model.lm_head, "weight") and not hasattr(model.lm_head, "qweight")
    quantized = [n for n, m in model.named_modules() if isinstance(m, (Linear, PackedLinear)) and hasattr(m, "qweight")]
    assert quantized and "lm_head" not in quantized


def test_quantize_lm_head_needs_a_quantization(tied):
    with pytest.raises(ValueError, match="quantize_lm_head needs a quantization"):
        QuantConfig(quantize_lm_head=True)
    with pytest.raises(ValueError, match="quantize_lm_head needs a quantization"):
        LLM(str(tied), quantize_lm_head=True)


@pytest.mark.parametrize("which", ["tied", "untied"])
def test_quantize_lm_head_on_a_quantized_checkpoint(request, tmp_path, which):
    """A folder `infertune quantize` wrote (its head in full precision) loaded with quantize_lm_head=True, with its
    method named or not (serve OUT --quantize-lm-head): the head in int8 as on the fly, the stored layers as stored;
    against HF transformers running the same dequantized weights. It was silently kept in full precision with the
    method named, and refused as 'none is set' without it; keep_fp, which the stored layers cannot follow, was
    silently dropped and is refused now."""
    from infertune.tools.quantizer import quantize

    ckpt = request.getfixturevalue(which)
    out = tmp_path / "w4"
    quantize(str(ckpt), "w4a16", str(out), group_size=32, show_progress=False)
    ref_model = _hf_with_dequantized(ckpt, "w4a16", 32)
    prompt = torch.randint(0, ref_model.config.vocab_size, (13,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0]
    for named in ({}, {"quantization": "w4a16"}):
        llm = LLM(str(out), dtype="float32", max_model_len=64, quantize_lm_head=True, **named)
        assert llm.config.quant.quantization == "w4a16" and llm.config.quant.quant_group_size == 32
        head = llm.engine.executor.runner.model.lm_head
        assert isinstance(head.quant_method, W8A16Method) and head.qweight.dtype == torch.int8
        ours = llm.engine.executor.runner.prompt_logits(prompt, list(range(5)))
        torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
    plain = LLM(str(out), dtype="float32", max_model_len=64).engine.executor.runner.prompt_logits(
        prompt, list(range(5))
    )
    assert (plain - ref).abs().max() > 1e-3  # (the oracle tells the two heads apart)
    with pytest.raises(ValueError, match=r"already quantized \(w4a16\).*drop keep_fp"):
        LLM(str(out), keep_fp=("model.layers.0.*",))
    with pytest.raises(ValueError, match=r"already quantized \(w4a16\); drop quantization='w8a16'"):
        LLM(str(out), quantization="w8a16", quantize_lm_head=True)


def test_quantize_lm_head_written_by_quantize_applies_at_every_load(tmp_path):
    """`infertune quantize --quantize-lm-head` (the flag did not exist): the checkpoint keeps its head's values and
    says so, and a plain LLM(OUT) runs it in int8 per row: on a tied Gemma 2 (scaled embeddings, final soft-cap)
    against HF transformers running the same dequantized weights, and equal to quantizing on the fly; plan counts
    the int8 head (hand arithmetic: vocab x hidden bytes and a bf16 scale a row, beside the bf16 embedding)."""
    from test_gemma import VARIANTS, make_gemma

    from infertune.plan import ModelSpec, weight_breakdown
    from infertune.plan.weights import WeightFormat
    from infertune.tools.quantizer import quantize

    src = make_gemma(tmp_path / "g2", **VARIANTS["gemma2"])
    out = tmp_path / "w4"
    result = quantize(str(src), "w4a16", str(out), group_size=32, quantize_lm_head=True, show_progress=False)
    assert "lm_head (int8 at load)" in result.format()
    ref_model = _hf_with_dequantized(src, "w4a16", 32)
    prompt = torch.randint(0, ref_model.config.vocab_size, (13,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        ref = ref_model(torch.tensor([prompt])).logits[0]
    llm = LLM(str(out), dtype="float32", max_model_len=64)
    head = llm.engine.executor.runner.model.lm_head
    assert llm.config.quant.quantize_lm_head and isinstance(head.quant_method, W8A16Method)
    ours = llm.engine.executor.runner.prompt_logits(prompt, list(range(5)))
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
    fly = LLM(
        str(src), dtype="float32", max_model_len=64, quantization="w4a16", quant_group_size=32, quantize_lm_head=True
    )
    torch.testing.assert_close(ours, fly.engine.executor.runner.prompt_logits(prompt, list(range(5))), atol=0, rtol=0)
    vocab, h = ref_model.config.vocab_size, ref_model.config.hidden_size
    with_head = weight_breakdown(ModelSpec.load(out), ModelSpec.load(out).weight_format).total_bytes
    without = weight_breakdown(ModelSpec.load(out), WeightFormat("w4a16", 32)).total_bytes
    assert with_head - without == vocab * h + vocab * 2
