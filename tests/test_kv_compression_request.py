"""KV compression per request (SamplingParams.kv_compression, the OpenAI body's `kv_compression`).

Oracle: an engine started with the same press engine-wide (its kept tokens checked against kvpress's algorithm and
HF transformers in tests/test_kv_compression.py), and one started without compression: a request's press gives, token
for token (greedy), what the engine started with that press gives, whatever the engine's own default; {"press":
"none"} gives the full-KV engine's tokens. The blocks each sequence holds after its prefill are ceil(kept / block)
with kvpress's count for its own press (int(n * (1 - ratio))); a compressed request neither takes nor leaves prefix-
cache blocks, so a full-KV request after it still hits the earlier full-KV blocks, intact. Bad values are
ValueErrors naming the field in Python and 400s naming it over HTTP (the openai SDK's extra_body)."""

from __future__ import annotations

import math

import httpx
import openai
import pytest
import torch
from conftest import make_checkpoint
from server_utils import ServerThread

from infertune import LLM, SamplingParams
from infertune.config import EngineConfig
from infertune.engine.admission import check_kv_compression
from infertune.sampling_params import ParamError
from infertune.scheduler_output import KVCacheGroup

BS = 4
SNAP = {"press": "snapkv", "compression_ratio": 0.5, "window_size": 16, "kernel_size": 5}
STREAM = {"press": "streaming_llm", "compression_ratio": 0.6, "n_sink": 4}
PYRAMID = {"press": "pyramidkv", "compression_ratio": 0.5, "window_size": 4, "kernel_size": 3, "beta": 2}
NONE = {"press": "none"}
ENGINE = dict(dtype="float32", block_size=BS, max_model_len=200, max_num_batched_tokens=16)
GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("llama-kvc-req"), "llama", std=0.2, num_hidden_layers=3)


def prompt_of(n: int, seed: int) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PROMPTS = [prompt_of(61, 1), prompt_of(45, 2), prompt_of(53, 3)]


def generate(llm: LLM, prompts, presses) -> list[list[int]]:
    """Greedy tokens of prompts run together, each with its own kv_compression (None: the engine's)."""
    params = [SamplingParams(**GREEDY, kv_compression=p) for p in presses]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks and all(b.ref_count == 0 for b in bm.blocks)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def alone(path):
    """Per engine-wide press (None: no compression): the greedy tokens of PROMPTS, the engine's own policy."""
    out = {}
    for name, press in (("full", None), ("snapkv", SNAP), ("streaming_llm", STREAM)):
        out[name] = generate(LLM(str(path), kv_compression=press, **ENGINE), PROMPTS, [None] * len(PROMPTS))
    # the presses change the tokens: equal tokens below are evidence, not a coincidence of the tiny model
    assert (
        out["snapkv"] != out["full"] and out["streaming_llm"] != out["full"] and out["streaming_llm"] != out["snapkv"]
    )
    return out


@pytest.mark.parametrize(
    "default", [NONE, STREAM, PYRAMID], ids=["engine-none", "engine-streaming_llm", "engine-pyramidkv-per-layer"]
)
def test_a_request_press_gives_the_tokens_of_an_engine_started_with_it(path, alone, default):
    """SnapKV asked per request, in an engine whose default keeps full KV, runs another press, or groups its layers
    per layer (PyramidKV's budgets): the tokens of the engine started with SnapKV."""
    llm = LLM(str(path), kv_compression=default, **ENGINE)
    assert generate(llm, PROMPTS, [SNAP] * len(PROMPTS)) == alone["snapkv"]


def test_press_none_in_a_compressing_engine_gives_the_full_kv_tokens(path, alone):
    llm = LLM(str(path), kv_compression=SNAP, **ENGINE)
    assert generate(llm, PROMPTS, [NONE] * len(PROMPTS)) == alone["full"]


def test_different_presses_in_one_batch_each_match_their_engine(path, alone):
    """Four requests decoded side by side: SnapKV, StreamingLLM, none and a policy (full up to 50 prompt tokens,
    SnapKV above), in an engine whose default is none. Each gives its single-policy engine's tokens, and right after
    its prefill holds ceil(kept / block) blocks with kvpress's count of its own press."""
    policy = {"policy": [{"max_length": 50, "press": "none"}, SNAP]}
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], PROMPTS[1], PROMPTS[0]]
    presses = [SNAP, STREAM, NONE, policy, policy]
    want = [alone["snapkv"][0], alone["streaming_llm"][1], alone["full"][2], alone["full"][1], alone["snapkv"][0]]
    llm = LLM(str(path), kv_compression=NONE, **ENGINE)
    assert generate(llm, prompts, presses) == want

    # the blocks each holds once its prefill is done: its own press's count (kvpress: int(n * (1 - ratio)))
    engine = llm.engine
    kept = [int(61 * (1 - 0.5)), int(45 * (1 - 0.6)), 53, 45]  # SnapKV, StreamingLLM, none, the policy below 50
    for i, (prompt, press) in enumerate(zip(prompts[:4], presses)):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, SamplingParams(**GREEDY, kv_compression=press))
    held = {}
    while len(held) < len(kept):
        for out in engine.step():
            if out.request_id not in held and out.outputs[0].token_ids:
                seq = next(s for s in engine.scheduler.running if s.request_id == out.request_id)
                held[out.request_id] = (len(seq.block_table), seq.num_evicted)
    for i, (prompt, k) in enumerate(zip(prompts, kept)):
        evicted = [len(prompt) - k] if k < len(prompt) else None
        assert held[str(i)] == (math.ceil(k / BS), evicted), (i, held)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preemption_replans_by_the_requests_own_press(path):
    """A pool so small that sequences preempt: a preempted request comes back whole and is compressed again by its
    own press over its prompt and outputs so far; the tokens equal those of an engine started with that press on the
    same pool (the same blocks freed, so the same schedule), and nothing leaks."""
    kv_bytes = 3 * 2 * 2 * 16 * 4 * BS * 14  # 14 blocks: fp32, 3 layers x (K, V) x 2 KV heads x 16 a token
    kw = {**ENGINE, "kv_cache_memory_bytes": kv_bytes, "max_num_batched_tokens": 64, "max_model_len": 56}
    prompts = [prompt_of(36, 20 + i) for i in range(3)]
    runs = {}
    for name, default, own in (("engine", SNAP, None), ("request", NONE, SNAP)):
        engine = LLM(str(path), kv_compression=default, **kw).engine
        for i, p in enumerate(prompts):
            engine.add_request(
                str(i), {"prompt_token_ids": p}, SamplingParams(**{**GREEDY, "max_tokens": 16}, kv_compression=own)
            )
        outs, replans = {}, []
        while engine.has_unfinished_requests():
            for o in engine.step():
                outs[o.request_id] = o.outputs[0].token_ids
            for seq in engine.scheduler.running:
                if seq.num_preemptions and seq.num_evicted is not None:
                    prefill = seq.kv_kept[0] + seq.num_evicted[0]  # what it compressed: prompt and outputs then
                    assert seq.kv_kept[0] == int(prefill * (1 - 0.5))
                    replans.append(prefill)
        assert engine.scheduler.num_preemptions > 0 and max(replans) > 36, name
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
        runs[name] = [outs[str(i)] for i in range(3)]
    assert runs["request"] == runs["engine"] and all(len(t) == 16 for t in runs["request"])


def test_bf16_with_the_fused_step_a_request_press_still_gives_its_engines_tokens(path):
    """bf16, where the CPU's kernels build the fused step (kept with or without a default press): a request's press
    takes the same paths as in an engine started with it (the fused step for its decode rows and for the prompt
    steps that record no queries, the per-op path for those that do), so SnapKV and StreamingLLM asked per request,
    side by side, give those engines' tokens."""
    kw = {**ENGINE, "dtype": "bfloat16", "max_num_batched_tokens": 128}
    want = [
        generate(LLM(str(path), kv_compression=press, **kw), PROMPTS[:2], [None, None])[i]
        for i, press in enumerate((SNAP, STREAM))
    ]
    llm = LLM(str(path), kv_compression=NONE, **kw)
    runner = llm.engine.executor.runner
    assert runner.decode_kernels is None or runner.fused is not None, "the fused step stays with a none default"
    assert generate(llm, PROMPTS[:2], [SNAP, STREAM]) == want


def test_prefix_cache_hits_only_full_kv_and_survives_a_compressed_request(path, alone):
    """In a SnapKV engine: a full-KV request ("none") registers its prompt's blocks; a second one hits them; a
    compressed request of the same prompt takes no hit (its KV is rewritten in place) and registers nothing, yet
    gives SnapKV's tokens; a full-KV request after it still hits and still gives the full engine's tokens (the cached
    blocks were not touched by the press)."""
    llm = LLM(str(path), kv_compression=SNAP, **ENGINE)
    bm = llm.engine.block_manager
    p = PROMPTS[0]
    assert generate(llm, [p], [NONE]) == [alone["full"][0]]
    hashed = {b.block_id for b in bm.blocks if b.hash is not None}
    assert hashed and bm.prefix_hits == 0
    assert generate(llm, [p], [NONE]) == [alone["full"][0]]
    hits = bm.prefix_hits
    assert hits > 0
    assert generate(llm, [p], [None]) == [alone["snapkv"][0]]  # the engine's own press
    assert generate(llm, [p], [SNAP]) == [alone["snapkv"][0]]
    assert bm.prefix_hits == hits, "a compressed request must not take full-KV prefix blocks"
    assert {b.block_id for b in bm.blocks if b.hash is not None} <= hashed
    assert generate(llm, [p], [NONE]) == [alone["full"][0]]
    assert bm.prefix_hits > hits


# ------------------------------------------------------------------------------------------- bad values
@pytest.mark.parametrize(
    "value, fragment",
    [
        ({"press": "snap"}, "is not one of"),
        ("snapkv", "must be a dict"),
        ({"press": "snapkv", "compression_ratio": 1.5}, "must be in [0, 1)"),
        ({"press": "snapkv", "window_size": 0}, "window_size=0"),
        ({"press": "none", "n_sink": 4}, "takes no parameters"),
        ({"policy": [{"layers": "0", "window": 8}]}, "cannot add window rules"),
        ({"compression_ratio": 0.5}, 'needs "press"'),
    ],
)
def test_bad_values_are_value_errors_naming_the_field(value, fragment):
    with pytest.raises(ValueError, match="kv_compression") as e:
        SamplingParams(kv_compression=value)
    assert fragment in str(e.value) and e.value.param == "kv_compression"


def test_what_the_engine_cannot_run_is_a_value_error_at_admission(path):
    """Against the engine: no kv_compression at start-up, a layer the model lacks, per-layer budgets over one block
    table; spec decode / MLA engines (no kv_compression there) say which. The engine is left unchanged."""
    plain = LLM(str(path), dtype="float32", block_size=BS, max_model_len=200)
    with pytest.raises(ValueError, match="started without kv_compression") as e:
        plain.engine.add_request("a", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(kv_compression=SNAP))
    assert e.value.param == "kv_compression"
    plain.engine.add_request("b", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(kv_compression=NONE))  # full KV
    engine = LLM(str(path), kv_compression=NONE, **ENGINE).engine
    for value, fragment in (
        ({**SNAP, "layers": "0-5"}, "layer 5 does not exist"),
        ({**SNAP, "layer_ratios": [0.5, 0.5]}, "has 2 ratios; the model has 3 layers"),
        (PYRAMID, "different token counts in layers 0 and 1"),
        ({"policy": [{"layers": "1-2", **SNAP}]}, "different token counts in layers 0 and 1"),
    ):
        with pytest.raises(ValueError, match="kv_compression") as e:
            engine.add_request("x", {"prompt_token_ids": PROMPTS[0]}, SamplingParams(kv_compression=value))
        assert fragment in str(e.value) and e.value.param == "kv_compression", value
    assert not engine.has_unfinished_requests() and not engine.scheduler.waiting
    # the same layer shapes run where the engine's own press split its groups alike (one group per layer)
    pyramid = LLM(str(path), kv_compression=PYRAMID, **ENGINE)
    assert len(pyramid.engine.executor.kv_cache_info.groups) == 3
    some = {"policy": [{"layers": "1-2", **SNAP}]}
    want = generate(LLM(str(path), kv_compression=some, **ENGINE), [PROMPTS[0]], [None])
    assert generate(pyramid, [PROMPTS[0]], [some]) == want
    spec = EngineConfig.create(str(path), speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    groups = (KVCacheGroup(None, (0, 1, 2)),)
    with pytest.raises(ParamError, match="runs speculative decoding, which KV compression does not run with"):
        check_kv_compression(SamplingParams(kv_compression=SNAP).kv_compression, spec, groups)


# ------------------------------------------------------------------------------------------ over HTTP
@pytest.fixture(scope="module")
def server(path):
    with ServerThread(path, kv_compression=NONE, max_model_len=128, max_num_batched_tokens=16) as s:
        yield s


def test_the_server_applies_the_body_field_and_refuses_bad_values(path, server):
    """completions and chat with extra_body={"kv_compression": ...} give the offline engine's text for that press
    (one started with it engine-wide); bad values are 400s naming kv_compression."""
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    prompt = "The key and value cache of a long prompt, compressed after its prefill."  # 71 byte tokens
    messages = [{"role": "user", "content": "Which tokens does SnapKV keep of this prompt?"}]
    greedy = dict(temperature=0, max_tokens=10)
    offline = {}
    for name, press in (("snapkv", SNAP), ("full", None)):
        llm = LLM(str(path), kv_compression=press, **{**ENGINE, "max_model_len": 128})
        params = SamplingParams(**greedy, ignore_eos=True)
        offline[name] = (
            llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text,
            llm.chat(messages, params)[0].outputs[0].text,
        )
    assert offline["snapkv"] != offline["full"]
    for name, body in (("snapkv", SNAP), ("full", NONE)):
        extra = {"ignore_eos": True, "kv_compression": body}
        r = client.completions.create(model="tiny", prompt=prompt, extra_body=extra, **greedy)
        c = client.chat.completions.create(model="tiny", messages=messages, extra_body=extra, **greedy)
        assert (r.choices[0].text, c.choices[0].message.content) == offline[name], name

    chat = client.chat.completions.create
    for body, fragment in (
        ({"press": "snap"}, "is not one of"),
        ({"press": "snapkv", "compression_ratio": 2}, "must be in [0, 1)"),
        (PYRAMID, "different token counts"),
        ({"policy": [{"window": 8}]}, "cannot add window rules"),
    ):
        for create, shape in ((client.completions.create, {"prompt": prompt}), (chat, {"messages": messages})):
            with pytest.raises(openai.BadRequestError) as e:
                create(model="tiny", extra_body={"kv_compression": body}, **shape)
            err = e.value.body
            assert err["param"] == "kv_compression" and fragment in err["message"], (body, err)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "kv_compression": "snapkv"}, timeout=30)
    assert r.status_code == 400 and "kv_compression" in str(r.json()["error"])
