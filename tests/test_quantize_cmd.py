"""Offline quantization (`infertune quantize`): calibration statistics against hand computations and HF hooks,
weight clipping, the stored format, SmoothQuant's invariance, and (with the loader's support for quantized
checkpoints) that a saved checkpoint reproduces on-the-fly quantization exactly and that --gate catches a
corrupted scale."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
import torch
from conftest import hf_model, make_checkpoint, make_tokenizer
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from infertune import LLM, SamplingParams
from infertune.config import default_model_path
from infertune.quant.int4 import quantize_int4_groupwise
from infertune.quant.int8 import quantize_int8_per_channel
from infertune.tools import quantize as command
from infertune.tools.calibration import ActivationStats, calibration_samples, collect, nearest_rank
from infertune.tools.quant_format import pack_int4, unpack_int4
from infertune.tools.quantizer import plan_layers, quantize, read_tensors, smooth
from infertune.tools.weight_clipping import parse_clip, quantize_int4, quantize_int8, reconstruction_error

needs_loader = pytest.mark.skipif(
    not command.loader_reads_quantized_checkpoints(),
    reason="the loader cannot read quantized checkpoints yet (apply quant_loader.patch: infertune/quant/checkpoint.py)",
)


# ---- calibration statistics ------------------------------------------------------------------------------
def test_activation_stats_by_hand():
    s = ActivationStats(2, percentile=50.0)
    s.update(torch.tensor([[1.0, -2.0], [3.0, 0.5]]))  # |x| sorted: 0.5 1 2 3 -> 50th nearest rank = 2nd = 1
    s.update(torch.tensor([[-4.0, 1.0]]))  # |x| sorted: 1 4 -> 1st = 1
    assert s.absmax.tolist() == [4.0, 2.0] and s.max == 4.0
    assert s.percentile_value == pytest.approx((1.0 + 1.0) / 2) and s.samples == 2 and s.tokens == 3
    assert s.clip_value("minmax") == 4.0 and s.clip_value("percentile:50") == pytest.approx(1.0)
    assert nearest_rank(torch.arange(1.0, 1001.0), 99.9) == 999.0  # ceil(0.999 * 1000) = 999th value


def test_calibration_samples_are_windows_of_each_document():
    tok = make_tokenizer()  # one token per byte
    docs = ["a" * 10, "b" * 3, "c"]  # "c" alone is too short to predict anything
    assert [len(s) for s in calibration_samples(tok, docs, 100, 4)] == [4, 4, 2, 3]
    assert len(calibration_samples(tok, docs, 2, 4)) == 2


def test_calibration_matches_hf_hooks_on_known_inputs(tiny_llama):
    """absmax per channel and the mean per-sample percentile of every linear input, from the engine's hooks,
    equal the same numbers computed by hand from HF transformers' layer inputs on the same token ids."""
    samples = [[5, 9, 14, 3, 77, 120, 8], [200, 1, 1, 60, 33], [42] * 9]
    llm = LLM(str(tiny_llama), dtype="float32", enable_prefix_caching=False, max_num_seqs=1)
    names = [
        "model.layers.0.self_attn.qkv_proj",
        "model.layers.1.self_attn.o_proj",
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.1.mlp.down_proj",
    ]
    stats = collect(llm.engine.executor.runner, names, samples, 90.0, show_progress=False)

    model = hf_model(tiny_llama)
    hf_names = {
        "model.layers.0.self_attn.qkv_proj": "model.layers.0.self_attn.q_proj",
        "model.layers.1.self_attn.o_proj": "model.layers.1.self_attn.o_proj",
        "model.layers.0.mlp.gate_up_proj": "model.layers.0.mlp.gate_proj",
        "model.layers.1.mlp.down_proj": "model.layers.1.mlp.down_proj",
    }
    seen: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    modules = dict(model.named_modules())
    for ours, theirs in hf_names.items():
        modules[theirs].register_forward_pre_hook(lambda m, args, ours=ours: seen[ours].append(args[0][0].clone()))
    with torch.no_grad():
        for ids in samples:
            model(torch.tensor([ids]))
    for name in names:
        xs = [x.abs() for x in seen[name]]  # [T, K] per sample
        absmax = torch.stack([x.amax(dim=0) for x in xs]).amax(dim=0)
        pct = []
        for x in xs:  # nearest rank by hand: sort, take the ceil(0.9 n)-th value
            flat = x.flatten().sort().values
            pct.append(float(flat[-(-9 * flat.numel() // 10) - 1]))
        torch.testing.assert_close(stats[name].absmax, absmax, atol=1e-5, rtol=1e-5)
        assert stats[name].percentile_value == pytest.approx(sum(pct) / len(pct), rel=1e-5, abs=1e-6)
        assert stats[name].samples == 3 and stats[name].tokens == 21


# ---- weight clipping and the stored format -----------------------------------------------------------------
def test_weight_clipping():
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    w[3, 7] = 25.0  # an outlier
    q, scale = quantize_int8(w, "minmax")
    q0, scale0 = quantize_int8_per_channel(w)
    assert torch.equal(q, q0) and torch.equal(scale, scale0)  # minmax is the engine's on-the-fly rule, bit for bit
    assert all(torch.equal(a, b) for a, b in zip(quantize_int4(w, 32), quantize_int4_groupwise(w, 32)))
    # percentile: row 3's range is its 99th nearest-rank |w| (the 127th of 128 sorted values), not the outlier
    _, scale_p = quantize_int8(w, "percentile:99")
    assert float(scale_p[3]) * 127 == pytest.approx(float(w[3].abs().sort().values[126]), rel=1e-6)
    for method, kw in (("w8a16", {}), ("w4a16", {"group_size": 32}), ("w4a16", {"group_size": 32, "symmetric": True})):
        minmax = reconstruction_error(w, method, "minmax", **kw)
        assert reconstruction_error(w, method, "mse", **kw) <= minmax  # r = 1 (minmax) is among the candidates
    # 15 levels leave room to trade the tails for a finer step (with 255 levels minmax is about optimal)
    assert reconstruction_error(w, "w4a16", "mse", group_size=128) < 0.95 * reconstruction_error(
        w, "w4a16", "minmax", group_size=128
    )
    assert parse_clip("percentile:99.9") == ("percentile", 99.9)
    with pytest.raises(ValueError, match="clip"):
        parse_clip("max")


def test_int4_packing_by_hand():
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 0, 15]])
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.tolist() == [[0x21, 0x0F], [0x87, 0xF0]]
    assert torch.equal(unpack_int4(packed), q)


def test_checkpoint_layout(tmp_path):
    src = make_checkpoint(tmp_path / "src", "qwen2", tie_word_embeddings=False)
    out = tmp_path / "w4"
    result = quantize(
        str(src), "w4a16", str(out), group_size=32, keep_fp=("lm_head", "model.layers.1.mlp.*"), show_progress=False
    )
    cfg = json.loads((out / "config.json").read_text())
    qc = cfg["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "infertune-int4-uint8"
    assert qc["config_groups"]["group_0"]["weights"] == {
        "num_bits": 4,
        "type": "int",
        "symmetric": False,
        "strategy": "group",
        "group_size": 32,
        "dynamic": False,
        "observer": "minmax",
        "actorder": None,
    }
    assert qc["ignore"] == [
        "lm_head",
        "model.layers.1.mlp.down_proj",
        "model.layers.1.mlp.gate_proj",
        "model.layers.1.mlp.up_proj",
    ]
    assert qc["infertune"]["source_model"] == str(src.resolve())
    assert {"tokenizer.json", "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    t = load_file(out / "model.safetensors")
    p = "model.layers.0.self_attn.k_proj"
    assert t[f"{p}.weight_packed"].dtype == torch.uint8 and t[f"{p}.weight_packed"].shape == (32, 32)
    assert t[f"{p}.weight_scale"].shape == (32, 2) and t[f"{p}.weight_zero"].shape == (32, 2)
    assert f"{p}.bias" in t and f"{p}.weight" not in t  # Qwen2's k bias kept as is
    assert t["model.layers.1.mlp.down_proj.weight"].dtype == torch.float32  # kept in full precision
    # 4 bits per weight + fp32 scale and zero per group of 32: 0.5 + 8/32 = 0.75 bytes per weight
    assert result.weight_bytes_after / result.weight_bytes_before == pytest.approx(0.75 / 4)
    w8 = quantize(str(src), "w8a16", str(tmp_path / "w8"), show_progress=False)
    weights = [t for name, t in read_tensors(str(src)).items() if name.endswith("proj.weight")]
    assert w8.weight_bytes_before == sum(4 * w.numel() for w in weights)  # fp32 source
    assert w8.weight_bytes_after == sum(w.numel() + 4 * w.shape[0] for w in weights)  # int8 + an fp32 scale per row
    with pytest.raises(ValueError, match="not empty"):
        quantize(str(src), "w8a16", str(tmp_path / "w8"), show_progress=False)


def test_smoothquant_leaves_the_unquantized_model_unchanged(tmp_path):
    src = make_checkpoint(tmp_path / "src", "llama")
    llm = LLM(str(src), dtype="float32", enable_prefix_caching=False, max_num_seqs=1)
    runner = llm.engine.executor.runner
    tensors = read_tensors(str(src))
    chosen, targets = plan_layers(str(src), ("lm_head",), tensors)
    stats = collect(runner, chosen, [[3, 50, 7, 99, 12], [8, 8, 100]], 99.9, show_progress=False)
    factors, smoothed = smooth(tensors, targets, stats, 0.5)
    assert set(factors) == {f"model.layers.{i}.{m}" for i in (0, 1) for m in ("self_attn.qkv_proj", "mlp.gate_up_proj")}
    assert all(not torch.allclose(s, torch.ones_like(s)) for s in factors.values())
    new = tmp_path / "smoothed"
    shutil.copytree(src, new)
    save_file({k: smoothed.get(k, v).contiguous() for k, v in tensors.items()}, str(new / "model.safetensors"))
    ids = [5, 9, 14, 3, 77, 120, 8, 1, 2, 3]
    before = runner.prompt_logits(ids, [0])
    after = LLM(str(new), dtype="float32", enable_prefix_caching=False).engine.executor.runner.prompt_logits(ids, [0])
    torch.testing.assert_close(after, before, atol=1e-4, rtol=1e-4)


# ---- loading what quantize wrote ---------------------------------------------------------------------------
@needs_loader
@pytest.mark.parametrize("arch", ["llama", "qwen2", "phi3"])  # (phi3: fused qkv_proj / gate_up_proj in its source)
def test_saved_checkpoint_reproduces_on_the_fly_quantization(tmp_path, arch):
    src = make_checkpoint(tmp_path / "src", arch)
    ids = [5, 9, 14, 3, 77, 120, 8, 1, 2, 3, 200, 17, 4, 66, 13, 90, 31, 7, 54, 21]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    opts = {"dtype": "float32", "enable_prefix_caching": False, "max_num_seqs": 2}
    for method in ("w8a16", "w4a16", "w8a8"):
        out = tmp_path / method
        quantize(str(src), method, str(out), group_size=32, num_samples=4, show_progress=False)
        fly = LLM(str(src), quantization=method, quant_group_size=32, **opts)
        saved = LLM(str(out), **opts)
        la = fly.engine.executor.runner.prompt_logits(ids, [0, 1])
        lb = saved.engine.executor.runner.prompt_logits(ids, [0, 1])
        torch.testing.assert_close(lb, la, atol=1e-5, rtol=0, msg=f"{method}: logits differ")
        prompts = [{"prompt_token_ids": ids[:6]}, {"prompt_token_ids": ids[6:9]}]
        tokens = [
            [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] for llm in (fly, saved)
        ]
        assert tokens[0] == tokens[1], method
        with pytest.raises(ValueError, match="already quantized"):
            LLM(str(out), quantization="w4a16" if method != "w4a16" else "w8a16", **opts)


@needs_loader
@pytest.mark.parametrize("ckpt_dtype, run", [(torch.float32, "bfloat16"), (torch.float16, "auto")])
def test_saved_checkpoint_reproduces_quantizing_at_the_run_dtype(tmp_path, ckpt_dtype, run):
    """A checkpoint whose dtype is not the one the engine runs it in (fp32 run in bf16; fp16, which runs in bf16
    on CPU): quantize rounds to the run dtype first, as the engine's load does, so the saved checkpoint still gives
    on-the-fly quantization's logits."""
    src = make_checkpoint(tmp_path / "src", "qwen3_moe" if ckpt_dtype is torch.float32 else "llama", dtype=ckpt_dtype)
    ids = [5, 9, 14, 3, 77, 120, 8, 1, 2, 3, 200, 17]
    opts = {"dtype": run, "enable_prefix_caching": False, "max_num_seqs": 2}
    for method in ("w8a16", "w4a16"):
        out = tmp_path / f"{method}-{run}"
        quantize(str(src), method, str(out), group_size=32, dtype=run, show_progress=False)
        fly = LLM(str(src), quantization=method, quant_group_size=32, **opts).engine.executor.runner
        saved = LLM(str(out), **opts).engine.executor.runner
        assert torch.equal(saved.prompt_logits(ids, [0]), fly.prompt_logits(ids, [0])), method


@needs_loader
def test_static_activation_scales_are_stored_and_used(tmp_path):
    src = make_checkpoint(tmp_path / "src", "llama")
    out = tmp_path / "static"
    result = quantize(
        str(src),
        "w8a8",
        str(out),
        static_activations=True,
        smoothquant=0.5,
        num_samples=6,
        seq_len=16,
        show_progress=False,
    )
    name = "model.layers.0.mlp.down_proj"
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        stored = float(f.get_tensor(f"{name}.input_scale"))
    assert stored == pytest.approx(result.stats[name].percentile_value / 127, rel=1e-6)
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"]["group_0"]["input_activations"]["dynamic"] is False
    llm = LLM(str(out), dtype="float32", enable_prefix_caching=False)
    layer = dict(llm.engine.executor.runner.model.named_modules())[name]
    assert float(layer.input_scale) == pytest.approx(stored)
    logits = llm.engine.executor.runner.prompt_logits([5, 9, 14, 3, 77], [0])
    assert torch.isfinite(logits).all()


@needs_loader
def test_quantize_command_gates_the_demo_model_and_catches_a_corrupted_scale(tmp_path, capsys):
    def run(module, *argv):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        return module.run(parser.parse_args(list(argv)))

    from infertune.evaluate import command as eval_command

    out = tmp_path / "w8"
    short = ("--num-prompts", "2", "--greedy-tokens", "8")
    assert run(command, "--method", "w8a16", "--out", str(out), "--gate", "1%", "--eval-max-tokens", "3000") == 0
    printed = capsys.readouterr()
    assert "28 linear layers as w8a16" in printed.out and "gate passed" in printed.err
    tensors = load_file(out / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight_scale"] *= 4.0  # the planted bad quantization
    save_file(tensors, str(out / "model.safetensors"))
    assert run(eval_command, "--model", str(out), "--gate", "1%", "--max-tokens", "3000", *short) == 1
    printed = capsys.readouterr()
    assert "gate FAILED" in printed.err and default_model_path() in printed.out  # compared with its source


def test_an_already_quantized_checkpoint_is_refused(tiny_llama, tmp_path):
    from infertune.tools.quantizer import quantize

    first = tmp_path / "w8"
    quantize(str(tiny_llama), "w8a16", str(first), show_progress=False)
    with pytest.raises(ValueError, match="already quantized"):
        quantize(str(first), "w4a16", str(tmp_path / "again"), group_size=32, show_progress=False)
    assert not (tmp_path / "again").exists()  # nothing written
    with pytest.raises(ValueError, match="seq-len"):
        quantize(str(tiny_llama), "w8a8", str(tmp_path / "s"), static_activations=True, seq_len=0)


@needs_loader
def test_a_users_keep_fp_never_quantizes_the_lm_head(tmp_path):
    """--keep-fp replaces the default ("lm_head"), yet the head stays in full precision in the checkpoint and on the
    fly (an int4 head moved every logit and, with a vocab that is not a multiple of 16 (260 here), could not even be
    loaded); the saved checkpoint still reproduces on-the-fly quantization with the same keep_fp."""
    src = make_checkpoint(tmp_path / "src", "llama")
    keep = ("model.layers.0.*",)
    out = tmp_path / "w4"
    result = quantize(str(src), "w4a16", str(out), group_size=32, keep_fp=keep, num_samples=4, show_progress=False)
    assert "lm_head" not in result.quantized and result.quantized
    assert not any(n.startswith("model.layers.0.") for n in result.quantized)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "lm_head.weight" in names and not {n for n in names if n.startswith("lm_head.")} - {"lm_head.weight"}
    ids = [5, 9, 14, 3, 77, 120, 8, 1]
    opts = {"dtype": "float32", "enable_prefix_caching": False, "max_num_seqs": 2}
    fly = LLM(str(src), quantization="w4a16", quant_group_size=32, keep_fp=keep, **opts).engine.executor.runner
    saved = LLM(str(out), **opts).engine.executor.runner
    torch.testing.assert_close(saved.prompt_logits(ids, [0, 1]), fly.prompt_logits(ids, [0, 1]), atol=1e-5, rtol=0)
    head = fly.model.lm_head
    assert type(head.quant_method).__name__ not in ("W4A16Method", "W8A16Method", "W8A8Method")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match="--out .*afile is a file"):
        quantize(str(src), "w8a16", str(tmp_path / "afile"), show_progress=False)


def test_int4_layers_of_any_width_load(tmp_path):
    """An int4 layer whose output width is not a multiple of 16 (aten's int4 pack needs it) keeps the reference
    layout instead of failing at load; its outputs are the dequantized weights' (within fp32 rounding)."""
    from infertune.layers.linear import Linear
    from infertune.quant.int4 import W4A16Method, dequantize_int4, quantize_int4_groupwise

    torch.manual_seed(0)
    layer = Linear(64, 260, bias=False)
    w = torch.randn(260, 64)
    layer.weight.data.copy_(w)
    method = W4A16Method(group_size=32)
    layer.quant_method = method
    method.process_weights_after_loading(layer)
    q, s, lo = quantize_int4_groupwise(w, 32, False)
    x = torch.randn(3, 64)
    torch.testing.assert_close(method.apply(layer, x), x @ dequantize_int4(q, s, lo, 32).t(), atol=1e-4, rtol=1e-4)


@needs_loader
def test_quantize_checks_the_reports_inputs_first_and_says_where_a_failed_report_left_the_checkpoint(
    tmp_path, capsys, monkeypatch
):
    """A missing --eval-data is said before any quantizing (nothing written); a report that fails after the
    checkpoint is written says the checkpoint is complete and how to score it alone, and the checkpoint loads."""
    from infertune.evaluate import accuracy

    def run(*argv):
        parser = argparse.ArgumentParser()
        command.add_arguments(parser)
        return command.run(parser.parse_args(list(argv)))

    src = make_checkpoint(tmp_path / "src", "llama")
    out = tmp_path / "w8"
    base = ("--model", str(src), "--method", "w8a16", "--out", str(out), "--num-samples", "2")
    with pytest.raises(FileNotFoundError, match="no-such.txt"):
        run(*base, "--eval-data", str(tmp_path / "no-such.txt"))
    with pytest.raises(ValueError, match="--eval-max-tokens 1"):
        run(*base, "--eval-max-tokens", "1")
    assert not out.exists()

    def broken(*a, **k):
        raise RuntimeError("the scorer ran out of memory")

    monkeypatch.setattr(accuracy, "compare", broken)
    assert run(*base) == 1
    err = capsys.readouterr().err
    assert f"the quantized checkpoint in {out} is complete" in err and "ran out of memory" in err
    assert f"infertune eval --model {out} --compare {src}" in err
    llm = LLM(model=str(out), dtype="float32")
    assert llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids


@needs_loader
def test_an_interrupted_run_leaves_no_checkpoint_and_a_bad_out_or_json_is_said_before_the_work(tmp_path, monkeypatch):
    """Interrupted while writing (Ctrl-C after the weights' file), quantize leaves nothing under --out (a half
    checkpoint there was refused by a rerun as not empty, and read half by a load) and no partial folder; the rerun
    writes a checkpoint equal to on-the-fly quantization. An --out under a file and an unwritable --json are
    one-line errors before any weight is read (they failed after the whole run: a NotADirectoryError traceback,
    and for --json after the accuracy report)."""
    from infertune.tools import quant_format, quantizer

    src = make_checkpoint(tmp_path / "src", "llama")
    out = tmp_path / "q" / "w8"

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(quant_format, "copy_side_files", interrupted)  # (after model.safetensors and config.json)
        with pytest.raises(KeyboardInterrupt):
            quantize(str(src), "w8a16", str(out), show_progress=False)
    assert list((tmp_path / "q").iterdir()) == []  # neither --out nor a partial folder
    out.mkdir()  # an empty folder given as --out is still taken
    quantize(str(src), "w8a16", str(out), show_progress=False)
    ids = [5, 9, 14, 3, 77, 120, 8, 1]
    opts = {"dtype": "float32", "enable_prefix_caching": False, "max_num_seqs": 2}
    fly = LLM(str(src), quantization="w8a16", **opts).engine.executor.runner.prompt_logits(ids, [0, 1])
    torch.testing.assert_close(LLM(str(out), **opts).engine.executor.runner.prompt_logits(ids, [0, 1]), fly)
    assert sorted(p.name for p in (tmp_path / "q").iterdir()) == ["w8"]

    def never(*a, **k):
        raise AssertionError("the weights were read before the output was checked")

    monkeypatch.setattr(quantizer, "read_tensors", never)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ValueError, match=r"--out .*afile is a file; give a folder"):
        quantize(str(src), "w8a16", str(tmp_path / "afile" / "w8"), show_progress=False)
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    argv = ["--model", str(src), "--method", "w8a16", "--out", str(tmp_path / "j"), "--json"]
    with pytest.raises(ValueError, match=r"--json .*afile"):
        command.run(parser.parse_args([*argv, str(tmp_path / "afile" / "r.json")]))
    assert not (tmp_path / "j").exists()
    from infertune.evaluate import accuracy
    from infertune.evaluate import command as eval_command

    monkeypatch.setattr(accuracy, "compare", never)  # eval --json too: said before the scoring
    parser = argparse.ArgumentParser()
    eval_command.add_arguments(parser)
    with pytest.raises(ValueError, match=r"--json .*afile is a file"):
        eval_command.run(parser.parse_args(["--model", str(out), "--json", str(tmp_path / "afile" / "r.json")]))


def test_a_missing_or_empty_calib_file_is_said_before_the_weights_are_read(tmp_path, monkeypatch, caplog):
    """--calib is read by w8a8's calibration, after the weights and the model were loaded: a missing or empty file
    was said only then (minutes into a large model). Now before any weight is read; and a --calib that a method
    without calibration would never read is said too (it was dropped without a word)."""
    from infertune.tools import quantizer

    src = make_checkpoint(tmp_path / "src", "llama")

    def never(*a, **k):
        raise AssertionError("the weights were read before --calib was checked")

    monkeypatch.setattr(quantizer, "read_tensors", never)
    (tmp_path / "empty.txt").write_text("")
    for calib, error in ((tmp_path / "none.txt", "does not exist"), (tmp_path / "empty.txt", "is empty")):
        with pytest.raises((ValueError, FileNotFoundError), match=error):
            quantize(str(src), "w8a8", str(tmp_path / "out"), calib=str(calib), show_progress=False)
    monkeypatch.undo()
    with caplog.at_level("WARNING", logger="infertune.tools.quantizer"):
        quantize(str(src), "w8a16", str(tmp_path / "w8"), calib=str(tmp_path / "none.txt"), show_progress=False)
    assert "--calib" in caplog.text and "is not read" in caplog.text
    assert not (tmp_path / "out").exists()


def _with(src, dst, qc, tensors):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    if qc is not None:
        cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    (dst / "model.safetensors").unlink()
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


@needs_loader
def test_published_quantized_formats_are_loaded_right_or_refused_by_name(tmp_path):
    """What users bring: an int8 compressed-tensors checkpoint as llm-compressor writes it (bf16 scales [N, 1], no
    'infertune' key) loads as W8A16 / W8A8, against HF transformers running its dequantized weights (W8A16: the same
    weights, fp32 activations); a GPTQ / AWQ quantization_config or llm-compressor's packed int4 is refused naming it;
    an AutoGPTQ folder with no quantization_config in config.json (its quantize_config.json beside it) is refused as
    GPTQ-style packed weights (it said 'has no place in LlamaForCausalLM; is config.json right?')."""
    src = make_checkpoint(tmp_path / "src", "llama")
    plain = load_file(str(src / "model.safetensors"))
    int8 = {}
    for k, v in plain.items():
        if k.endswith("proj.weight"):
            q, s = quantize_int8_per_channel(v)
            int8[k], int8[k.replace(".weight", ".weight_scale")] = q, s.to(torch.bfloat16).unsqueeze(1)
        else:
            int8[k] = v
    scheme = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel", "dynamic": False}
    group = {"targets": ["Linear"], "weights": scheme, "input_activations": None}
    qc = {"quant_method": "compressed-tensors", "format": "int-quantized", "config_groups": {"group_0": group}}
    ct = _with(src, tmp_path / "ct", {**qc, "ignore": ["lm_head"]}, int8)
    hf = hf_model(src)
    with torch.no_grad():
        for k, v in hf.named_parameters():
            if k in int8 and int8[k].dtype == torch.int8:
                v.copy_(int8[k].float() * int8[k.replace(".weight", ".weight_scale")].float())
        ids = [5, 9, 14, 3, 77, 120, 8, 1]
        ref = hf(torch.tensor([ids])).logits[0]
    llm = LLM(str(ct), dtype="float32", max_model_len=64)
    assert llm.config.quant.quantization == "w8a16"
    torch.testing.assert_close(llm.engine.executor.runner.prompt_logits(ids, [0, 1, 2, 3]), ref, atol=1e-4, rtol=0)
    for name, bad, match in (
        ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 128}, "quant_method='gptq'"),
        ("awq", {"quant_method": "awq", "bits": 4, "version": "gemm"}, "quant_method='awq'"),
        ("pack", {**qc, "format": "pack-quantized"}, "format='pack-quantized'"),
    ):
        with pytest.raises(ValueError, match=match):
            LLM(str(_with(src, tmp_path / name, bad, plain)))
    gptq = {}
    for k, v in plain.items():
        if k.endswith("proj.weight"):
            p, (n, kk) = k.removesuffix(".weight"), v.shape
            gptq[p + ".qweight"] = torch.zeros(kk // 8, n, dtype=torch.int32)
            gptq[p + ".qzeros"] = torch.zeros(1, n // 8, dtype=torch.int32)
            gptq[p + ".scales"] = torch.ones(1, n, dtype=torch.float16)
            gptq[p + ".g_idx"] = torch.zeros(kk, dtype=torch.int32)
        else:
            gptq[k] = v
    old = _with(src, tmp_path / "autogptq", None, gptq)
    (old / "quantize_config.json").write_text(json.dumps({"bits": 4, "group_size": 128}))
    with pytest.raises(ValueError, match="GPTQ / AWQ-style packed int4 weight"):
        LLM(str(old))
