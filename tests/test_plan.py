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
    # INT8 data is exactly half; with one fp16 scale per token, layer, KV head (K and V) the factor is 130/256.
    assert kv_bytes(qwen, 2048, 32, KVFormat("int8", scale_bytes=0)) == 3_758_096_384 // 2
    assert kv_bytes_per_token(qwen, KVFormat("int8")) == 2 * 28 * 4 * (128 + 2) == 29_120
    assert kv_bytes(qwen, 2048, 32, KVFormat("int8")) == 29_120 * 2048 * 32 == 1_908_408_320


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
    assert kv_bytes_per_sequence(qwen_sw, 8192) == (20 * 8192 + 8 * 4096) * 2 * 4 * 128 * 2


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
    assert "29,120 B per token" in text and "0.5078" in text and "*32" in text and "P/D split" in text
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
