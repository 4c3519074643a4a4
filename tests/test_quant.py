"""Weight quantization (W8A16, W4A16, W8A8): error bounds, fast kernels against exact arithmetic, and whole-model
parity with HF transformers running the same dequantized weights."""

from __future__ import annotations

import pytest
import torch
from conftest import hf_model, make_checkpoint

from infertune import LLM
from infertune.config import QuantConfig
from infertune.layers.linear import Linear, PackedLinear
from infertune.quant import W4A16Method, W8A8Method, W8A16Method
from infertune.quant.int4 import dequantize_int4, quantize_int4_groupwise
from infertune.quant.int8 import quantize_int8_per_channel, quantize_int8_per_token


def test_int8_round_trip_within_half_a_step():
    w = torch.randn(96, 64) * torch.logspace(-2, 1, 96).unsqueeze(1)  # rows of very different scale
    q, scale = quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and q.abs().max() <= 127
    err = (w - q.float() * scale.unsqueeze(1)).abs()
    assert (err <= scale.unsqueeze(1) / 2 * (1 + 1e-6)).all()
    assert (q.abs().amax(dim=1) == 127).all()  # the largest weight of each row uses the full range


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_round_trip_within_half_a_step(group_size, symmetric):
    w = torch.randn(48, 128) + 0.5
    q, scale, low = quantize_int4_groupwise(w, group_size, symmetric)
    assert q.min() >= 0 and q.max() <= 15
    deq = dequantize_int4(q, scale, low, group_size)
    bound = scale.repeat_interleave(group_size, dim=1) / 2 * (1 + 1e-5)
    assert ((w - deq).abs() <= bound).all()
    if not symmetric:  # each group's min and max are represented exactly (up to rounding)
        g = w.view(48, -1, group_size)
        torch.testing.assert_close(deq.view(48, -1, group_size).amin(-1), g.amin(-1), atol=1e-5, rtol=0)


def test_int4_group_size_must_divide_in_features():
    with pytest.raises(ValueError, match="group_size"):
        quantize_int4_groupwise(torch.randn(8, 96), 64)


def quantized_linear(method, k=128, n=96, bias=True, dtype=torch.float32, seed=0) -> tuple[Linear, torch.Tensor]:
    torch.manual_seed(seed)
    layer = Linear(k, n, bias=bias, dtype=dtype, quant_method=method)
    w = torch.randn(n, k, dtype=dtype)
    layer.weight.data.copy_(w)
    if bias:
        layer.bias.data.copy_(torch.randn(n, dtype=dtype))
    method.process_weights_after_loading(layer)
    return layer, w


def reference_weight(layer: Linear) -> torch.Tensor:
    return layer.quant_method.dequantized_weight(layer).double()  # from the int8 values and scales


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a16_kernel_matches_dequantized_product(dtype):
    layer, w = quantized_linear(W8A16Method(), dtype=dtype)
    assert not hasattr(layer, "weight") and layer.qweight.dtype == torch.int8
    x = torch.randn(5, 128, dtype=dtype)
    ref = x.double() @ reference_weight(layer).t() + layer.bias.double()
    y = layer(x)
    assert y.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((y.double() - ref).abs() <= tol * ref.abs().max()).all()
    # and the quantized product stays close to the original weights' product (int8: ~0.5% of a row's max)
    full = x.double() @ w.double().t() + layer.bias.double()
    assert (y.double() - full).abs().max() <= 0.02 * full.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("symmetric", [False, True])
def test_w4a16_kernel_matches_dequantized_product(dtype, symmetric):
    torch.manual_seed(1)
    w = torch.randn(96, 128, dtype=dtype)
    q, scale, low = quantize_int4_groupwise(w, 32, symmetric)
    deq = dequantize_int4(q, scale, low, 32).double()
    layer = Linear(128, 96, dtype=dtype, quant_method=W4A16Method(32, symmetric))
    layer.weight.data.copy_(w)
    layer.quant_method.process_weights_after_loading(layer)
    x = torch.randn(7, 128, dtype=dtype)
    ref = x.double() @ deq.t()
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    assert ((layer(x).double() - ref).abs() <= tol * ref.abs().max()).all()
    reference_path = Linear(128, 96, dtype=dtype, quant_method=W4A16Method(32, symmetric, fast_kernel=False))
    reference_path.weight.data.copy_(w)
    reference_path.quant_method.process_weights_after_loading(reference_path)
    assert ((reference_path(x).double() - ref).abs() <= tol * ref.abs().max()).all()


def test_w8a8_equals_exact_integer_arithmetic():
    layer, _ = quantized_linear(W8A8Method(), bias=False)
    x = torch.randn(6, 128)
    xq, xs = quantize_int8_per_token(x)
    wq = layer.qweight  # [N, K] int8
    exact = (xq.long() @ wq.long().t()).double() * xs.double() * layer.scales.double()  # int64: no rounding
    torch.testing.assert_close(layer(x).double(), exact, rtol=1e-6, atol=1e-6)


def test_w8a8_sums_exactly_where_products_are_largest():
    """Inputs that round to +-127 against weights of +-127 (an outlier channel meeting a row's largest weight): the
    case oneDNN's int8 GEMM gets wrong on CPUs without VNNI (VPMADDUBSW saturates pairs of products), which the
    torch path must not inherit. The output is bit for bit the exact integer sums, rounded once."""
    layer, _ = quantized_linear(W8A8Method(), k=256, n=64, bias=False)
    wq = layer.quant_method.int8_weight(layer)
    wq[:8] = torch.where(torch.arange(256) % 3 == 0, -127, 127).to(torch.int8)
    x = torch.full((20, 256), 3.0)
    x[:, 1::2] = -3.0
    x[5:] = torch.randn(15, 256)
    x[5:, 7] = 40.0  # an outlier: the rest of the row rounds to small integers
    xq, xs = quantize_int8_per_token(x)
    exact = xq.long() @ wq.long().t()
    assert exact.abs().max() > 2**15  # (sums far past int16)
    want = exact.float() * xs * layer.scales
    assert torch.equal(layer(x), want)


# ---- whole model ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("quant"), "qwen2")  # q/k/v bias, untied lm_head


def _load_dequantized_into_hf(hf, model) -> None:
    """Write our dequantized weights into the HF model, unpacking q/k/v and gate/up."""
    params = dict(hf.named_parameters())
    for name, module in model.named_modules():
        if not isinstance(module, Linear) or not hasattr(module.quant_method, "dequantized_weight"):
            continue
        w = module.quant_method.dequantized_weight(module)
        if isinstance(module, PackedLinear):
            parts = {"q": "q_proj", "k": "k_proj", "v": "v_proj", 0: "gate_proj", 1: "up_proj"}
            for shard, (start, size) in module.shard_offsets.items():
                target = name.rsplit(".", 1)[0] + "." + parts[shard] + ".weight"
                params[target].data.copy_(w[start : start + size])
        else:
            params[name + ".weight"].data.copy_(w)


@pytest.mark.parametrize("method", ["w8a16", "w8a8"])
def test_quantized_model_matches_hf_with_dequantized_weights(ckpt, method):
    llm = LLM(str(ckpt), dtype="float32", max_model_len=64, block_size=4, quantization=method)
    model = llm.engine.executor.runner.model
    quantized = [n for n, m in model.named_modules() if isinstance(m, Linear) and not hasattr(m, "weight")]
    assert len(quantized) == 2 * 4  # 2 layers x (qkv, o, gate_up, down); lm_head kept in full precision
    hf = hf_model(ckpt)
    prompt = torch.randint(0, hf.config.vocab_size, (13,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        fp_logits = hf(torch.tensor([prompt])).logits[0]
    _load_dequantized_into_hf(hf, model)
    ours = llm.engine.executor.runner.prompt_logits(prompt, list(range(4)))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    if method == "w8a16":  # same weights, fp32 activations: only kernel rounding separates the two
        torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
    else:  # activations are int8 too, which HF cannot emulate: bound the error against both references
        assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
    assert (ours - fp_logits).abs().max() < 0.05 * fp_logits.abs().max()


def test_w4a16_model_matches_hf_with_dequantized_weights(ckpt):
    llm = LLM(str(ckpt), dtype="float32", max_model_len=64, block_size=4, quantization="w4a16", quant_group_size=32)
    model = llm.engine.executor.runner.model
    hf = hf_model(ckpt)
    # Rebuild the int4 integers from the original weights with the same quantizer and load them into HF.
    params = dict(hf.named_parameters())
    for name, p in params.items():
        if name.endswith("proj.weight"):
            q, scale, low = quantize_int4_groupwise(p.data, 32)
            p.data.copy_(dequantize_int4(q, scale, low, 32))
    prompt = torch.randint(0, hf.config.vocab_size, (11,), generator=torch.Generator().manual_seed(4)).tolist()
    ours = llm.engine.executor.runner.prompt_logits(prompt, list(range(3)))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=0)
    assert model.model.layers[0].mlp.down_proj.qweight.dtype == torch.uint8  # packed nibbles


def test_keep_fp_patterns(ckpt):
    llm = LLM(
        str(ckpt), dtype="float32", max_model_len=64, quantization="w8a16", keep_fp=("lm_head", "model.layers.0.*")
    )
    model = llm.engine.executor.runner.model
    assert hasattr(model.model.layers[0].self_attn.qkv_proj, "weight")
    assert hasattr(model.lm_head, "weight")
    assert not hasattr(model.model.layers[1].self_attn.qkv_proj, "weight")


def test_bad_quant_options():
    with pytest.raises(ValueError, match="quantization"):
        QuantConfig(quantization="int3")
    with pytest.raises(ValueError, match="quant_group_size"):
        QuantConfig(quantization="w4a16", quant_group_size=48)


# ---- kernel choice by row count (decode: weight-pack kernels; prefill: dequantize + dense matmul) -----------
@pytest.mark.parametrize("rows", [3, 9])
def test_w8a16_both_paths_match_the_dequantized_product(rows):
    layer, _ = quantized_linear(W8A16Method(kernel_max_rows=4), dtype=torch.bfloat16)
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    ref = x.double() @ reference_weight(layer).t() + layer.bias.double()
    assert ((layer(x).double() - ref).abs() <= 2e-2 * ref.abs().max()).all()


@pytest.mark.parametrize("n", [128, 80])  # 128: unpacked from the kernel's layout; 80: kept as a separate copy
@pytest.mark.parametrize("rows", [2, 9])
def test_w4a16_both_paths_match_the_dequantized_product(n, rows):
    torch.manual_seed(2)
    w = torch.randn(n, 128, dtype=torch.bfloat16)
    q, scale, low = quantize_int4_groupwise(w, 32)
    deq = dequantize_int4(q, scale, low, 32).double()
    layer = Linear(128, n, dtype=torch.bfloat16, quant_method=W4A16Method(32, kernel_max_rows=4))
    layer.weight.data.copy_(w)
    layer.quant_method.process_weights_after_loading(layer)
    # torch's int4 pack is read back where its rows fill its blocks: 64 rows with torch's AVX-512 kernels, 32 with
    # its AVX2 ones; otherwise the integers are kept as well
    block = 64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32
    assert layer.quant_method.unpack_known == (n % block == 0)
    assert (layer.q_dense is None) == (n % block == 0)
    x = torch.randn(rows, 128, dtype=torch.bfloat16)
    ref = x.double() @ deq.t()
    assert ((layer(x).double() - ref).abs() <= 2e-2 * ref.abs().max()).all()


def test_int4_kernel_layout_unpacks_exactly():
    from infertune.quant.int4 import CPU_INT4_LAYOUTS, _unpack_cpu_int4

    q = torch.randint(0, 16, (192, 96), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 2)
    cap = torch.backends.cpu.get_cpu_capability()  # torch's layout follows the kernels it dispatches to
    layout = "avx512" if cap.startswith("AVX512") else "avx2" if cap == "AVX2" else "default"
    assert torch.equal(_unpack_cpu_int4(packed, 192, 96, layout), q)
    assert not any(  # and the other layouts do not read it back: the test tells them apart
        torch.equal(_unpack_cpu_int4(packed, 192, 96, other), q) for other in CPU_INT4_LAYOUTS if other != layout
    )


def test_prepacked_bf16_linear_matches_reference():
    from infertune.backends import CPUBackend
    from infertune.layers.linear import PrepackedMethod

    backend = CPUBackend()
    if not backend.can_prepack(torch.bfloat16):
        pytest.skip("this CPU has no native bf16 (AVX512-BF16 / AMX), so weights are not prepacked")
    torch.manual_seed(5)
    layer = Linear(256, 192, bias=True, dtype=torch.bfloat16, quant_method=PrepackedMethod(backend))
    w, b = torch.randn(192, 256, dtype=torch.bfloat16), torch.randn(192, dtype=torch.bfloat16)
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(b)
    layer.quant_method.process_weights_after_loading(layer)
    assert not hasattr(layer, "weight")
    for rows in (1, 5, 64):
        x = torch.randn(rows, 256, dtype=torch.bfloat16)
        ref = x.double() @ w.double().t() + b.double()
        assert ((layer(x).double() - ref).abs() <= 1e-2 * ref.abs().max()).all()


def test_bf16_model_prepacked_matches_plain(ckpt):
    kw = dict(dtype="bfloat16", max_model_len=64, block_size=4, decode_kernels="off")  # kernels take plain weights
    packed = LLM(str(ckpt), **kw)
    plain = LLM(str(ckpt), prepack_weights=False, **kw)
    layer = packed.engine.executor.runner.model.model.layers[0].mlp.down_proj
    if not packed.engine.executor.backend.can_prepack(torch.bfloat16):
        pytest.skip("this CPU has no native bf16, so weights are not prepacked")
    assert layer.quant_method.name == "prepacked"
    prompt = list(range(5, 40))
    a = packed.engine.executor.runner.prompt_logits(prompt, list(range(9)))
    b = plain.engine.executor.runner.prompt_logits(prompt, list(range(9)))
    assert (a - b).abs().max() <= 0.05 * b.abs().max()  # same weights; only bf16 accumulation order differs


def test_each_layer_is_quantized_as_soon_as_its_weights_are_loaded(tmp_path, monkeypatch):
    """The loader quantizes (or packs) a module the moment the last of its weights is in (models/loader.py
    _ReadyModules), not after the whole checkpoint: so a quantized model never holds every layer in the checkpoint's
    precision at once (the MoE preset in W4A16: peak RSS 1.5 GiB, against 2.7 with the whole bf16 model loaded
    first). Checked on the order of events: each Linear (and each MoE layer's experts) is processed right after its
    own last tensor loads, before the next tensor, and the output is what the whole-checkpoint-first order gave (the
    parity tests above). A tensor coming again after its layer was processed is an error, not a silent overwrite."""
    from safetensors.torch import load_file, save_file

    from infertune.layers.moe import Experts
    from infertune.models import loader
    from infertune.quant.experts import QuantizedExperts

    path = make_checkpoint(
        tmp_path / "moe",
        "qwen3_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        num_hidden_layers=2,
    )
    events = []
    real_iter = loader.iter_tensors

    def iter_tensors(p):
        for name, t in real_iter(p):
            events.append(("load", name))
            yield name, t

    monkeypatch.setattr(loader, "iter_tensors", iter_tensors)
    for cls in (W8A16Method, QuantizedExperts):
        real = cls.process_weights_after_loading

        def process(self, layer, real=real):
            events.append(("process", layer))
            return real(self, layer)

        monkeypatch.setattr(cls, "process_weights_after_loading", process)
    llm = LLM(str(path), dtype="float32", quantization="w8a16", max_model_len=64)
    model = llm.engine.executor.runner.model
    names = {m: n for n, m in model.named_modules()}
    loads = [i for i, (kind, _) in enumerate(events) if kind == "load"]
    # (W8A16Method also packs each expert's slice for QuantizedExperts: not a module of the model)
    processed = [(i, names[m]) for i, (kind, m) in enumerate(events) if kind == "process" and m in names]
    experts = [n for n, m in model.named_modules() if isinstance(m, Experts)]
    assert len(experts) == 2 and {n for _, n in processed} >= set(experts) | {"model.layers.0.self_attn.o_proj"}
    assert processed[0][0] < loads[len(loads) // 2]  # the first layers go before half the checkpoint is read
    for i, name in processed:
        # the module's last tensor is the event just before (a process follows its own load at once)
        previous = [e for e in events[:i] if e[0] == "load"][-1][1]
        stem = name.removesuffix(".experts").replace("qkv_proj", "").replace("gate_up_proj", "")
        assert previous.startswith(stem.rstrip(".")), (name, previous)
    # a checkpoint that names a layer's tensor twice: refused once the layer is processed
    state = load_file(path / "model.safetensors")
    dup = tmp_path / "dup"
    dup.mkdir()
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (dup / f.name).write_bytes(f.read_bytes())
    save_file(state, dup / "model-00001-of-00002.safetensors", metadata={"format": "pt"})
    save_file({"model.layers.0.self_attn.o_proj.weight": state["model.layers.0.self_attn.o_proj.weight"]},
              dup / "model-00002-of-00002.safetensors", metadata={"format": "pt"})  # fmt: skip
    with pytest.raises(ValueError, match="comes again after its layer was loaded whole"):
        LLM(str(dup), dtype="float32", quantization="w8a16", max_model_len=64)


@pytest.mark.parametrize("k", [96, 256, 4096])
def test_quantizing_in_row_blocks_gives_the_whole_weights_values(monkeypatch, k):
    """The quantizers take a weight a block of rows at a time (int8.QUANT_BLOCK_ELEMENTS: a load's fp32 temporaries
    stay small); every statistic is per row (int8) or per row group (int4), so the result must be bit for bit the
    one-shot formula's on the whole weight, here with blocks of 1, 3 and 16 rows and a partial last block."""
    from infertune.quant import int8 as q8
    from infertune.quant.int4 import quantize_int4_groupwise

    g = torch.Generator().manual_seed(k)
    w = (torch.randn(37, k, generator=g) * torch.rand(37, 1, generator=g)).to(torch.bfloat16)
    w[5] = 0  # (a zero row: the clamped scale)
    w32 = w.float()
    s8 = (w32.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    want8 = (torch.round(w32 / s8.unsqueeze(1)).clamp(-127, 127).to(torch.int8), s8)
    gs = 32
    grp = w32.view(37, k // gs, gs)
    lo, hi = grp.amin(dim=-1), grp.amax(dim=-1)
    s4 = ((hi - lo) / 15.0).clamp(min=1e-12)
    want4 = (torch.round((grp - lo.unsqueeze(-1)) / s4.unsqueeze(-1)).clamp(0, 15).to(torch.int32).view(37, k), s4, lo)
    s4s = (grp.abs().amax(dim=-1) / 7.5).clamp(min=1e-12)
    want4s = torch.round((grp + 8.0 * s4s.unsqueeze(-1)) / s4s.unsqueeze(-1)).clamp(0, 15).to(torch.int32).view(37, k)
    for rows in (1, 3, 16):
        monkeypatch.setattr(q8, "QUANT_BLOCK_ELEMENTS", rows * k)
        assert list(q8.row_blocks(37, k))[:2] == [0, rows]
        got8 = q8.quantize_int8_per_channel(w)
        assert got8[0].dtype == torch.int8 and all(torch.equal(a, b) for a, b in zip(got8, want8))
        got4 = quantize_int4_groupwise(w, gs)
        assert got4[0].dtype == torch.int32 and all(torch.equal(a, b) for a, b in zip(got4, want4))
        got4s = quantize_int4_groupwise(w, gs, symmetric=True)
        assert torch.equal(got4s[0], want4s) and torch.equal(got4s[1], s4s) and torch.equal(got4s[2], -8.0 * s4s)
