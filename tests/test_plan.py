"""Planner: exact weight / KV arithmetic against hand-computed values and transformers, catalog validation,
the P/D split, and the roofline against BASELINES.md's figures for the benchmark model on this machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from infertune.plan import (
    Device,
    DeviceFileError,
    KVFormat,
    ModelSpec,
    PlanRequest,
    Roofline,
    WeightFormat,
    calibrate_decode,
    find_device,
    kv_bytes,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    load_catalog,
    load_device_file,
    make_plan,
    memory_budget,
    pd_split,
    tokens_per_joule,
    usd_per_million_tokens,
    weight_breakdown,
)
from infertune.plan.command import main as plan_main
from infertune.plan.memory import kv_shard_fraction, weight_bytes_per_card

DATA = Path(__file__).parent / "data"
QWEN7B = DATA / "qwen2.5-7b-instruct"

# BASELINES.md's benchmark model: 386M LlamaForCausalLM, tied embeddings.
BENCH_386M = dict(
    architectures=["LlamaForCausalLM"],
    hidden_size=896,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    intermediate_size=4864,
    vocab_size=32000,
    tie_word_embeddings=True,
    rope_theta=1e6,
    max_position_embeddings=4096,
    torch_dtype="bfloat16",
)
# BASELINES.md's machine: 30.5 GB/s read bandwidth, ~376 GFLOP/s bf16 matmul; measured, so efficiency 1.0.
BASELINE_CPU = Device(
    name="baseline-cpu",
    display_name="BASELINES.md machine",
    memory_bytes=23 * 10**9,
    memory_bandwidth_bytes_per_s=30.5e9,
    bf16_tflops=0.376,
    source=("BASELINES.md",),
    measured=True,
)


@pytest.fixture(scope="module")
def qwen() -> ModelSpec:
    return ModelSpec.load(QWEN7B)


# ----------------------------------------------------------------------------------- Qwen2.5-7B (seeds' figures)


def test_qwen7b_weights_exact(qwen):
    w = weight_breakdown(qwen)
    # Per layer: q 3584x3584 + bias 3584, k/v 512x3584 + bias 512 each, o 3584x3584 (no bias in Qwen2),
    # gate/up 18944x3584, down 3584x18944, two norms of 3584. Untied: embedding and lm_head 152064x3584 each.
    per_layer = (3584 * 3584 + 3584) + 2 * (512 * 3584 + 512) + 3584 * 3584 + 3 * 3584 * 18944 + 2 * 3584
    assert per_layer == 233_057_792
    assert w.total_params == 28 * per_layer + 2 * 152064 * 3584 + 3584 == 7_615_616_512
    assert w.total_bytes == 15_231_233_024  # bf16: about 15.2 GB, not the seeds' "7B weights 72 GB"
    assert w.total_bytes < 16e9
    # A step streams everything but the untied input embedding (a row lookup).
    assert w.streamed_bytes_per_step == 15_231_233_024 - 152064 * 3584 * 2


def test_qwen7b_quantized_weights_exact(qwen):
    linear = 28 * (3584 * 3584 * 2 + 512 * 3584 * 2 + 3 * 3584 * 18944)  # the 7 matrices, all layers
    bf16_rest = 2 * (2 * 152064 * 3584 + 28 * (4608 + 2 * 3584) + 3584)  # embedding, lm_head, biases, norms
    out_channels = 3584 + 512 + 512 + 3584 + 18944 + 18944 + 3584  # one scale per output row (W8A16)
    w8 = weight_breakdown(qwen, WeightFormat("w8a16"))
    assert w8.bytes_quant_scales == 28 * out_channels * 2 == 2_781_184
    assert w8.total_bytes == linear + 28 * out_channels * 2 + bf16_rest == 8_708_725_760
    # W4A16, group 128 along the input dim: rows x (in / 128) groups per matrix, a bf16 scale and zero each.
    groups = 3584 * 28 + 512 * 28 * 2 + 3584 * 28 + 18944 * 28 * 2 + 3584 * 148
    w4 = weight_breakdown(qwen, WeightFormat("w4a16", group_size=128))
    assert w4.bytes_quant_scales == 28 * groups * 4 == 203_915_264
    assert w4.total_bytes == linear // 2 + 28 * groups * 4 + bf16_rest == 5_647_215_616
    scale_only = weight_breakdown(qwen, WeightFormat("w4a16", group_size=128, zero_bytes=0))
    assert scale_only.total_bytes == linear // 2 + 28 * groups * 2 + bf16_rest == 5_545_257_984


def test_qwen7b_kv_matches_seeds(qwen):
    assert qwen.num_windowed_layers == 0  # sliding_window 131072 but use_sliding_window false
    assert kv_bytes_per_token(qwen) == 2 * 28 * 4 * 128 * 2 == 57_344 == qwen.arch.kv_bytes_per_token(2)
    assert kv_bytes(qwen, 2048, 32) == 3_758_096_384  # the seeds' "3.6 GB" (3.76e9 bytes)
    # INT8 data is exactly half; with the engine's fp32 scale per token, layer, KV head (K and V): 132/256.
    assert kv_bytes(qwen, 2048, 32, KVFormat("int8", scale_bytes=0)) == 3_758_096_384 // 2
    assert kv_bytes_per_token(qwen, KVFormat("int8")) == 2 * 28 * 4 * (128 + 4) == 29_568
    assert kv_bytes(qwen, 2048, 32, KVFormat("int8")) == 29_568 * 2048 * 32 == 1_937_768_448
    # The engine's int4 tier after 512 tokens: 1536 of the 2048 in int4, head_dim / 2 bytes + an fp16 scale a KV head.
    int4 = 2 * 28 * 4 * (64 + 2)
    assert kv_bytes(qwen, 2048, 32, KVFormat("int8", int4_after=512)) == (512 * 29_568 + 1536 * int4) * 32
    assert kv_bytes(qwen, 300, 1, KVFormat("int8", int4_after=512)) == 300 * 29_568  # (shorter than the tier's age)
    with pytest.raises(ValueError, match="needs the int8 KV dtype"):
        KVFormat("bf16", int4_after=512)


def test_qwen7b_max_sequences_on_910b(qwen):
    mem = memory_budget(qwen, WeightFormat(), KVFormat(), 64 * 10**9, context=2048)
    activations = 2048 * (2 * 3584 + 36 * 128 + 3 * 18944) * 2 + 256 * 152064 * 4  # step workspace + fp32 logits
    assert mem.activation_bytes == activations == 436_731_904
    assert mem.kv_budget_bytes == 57_600_000_000 - 15_231_233_024 - activations
    assert mem.max_concurrent_sequences == (57_600_000_000 - 15_231_233_024 - activations) // (57_344 * 2048) == 357


def test_tensor_parallel_divides_weights_and_kv(qwen):
    w = weight_breakdown(qwen)
    norms = (28 * 2 + 1) * 3584 * 2
    assert weight_bytes_per_card(w, 2) == (w.total_bytes - norms) // 2 + norms
    assert kv_shard_fraction(qwen, 2) == 0.5
    assert kv_shard_fraction(qwen, 4) == 0.25
    assert kv_shard_fraction(qwen, 28) == 0.25  # 28 cards > 4 KV heads: each card keeps one replicated head
    tp2 = memory_budget(qwen, WeightFormat(), KVFormat(), 64 * 10**9, 2048, tp=2)
    assert tp2.kv_bytes_per_sequence == 57_344 * 2048 // 2
    with pytest.raises(ValueError, match="does not divide num_attention_heads"):
        memory_budget(qwen, WeightFormat(), KVFormat(), 64 * 10**9, 2048, tp=3)


# ----------------------------------------------------------------------------------- other configs


def test_bench_386m_exact_and_roofline_matches_baselines():
    spec = ModelSpec.from_dict(BENCH_386M, "bench-386m")
    w = weight_breakdown(spec)
    per_layer = 896 * 896 * 2 + 128 * 896 * 2 + 3 * 896 * 4864 + 2 * 896
    assert w.total_params == 24 * per_layer + 32000 * 896 + 896 == 386_542_464
    assert w.total_bytes == w.streamed_bytes_per_step == 773_084_928  # tied: the embedding is the lm_head
    assert kv_bytes_per_token(spec) == 2 * 24 * 2 * 64 * 2 == 12_288
    roof = Roofline(spec, BASELINE_CPU)
    # BASELINES.md: "Roofline for batch-1 decode, with each token reading all weights, at 30.5 GB/s: bf16 39".
    b1 = roof.decode_step(1, 1)
    assert b1.bound == "memory" and round(b1.tokens_per_s) == 39
    assert b1.tokens_per_s == pytest.approx(30.5e9 / 773_084_928, rel=1e-3)
    # int8 79 / int4 158 there count every weight at 1 / 0.5 byte; with the lm_head quantized and scales counted:
    assert Roofline(spec, BASELINE_CPU, WeightFormat("w8a16", quantize_lm_head=True)).decode_step(
        1, 1
    ).tokens_per_s == pytest.approx(79, rel=0.01)
    # "Batch-16 in bf16: decode is compute-bound at about 485 tok/s; the end-to-end limit for 16 x (128 + 128) is
    # about 250 output tok/s" (this model adds attention FLOPs, hence a little lower).
    b16 = roof.decode_step(16, 192)
    assert b16.bound == "compute" and b16.tokens_per_s == pytest.approx(485, rel=0.03)
    assert roof.generation(128, 128, 16)["output_tokens_per_s"] == pytest.approx(250, rel=0.03)


def test_bench_386m_12bit_weights_match_the_packed_tensors():
    """--weight-dtype bf16-12bit: the bytes of the kernels' 12-bit layout, tile for tile (the escapes excepted),
    checked against pack_bf16c's tensors for the 386M model's four matrix shapes; the tied embedding / lm_head
    stays bf16, and the batch-1 roofline scales with the streamed bytes."""
    spec = ModelSpec.from_dict(BENCH_386M, "bench-386m")
    fmt = WeightFormat("bf16-12bit")
    for n, k in [(896, 896), (128, 896), (4864, 896), (896, 4864)]:
        tiles = -(-n // 64) * (k // 32)
        assert fmt.linear_bytes(n, k) == (tiles * 3072 + 16 + (tiles + 1) * 4, 0)
    bf16, c12 = weight_breakdown(spec), weight_breakdown(spec, fmt)
    assert c12.bytes_embedding == bf16.bytes_embedding == 32000 * 896 * 2
    linear = 24 * (896 * 896 * 2 + 128 * 896 * 2 + 3 * 896 * 4864)  # weights of the 7 matrices, all layers
    assert 0.75 < (c12.bytes_layers - 24 * 2 * 896 * 2) / (linear * 2) < 0.76
    roof = Roofline(spec, BASELINE_CPU, fmt).decode_step(1, 1).tokens_per_s
    assert roof == pytest.approx(30.5e9 / c12.streamed_bytes_per_step, rel=1e-3)
    try:
        import torch

        from infertune.kernels import cpu as kernels
    except ImportError:
        return
    if kernels.available() and kernels.bf16c_supported(16, 32):
        for n, k in [(128, 896), (896, 4864)]:
            packed = kernels.pack_bf16c((torch.randn(n, k) * 0.02).to(torch.bfloat16))
            esc = packed["esc_pos"].numel() * 2 + packed["esc_val"].numel() * 2
            got = sum(t.numel() * t.element_size() for t in packed.values()) - esc
            assert got == fmt.linear_bytes(n, k)[0]


TINY_CONFIGS = [
    ("llama", dict(tie_word_embeddings=True, head_dim=24, attention_bias=True, mlp_bias=True)),  # explicit head_dim
    ("llama", dict(tie_word_embeddings=False, num_key_value_heads=4)),  # MHA
    ("qwen2", dict(tie_word_embeddings=True)),  # q/k/v bias, no o bias
    ("mistral", dict(tie_word_embeddings=False, sliding_window=64)),
]


@pytest.mark.parametrize(
    "family,overrides", TINY_CONFIGS, ids=["llama-tied-hd24-bias", "llama-mha", "qwen2-tied", "mistral"]
)
def test_param_count_matches_transformers(family, overrides):
    """Oracle: a real transformers model built from the same config on the meta device (no memory, no init)."""
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    base = dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    cfg_cls, model_cls = {
        "llama": (LlamaConfig, LlamaForCausalLM),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM),
        "mistral": (MistralConfig, MistralForCausalLM),
    }[family]
    hf_cfg = cfg_cls(**{**base, **overrides})
    with torch.device("meta"):
        model = model_cls(hf_cfg)
    named = dict(model.named_parameters())  # tied weights appear once
    spec = ModelSpec.from_dict(hf_cfg.to_dict(), family)
    w = weight_breakdown(spec)
    assert w.total_params == sum(p.numel() for p in named.values())
    assert w.params_norms == sum(p.numel() for n, p in named.items() if "norm" in n)
    assert w.params_attention == sum(p.numel() for n, p in named.items() if "self_attn" in n)
    assert w.params_mlp == sum(p.numel() for n, p in named.items() if ".mlp." in n)
    assert w.total_bytes == 2 * w.total_params


def test_sliding_window_caps_kv():
    mistral = ModelSpec.from_dict(
        dict(
            architectures=["MistralForCausalLM"],
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=32000,
            sliding_window=4096,
            max_position_embeddings=32768,
        )
    )
    assert mistral.num_windowed_layers == 32
    per_token = 2 * 32 * 8 * 128 * 2
    assert kv_bytes_per_sequence(mistral, 2048) == 2048 * per_token
    assert kv_bytes_per_sequence(mistral, 16384) == 4096 * per_token  # capped at the window
    # Qwen2 with use_sliding_window windows only the layers from max_window_layers on.
    cfg = json.loads((QWEN7B / "config.json").read_text())
    qwen_sw = ModelSpec.from_dict({**cfg, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 20})
    assert qwen_sw.num_windowed_layers == 8
    # (20 full and 8 windowed layers: the engine cuts them into 7 groups of 4, so no page a block is left empty;
    # as two groups a block was 20 layers' pages, and the windowed group's tokens cost 20 layers' bytes)
    assert kv_bytes_per_sequence(qwen_sw, 8192) == (20 * 8192 + 8 * 4096) * 2 * 4 * 128 * 2
    # Gemma 3 1B's shape (22 windowed, 4 full: the last of 6 windowed groups leaves 2 of its 4 pages empty)
    gemma = ModelSpec.from_dict(
        dict(
            architectures=["Gemma3ForCausalLM"],
            model_type="gemma3_text",
            hidden_size=1152,
            num_hidden_layers=26,
            num_attention_heads=4,
            num_key_value_heads=1,
            head_dim=256,
            intermediate_size=6912,
            vocab_size=262144,
            sliding_window=512,
            max_position_embeddings=32768,
        )
    )
    assert gemma.num_windowed_layers == 22
    assert kv_bytes_per_sequence(gemma, 8192) == (4 * 8192 + 24 * 512) * 2 * 1 * 256 * 2
    assert kv_bytes_per_sequence(gemma, 8192, held=False) == (4 * 8192 + 22 * 512) * 2 * 1 * 256 * 2


# ----------------------------------------------------------------------------------- catalog


def test_catalog_loads_with_sources():
    catalog = load_catalog()
    for name in ("910b", "910b2", "910c", "h100", "h200", "a100", "l40s", "rtx4090"):
        assert catalog[name].source and all(s.strip() for s in catalog[name].source)
    b = catalog["910b"]
    assert (b.memory_bytes, b.memory_bandwidth_bytes_per_s, b.fp16_tflops) == (64 * 10**9, 1.2e12, 320)  # the seeds
    h100 = find_device(catalog, "H100-SXM")  # aliases, any case
    assert h100.name == "h100" and h100.price.date and h100.price.usd_per_hour > 0
    with pytest.raises(ValueError, match="not in the catalog"):
        find_device(catalog, "tpu-v9")


GOOD = dict(
    name="mychip",
    display_name="My chip",
    memory_bytes=32 * 10**9,
    memory_bandwidth_bytes_per_s=1e12,
    bf16_tflops=100,
    source="my datasheet",
)


@pytest.mark.parametrize(
    "change,field",
    [
        ({"memory_bytes": "32GB"}, "memory_bytes"),
        ({"bf16_tflops": -1}, "bf16_tflops"),
        ({"source": []}, "source"),
        ({"bandwith": 1e12}, "bandwith"),
        ({"price": {"usd_per_hour": 1.0, "kind": "cloud", "provider": "x", "source": "y"}}, "date"),
        ({"price": {"usd_per_hour": 1.0, "kind": "cloud", "provider": "x", "source": "y", "date": "May 2026"}}, "date"),
        ({"interconnect": {"name": "link", "bandwidth_bytes_per_s": 0}}, "bandwidth_bytes_per_s"),
    ],
)
def test_bad_device_file_names_file_and_field(tmp_path, change, field):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"devices": [GOOD, {**GOOD, "name": "second", **change}]}))
    with pytest.raises(DeviceFileError) as e:
        load_device_file(path)
    assert str(path) in str(e.value) and "devices[1]" in str(e.value) and repr(field) in str(e.value)


def test_missing_required_field_and_bad_json(tmp_path):
    path = tmp_path / "chip.json"
    path.write_text(json.dumps({k: v for k, v in GOOD.items() if k != "memory_bandwidth_bytes_per_s"}))
    with pytest.raises(DeviceFileError, match=r"chip\.json: required field 'memory_bandwidth_bytes_per_s' is missing"):
        load_device_file(path)
    path.write_text("{not json")
    with pytest.raises(DeviceFileError, match="not valid JSON"):
        load_device_file(path)


def test_user_device_file_through_the_command(tmp_path, capsys):
    path = tmp_path / "chip.json"
    path.write_text(
        json.dumps(
            {
                **GOOD,
                "tdp_watts": 200,
                "price": {
                    "usd_per_hour": 2.0,
                    "kind": "cloud on-demand",
                    "provider": "me",
                    "date": "2026-11-30",
                    "source": "my invoice",
                },
            }
        )
    )
    # The file's only device is picked without --device.
    rc = plan_main(["--model", str(QWEN7B), "--device-file", str(path), "--batch", "8", "--json"])
    assert rc == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["device"]["name"] == "mychip" and plan["weights"]["bytes"] == 15_231_233_024
    row = next(r for r in plan["by_batch"] if r["batch"] == 8)
    assert row["usd_per_million_output_tokens"] == pytest.approx(2.0 / 3600 / row["output_tokens_per_s"] * 1e6)
    assert row["output_tokens_per_joule"] == pytest.approx(row["output_tokens_per_s"] / 200)
    assert plan_main(["--model", str(QWEN7B), "--device", "nochip"]) == 2
    assert "not in the catalog" in capsys.readouterr().err


# ----------------------------------------------------------------------------------- cost, P/D, calibration


def test_cost_formulas():
    assert usd_per_million_tokens(3.49, 1, 1000.0) == pytest.approx(3.49 / 3.6)
    assert usd_per_million_tokens(None, 1, 1000.0) is None
    assert tokens_per_joule(1400.0, 700, 2) == pytest.approx(1.0)


def test_pd_split_synthetic():
    # A card prefills 3 requests/s or decodes 1 request/s: decode needs 3x the card-time, so 2 + 6 of 8.
    s = pd_split(8, prefill_rps=3.0, decode_rps=1.0, rate=5.0)
    assert (s.prefill_instances, s.decode_instances, s.bottleneck) == (2, 6, "balanced")
    assert s.requests_per_s == pytest.approx(6.0) and s.ideal_prefill_share == pytest.approx(0.25)
    assert s.colocated_requests_per_s == pytest.approx(6.0)  # at the ideal ratio a roofline sees no gain
    assert (s.prefill_instances_for_rate, s.decode_instances_for_rate) == (2, 5)
    s = pd_split(4, prefill_rps=10.0, decode_rps=1.0)
    assert (s.prefill_instances, s.decode_instances, s.bottleneck, s.requests_per_s) == (1, 3, "decode", 3.0)
    with pytest.raises(ValueError):
        pd_split(1, 1.0, 1.0)


def test_seeds_two_prefill_six_decode(qwen):
    """The seeds' 2 + 6 on 8 910B cards: Qwen2.5-7B, 1024-token prompts, 512-token outputs, decode batch 32."""
    plan = make_plan(PlanRequest(qwen, load_catalog()["910b"], input_len=1024, output_len=512, batch=32, cards=8))
    pd = plan["pd_split"]
    assert (pd["prefill_instances"], pd["decode_instances"]) == (2, 6)
    assert 0.2 < pd["ideal_prefill_share"] < 0.3


def test_calibration_reproduces_the_measurement(qwen):
    dev = load_catalog()["910b"]
    roof = Roofline(qwen, dev)
    eff = calibrate_decode(roof, 72.0, batch=8, context=2048)  # the seeds' 910B FP16 batch-8 figure
    assert Roofline(qwen, dev, efficiency=eff).decode_step(8, 2048).tokens_per_s == pytest.approx(72.0, rel=1e-3)
    assert eff.compute == roof.eff.compute and eff.bandwidth < 0.2  # far below the default 82%
    with pytest.raises(ValueError, match="faster than 910b's peak bandwidth"):
        calibrate_decode(roof, 5000.0, batch=1, context=2048)


# ----------------------------------------------------------------------------------- command


def test_command_json_and_text(capsys):
    args = ["--model", str(QWEN7B / "config.json"), "--device", "910b", "--context", "2048", "--batch", "32"]
    assert plan_main(args + ["--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["kv"]["bytes_per_token"] == 57_344 and plan["kv"]["bytes_for_batch"] == 3_758_096_384
    assert plan["settings"]["input_len"] + plan["settings"]["output_len"] == 2048
    assert plan["memory"]["max_concurrent_sequences"] > 32
    assert all(r["fits"] == (r["batch"] <= plan["memory"]["max_concurrent_sequences"]) for r in plan["by_batch"])
    assert plan_main(args + ["--kv-dtype", "int8"]) == 0
    text = capsys.readouterr().out
    assert "29,568 B per token" in text and "0.5156" in text and "*32" in text and "P/D split" in text
    assert plan_main(["--model", str(QWEN7B), "--device", "rtx4090"]) == 0
    assert "OOM" in capsys.readouterr().out  # 15.2 GB of weights leave a 24 GB card little room at batch 256


def test_plan_imports_no_torch():
    code = (
        "import sys, io, contextlib\n"
        "from infertune.plan.command import main\n"
        "with contextlib.redirect_stdout(io.StringIO()):\n"
        f"    assert main(['--model', {str(QWEN7B)!r}, '--device', 'h100', '--json']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_local_probe_measures_this_machine():
    from infertune.plan.probe import probe_local

    dev = probe_local("cpu", budget_s=0.02)
    assert dev.measured and dev.name == "local"
    assert 1e8 < dev.memory_bandwidth_bytes_per_s < 1e13 and 0 < dev.bf16_tflops < 100
    assert dev.memory_bytes > 10**8


def test_a_local_plan_says_what_the_engine_here_takes_by_default():
    """On a probed machine the plan names the KV cache `serve` sizes with its defaults (kv_cache_memory_fraction of
    the free memory, at most max_num_seqs sequences): with the demo model that cap binds, so the figure is exactly the
    engine's own allocation (its blocks x bytes), and the flags it prints for the plan's budget are the plan's."""
    from infertune import LLM
    from infertune.config import default_model_path
    from infertune.plan.probe import probe_local
    from infertune.plan.render import render_text

    dev = probe_local("cpu", budget_s=0.02)
    assert dev.free_memory_bytes is not None and 0 < dev.free_memory_bytes <= dev.memory_bytes
    spec = ModelSpec.from_dict(json.loads((Path(default_model_path()) / "config.json").read_text()), "demo")
    plan = make_plan(PlanRequest(spec, dev, input_len=512, output_len=512))
    mem = plan["memory"]
    with LLM(default_model_path(), dtype="bfloat16", max_model_len=1024) as llm:
        info = llm.engine.executor.kv_cache_info
        engine_bytes = info.num_blocks * info.block_size * info.bytes_per_token
    assert mem["engine_kv_bytes_per_card"] == engine_bytes
    assert mem["engine_max_concurrent_sequences"] == info.num_blocks * info.block_size // 1024 == 64
    text = render_text(plan)
    assert f"KV {engine_bytes / 1e6:.2f} MB -> 64 concurrent 1024-token sequences" in text
    assert f"serve --kv-cache-memory-bytes {mem['kv_budget_bytes_per_card']} --max-num-seqs" in text
    catalog = make_plan(PlanRequest(spec, load_catalog()["910b"], input_len=512, output_len=512))
    assert "engine_kv_bytes_per_card" not in catalog["memory"] and "`serve` here" not in render_text(catalog)


# ----------------------------------------------------------------------------------- MoE, MLA, FP8: shipped configs


def counts_from_config(cfg: dict) -> tuple[int, int]:
    """(total, active) parameters written out from config.json's numbers, independently of the planner.

    Per layer: attention (MLA's q_a / q_a_layernorm / q_b or q_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
    o_proj; else q / k / v / o plus Qwen3's q / k norms), two norms, then a dense MLP (3 h I) or a MoE block: E
    routed experts of 3 h I_e, the router E x h (+ DeepSeek-V3's correction bias E), a shared expert of 3 h I_s.
    Untied embedding and lm_head, and the final norm. A token runs top_k of the E experts."""
    h, layers, vocab, heads = (
        cfg["hidden_size"],
        cfg["num_hidden_layers"],
        cfg["vocab_size"],
        cfg["num_attention_heads"],
    )
    if "kv_lora_rank" in cfg:
        r, nope, rope, v, ql = (
            cfg[k] for k in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank")
        )
        q = h * ql + ql + ql * heads * (nope + rope) if ql else h * heads * (nope + rope)
        attn = q + h * (r + rope) + r + r * heads * (nope + v) + heads * v * h
    else:
        hd, kvh = cfg.get("head_dim") or h // heads, cfg["num_key_value_heads"]
        attn = 2 * h * heads * hd + 2 * h * kvh * hd + (2 * hd if cfg["model_type"].startswith("qwen3") else 0)
    mixtral = cfg["architectures"][0] == "MixtralForCausalLM"
    experts = cfg.get("num_local_experts") or cfg.get("num_experts") or cfg.get("n_routed_experts") or 0
    k = cfg.get("num_experts_per_tok", 0)
    inter_e = cfg["intermediate_size"] if mixtral else cfg.get("moe_intermediate_size", 0)
    shared = cfg.get("n_shared_experts", 0) * inter_e  # DeepSeek's shared experts, fused into one MLP
    dense_layers = cfg.get("first_k_dense_replace", 0) if experts else layers
    bias = experts if cfg.get("topk_method") == "noaux_tc" else 0  # DeepSeek-V3's e_score_correction_bias
    moe_layers = layers - dense_layers
    moe_block = experts * 3 * h * inter_e + experts * h + bias + 3 * h * shared
    total = (
        2 * vocab * h
        + h
        + layers * (attn + 2 * h)
        + dense_layers * 3 * h * cfg["intermediate_size"]
        + moe_layers * moe_block
    )
    return total, total - moe_layers * (experts - k) * 3 * h * inter_e


# name: published total, published active, the unit of the active figure's last digit, and whether the vendor's active
# figure counts the input embedding (Mistral and Qwen do; DeepSeek counts what a step reads: no embedding table).
PUBLISHED = {
    "deepseek-v3": (671e9, 37e9, 1e9, False),
    "deepseek-v2-lite": (15.7e9, 2.4e9, 0.1e9, False),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, 0.1e9, True),
    "qwen3-235b-a22b": (235e9, 22e9, 1e9, True),
    "mixtral-8x7b": (46.7e9, 12.9e9, 0.1e9, True),
    "qwen3-8b": (8.2e9, 8.2e9, 0.1e9, True),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shipped_config_params_exact_and_as_published(name):
    from infertune.plan import shipped_models

    assert name in shipped_models()
    spec = ModelSpec.load(name)
    cfg = json.loads((Path(__file__).parents[1] / "infertune/plan/data/models" / f"{name}.json").read_text())
    total, active = counts_from_config(cfg)
    w = weight_breakdown(spec)
    assert (w.total_params, w.params_active) == (total, active)
    assert w.params_active_streamed == active - cfg["vocab_size"] * cfg["hidden_size"]  # untied: less the embedding
    published_total, published_active, unit, with_embedding = PUBLISHED[name]
    assert abs(total - published_total) <= 0.01 * published_total
    # The active figures are given to two or three digits (37B, 2.4B, 3.3B): within one unit of the last one.
    ours = w.params_active if with_embedding else w.params_active_streamed
    assert abs(ours - published_active) < unit, f"{ours / 1e9:.3f}B against the published {published_active / 1e9}B"


def test_deepseek_v3_exact_counts_and_latent_kv():
    spec = ModelSpec.load("deepseek-v3")  # 61 layers: the MTP layer (num_nextn_predict_layers) is not counted
    assert spec.arch.num_hidden_layers == 61 and spec.weight_format.name == "fp8"
    w = weight_breakdown(spec)
    assert w.total_params == 671_026_419_200  # by hand: see counts_from_config
    assert w.params_active == 37_552_297_472 and w.params_active_streamed == 36_625_618_432
    assert kv_bytes_per_token(spec) == (512 + 64) * 61 * 2 == 70_272
    assert kv_bytes_per_token(spec, KVFormat("int8")) == 61 * (576 + 4)  # one row, one fp32 scale (the engine's)
    assert kv_bytes_per_token(spec, KVFormat("int8", scale_bytes=4)) == 61 * (576 + 4)  # the engine's fp32 scale
    assert kv_bytes_per_sequence(spec, 4096) == 70_272 * 4096
    # Tensor parallel: the latent is replicated on every card; the experts are split (expert parallel).
    assert kv_shard_fraction(spec, 8) == 1.0
    tp8 = memory_budget(spec, WeightFormat("fp8"), KVFormat(), 141 * 10**9, 4096, tp=8)
    assert tp8.kv_bytes_per_sequence == 70_272 * 4096
    mixtral = ModelSpec.load("mixtral-8x7b")  # 8 experts cannot be dealt to 16 cards
    with pytest.raises(ValueError, match="num_experts=8"):
        memory_budget(mixtral, WeightFormat(), KVFormat(), 80 * 10**9, 4096, tp=16)
    v2 = ModelSpec.load("deepseek-v2-lite")
    assert kv_bytes_per_token(v2) == (512 + 64) * 27 * 2 == 31_104


def test_deepseek_v3_fp8_and_bf16_bytes_exact():
    """fp8: one byte a weight of every layer matrix but the router, one fp32 scale per 128 x 128 block (partial
    blocks count), bf16 embeddings / norms, the fp32 router and correction bias (as infertune holds them)."""
    spec = ModelSpec.load("deepseek-v3")
    blocks = lambda n, k: -(-n // 128) * -(-k // 128)  # noqa: E731
    attn = [(1536, 7168), (24576, 1536), (576, 7168), (32768, 512), (7168, 16384)]
    dense = [(18432, 7168), (18432, 7168), (7168, 18432)]
    expert = [(2048, 7168), (2048, 7168), (7168, 2048)]
    mats = 61 * attn + 3 * dense + 58 * 257 * expert  # 256 routed + 1 shared expert per MoE layer
    norms = 61 * (2 * 7168 + 1536 + 512) + 7168
    routers = 58 * (256 * 7168 + 256)
    fp8 = sum(n * k + 4 * blocks(n, k) for n, k in mats) + 2 * 129280 * 7168 * 2 + 2 * norms + 4 * routers
    assert weight_breakdown(spec, WeightFormat("fp8")).total_bytes == fp8
    assert weight_breakdown(spec, WeightFormat("fp8")).bytes_quant_scales == sum(4 * blocks(n, k) for n, k in mats)
    total = weight_breakdown(spec).total_params
    assert weight_breakdown(spec, WeightFormat("bf16")).total_bytes == 2 * total + 2 * routers  # fp32 routers


def test_expected_experts_touched_exact_for_small_cases():
    """E (1 - (1 - k/E)^b) against exact enumeration: every token picks one of the C(E, k) subsets, equally likely."""
    import itertools
    from fractions import Fraction

    from infertune.plan import expected_experts_touched

    for e, k, b in [(4, 1, 3), (4, 2, 3), (5, 2, 2), (6, 3, 3), (8, 2, 3)]:
        subsets = list(itertools.combinations(range(e), k))
        touched = [len(set().union(*pick)) for pick in itertools.product(subsets, repeat=b)]
        exact = Fraction(sum(touched), len(touched))
        assert exact == e * (1 - (1 - Fraction(k, e)) ** b)
        assert expected_experts_touched(e, k, b) == pytest.approx(float(exact), rel=1e-12)
    assert expected_experts_touched(256, 8, 1) == pytest.approx(8)  # one token: exactly its k experts


def test_moe_decode_reads_only_the_touched_experts():
    """Qwen3-30B-A3B decode bytes: the non-expert weights once, plus per MoE layer the expected distinct experts
    of the batch, plus the KV; its FLOPs are those of the k experts a token runs."""
    from infertune.plan import expected_experts_touched

    spec = ModelSpec.load("qwen3-30b-a3b")
    w = weight_breakdown(spec)
    roof = Roofline(spec, BASELINE_CPU)
    expert_bytes = 3 * 2048 * 768 * 2
    assert w.bytes_expert == expert_bytes and w.moe_layers == 48
    everything = w.total_bytes - 151936 * 2048 * 2  # every weight but the (untied) input embedding
    for batch in (1, 4, 64):
        step = roof.decode_step(batch, 100)
        touched = 128 * (1 - (1 - 8 / 128) ** batch)
        assert touched == pytest.approx(expected_experts_touched(128, 8, batch))
        weights = everything - 48 * (128 - touched) * expert_bytes
        kv = batch * 100 * kv_bytes_per_token(spec) + batch * kv_bytes_per_token(spec)
        assert step.bytes_per_card == pytest.approx(weights + kv, rel=1e-12)
        active_matmul = w.params_active - 151936 * 2048 - w.params_norms  # embedding and norms are no matmul
        attention = 4 * 32 * 128 * 48 * 100
        assert step.flops_per_card == pytest.approx(batch * (2 * active_matmul + attention), rel=1e-12)
    # Batch 1 reads about the active weights, far below the total.
    assert roof.decode_step(1, 1).bytes_per_card < 0.11 * w.total_bytes


def test_mla_attention_flops_absorbed_at_decode_decompressed_at_prefill():
    spec = ModelSpec.load("deepseek-v2-lite")
    roof = Roofline(spec, BASELINE_CPU)
    assert roof.attn_flops_per_token_layer == 2 * 16 * ((512 + 64) + 512)  # scores over 576 dims, output over 512
    assert roof.prefill_attn_flops_per_pair == 2 * 16 * (128 + 64 + 128)
    w = weight_breakdown(spec)
    step = roof.decode_step(2, 50)
    matmul = 2 * (w.params_active_linear_weights + w.lm_head_matmul_params) * 2
    assert step.flops_per_card == pytest.approx(matmul + 2 * 16 * 1088 * 27 * 50 * 2, rel=1e-12)


MOE_TINY = [
    ("qwen3", dict(head_dim=24)),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, mlp_only_layers=[1])),
    ("qwen3_moe", dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, decoder_sparse_step=2)),
    (
        "qwen2_moe",
        dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48, shared_expert_intermediate_size=80),
    ),
    ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2, tie_word_embeddings=True)),
    ("deepseek_v2", dict(q_lora_rank=None, attention_bias=True, n_shared_experts=2, first_k_dense_replace=1)),
    ("deepseek_v3", dict(q_lora_rank=48, n_group=2, topk_group=1, first_k_dense_replace=2, attention_bias=True)),
]


@pytest.mark.parametrize(
    "family,overrides",
    MOE_TINY,
    ids=[
        "qwen3",
        "qwen3-moe-mlp-only",
        "qwen3-moe-sparse-step",
        "qwen2-moe-shared",
        "mixtral-tied",
        "deepseek-v2-lite",
        "deepseek-v3",
    ],
)
def test_moe_and_mla_param_count_matches_transformers(family, overrides):
    """Oracle: the transformers model of the same config (meta device). DeepSeek-V3's e_score_correction_bias is a
    buffer there and a parameter here (loaded from the checkpoint either way), so it joins the sum."""
    import torch
    import transformers

    cls = {
        "qwen3": "Qwen3",
        "qwen3_moe": "Qwen3Moe",
        "qwen2_moe": "Qwen2Moe",
        "mixtral": "Mixtral",
        "deepseek_v2": "DeepseekV2",
        "deepseek_v3": "DeepseekV3",
    }[family]
    base = dict(
        vocab_size=1000,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    if family.startswith("deepseek"):
        base.update(
            num_key_value_heads=4,
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            kv_lora_rank=32,
            qk_nope_head_dim=16,
            qk_rope_head_dim=8,
            v_head_dim=16,
        )
    hf_cfg = getattr(transformers, f"{cls}Config")(**{**base, **overrides})
    with torch.device("meta"):
        model = getattr(transformers, f"{cls}ForCausalLM")(hf_cfg)
    named = {**dict(model.named_parameters()), **{n: b for n, b in model.named_buffers() if "correction_bias" in n}}
    w = weight_breakdown(ModelSpec.from_dict(hf_cfg.to_dict(), family))
    assert w.total_params == sum(p.numel() for p in named.values())
    assert w.params_norms == sum(p.numel() for n, p in named.items() if "norm" in n)
    assert w.params_attention == sum(p.numel() for n, p in named.items() if "self_attn" in n and "norm" not in n)
    assert w.params_mlp == sum(p.numel() for n, p in named.items() if ".mlp." in n)
    assert w.params_routed_experts == sum(p.numel() for n, p in named.items() if ".experts." in n)


def test_command_plans_a_shipped_moe_mla_model(capsys):
    assert plan_main(["--model", "DeepSeek-V3", "--device", "h200", "--tp", "8", "--context", "4096", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["settings"]["weight_dtype"] == "fp8" and plan["settings"]["fp8_block"] == [128, 128]
    assert plan["kv"]["bytes_per_token"] == 70_272 and plan["model"]["mla"]["kv_lora_rank"] == 512
    assert plan["weights"]["params"] == 671_026_419_200 and plan["weights"]["params_active"] == 37_552_297_472
    rows = {r["batch"]: r for r in plan["by_batch"]}
    assert rows[1]["experts_touched_per_layer"] == pytest.approx(8.0)
    assert rows[1]["weight_bytes_read_per_card"] < rows[256]["weight_bytes_read_per_card"]
    assert plan_main(["--model", "qwen3-30b-a3b", "--device", "h100", "--weight-dtype", "w8a16"]) == 0
    text = capsys.readouterr().out
    assert "128 experts, top-8, in 48 layers" in text and "3,353,032,704 params active" in text
    assert plan_main(["--model", "no-such-model", "--device", "h100"]) == 2
    assert "deepseek-v3" in capsys.readouterr().err  # the error lists the shipped configs


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_kv_bytes_per_token_are_the_engines(tiny_llama, kv):
    """Oracle: the KV cache the engine allocates (bytes per token of its pages), for the 16-bit and the int8 cache."""
    from infertune import LLM

    llm = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory_bytes="1Mi", max_model_len=64)
    engine_bytes = llm.engine.executor.kv_cache_info.bytes_per_token
    assert kv_bytes_per_token(ModelSpec.load(tiny_llama), KVFormat(kv)) == engine_bytes


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--context", "0"], "--context 0 must be >= 2"),
        (["--price-per-hour", "-1"], "--price-per-hour -1 must be >= 0"),
        (["--cards", "-1"], "--cards -1 must be >= 0"),
        (["--weight-dtype", "w4a16", "--group-size", "100"], "--group-size 100 is not one the engine runs"),
    ],
)
def test_bad_numbers_are_usage_errors_naming_the_flag(capsys, flags, message):
    assert plan_main(["--model", str(QWEN7B / "config.json"), "--device", "h100", *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "family, overrides",
    [
        ("gemma3", dict(sliding_window=8, layer_types=["sliding_attention"] * 3 + ["full_attention"])),  # 3 : 1
        # 7 : 3 in 10 layers: cut into groups of 3 (1 full, 3 windowed), the last windowed group's 2 pages empty
        (
            "gemma3",
            dict(
                sliding_window=8,
                num_hidden_layers=10,
                layer_types=(["sliding_attention"] * 2 + ["full_attention"]) * 3 + ["sliding_attention"],
            ),
        ),
        ("qwen2", dict(num_hidden_layers=4, use_sliding_window=True, sliding_window=8, max_window_layers=3)),
    ],
)
def test_kv_of_uneven_window_groups_is_the_engines(tmp_path, family, overrides):
    """Oracle: the blocks the engine's KV cache groups hold for one sequence of max_model_len, at its bytes a block
    id (a page of each layer of the largest group)."""
    from conftest import make_checkpoint
    from test_gemma import make_gemma

    from infertune import LLM

    path = (
        make_gemma(tmp_path / "g", "Gemma3Text", **overrides)
        if family == "gemma3"
        else make_checkpoint(tmp_path / "q", "qwen2", **overrides)
    )
    length = 128
    # (prompt chunks of one block: a windowed group then holds its window and a block or two past it, as the
    # planner's steady state has it; a whole-prompt prefill holds every prompt block until it is done)
    llm = LLM(
        str(path),
        dtype="bfloat16",
        max_model_len=length,
        kv_cache_memory_bytes="1Mi",
        block_size=16,
        max_num_batched_tokens=16,
    )
    info = llm.engine.executor.kv_cache_info
    assert len(info.groups) > 2  # (the kinds of layers cut into equal groups)
    chunk = llm.engine.config.scheduler.max_num_batched_tokens
    blocks = sum(g.max_blocks(length, info.block_size, chunk) for g in info.groups)
    engine = blocks * info.block_size * info.bytes_per_token
    planned = kv_bytes_per_sequence(ModelSpec.load(path), length)
    # (the engine keeps whole blocks, and each windowed group a block or two past its window)
    windowed = sum(g.window is not None for g in info.groups)
    assert engine - 3 * windowed * info.block_size * info.bytes_per_token <= planned <= engine


@pytest.mark.parametrize(
    "compression",
    [
        {"press": "streaming_llm", "compression_ratio": 0.5, "n_sink": 4},
        # the seeds' recipe: layer 0 in a window, full below a length, a press above it
        {
            "policy": [
                {"layers": "0", "window": 16},
                {"max_length": 32, "press": "none"},
                {"press": "snapkv", "compression_ratio": 0.75},
            ]
        },
    ],
)
def test_kv_compression_is_planned_as_the_engine_holds_it(tmp_path, capsys, compression):
    """plan --kv-compression: each KV cache group holds what its window or press keeps of the prompt plus the tokens
    decoded after it. Oracle: the blocks the engine's groups hold for one sequence mid-decode (its coordinator's own
    count), whole blocks of the planned tokens (a window's group up to a block past it); and the engine's grouping of
    the layers. The JSON and the text say the press; an MLA model is refused as the engine refuses it."""
    from conftest import make_checkpoint

    from infertune import LLM, SamplingParams
    from infertune.kv_compression import KVCompressionConfig
    from infertune.plan.memory import kv_group_tokens

    path = make_checkpoint(tmp_path / "m", "llama", num_hidden_layers=4)
    prompt_len, decoded, bs = 100, 7, 8
    llm = LLM(
        str(path),
        dtype="float32",
        max_model_len=128,
        block_size=bs,
        kv_cache_memory_bytes="1Mi",
        kv_compression=compression,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    prompt = list(range(3, 3 + prompt_len))
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=decoded + 5, ignore_eos=True))
    while True:  # (to the step after which its cache holds the prompt's kept tokens and `decoded` more)
        engine.step()
        seq = engine.requests["r"].samples[0].seq
        if seq.num_computed_tokens >= prompt_len + decoded:
            break
    held = engine.block_manager.blocks_used_by_group
    kv = KVFormat(compression=KVCompressionConfig.from_dict(compression), prompt_len=prompt_len)
    spec = ModelSpec.load(path)
    planned = kv_group_tokens(spec, prompt_len + decoded, kv)
    runner_groups = engine.executor.runner.kv_groups
    assert [(g.window, g.layers) for g, _ in planned] == [(g.window, g.layers) for g in runner_groups]
    assert any(g.compressed for g, _ in planned)
    for (g, tokens), blocks in zip(planned, held):
        assert tokens < prompt_len + decoded or g.window is None  # (something dropped, or a full group)
        least = -(-tokens // bs)
        assert least <= blocks <= least + (1 if g.window is not None else 0), (g, tokens, blocks, held)
    # the CLI: the press in the settings, the groups' kept tokens, and MLA refused
    cfg = json.dumps(compression)
    args = ["--model", str(path), "--device", "h100", "--input-len", str(prompt_len), "--output-len", str(decoded)]
    assert plan_main([*args, "--kv-compression", cfg, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["settings"]["kv_compression"] == compression
    rows = out["kv"]["groups"]
    assert sum(r["layers"] for r in rows if r["compressed"]) == sum(len(g.layers) for g, _ in planned if g.compressed)
    assert plan_main([*args, "--kv-compression", cfg]) == 0
    assert "compressed after each 100-token prompt" in capsys.readouterr().out
    assert plan_main(["--model", "deepseek-v2-lite", "--device", "h100", "--kv-compression", cfg]) == 2
    assert "MLA's latent cache does not take it" in capsys.readouterr().err


def test_a_w4a16_checkpoints_groups_are_planned_and_a_group_that_does_not_fit_is_refused(tmp_path, capsys):
    """Hand arithmetic on a tiny tied Llama (hidden 64, MLP 128, 2 layers, 4 heads of 16, 2 KV heads, vocab 260)
    quantized by `infertune quantize` in groups of 32: with --quantize-lm-head the plan keeps the checkpoint's groups
    (it planned groups of 128, which the engine cannot even load on a 64-wide layer) and adds the int8 head beside the
    bf16 embedding; a --group-size or --weight-dtype other than the checkpoint's is refused, and so is a group size
    that does not divide a layer (planned before with a partial group, where the engine refuses the model)."""
    from conftest import make_checkpoint

    from infertune.tools.quantizer import quantize

    src = make_checkpoint(tmp_path / "src", "llama", tie_word_embeddings=True)
    out = tmp_path / "w4"
    quantize(str(src), "w4a16", str(out), group_size=32, show_progress=False)
    h, inter, layers, vocab = 64, 128, 2, 260
    # (out, in) of each projection: q, k, v, o, gate, up, down
    mats = [(h, h), (32, h), (32, h), (h, h), (inter, h), (inter, h), (h, inter)]
    int4 = layers * sum(o * i for o, i in mats) // 2
    scales = layers * sum(o * (i // 32) for o, i in mats) * (2 + 2)  # a bf16 scale and zero per group of 32
    head = vocab * h + vocab * 2  # int8 rows and a bf16 scale each
    rest = vocab * h * 2 + (2 * layers + 1) * h * 2  # the bf16 embedding, the norms
    assert plan_main(["--model", str(out), "--device", "h100", "--quantize-lm-head", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["settings"]["weight_dtype"] == "w4a16" and plan["settings"]["group_size"] == 32
    assert plan["weights"]["bytes"] == int4 + scales + head + rest == 97_160
    assert plan["weights"]["bytes_quant_scales"] == scales + vocab * 2
    for flags, message in (
        (["--group-size", "64"], "already quantized in groups of 32; drop --group-size 64"),
        (["--weight-dtype", "w8a16"], "already quantized (w4a16); drop --weight-dtype w8a16"),
    ):
        assert plan_main(["--model", str(out), "--device", "h100", *flags]) == 2
        assert message in capsys.readouterr().err
    assert plan_main(["--model", str(src), "--device", "h100", "--weight-dtype", "w4a16"]) == 2
    assert "groups of 128 does not fit a layer of 64 input features" in capsys.readouterr().err


def test_an_int8_compressed_tensors_checkpoint_is_planned_as_the_engine_loads_it(tmp_path, capsys):
    """An int8 compressed-tensors checkpoint as llm-compressor writes it (no 'infertune' key; the engine loads it as
    W8A8) is counted at one byte a weight plus its per-channel scales, the same hand arithmetic as `--weight-dtype
    w8a16` (it was counted in bf16, 'not modelled'); and a checkpoint `infertune quantize` wrote keeps its own name in
    the report (it was named after its method: 'infertune plan: w4a16 (LlamaForCausalLM)')."""
    cfg = json.loads((QWEN7B / "config.json").read_text())
    scheme = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    qc = {
        "quant_method": "compressed-tensors",
        "format": "int-quantized",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": scheme, "input_activations": acts}},
        "ignore": ["lm_head"],
    }
    spec = ModelSpec.from_dict({**cfg, "quantization_config": qc}, "qwen-w8a8")
    assert spec.name == "qwen-w8a8" and spec.weight_format == WeightFormat("w8a8")
    ours = weight_breakdown(spec, spec.weight_format)
    assert ours.total_bytes == weight_breakdown(ModelSpec.from_dict(cfg), WeightFormat("w8a16")).total_bytes
    qc_own = {**qc, "infertune": {"method": "w4a16"}, "format": "infertune-int4-uint8"}
    qc_own["config_groups"] = {"group_0": {"weights": {"num_bits": 4, "strategy": "group", "group_size": 64}}}
    own = ModelSpec.from_dict({**cfg, "quantization_config": qc_own}, "mine")
    assert own.name == "mine" and own.weight_format == WeightFormat("w4a16", 64)


def test_weight_dtype_w8a8_is_planned_at_w8a16s_bytes(qwen, capsys):
    """--weight-dtype w8a8 (it was an invalid choice, though the engine and quantize take w8a8): int8 weights and a
    bf16 scale a row, the same bytes as w8a16, by hand for Qwen2.5-7B's layers (28 x (q, k, v, o, gate, up, down))."""
    h, inter, layers, kv = 3584, 18944, 28, 512
    mats = [(h, h), (kv, h), (kv, h), (h, h), (inter, h), (inter, h), (h, inter)]
    int8 = layers * sum(o * i for o, i in mats)
    scales = layers * sum(o for o, _ in mats) * 2
    plain = weight_breakdown(qwen, WeightFormat("bf16"))
    ours = weight_breakdown(qwen, WeightFormat("w8a8"))
    assert plain.total_bytes - ours.total_bytes == 2 * int8 - (int8 + scales)
    assert ours.total_bytes == weight_breakdown(qwen, WeightFormat("w8a16")).total_bytes
    assert plan_main(["--model", str(QWEN7B), "--device", "h100", "--weight-dtype", "w8a8", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["settings"]["weight_dtype"] == "w8a8" and plan["weights"]["bytes"] == ours.total_bytes
