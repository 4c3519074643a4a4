"""Bad input gets a clear exception that names what to change, and never leaks engine state."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from conftest import make_checkpoint, read_config

from infertune import LLM, SamplingParams

MAX_LEN = 128


@pytest.fixture(scope="module")
def llm(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", max_model_len=MAX_LEN)


def _assert_clean(llm: LLM) -> None:
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks, "KV blocks leaked"
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.num_running == 0 and llm.engine.scheduler.num_waiting == 0


def _write_config(path: Path, cfg: dict) -> None:
    (Path(path) / "config.json").write_text(json.dumps(cfg))


def _load(path, **kw) -> LLM:
    return LLM(str(path), **{"dtype": "float32", "max_model_len": MAX_LEN, **kw})


# ---- SamplingParams ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kw, name",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(max_tokens=-3), "max_tokens"),
        (dict(max_tokens=2.5), "max_tokens"),
        (dict(temperature=-0.1), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_p=-0.2), "top_p"),
        (dict(top_k=-2), "top_k"),
        (dict(top_k=2.0), "top_k"),
        (dict(n=0), "n"),
        (dict(n=-1), "n"),
        (dict(logprobs=50), "logprobs"),
        (dict(logprobs=-1), "logprobs"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=-0.1), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=-3.0), "frequency_penalty"),
        (dict(seed="1"), "seed"),
        (dict(stop=""), "stop"),
        (dict(stop=["ok", ""]), "stop"),
    ],
)
def test_sampling_params_reject_bad_values_naming_the_parameter(kw, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        SamplingParams(**kw)


@pytest.mark.parametrize(
    "kw, name",
    [
        pytest.param(dict(temperature=math.nan), "temperature"),
        pytest.param(dict(repetition_penalty=math.nan), "repetition_penalty"),
        (dict(top_p=math.nan), "top_p"),
        (dict(min_p=math.nan), "min_p"),
        (dict(presence_penalty=math.nan), "presence_penalty"),
    ],
)
def test_sampling_params_reject_nan(kw, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        SamplingParams(**kw)


def test_sampling_params_accepts_edges():
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_p=1.0, min_p=1.0, logprobs=20, temperature=0.0).greedy
    SamplingParams(logprobs=0, presence_penalty=2.0, frequency_penalty=-2.0, max_tokens=None, stop=["a", "b"])


# ---- generate: bad prompts -----------------------------------------------------------------------------
def test_empty_prompt_raises(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, SamplingParams(max_tokens=4))
    _assert_clean(llm)


@pytest.mark.parametrize("length", [MAX_LEN, 200])
def test_prompt_too_long_names_both_lengths(llm, length):
    with pytest.raises(ValueError, match="max_model_len") as info:
        llm.generate("a" * length, SamplingParams(max_tokens=4))
    assert str(length) in str(info.value) and str(MAX_LEN) in str(info.value)
    _assert_clean(llm)


def test_prompt_leaving_room_for_one_token_is_accepted(llm):
    out = llm.generate("a" * (MAX_LEN - 1), SamplingParams(max_tokens=10, ignore_eos=True))[0]
    assert out.error is None
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    _assert_clean(llm)


@pytest.mark.parametrize("ids", [[1, 2, 260], [1, 99999], [-1, 5], [3, 1.0]])
def test_out_of_vocab_token_ids_raise(llm, ids):
    vocab = llm.engine.config.model.arch.vocab_size
    with pytest.raises(ValueError, match="prompt_token_ids") as info:
        llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=4))
    assert str(vocab) in str(info.value)
    _assert_clean(llm)


def test_bad_dict_prompt_raises(llm):
    with pytest.raises(ValueError, match="prompt_token_ids"):
        llm.generate({"text": "hello"}, SamplingParams(max_tokens=4))


def test_non_prompt_object_gets_a_clear_error(llm):
    with pytest.raises(ValueError, match="prompt"):
        llm.generate(3, SamplingParams(max_tokens=4))


def test_sampling_params_count_mismatch_raises(llm):
    with pytest.raises(ValueError, match="SamplingParams"):
        llm.generate(["a", "b", "c"], [SamplingParams(max_tokens=2)] * 2)
    assert llm.generate([], SamplingParams()) == []
    _assert_clean(llm)


@pytest.mark.parametrize(
    "bad, fragment",
    [
        ("", "empty"),
        ("z" * 300, "300"),
        ({"prompt_token_ids": [1, 2, 100000]}, "prompt_token_ids"),
    ],
    ids=["empty", "too_long", "out_of_vocab"],
)
def test_bad_prompt_in_batch_does_not_stop_the_others(llm, bad, fragment):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    solo = [llm.generate(p, sp)[0].outputs[0].token_ids for p in ("good one", "good two")]
    outs = llm.generate(["good one", bad, "good two"], sp)
    assert len(outs) == 3
    for out, ref in zip((outs[0], outs[2]), solo):
        assert out.error is None and out.finished
        assert out.outputs[0].finish_reason == "length"
        assert out.outputs[0].token_ids == ref
    rejected = outs[1]
    assert rejected.finished
    assert rejected.error and fragment in rejected.error
    assert rejected.outputs[0].finish_reason == "error"
    assert rejected.outputs[0].token_ids == []
    _assert_clean(llm)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_bool_logprobs_in_batch_is_refused_and_the_others_run(llm, tiny_llama, field):
    """logprobs=True (a bool, which Python counts as an int) passed the check and reached the sampler's topk as k:
    a TypeError that failed the whole step, the batch's good requests with it. Now the request is refused, naming
    the field, and the others give HF transformers' greedy tokens."""
    import torch
    from conftest import hf_model

    good = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with pytest.raises(ValueError, match=rf"\b{field}\b"):
        SamplingParams(**{field: True})
    bad = SamplingParams(max_tokens=3)
    setattr(bad, field, True)  # (set afterwards, as vLLM scripts do: checked when queued)
    outs = llm.generate(["good one", "bad", "good two"], [good, bad, good])
    assert outs[1].error and field in outs[1].error and outs[1].outputs[0].finish_reason == "error"
    model = hf_model(tiny_llama)
    for out in (outs[0], outs[2]):
        assert out.error is None
        ids = torch.tensor([out.prompt_token_ids])
        want = model.generate(ids, max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=0)
        assert out.outputs[0].token_ids == want[0, ids.shape[1] :].tolist()
    _assert_clean(llm)


def test_all_bad_batch_raises_first_error(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate(["", "z" * 300, {"prompt_token_ids": [999999]}], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="300"):
        llm.generate(["z" * 300, ""], SamplingParams(max_tokens=4))
    _assert_clean(llm)
    # The engine still works afterwards.
    out = llm.generate("hello", SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
    _assert_clean(llm)


def test_engine_add_request_rejects_cleanly(llm):
    eng = llm.engine
    with pytest.raises(ValueError, match="empty"):
        eng.add_request("bad-1", "", SamplingParams(max_tokens=3))
    assert "bad-1" not in eng.requests
    _assert_clean(llm)
    eng.add_request("dup", "hello", SamplingParams(max_tokens=3))
    with pytest.raises(ValueError, match="dup"):
        eng.add_request("dup", "again", SamplingParams(max_tokens=3))
    assert eng.abort_request("dup")
    _assert_clean(llm)


# ---- abort -----------------------------------------------------------------------------------------------
def test_abort_after_a_step_frees_all_blocks(llm):
    eng = llm.engine
    eng.add_request("x", "hello", SamplingParams(max_tokens=50))
    eng.step()
    assert eng.block_manager.num_free_blocks < eng.block_manager.num_blocks
    assert eng.abort_request("x") is True
    _assert_clean(llm)
    assert eng.abort_request("x") is False  # already gone
    assert eng.step() == []


def test_abort_unknown_or_finished_id_returns_false(llm):
    eng = llm.engine
    assert eng.abort_request("no-such-request") is False
    eng.add_request("short", "hi", SamplingParams(max_tokens=1, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.abort_request("short") is False
    _assert_clean(llm)


def test_abort_waiting_and_multi_sample_requests(llm):
    eng = llm.engine
    eng.add_request("waiting", "never scheduled", SamplingParams(max_tokens=5))
    assert eng.abort_request("waiting") is True
    _assert_clean(llm)
    eng.add_request("many", "three samples", SamplingParams(n=3, max_tokens=40, ignore_eos=True))
    eng.add_request("other", "keeps running", SamplingParams(max_tokens=4, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.abort_request("many") is True
    done = {}
    while eng.has_unfinished_requests():
        for out in eng.step():
            done[out.request_id] = out
    assert set(done) == {"other"} and len(done["other"].outputs[0].token_ids) == 4
    _assert_clean(llm)
    # The id can be used again.
    eng.add_request("many", "again", SamplingParams(max_tokens=2, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()
    _assert_clean(llm)


def test_abort_during_chunked_prefill(tiny_llama):
    small = _load(tiny_llama, max_num_batched_tokens=16)
    eng = small.engine
    eng.add_request("long", "p" * 100, SamplingParams(max_tokens=5))
    assert eng.step() == []  # first 16-token chunk: nothing sampled yet
    assert eng.abort_request("long") is True
    _assert_clean(small)


# ---- LLM construction ------------------------------------------------------------------------------------
def test_unknown_model_path(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(FileNotFoundError) as info:
        _load(missing)
    assert str(missing) in str(info.value)


def test_folder_without_config_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        _load(tmp_path)


def test_invalid_config_json(tmp_path):
    path = make_checkpoint(tmp_path)
    (path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        _load(path)


def test_unsupported_architecture_lists_supported(tmp_path):
    path = make_checkpoint(tmp_path)
    cfg = read_config(path)
    cfg["architectures"] = ["GPT2LMHeadModel"]
    _write_config(path, cfg)
    with pytest.raises(ValueError) as info:
        _load(path)
    msg = str(info.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"):
        assert arch in msg


def test_missing_safetensors_file(tmp_path):
    path = make_checkpoint(tmp_path)
    (path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        _load(path)


@pytest.mark.parametrize("damage", ["garbage", "truncate_half", "truncate_header"])
def test_corrupt_safetensors_file(tmp_path, damage):
    path = make_checkpoint(tmp_path)
    f = path / "model.safetensors"
    data = f.read_bytes()
    if damage == "garbage":
        f.write_bytes(bytes((i * 37 + 11) % 256 for i in range(4096)))
    elif damage == "truncate_half":
        f.write_bytes(data[: len(data) // 2])
    else:
        f.write_bytes(data[:6])
    with pytest.raises(ValueError, match="model.safetensors"):
        _load(path)


def test_sharded_checkpoint_with_missing_shard(tmp_path):
    path = make_checkpoint(tmp_path, shard_size="20KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2
    (path / shards[1]).unlink()
    with pytest.raises(FileNotFoundError) as info:
        _load(path)
    assert shards[1] in str(info.value)


def test_sharded_checkpoint_loads_when_complete(tmp_path):
    path = make_checkpoint(tmp_path, shard_size="20KB")
    out = _load(path).generate("hi", SamplingParams(max_tokens=2, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 2


def _drop_tensor(path: Path, name: str) -> None:
    from safetensors.torch import load_file, save_file

    f = path / "model.safetensors"
    tensors = load_file(f)
    del tensors[name]
    save_file(tensors, f, metadata={"format": "pt"})


def test_missing_tensor_is_named(tmp_path):
    path = make_checkpoint(tmp_path)
    _drop_tensor(path, "model.norm.weight")
    with pytest.raises(ValueError, match=r"model\.norm\.weight"):
        _load(path)


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"])
def test_missing_packed_tensor_is_named_as_in_the_checkpoint(tmp_path, name):
    path = make_checkpoint(tmp_path)
    _drop_tensor(path, name)
    with pytest.raises(ValueError, match="missing") as info:
        _load(path)
    assert name in str(info.value)


def test_tensor_with_wrong_shape_is_named(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(tmp_path)
    f = path / "model.safetensors"
    tensors = load_file(f)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(31, 64)
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"k_proj\.weight") as info:
        _load(path)
    assert "(31, 64)" in str(info.value)


def test_mistral_sliding_window_shorter_than_max_model_len(tmp_path):
    """Refused while infertune had no window; now the window is exact (tests/test_sliding_window.py) and its blocks
    are freed as they leave it (tests/test_kv_groups.py): the start-up line gives the window's layer group."""
    path = make_checkpoint(tmp_path, "mistral", sliding_window=64)
    llm = _load(path, max_model_len=200, max_num_batched_tokens=32)
    assert llm.config.model.arch.layer_windows == (64, 64)
    line = llm.engine.describe_kv_cache()
    # with chunks of 32, a sequence touches at most ceil((64 - 1 + 32 - 1) / 16) + 1 = 7 blocks of 16
    assert "sliding window 64 (layers 0,1): 7 blocks = 112 tokens a sequence" in line


def test_unknown_engine_option():
    with pytest.raises(TypeError, match="foo"):
        LLM("unused-path", foo=1)


def test_unknown_engine_option_with_real_model(tiny_llama):
    with pytest.raises(TypeError, match="foo"):
        LLM(str(tiny_llama), foo=1)


def test_bad_dtype(tiny_llama):
    with pytest.raises(ValueError, match="dtype") as info:
        LLM(str(tiny_llama), dtype="int8")
    assert "int8" in str(info.value)


@pytest.mark.parametrize("style", ["rope_parameters", "rope_scaling"])
def test_unsupported_rope_scaling_is_refused(tmp_path, style):
    path = make_checkpoint(tmp_path)
    cfg = read_config(path)
    if style == "rope_parameters":  # transformers >= 5 layout
        cfg["rope_parameters"] = {
            "rope_type": "longrope",
            "factor": 2.0,
            "rope_theta": 10000.0,
            "original_max_position_embeddings": 128,
        }
    else:  # older layout
        cfg.pop("rope_parameters", None)
        cfg["rope_theta"] = 10000.0
        cfg["rope_scaling"] = {"type": "longrope", "factor": 2.0, "original_max_position_embeddings": 128}
    _write_config(path, cfg)
    with pytest.raises(ValueError, match="longrope"):
        _load(path)


@pytest.mark.parametrize(
    "kw, fragment",
    [
        (dict(max_model_len=1000), "max_position_embeddings"),
        (dict(max_model_len=0), "max_model_len"),
        (dict(block_size=3), "block_size"),
        (dict(device="tpu"), "device"),
        (dict(kv_cache_memory_bytes=1000), "kv_cache_memory_bytes"),
        (dict(max_num_seqs=0), "max_num_seqs"),
        (dict(enable_chunked_prefill=False, max_num_batched_tokens=64), "max_num_batched_tokens"),
    ],
)
def test_bad_engine_options(tiny_llama, kw, fragment):
    with pytest.raises(ValueError, match=fragment):
        _load(tiny_llama, **kw)


def test_missing_tokenizer(tmp_path):
    path = make_checkpoint(tmp_path)
    for f in list(path.iterdir()):
        if f.name.startswith(("tokenizer", "chat_template")):
            f.unlink()
    with pytest.raises(ValueError, match="tokenizer"):
        _load(path)


def test_a_group_size_that_does_not_divide_a_layer_names_that_layer(tmp_path):
    """quantization="w4a16" with a group size that does not divide one layer's inputs: the error names the layer
    (here Qwen2-MoE's shared expert, whose down_proj takes shared_expert_intermediate_size = 48 inputs, from the
    config: every other layer takes 64 or 32), not just the number."""
    path = make_checkpoint(
        tmp_path / "m",
        "qwen2_moe",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
    )
    assert read_config(path)["shared_expert_intermediate_size"] == 48
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.shared_expert\.down_proj: in_features=48 is not"):
        LLM(str(path), dtype="float32", quantization="w4a16", quant_group_size=32)
    LLM(
        str(path),
        dtype="float32",
        quantization="w4a16",
        quant_group_size=32,
        keep_fp=("lm_head", "*shared_expert.down_proj"),
    )
