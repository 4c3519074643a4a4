"""KV compression (kv_compression.py, layers/attention/press.py): the tokens each layer and KV head keeps equal a
reference implementation of kvpress's algorithms written here (kvpress itself pins transformers < 5.3, so its
StreamingLLMPress / SnapKVPress / PyramidKVPress scoring is mirrored below from its source, over HF transformers'
own queries and cache); the next token's logits after compression equal HF's on a DynamicCache holding the same
kept K/V (the next token fed at its true position) and greedy decoding goes on alike; a compressed sequence holds
ceil(kept / block) blocks per group, never registers in the prefix cache, and leaks nothing after finish / abort /
preemption; the policy picks full below its length threshold and the press above; bad configs are clear errors."""

from __future__ import annotations

import argparse
import math

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_model, make_checkpoint

from infertune import LLM, SamplingParams
from infertune.config import CacheConfig, EngineConfig, SchedulerConfig
from infertune.engine.kv_cache_coordinator import KVCacheCoordinator
from infertune.engine.scheduler import Scheduler
from infertune.engine.sequence import Sequence
from infertune.kv_compression import KVCompressionConfig
from infertune.scheduler_output import KVCacheGroup, kv_cache_groups

BS = 4
N = 61  # prompt tokens: several blocks, and a last chunk of 13 < window_size with chunks of 16
SNAP = {"press": "snapkv", "compression_ratio": 0.5, "window_size": 16, "kernel_size": 5}
STREAM = {"press": "streaming_llm", "compression_ratio": 0.6, "n_sink": 4}
PYRAMID = {"press": "pyramidkv", "compression_ratio": 0.5, "window_size": 4, "kernel_size": 3, "beta": 2}


# ----------------------------------------------------------------------------- kvpress, mirrored as the oracle
def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def ref_scores(press: dict, hf, layer: int, hidden: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """kvpress's score(...) for one layer: hidden [1, n, hidden] (the layer's input), keys [1, Hkv, n, D] (after
    rotary, HF's cache) -> [1, Hkv, n]."""
    _, hkv, n, d = keys.shape
    if press["press"] == "streaming_llm":  # StreamingLLMPress.score
        n_pruned = n - int(n * (1 - press["compression_ratio"]))
        scores = torch.ones_like(keys[..., 0])
        scores[:, :, press["n_sink"] : press["n_sink"] + n_pruned] = 0
        return scores
    # SnapKVPress.compute_window_attention + score
    w, kernel = press["window_size"], press["kernel_size"]
    mod = hf.model.layers[layer]
    cfg = hf.config
    h = cfg.num_attention_heads
    normed = mod.input_layernorm(hidden)
    q = mod.self_attn.q_proj(normed[:, -w:]).view(1, w, h, d).transpose(1, 2)  # get_query_states
    cos, sin = hf.model.rotary_emb(normed, torch.arange(n).unsqueeze(0))
    cos, sin = cos[:, -w:], sin[:, -w:]
    q = q * cos.unsqueeze(1) + rotate_half(q) * sin.unsqueeze(1)
    groups = h // hkv
    k = keys[:, :, None].expand(1, hkv, groups, n, d).reshape(1, h, n, d)  # repeat_kv
    attn = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(d)
    mask = torch.triu(torch.ones_like(attn) * float("-inf"), diagonal=n - w + 1)
    attn = F.softmax(attn + mask, dim=-1, dtype=torch.float32).to(q.dtype)[..., :-w]
    scores = attn.mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel, padding=kernel // 2, stride=1)
    scores = scores.view(1, hkv, groups, n - w).mean(2)
    return F.pad(scores, (0, w), value=scores.max().item())


def ref_budget(press: dict, layer: int, num_layers: int, n: int) -> int:
    """ScorerPress.compress's n_kept, or PyramidKVPress.get_layer_budget."""
    r = press["compression_ratio"]
    if press["press"] != "pyramidkv":
        return max(1, int(n * (1 - r)))
    w, beta = press["window_size"], press["beta"]
    cap = w + n * (1 - r)
    lo = (cap - w) / beta
    hi = (cap - w) * 2 - lo
    if hi >= n - w:
        hi = n - w
        lo = (cap - w) * 2 - hi
    if not (n >= hi >= lo >= w):
        return round(n * (1 - r))
    steps = (hi - lo) / (num_layers - 1)
    return round(hi - layer * steps)


def ref_kept(press: dict, hf, prompt: list[int]):
    """Per layer: the kept token indices per KV head (sorted), and HF's full K / V [1, Hkv, n, D]."""
    with torch.no_grad():
        out = hf(torch.tensor([prompt]), use_cache=True, output_hidden_states=True)
    cache = out.past_key_values
    kept = []
    for layer in range(hf.config.num_hidden_layers):
        keys, values = cache.layers[layer].keys, cache.layers[layer].values
        scores = ref_scores(press, hf, layer, out.hidden_states[layer], keys)
        n_kept = ref_budget(press, layer, hf.config.num_hidden_layers, len(prompt))
        idx = scores.topk(n_kept, dim=-1).indices[0].sort(dim=-1).values  # [Hkv, n_kept]
        kept.append((idx, keys, values))
    return kept


# ------------------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("llama-kvc"), "llama", std=0.2, num_hidden_layers=3)
    return path, hf_model(path)


def prompt_of(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 250, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_of(path, press, **kw):
    kw = {"dtype": "float32", "block_size": BS, "max_model_len": 200, "max_num_batched_tokens": 16, **kw}
    return LLM(str(path), kv_compression=press, **kw).engine


def run_prefill(engine, prompt, max_tokens=6, req="r"):
    """Step until req's prefill is done (its first token out); returns the runner and its state of req."""
    engine.add_request(req, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=max_tokens))
    runner = engine.executor.runner
    seq_id = None
    while True:
        outs = engine.step()
        if any(o.request_id == req and o.outputs[0].token_ids for o in outs):
            break
    seq_id = next(s.seq_id for s in engine.scheduler.running if s.request_id == req)
    return runner, runner.requests.requests[str(seq_id)], seq_id


def cache_rows(runner, state, layer: int, count: int, which: int = 0) -> torch.Tensor:
    """K (0) or V (1) of slots 0 .. count - 1 of layer's group table: [count, Hkv, D] in the compute dtype."""
    g = runner._group_of_layer[layer]
    table = state.block_tables[g]
    slots = torch.tensor([table[s // BS] * BS + s % BS for s in range(count)])
    return runner.attn._read_slots(runner.kv_caches[layer], which, slots)


# ------------------------------------------------------------------------------------ kept tokens vs kvpress
@pytest.mark.parametrize("press", [STREAM, SNAP, PYRAMID], ids=["streaming_llm", "snapkv", "pyramidkv"])
def test_kept_tokens_per_layer_and_head_equal_kvpress(llama, press):
    """Chunked prefill (16-token chunks; SnapKV's 16 queries span the last two): per layer and KV head the cache's
    first kept slots hold exactly the K and V of the tokens kvpress keeps, in order; each group's block table is
    cut to ceil(kept / block)."""
    path, hf = llama
    prompt = prompt_of(N)
    engine = engine_of(path, press)
    runner, state, seq_id = run_prefill(engine, prompt)
    ref = ref_kept(press, hf, prompt)
    seq = next(s for s in engine.scheduler.running if s.seq_id == seq_id)
    for layer, (idx, keys, values) in enumerate(ref):
        g = runner._group_of_layer[layer]
        kept = idx.shape[1]
        assert state.kv_kept[g] == kept == N - state.num_evicted[g]
        ours_k = cache_rows(runner, state, layer, kept, 0)  # [kept, Hkv, D]
        ours_v = cache_rows(runner, state, layer, kept, 1)
        for h in range(keys.shape[1]):
            # the positions our rows hold: the HF key each row equals (keys are distinct random vectors)
            dist = (ours_k[:, h, None, :] - keys[0, h][None]).abs().amax(-1)  # [kept, n]
            assert dist.min(-1).values.max() < 1e-4
            assert dist.argmin(-1).tolist() == idx[h].tolist(), (layer, h)
            torch.testing.assert_close(ours_v[:, h], values[0, h, idx[h]], atol=1e-4, rtol=1e-4)
        # the engine's table for the group was cut to the kept tokens' blocks (+ one for the next token once decoding)
        assert len(seq.block_tables[g]) <= -(-(kept + 1) // BS)
    if press is PYRAMID:  # a budget per layer: one KV cache group each
        assert len({state.kv_kept[runner._group_of_layer[i]] for i in range(3)}) == 3


@pytest.mark.parametrize("press", [STREAM, SNAP], ids=["streaming_llm", "snapkv"])
def test_logits_after_compression_equal_hf_on_the_kept_cache(llama, press):
    """The first decode step after compression: its logits equal HF's fed the same token at its true position over
    a DynamicCache of the kept K / V (fp32, within 1e-3); then 4 more greedy tokens agree."""
    from transformers import DynamicCache

    path, hf = llama
    prompt = prompt_of(N, seed=1)
    engine = engine_of(path, press)
    runner = engine.executor.runner
    logged = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda h, fp32=True: logged.append(compute(h)) or logged[-1]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    outs = []
    while engine.has_unfinished_requests():
        outs += engine.step()
    tokens = [o for o in outs if o.finished][0].outputs[0].token_ids
    assert len(tokens) == 6
    cache = DynamicCache(config=hf.config)
    for layer, (idx, keys, values) in enumerate(ref_kept(press, hf, prompt)):
        gather = idx[None, :, :, None].expand(1, *idx.shape, keys.shape[-1])
        cache.update(keys.gather(2, gather), values.gather(2, gather), layer)
    pos, expect, hf_tokens = N, None, []
    with torch.no_grad():
        for i, t in enumerate(tokens[:-1]):
            logits = hf(torch.tensor([[t]]), cache=cache, position_ids=torch.tensor([[pos]]), use_cache=True).logits
            if i == 0:
                expect = logits[0, -1]
            hf_tokens.append(int(logits[0, -1].argmax()))
            pos += 1
    ours = logged[-5]  # the decode steps' logits: the first after the prefill's is logged[-5]
    torch.testing.assert_close(ours[0], expect, atol=1e-3, rtol=0)
    assert hf_tokens == list(tokens[1:])


# ------------------------------------------------------------------------- dtypes, batches, blocks, leaks
@pytest.mark.parametrize("kv", ["bf16", "int8"])
def test_compressed_rows_are_the_uncompressed_caches_rows(llama, kv):
    """bf16 weights and an int8 KV cache: the kept slots hold exactly (bit for bit) rows of the same run without
    compression (the int8 rows with their scales), StreamingLLM's: the sinks, then the most recent tokens. (bf16:
    decode_kernels "linear" in both runs, as an engine with the fused decode step, which compression turns off,
    prefills through other kernels and so other roundings.)"""
    path, _ = llama
    kw = {"dtype": "bfloat16", "decode_kernels": "linear"} if kv == "bf16" else {"kv_cache_dtype": "int8"}
    prompt = prompt_of(N, seed=2)
    full_runner, full_state, _ = run_prefill(engine_of(path, None, **kw), prompt)
    runner, state, _ = run_prefill(engine_of(path, STREAM, **kw), prompt)
    kept = state.kv_kept[0]
    want = list(range(4)) + list(range(N - (kept - 4), N))
    for layer in range(3):
        for which in (0, 1):
            full = cache_rows(full_runner, full_state, layer, N, which)
            ours = cache_rows(runner, state, layer, kept, which)
            assert torch.equal(ours, full[want])


def test_batch_of_many_equals_each_alone(llama):
    """Three prompts of different lengths (one too short to compress) decoded together give each one's tokens
    alone; every block comes back."""
    path, _ = llama
    prompts = [prompt_of(61, 3), prompt_of(10, 4), prompt_of(45, 5)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = []
    for p in prompts:
        llm = LLM(str(path), dtype="float32", block_size=BS, max_model_len=200, kv_compression=SNAP)
        alone.append(llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)[0].outputs[0].token_ids)
    llm = LLM(str(path), dtype="float32", block_size=BS, max_model_len=200, kv_compression=SNAP)
    together = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    assert together == alone
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_compression_frees_blocks_so_more_sequences_fit(llama):
    """A pool of 48 blocks (192 tokens): four 61-token prompts with 8 tokens to go do not fit at once in full
    attention (16-18 blocks each, and they preempt); at ratio 0.5 each holds 8-10 blocks after its prefill, so
    all four decode side by side with no preemption. Nothing leaks either way."""
    path, _ = llama
    kv_bytes = 3 * 2 * 2 * 16 * 4 * BS * 48  # fp32: 3 layers x (K, V) x 2 KV heads x 16 x 4 bytes a token
    prompts = [prompt_of(61, 10 + i) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    peak = {}
    for name, press in (("full", None), ("snapkv", SNAP)):
        engine = engine_of(path, press, kv_cache_memory_bytes=kv_bytes, max_num_batched_tokens=64, max_model_len=80)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": p}, params)
        running = []
        while engine.has_unfinished_requests():
            engine.step()
            running.append(sum(s.num_output_tokens > 1 for s in engine.scheduler.running))
        peak[name] = (max(running), engine.scheduler.num_preemptions)
        assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert peak["snapkv"] == (4, 0)
    assert peak["full"][0] < 4


def test_preemption_recomputes_and_compresses_again(llama):
    """A pool so small that sequences preempt: a preempted sequence comes back whole and is compressed again over
    its prompt and outputs so far (its new plan), all finish with max_tokens, and no block leaks."""
    path, _ = llama
    kv_bytes = 3 * 2 * 2 * 16 * 4 * BS * 22
    engine = engine_of(path, SNAP, kv_cache_memory_bytes=kv_bytes, max_num_batched_tokens=64, max_model_len=80)
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    for i in range(3):
        engine.add_request(str(i), {"prompt_token_ids": prompt_of(50, 20 + i)}, params)
    outs = []
    replans = []
    while engine.has_unfinished_requests():
        outs += engine.step()
        for s in engine.scheduler.running:
            if s.num_preemptions and s.num_evicted is not None:
                prefill = s.kv_kept[0] + s.num_evicted[0]  # what it compressed: prompt and outputs then
                assert s.kv_kept[0] == int(prefill * 0.5)
                replans.append(prefill)
    assert engine.scheduler.num_preemptions > 0
    assert replans and max(replans) > 50, "a preempted sequence is compressed again over its outputs too"
    assert sorted(len(o.outputs[0].token_ids) for o in outs if o.finished) == [30, 30, 30]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_abort_mid_prefill_and_after_compression_frees_everything(llama):
    path, _ = llama
    engine = engine_of(path, SNAP)
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": prompt_of(61, 30)}, params)
    engine.add_request("b", {"prompt_token_ids": prompt_of(61, 31)}, params)
    engine.step()  # "a" mid-prefill (16-token chunks)
    engine.abort_request("a")
    while not any(s.num_evicted for s in engine.scheduler.running):
        engine.step()
    engine.step()
    engine.abort_request("b")
    engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_compressed_sequences_skip_the_prefix_cache(llama):
    """The same prompt twice: compressed, the second run hits nothing (its KV was rewritten in place, so it no
    longer matches the token hashes, and nothing was registered); below the policy's length threshold (full
    attention) the second run hits the first's blocks."""
    path, _ = llama
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    policy = {"policy": [{"max_length": 64, "press": "none"}, SNAP]}
    for press, length, hits in ((SNAP, 61, False), (policy, 61, True), (policy, 70, False)):
        llm = LLM(str(path), dtype="float32", block_size=BS, max_model_len=200, kv_compression=press)
        p = prompt_of(length, 41)
        llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)
        llm.generate({"prompt_token_ids": p}, params, use_tqdm=False)
        bm = llm.engine.block_manager
        assert (bm.prefix_hits > 0) == hits, (press, length)
        assert not any(b.hash is not None for b in bm.blocks) or hits


# ----------------------------------------------------------------------------- the policy, pure Python
RECIPE = {
    "policy": [
        {"layers": "0-1", "window": 128},
        {"max_length": 4096, "press": "none"},
        {"press": "snapkv", "compression_ratio": 0.25},
    ]
}


def test_the_policy_picks_full_below_the_threshold_and_the_press_above():
    cfg = KVCompressionConfig.from_dict(RECIPE)
    assert cfg.layer_windows(None, 6) == (128, 128, None, None, None, None)
    for layer in range(2, 6):
        assert cfg.press_for(layer, 4096) is None and cfg.kept_tokens(layer, 6, 4096) == 4096
        assert cfg.press_for(layer, 4097).name == "snapkv"
        assert cfg.kept_tokens(layer, 6, 8000) == int(8000 * 0.75)
    assert cfg.press_for(0, 9000) is None  # a windowed layer is never pressed
    groups = kv_cache_groups(cfg.layer_windows(None, 6), 6, 32768, tuple(cfg.layer_key(i) for i in range(6)))
    # (4 compressed layers to 2 windowed: cut into groups of 2, a block 2 layers' pages)
    assert [(g.window, g.layers, g.compressed) for g in groups] == [
        (None, (2, 3), True),
        (None, (4, 5), True),
        (128, (0, 1), False),
    ]
    assert cfg.plan(groups, 4000) is None
    assert cfg.plan(groups, 8000) == [6000, 6000, 8000]
    # per-layer ratios: one kind of group per budget (2 layers to 1: groups of one layer); pyramid: one per layer
    per_layer = KVCompressionConfig.from_dict({**SNAP, "layer_ratios": [0.5, 0.5, 0.25]})
    groups = kv_cache_groups(None, 3, 200, tuple(per_layer.layer_key(i) for i in range(3)))
    assert [g.layers for g in groups] == [(0,), (1,), (2,)]
    assert per_layer.plan(groups, 100) == [50, 50, 75]
    groups = kv_cache_groups(None, 3, 200, tuple(per_layer.layer_key(i) for i in range(3)), max_groups=2)
    assert [g.layers for g in groups] == [(0, 1), (2,)]
    assert per_layer.plan(groups, 100) == [50, 75]


def test_the_seeds_recipe_runs_end_to_end(llama):
    """The recipe on the tiny model (threshold 40): a 30-token prompt stays whole (its layers' slots = positions),
    a 61-token one is compressed in layer 2 while layers 0-1 keep a window of 8."""
    path, _ = llama
    recipe = {"policy": [{"layers": "0-1", "window": 8}, {"max_length": 40, "press": "none"}, SNAP]}
    engine = engine_of(path, recipe)
    runner = engine.executor.runner
    # (1 compressed layer to 2 windowed: groups of one layer each)
    groups = [(g.window, g.layers, g.compressed) for g in runner.kv_groups]
    assert groups == [(None, (2,), True), (8, (0,), False), (8, (1,), False)]
    _, short, _ = run_prefill(engine, prompt_of(30, 50), req="short")
    _, long, _ = run_prefill(engine, prompt_of(61, 51), req="long")
    assert short.kv_kept is None and short.num_evicted is None
    assert long.kv_kept == [30, 61, 61] and long.num_evicted == [31, 0, 0]


@pytest.mark.parametrize(
    "value, message",
    [
        ({"press": "snap"}, "is not one of ['none', 'pyramidkv', 'snapkv', 'streaming_llm']"),
        (
            {"press": "snapkv", "ratio": 0.5},
            "takes ['compression_ratio', 'kernel_size', 'layer_ratios', 'window_size']",
        ),
        ({"press": "streaming_llm", "compression_ratio": 1.0}, "compression_ratio=1.0 must be in [0, 1)"),
        ({"press": "snapkv", "window_size": 0}, "window_size=0 must be an integer >= 1"),
        ({"press": "snapkv", "kernel_size": 4}, "kernel_size=4 must be odd"),  # (an even one crashed the step)
        ({"compression_ratio": 0.5}, 'needs "press"'),
        ({"policy": [{"layers": "1-0", "window": 8}]}, "layers='1-0' is not a layer list; write \"0-1\""),
        ({"policy": [{"layers": "x", "press": "snapkv"}]}, "is not a layer list"),
        ({"policy": [{"window": 8, "max_length": 10}]}, 'a window rule takes "layers" and "window" only'),
        ({"policy": [{"max_length": 10}]}, 'a rule needs "press"'),
        ({"policy": []}, "non-empty list of rules"),
        ({"policy": [SNAP], "press": "snapkv"}, "a policy stands alone"),
        ({"press": "snapkv", "max_length": -1}, "max_length=-1 must be a positive integer"),
    ],
)
def test_bad_configs_are_clear_errors(value, message):
    with pytest.raises(ValueError) as e:
        CacheConfig(kv_compression=value)
    assert message in str(e.value)


def test_errors_against_the_model(llama):
    path, _ = llama
    with pytest.raises(ValueError, match=r"layer 5 does not exist; the model has layers 0-2"):
        EngineConfig.create(str(path), kv_compression={"policy": [{"layers": "4-5", "window": 8}]})
    with pytest.raises(ValueError, match="layer_ratios has 2 ratios; the model has 3 layers"):
        EngineConfig.create(str(path), kv_compression={**SNAP, "layer_ratios": [0.1, 0.2]})
    with pytest.raises(ValueError, match="does not run with speculative decoding"):
        EngineConfig.create(
            str(path), kv_compression=SNAP, speculative_config={"method": "ngram", "num_speculative_tokens": 2}
        )


# ------------------------------------------------------------------------------- blocks, pure Python
def test_a_compressed_sequence_holds_ceil_kept_over_block_blocks():
    """Scheduler + coordinator, no model: after the prefill step each group holds ceil(kept / 4) blocks (the full
    group its whole prompt), one more block only when the decoded tokens fill the last; finish returns all."""
    groups = (KVCacheGroup(None, (0,), True), KVCacheGroup(None, (1,), False))
    cfg = KVCompressionConfig.from_dict({**STREAM, "layer_ratios": [0.6, 0.0]})
    bm = KVCacheCoordinator(64, BS, [None, None], True, 16, lambda n: cfg.plan(groups, n))
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=16), bm)
    seq = Sequence(list(range(50)), 12)
    sched.add(seq)
    kept = max(1, int(50 * (1 - 0.6)))  # kvpress's count: 20
    while seq.num_output_tokens == 0:
        batch = sched.schedule()
        sched.update(batch, [7 if s else None for s in batch.sample])
    assert seq.kv_kept == [kept, 50] and seq.num_evicted == [30, 0]
    assert [len(t) for t in seq.block_tables] == [math.ceil(kept / BS), math.ceil(50 / BS)]
    while not seq.is_finished:
        batch = sched.schedule()
        slots = seq.num_computed_tokens + 1 - seq.num_evicted[0]
        assert len(seq.block_tables[0]) == math.ceil(slots / BS)
        sched.update(batch, [7 if s else None for s in batch.sample])
    assert bm.num_free_blocks == 64 and all(b.ref_count == 0 for b in bm.blocks)


# ------------------------------------------------------------------- tune: where compression starts to pay
def test_the_threshold_is_the_longest_length_where_the_press_does_not_pay():
    from infertune.tune.kv_threshold import pick_threshold, policy

    def rows(*pairs):
        return [{"length": n, "full_s": f, "press_s": p} for n, f, p in pairs]

    # slower up to 2048 (its scoring costs more than the reads it saves), faster from 4096 on
    assert pick_threshold(rows((512, 1.0, 1.2), (1024, 1.0, 1.1), (2048, 1.0, 1.01), (4096, 1.0, 0.8))) == 2048
    # a noisy win at 1024 below a loss at 2048 does not count: the press must pay at every longer length
    assert pick_threshold(rows((1024, 1.0, 0.9), (2048, 1.0, 1.1), (4096, 2.0, 1.0))) == 2048
    assert pick_threshold(rows((512, 1.0, 0.9), (1024, 1.0, 0.8))) is None
    assert policy(SNAP, None) == SNAP
    cfg = KVCompressionConfig.from_dict(policy(SNAP, 2048))
    assert cfg.press_for(0, 2048) is None and cfg.press_for(0, 2049).name == "snapkv"


def test_tune_writes_a_loadable_policy_for_a_policy_it_was_given():
    """--kv-compression may be a policy (the docs' seeds' recipe): the written config is one policy (it nested the
    user's inside its own, which no engine loads) that presses nothing up to the threshold and is the user's policy
    above it, its windows at every length."""
    from infertune.tune.kv_threshold import policy

    recipe = {"policy": [{"layers": "0-1", "window": 8}, {"max_length": 40, "press": "none"}, SNAP]}
    user = KVCompressionConfig.from_dict(recipe)
    written = KVCompressionConfig.from_dict(policy(recipe, 100))
    assert written.layer_windows(None, 4) == user.layer_windows(None, 4) == (8, 8, None, None)
    for layer in range(4):
        assert all(written.press_for(layer, n) is None for n in (1, 40, 41, 100))
        for n in (101, 500):
            assert written.press_for(layer, n) == user.press_for(layer, n)
    assert user.press_for(2, 41).name == "snapkv"  # (the threshold, not the user's 40, rules below 100)


def test_tune_writes_the_measured_policy_into_its_config(tmp_path, capsys):
    """infertune tune --kv-compression on the demo model: a tiny sweep, then one request per length with and without
    the press; the written config carries the policy, and LLM accepts it (the threshold itself is the machine's)."""
    import json

    from infertune.tune import command

    p = argparse.ArgumentParser()
    command.add_arguments(p)
    out = tmp_path / "cfg.json"
    sweep = "--input-len 8 --output-len 4 --max-batch 1 --batched-tokens 64 --dtype float32".split()
    kv = ["--kv-compression", json.dumps(SNAP), "--kv-threshold-lengths", "40,80"]
    assert command.run(p.parse_args([*sweep, "--out-config", str(out), *kv])) == 0
    text = capsys.readouterr().out
    assert "| prompt tokens | full: request s" in text and "KV compression threshold:" in text
    cfg = json.loads(out.read_text())
    kvc = KVCompressionConfig.from_dict(cfg["kv_compression"])
    assert kvc.presses[0].name == "snapkv"
    LLM(**cfg)
    with pytest.raises(ValueError, match="is not one of"):
        command.run(p.parse_args(["--kv-compression", '{"press": "snap"}']))


def test_a_worker_process_compresses_alike(llama):
    """The plan crosses the pipe (NewRequest.kv_kept): a worker process gives the in-process tokens."""
    path, _ = llama
    prompts = [{"prompt_token_ids": prompt_of(61, 60)}, {"prompt_token_ids": prompt_of(45, 61)}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    kw = dict(dtype="float32", block_size=BS, max_model_len=200, max_num_batched_tokens=16, kv_compression=SNAP)
    here = [o.outputs[0].token_ids for o in LLM(str(path), **kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(str(path), distributed_executor_backend="mp", **kw)
    try:
        there = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    finally:
        llm.engine.shutdown()
    assert there == here


@pytest.mark.parametrize("press", [SNAP, STREAM], ids=["snapkv", "streaming_llm"])
def test_the_fused_decode_step_runs_compressed_sequences(llama, press):
    """bf16 on the CPU's kernels: an engine that compresses keeps the fused step, and the decode steps of its
    compressed sequences run there (each reads its kept slots through its block table and context length, and
    rotates at its true position). Each decode step is also run through the modules (the per-op path, held to
    kvpress above) on the same cache: the two steps' logits agree to bf16 rounding, for the compressed sequences as
    for a short one the press leaves whole (relative max gaps). (Rotating at the kept slot's index instead of the
    position fails it.)"""
    from test_kernels import needs_fused

    if needs_fused.args[0]:
        pytest.skip(needs_fused.kwargs["reason"])
    path, _ = llama
    llm = LLM(str(path), kv_compression=press, dtype="bfloat16", block_size=BS, max_model_len=200)
    runner = llm.engine.executor.runner
    assert runner.fused is not None, "the fused step stays with compression"
    real, gaps = runner._forward, []

    def both(input_ids, positions, meta, out_rows=None):
        if meta.prefills or meta.press_rows is not None:
            return real(input_ids, positions, meta, out_rows)
        assert runner.fused.applicable(input_ids.shape[0], meta)
        fused = runner.fused(input_ids, positions, meta).clone()
        modules = runner.model(input_ids, positions, runner.kv_caches, meta)
        want = runner.model.compute_logits(modules)
        gap = (runner.model.compute_logits(fused) - want).abs().amax(1) / want.abs().amax(1)
        whole = int(meta.decode_context_lens.argmin())  # (the short prompt's row: the press keeps all of it)
        gaps.append((gap.max().item(), gap[whole].item()))
        return fused

    runner._forward = both
    prompts = [{"prompt_token_ids": prompt_of(n, 40 + n)} for n in (61, 45, 6)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)
    assert len(gaps) >= 7, gaps  # (every decode step)
    worst, whole = max(g for g, _ in gaps), max(w for _, w in gaps)
    assert worst <= 1.5 * whole + 0.01, gaps


def test_a_press_on_a_model_windowed_everywhere_is_said_to_do_nothing(tmp_path, caplog):
    import logging

    from infertune.config import EngineConfig

    ckpt = make_checkpoint(tmp_path / "mistral", "mistral", sliding_window=64)
    with caplog.at_level(logging.WARNING, logger="infertune.config"):
        EngineConfig.create(str(ckpt), kv_compression={"press": "snapkv", "compression_ratio": 0.5})
    assert "the press compresses nothing here" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infertune.config"):
        EngineConfig.create(str(ckpt), kv_compression={"press": "none"})  # (none asked for: nothing to say)
    assert "compresses nothing" not in caplog.text
