"""W8A16 / W4A16 (and W8A8) on MoE experts: HF transformers running the very weights infertune dequantizes, the
half-a-step error bound against the checkpoint's weights, the stored checkpoint `infertune quantize` writes against
quantizing at load, keep_fp, and that no full-precision copy of the experts survives loading."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import hf_model, make_checkpoint
from parity_utils import assert_teacher_forced
from safetensors.torch import load_file, save_file
from test_deepseek import VARIANTS as DEEPSEEK_VARIANTS
from test_deepseek import make_deepseek_checkpoint

from infertune import LLM, SamplingParams
from infertune.config import MoeArch
from infertune.kernels.interface import MoeRouting
from infertune.layers.linear import Linear, PackedLinear
from infertune.layers.moe import Experts, group_by_expert
from infertune.quant import int4, int8
from infertune.quant.experts import QuantizedExperts
from infertune.quant.int4 import W4A16Method
from infertune.quant.int8 import W8A8Method, W8A16Method, quantize_int8_per_token
from infertune.tools.quantizer import quantize

MOE = {
    "qwen3_moe": dict(
        arch="qwen3_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        head_dim=16,
        norm_topk_prob=True,
    ),
    # stored in bf16: what published checkpoints are (loaded in fp32 here and by HF alike)
    "mixtral": dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=2, dtype=torch.bfloat16),
    "qwen2_moe": dict(
        arch="qwen2_moe",
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=64,
        shared_expert_intermediate_size=96,
        norm_topk_prob=False,
    ),
}
# DeepSeek (MLA + DeepSeek MoE: a dense first layer, shared experts): every quantized Linear's in_features (hidden 64,
# q_lora_rank 64, kv_lora_rank 32, heads x v_head_dim 96, intermediate 96, moe_intermediate 32) divides by 32, so
# int4 g32 takes the latent attention too (test_deepseek's q_lora_rank=48 would refuse it)
DEEPSEEK = {
    "deepseek_v3": dict(DEEPSEEK_VARIANTS["v3"], q_lora_rank=64),
    "deepseek_v2_lite": DEEPSEEK_VARIANTS["v2-lite"],
}
ATTENTION_FP = ("lm_head", "*.self_attn.*")  # int4 on the MLPs and experts only, attention kept in full precision
PROMPTS = [[5, 90, 17, 3, 201, 64, 8, 8, 150, 33, 2, 71, 19], [240, 12, 7, 99, 5]]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    made = {}

    def get(name: str):
        if name not in made:
            if name in DEEPSEEK:
                made[name] = make_deepseek_checkpoint(tmp_path_factory.mktemp(name), seed=1, **DEEPSEEK[name])
            else:
                made[name] = make_checkpoint(tmp_path_factory.mktemp(name), seed=1, **MOE[name])
        return made[name]

    return get


def _experts(model) -> dict[str, Experts]:
    return {n: m for n, m in model.named_modules() if isinstance(m, Experts)}


def _linear_dequantized(module: Linear) -> torch.Tensor:
    """fp32 [N, K]: the weight a quantized Linear multiplies (W4A16 Linears have no dequantized_weight: the dense
    weight its prefill path multiplies, as QuantizedExperts.dequantized_weight takes for an int4 expert)."""
    method = module.quant_method
    if hasattr(method, "dequantized_weight"):
        return method.dequantized_weight(module)
    assert isinstance(method, W4A16Method), f"no way to dequantize {type(method).__name__}"
    if hasattr(module, "q_ref"):
        return int4.dequantize_int4(module.q_ref.to(torch.int32), module.scale_ref, module.low_ref, method.group_size)
    return method._dense_weight(module, torch.float32)


def _load_dequantized_into_hf(hf, model) -> None:
    """Our dequantized weights into the HF model: experts as its fused [E, 2I, H] / [E, H, I] tensors (the same names
    in transformers v5), quantized Linears unpacked into q/k/v and gate/up. Every quantized module is copied."""
    params = dict(hf.named_parameters())
    parts = {"q": "q_proj", "k": "k_proj", "v": "v_proj", 0: "gate_proj", 1: "up_proj"}
    for name, module in model.named_modules():
        if isinstance(module, Experts) and isinstance(module.quant_method, QuantizedExperts):
            for proj in ("gate_up_proj", "down_proj"):
                params[f"{name}.{proj}"].data.copy_(module.quant_method.dequantized_weight(module, proj))
        elif isinstance(module, Linear) and isinstance(module.quant_method, (W8A16Method, W4A16Method)):
            w = _linear_dequantized(module)
            if isinstance(module, PackedLinear):
                for shard, (start, size) in module.shard_offsets.items():
                    params[f"{name.rsplit('.', 1)[0]}.{parts[shard]}.weight"].data.copy_(w[start : start + size])
            else:
                params[f"{name}.weight"].data.copy_(w)


CASES = {
    "qwen3_moe-w8a16": ("qwen3_moe", dict(quantization="w8a16")),
    "mixtral-w8a16": ("mixtral", dict(quantization="w8a16")),
    "qwen2_moe-w8a16": ("qwen2_moe", dict(quantization="w8a16")),  # shared expert quantized, its gate not
    "qwen3_moe-w4a16-g32": ("qwen3_moe", dict(quantization="w4a16", quant_group_size=32, keep_fp=ATTENTION_FP)),
    "mixtral-w4a16-g64": ("mixtral", dict(quantization="w4a16", quant_group_size=64, keep_fp=ATTENTION_FP)),
    # the latent attention's projections (not kv_b_proj, the absorbed up-projection), the shared experts and the
    # dense first layer quantized with the experts; the router and its correction bias not
    "deepseek_v3-w8a16": ("deepseek_v3", dict(quantization="w8a16")),
    "deepseek_v3-w4a16-g32": ("deepseek_v3", dict(quantization="w4a16", quant_group_size=32)),
    "deepseek_v2_lite-w8a16": ("deepseek_v2_lite", dict(quantization="w8a16")),
    "deepseek_v2_lite-w4a16-g32": (
        "deepseek_v2_lite",
        dict(quantization="w4a16", quant_group_size=32, keep_fp=ATTENTION_FP),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_logits_and_greedy_match_hf_running_the_dequantized_weights(ckpt, case):
    arch, options = CASES[case]
    path = ckpt(arch)
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=4, enable_prefix_caching=False, **options)
    model = llm.engine.executor.runner.model
    for name, ex in _experts(model).items():
        assert ex.quant_method.name == options["quantization"], name
        assert not list(ex.parameters(recurse=False))  # the fp32 experts are gone
        mlp = model.get_submodule(name.removesuffix(".experts"))
        assert mlp.gate.weight.dtype == torch.float32  # the router stays in full precision
        if arch == "qwen2_moe":
            assert not hasattr(mlp.shared_expert.gate_up_proj, "weight")  # a Linear: quantized like the others
            assert mlp.shared_expert_gate.weight.dtype == torch.float32
        if arch in DEEPSEEK:
            assert not hasattr(mlp.shared_experts.gate_up_proj, "weight") and not hasattr(
                mlp.shared_experts.down_proj, "weight"
            )
    if arch in DEEPSEEK:
        dense_mlp = model.model.layers[0].mlp  # first_k_dense_replace=1
        assert not hasattr(dense_mlp.gate_up_proj, "weight") and not hasattr(dense_mlp.down_proj, "weight")
        attn = model.model.layers[1].self_attn
        assert hasattr(attn.o_proj, "weight") == ("keep_fp" in options)
        assert attn.kv_b_proj.weight.dtype == torch.float32  # the latent up-projection stays in full precision
    hf = hf_model(path)
    with torch.no_grad():
        fp_logits = hf(torch.tensor([PROMPTS[0]])).logits[0]
    _load_dequantized_into_hf(hf, model)
    runner = llm.engine.executor.runner
    for prompt in PROMPTS:
        ours = runner.prompt_logits(prompt, list(range(-(-len(prompt) // 4))))
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    # the integers did change the model: by a little for int8; int4 on random weights also flips routing choices
    drift = (runner.prompt_logits(PROMPTS[0], list(range(4))) - fp_logits).abs().max()
    assert drift > 1e-3
    if options["quantization"] == "w8a16":
        # (DeepSeek: MLA's four projections, the dense layer and the shared experts too, over 3 layers; measured
        # 0.055 and 0.058 of the largest logit, spread over every position rather than one rerouted token)
        assert drift < (0.1 if arch in DEEPSEEK else 0.05) * fp_logits.abs().max()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    for prompt, out in zip(PROMPTS, outs):
        assert_teacher_forced(hf, prompt, out.outputs[0].token_ids)


def _checkpoint_experts(path, name: str, num_experts: int) -> dict[str, torch.Tensor]:
    """{proj: [E, N, K] fp64} of the experts module `name`, straight from the per-expert checkpoint tensors."""
    tensors = {k.replace("block_sparse_moe", "mlp"): v for k, v in load_file(str(path / "model.safetensors")).items()}
    mixtral = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}

    def weight(e: int, proj: str) -> torch.Tensor:
        return tensors.get(f"{name}.{e}.{proj}.weight", tensors.get(f"{name}.{e}.{mixtral[proj]}.weight"))

    experts = range(num_experts)
    return {
        "gate_up_proj": torch.stack([torch.cat([weight(e, "gate_proj"), weight(e, "up_proj")]) for e in experts]),
        "down_proj": torch.stack([weight(e, "down_proj") for e in experts]),
    }


@pytest.mark.parametrize(
    "options",
    [
        dict(quantization="w8a16"),
        dict(quantization="w4a16", quant_group_size=32),
        dict(quantization="w4a16", quant_group_size=64, quant_symmetric=True),
    ],
    ids=["w8a16", "w4a16-g32", "w4a16-g64-symmetric"],
)
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_expert_dequantization_error_within_half_a_step(ckpt, arch, options):
    """|w - dequant(w)| <= step / 2 for every expert weight, the step computed here from the checkpoint's weights:
    max|w| / 127 per output row (int8); (max - min) / 15, or max|w| / 7.5 symmetric, per group (int4)."""
    path = ckpt(arch)
    llm = LLM(str(path), dtype="float32", max_model_len=32, block_size=4, **options)
    for name, ex in _experts(llm.engine.executor.runner.model).items():
        original = _checkpoint_experts(path, name, ex.num_experts)
        for proj in ("gate_up_proj", "down_proj"):
            w = original[proj].double()  # [E, N, K]
            dq = ex.quant_method.dequantized_weight(ex, proj).double()
            if options["quantization"] == "w8a16":
                step = (w.abs().amax(dim=-1, keepdim=True) / 127).expand_as(w)
            else:
                g = w.unflatten(-1, (-1, options["quant_group_size"]))  # [E, N, K/g, g]
                if options.get("quant_symmetric"):
                    step = g.abs().amax(dim=-1, keepdim=True) / 7.5
                else:
                    step = (g.amax(dim=-1, keepdim=True) - g.amin(dim=-1, keepdim=True)) / 15
                step = step.expand_as(g).flatten(-2)
            assert ((w - dq).abs() <= step / 2 * (1 + 1e-5) + 1e-7).all(), f"{name}.{proj}"
            assert (w - dq).abs().max() > 0.05 * step.max()  # the integers really are coarser than w


@pytest.mark.parametrize(
    "options", [dict(quantization="w8a16"), dict(quantization="w4a16", quant_group_size=64)], ids=["w8a16", "w4a16"]
)
def test_bf16_load_keeps_no_full_precision_experts_and_runs_the_dequantized_weights(ckpt, options, monkeypatch):
    """bf16 (the backend's int kernels where it has them): the experts are quantized one [N, K] weight at a time,
    each projection then holds exactly its integers (one byte, or half a byte, a weight) plus per-row / per-group
    scales, and the experts' output, through the kernels' path and the per-expert torch path alike, is the fp64
    product of the dequantized weights within bf16 rounding."""
    shapes = []

    def recorded(quantizer):
        def quantize_and_record(w, *args):
            shapes.append(w.shape)
            return quantizer(w, *args)

        return quantize_and_record

    monkeypatch.setattr(int8, "quantize_int8_per_channel", recorded(int8.quantize_int8_per_channel))
    monkeypatch.setattr(int4, "quantize_int4_groupwise", recorded(int4.quantize_int4_groupwise))
    llm = LLM(str(ckpt("qwen3_moe")), dtype="bfloat16", max_model_len=32, block_size=4, **options)
    assert shapes and all(len(s) == 2 and s.numel() <= 128 * 64 for s in shapes)  # never all experts at once
    ex = next(iter(_experts(llm.engine.executor.runner.model).values()))
    assert not list(ex.parameters(recurse=False))
    weights = 8 * 128 * 64 + 8 * 64 * 64  # gate_up [8, 128, 64] + down [8, 64, 64]
    int_bytes = sum(b.numel() * b.element_size() for b in ex.buffers() if not b.is_floating_point())
    float_numel = sum(b.numel() for b in ex.buffers() if b.is_floating_point())
    if options["quantization"] == "w8a16":
        assert int_bytes == weights and float_numel == 8 * 128 + 8 * 64  # a scale per output row
    else:
        assert int_bytes == weights // 2 and float_numel == 2 * weights // 64  # scale + zero per group of 64
    gate_up = ex.quant_method.dequantized_weight(ex, "gate_up_proj").double()
    down = ex.quant_method.dequantized_weight(ex, "down_proj").double()
    gen = torch.Generator().manual_seed(5)
    for rows in (1, 24):  # a decode (the int kernels) and a prefill (dequantized matmuls)
        x = torch.randn(rows, 64, generator=gen).bfloat16()
        ids = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(rows)])
        w = torch.rand(rows, 2, generator=gen)
        routing = MoeRouting(w, ids, *group_by_expert(ids, 8))
        ref = torch.zeros(rows, 64, dtype=torch.float64)
        for t in range(rows):
            for j, e in enumerate(ids[t].tolist()):
                h = gate_up[e] @ x[t].double()
                ref[t] += w[t, j].double() * (down[e] @ (torch.nn.functional.silu(h[:64]) * h[64:]))
        for y in (ex(x, routing), ex.forward_native(x, routing)):
            assert y.dtype == torch.bfloat16
            assert (y.double() - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_keep_fp_patterns_keep_experts(ckpt):
    llm = LLM(
        str(ckpt("qwen3_moe")),
        dtype="float32",
        max_model_len=32,
        quantization="w8a16",
        keep_fp=("model.layers.1.mlp.*",),
    )
    experts = _experts(llm.engine.executor.runner.model)
    kept, quantized = experts["model.layers.1.mlp.experts"], experts["model.layers.0.mlp.experts"]
    assert kept.quant_method.name == "unquantized" and kept.gate_up_proj.dtype == torch.float32
    assert quantized.quant_method.name == "w8a16" and quantized.gate_up_proj_qweight.dtype == torch.int8
    # (the LM head stays in full precision whatever keep_fp lists, quant.keeps: it was quantized when a keep_fp of the
    # user's replaced the default "lm_head")
    assert llm.engine.executor.runner.model.lm_head.weight.dtype == torch.float32


STORED = {
    "qwen3_moe-w8a16": ("qwen3_moe", "w8a16", 128, ("lm_head",)),
    "mixtral-w4a16-g32": ("mixtral", "w4a16", 32, ("lm_head",)),
    "qwen3_moe-w4a16-g64-layer1-kept": ("qwen3_moe", "w4a16", 64, ("lm_head", "model.layers.1.mlp.*")),
    "qwen2_moe-w8a8": ("qwen2_moe", "w8a8", 128, ("lm_head",)),
}


@pytest.mark.parametrize("case", list(STORED))
def test_stored_checkpoint_equals_quantizing_at_load(ckpt, tmp_path, case):
    arch, method, group, keep = STORED[case]
    src = ckpt(arch)
    out = tmp_path / "q"
    # (w8a8 without calibration samples: dynamic per-token activation scales, as at load)
    quantize(str(src), method, str(out), group_size=group, keep_fp=keep, num_samples=0, show_progress=False)
    stored = load_file(str(out / "model.safetensors"))
    prefix = "model.layers.0." + ("block_sparse_moe.experts.3.w1" if arch == "mixtral" else "mlp.experts.3.gate_proj")
    if method == "w4a16":
        assert stored[f"{prefix}.weight_packed"].dtype == torch.uint8 and f"{prefix}.weight" not in stored
        assert stored[f"{prefix}.weight_zero"].shape == (stored[f"{prefix}.weight_packed"].shape[0], 64 // group)
    else:
        assert stored[f"{prefix}.weight"].dtype == torch.int8 and stored[f"{prefix}.weight_scale"].shape[1] == 1
    ignore = json.loads((out / "config.json").read_text())["quantization_config"]["ignore"]
    layer1_kept = "model.layers.1.mlp.*" in keep
    assert ("model.layers.1.mlp.experts" in ignore) == layer1_kept
    if layer1_kept:  # as in the source
        assert stored["model.layers.1.mlp.experts.0.down_proj.weight"].dtype == torch.float32

    loaded = LLM(str(out), dtype="float32", max_model_len=32, block_size=4)
    at_load = LLM(
        str(src),
        dtype="float32",
        max_model_len=32,
        block_size=4,
        quantization=method,
        quant_group_size=group,
        keep_fp=keep,
    )
    for prompt in PROMPTS:
        table = list(range(-(-len(prompt) // 4)))
        a = loaded.engine.executor.runner.prompt_logits(prompt, table)
        b = at_load.engine.executor.runner.prompt_logits(prompt, table)
        assert torch.equal(a, b)
    ours, theirs = (_experts(x.engine.executor.runner.model) for x in (loaded, at_load))
    for name in theirs:
        assert ours[name].quant_method.name == theirs[name].quant_method.name
        buffers, expected = dict(ours[name].named_buffers()), dict(theirs[name].named_buffers())
        assert buffers.keys() == expected.keys() and all(torch.equal(buffers[k], v) for k, v in expected.items())
        assert not list(ours[name].parameters(recurse=False)) or name == "model.layers.1.mlp.experts" and layer1_kept


def test_fused_source_layout_is_stored_per_expert(ckpt, tmp_path):
    """A source in transformers v5's fused layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I])
    gives the very tensors, under the same per-expert names, as the per-expert source."""
    src = ckpt("qwen3_moe")
    tensors = load_file(str(src / "model.safetensors"))
    fused = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(2):
        p = f"model.layers.{layer}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack(
            [torch.cat([tensors[f"{p}.{e}.gate_proj.weight"], tensors[f"{p}.{e}.up_proj.weight"]]) for e in range(8)]
        )
        fused[f"{p}.down_proj"] = torch.stack([tensors[f"{p}.{e}.down_proj.weight"] for e in range(8)])
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    for f in src.iterdir():
        if f.name != "model.safetensors":
            (fused_dir / f.name).write_bytes(f.read_bytes())
    save_file(fused, str(fused_dir / "model.safetensors"))
    for method in ("w8a16", "w4a16"):
        a, b = tmp_path / f"a-{method}", tmp_path / f"b-{method}"
        quantize(str(src), method, str(a), group_size=32, show_progress=False)
        quantize(str(fused_dir), method, str(b), group_size=32, show_progress=False)
        ta, tb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
        assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


def test_w8a8_expert_matmuls_equal_exact_integer_arithmetic():
    """Under w8a8 each expert's matmul is int8 x int8 with dynamic per-token activation scales, summed exactly."""
    moe = MoeArch(num_experts=4, top_k=2, intermediate_size=32, layers=(0,), norm_topk_prob=True)
    ex = Experts(64, moe, torch.float32)
    gen = torch.Generator().manual_seed(2)
    ex.gate_up_proj.data.copy_(torch.randn(4, 64, 64, generator=gen))
    ex.down_proj.data.copy_(torch.randn(4, 64, 32, generator=gen))
    ex.quant_method = QuantizedExperts(W8A8Method)
    ex.quant_method.process_weights_after_loading(ex)
    gate_up, down = ex.quant_method.matmuls(ex)
    for e in range(4):
        for matmul, proj, k in ((gate_up, "gate_up_proj", 64), (down, "down_proj", 32)):
            x = torch.randn(5, k, generator=gen)
            xq, xs = quantize_int8_per_token(x)
            wq = getattr(ex, f"{proj}_qweight")[e]  # [N, K] int8
            exact = (xq.long() @ wq.long().t()).double() * xs.double() * getattr(ex, f"{proj}_scales")[e].double()
            torch.testing.assert_close(matmul(e, x).double(), exact, rtol=1e-6, atol=1e-6)


def _row_step(w: torch.Tensor) -> torch.Tensor:  # int8 per output row
    return (w.abs().amax(dim=-1, keepdim=True) / 127).expand_as(w)


def _group_step(w: torch.Tensor, group: int = 32) -> torch.Tensor:  # asymmetric int4 per group of inputs
    g = w.unflatten(-1, (-1, group))
    return ((g.amax(dim=-1, keepdim=True) - g.amin(dim=-1, keepdim=True)) / 15).expand_as(g).flatten(-2)


@pytest.mark.parametrize(
    "make_method, step",
    [(lambda: W8A16Method(fast_kernel=False), _row_step), (lambda: W4A16Method(32, fast_kernel=False), _group_step)],
    ids=["w8a16", "w4a16"],
)
def test_reference_layouts_without_int_kernels(make_method, step):
    """Where the device has no int kernels (CUDA, NPU: the dequantize-then-matmul layouts), the experts give the fp64
    weighted sum of each picked expert's MLP on the dequantized weights, which lie within half a step of w."""
    moe = MoeArch(num_experts=4, top_k=2, intermediate_size=32, layers=(0,), norm_topk_prob=True)
    ex = Experts(64, moe, torch.float32)
    gen = torch.Generator().manual_seed(3)
    w_gate_up, w_down = 0.2 * torch.randn(4, 64, 64, generator=gen), 0.2 * torch.randn(4, 64, 32, generator=gen)
    ex.gate_up_proj.data.copy_(w_gate_up)
    ex.down_proj.data.copy_(w_down)
    ex.quant_method = QuantizedExperts(make_method)
    ex.quant_method.process_weights_after_loading(ex)
    layout = {"w8a16": {"qweight", "scales"}, "w4a16": {"q_ref", "scale_ref", "low_ref"}}[ex.quant_method.name]
    assert ex.quant_method.stacked_buffers(ex, "down_proj").keys() == layout
    gate_up = ex.quant_method.dequantized_weight(ex, "gate_up_proj").double()
    down = ex.quant_method.dequantized_weight(ex, "down_proj").double()
    for w, dq in ((w_gate_up.double(), gate_up), (w_down.double(), down)):
        assert ((w - dq).abs() <= step(w) / 2 * (1 + 1e-5)).all() and (w - dq).abs().max() > 0
    x = torch.randn(6, 64, generator=gen)
    ids = torch.tensor([[0, 1], [1, 0], [3, 1], [3, 0], [1, 3], [0, 3]])  # expert 2 unpicked
    weights = torch.rand(6, 2, generator=gen)
    ref = torch.zeros(6, 64, dtype=torch.float64)
    for t in range(6):
        for j, e in enumerate(ids[t].tolist()):
            h = gate_up[e] @ x[t].double()
            ref[t] += weights[t, j].double() * (down[e] @ (torch.nn.functional.silu(h[:32]) * h[32:]))
    y = ex.forward_native(x, MoeRouting(weights, ids, *group_by_expert(ids, 4)))
    assert (y.double() - ref).abs().max() <= 1e-5 * ref.abs().max()  # fp32 rounding only


def test_stored_w8a8_experts_holding_minus_128_load_in_one_layout(ckpt, tmp_path):
    """A stored W8A8 checkpoint (written by another tool) whose experts hold -128 in one expert only: the kernels'
    int8 layout refuses -128, so that projection keeps torch's [E, N, K] for every expert (never half in each), loads,
    and every expert's product is the exact integer one with the reference's rounding; the other projection keeps the
    kernels' layout where the CPU has them."""
    out = tmp_path / "q"
    quantize(str(ckpt("qwen2_moe")), "w8a8", str(out), keep_fp=("lm_head",), num_samples=0, show_progress=False)
    tensors = load_file(str(out / "model.safetensors"))
    name = "model.layers.0.mlp.experts.5.gate_proj.weight"
    tensors[name][3, 7] = -128
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    llm = LLM(str(out), dtype="bfloat16", max_model_len=32, block_size=4)
    ex = _experts(llm.engine.executor.runner.model)["model.layers.0.mlp.experts"]
    method = ex.quant_method
    assert (
        not method.linear_methods["gate_up_proj"].own_layout and method.linear_methods["gate_up_proj"].torch_layout_only
    )
    kernels = llm.engine.executor.runner.backend.decode_kernels()
    with_kernels = kernels is not None and kernels.max_rows("w8a8") > 0
    assert method.linear_methods["down_proj"].own_layout == with_kernels
    gate_up, down = method.matmuls(ex)
    gen = torch.Generator().manual_seed(4)
    for proj, matmul in (("gate_up_proj", gate_up), ("down_proj", down)):
        lm = method.linear_methods[proj]
        n, k = method.shapes[proj]
        for e in range(ex.num_experts):
            wq = lm.int8_weight(method.expert_view(ex, proj, e))
            stored_name = f"model.layers.0.mlp.experts.{e}." + ("gate_proj" if proj == "gate_up_proj" else "down_proj")
            assert torch.equal(wq[: n // 2 if proj == "gate_up_proj" else n], tensors[f"{stored_name}.weight"])
            x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
            xq, xs = quantize_int8_per_token(x.reshape(-1, k))
            acc = (xq.long() @ wq.long().t()).float()  # exact (|sums| < 2^24)
            scales = getattr(ex, f"{proj}_scales")[e]
            assert torch.equal(matmul(e, x), (acc * xs * scales).to(torch.bfloat16))
    out_tokens = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=4, temperature=0.0))[0].outputs[0].token_ids
    assert len(out_tokens) == 4
