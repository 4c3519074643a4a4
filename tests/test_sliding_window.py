"""Sliding-window attention, exact: the per-layer windows read from each family's config (transformers' own config
classes as the oracle), the paged backends' banded masks against a brute-force fp64 attention, and Mistral / Qwen2
models with short windows against HF transformers (eager, fp32) on prompts and decodes several windows long."""

from __future__ import annotations

import functools
import json
import math
import random
import shutil

import pytest
import torch
from conftest import hf_model, make_checkpoint, read_config
from parity_utils import assert_mode_matches, assert_teacher_forced

from infertune import LLM, SamplingParams
from infertune.config import ArchConfig
from infertune.layers.attention import AttentionMetadata, Int8PagedAttention, PrefillChunk, TorchPagedAttention
from infertune.layers.attention.sdpa import reference_causal_attention

# ------------------------------------------------------------------------------------------- config: which layers


def _hf_windows(cfg) -> tuple:
    """Per layer, the window transformers' modeling applies: the layer_types (where the family has them, else every
    layer) with the config's sliding_window after its own __post_init__ (0 or None: no window)."""
    kinds = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    window = getattr(cfg, "sliding_window", None) or None  # (Llama has none)
    return tuple(window if kind == "sliding_attention" else None for kind in kinds)


CONFIGS = {
    "mistral": ("MistralConfig", dict(sliding_window=24)),
    "mistral-no-window": ("MistralConfig", dict(sliding_window=None)),
    "mixtral": ("MixtralConfig", dict(sliding_window=24)),
    "qwen2-off": ("Qwen2Config", dict(sliding_window=24, max_window_layers=2)),  # use_sliding_window false
    "qwen2": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=24, max_window_layers=2)),
    "qwen2-all": ("Qwen2Config", dict(use_sliding_window=True, sliding_window=24, max_window_layers=0)),
    "qwen3": ("Qwen3Config", dict(use_sliding_window=True, sliding_window=24, max_window_layers=3)),
    "qwen2-moe": ("Qwen2MoeConfig", dict(use_sliding_window=True, sliding_window=24, max_window_layers=4)),
    "qwen3-moe": ("Qwen3MoeConfig", dict(use_sliding_window=True, sliding_window=24)),
    "gemma2": ("Gemma2Config", dict(sliding_window=24)),
    "gemma3": ("Gemma3TextConfig", dict(sliding_window=24, sliding_window_pattern=3)),
    "gemma3-default-pattern": ("Gemma3TextConfig", dict(sliding_window=24)),
    "llama": ("LlamaConfig", dict()),
}


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("layer_types", ["kept", "dropped"])
def test_layer_windows_are_transformers(name, layer_types):
    """With the layer_types a saved config has, and without them (older Hub configs): transformers' windows."""
    import transformers

    cls_name, kw = CONFIGS[name]
    cfg = getattr(transformers, cls_name)(num_hidden_layers=7, **kw)
    d = {**cfg.to_dict(), **kw}  # the values as a config.json states them (before transformers' __post_init__)
    if layer_types == "dropped":
        d.pop("layer_types", None)
    d["architectures"] = [transformers.AutoModelForCausalLM._model_mapping[type(cfg)].__name__]
    arch = ArchConfig.from_dict(d)
    expected = _hf_windows(cfg)
    assert arch.layer_windows == (expected if any(expected) else None)
    assert arch.sliding_window == max((w for w in expected if w), default=None)


# -------------------------------------------------------------------------------------- the backends' band masks

H, HKV, D, BS, NUM_BLOCKS = 4, 2, 8, 4, 96


def brute_force(q, k, v, first_pos: int, scale: float, window, softcap) -> torch.Tensor:
    """fp64, one query and one key at a time: q [n, H, D] at positions first_pos.., keys k, v [C, Hkv, D] at 0..;
    query i sees key j iff i - window < j <= i."""
    n, h, _ = q.shape
    out = torch.zeros(n, h, D, dtype=torch.float64)
    for i in range(n):
        pos = first_pos + i
        keys = range(0 if window is None else max(0, pos - window + 1), pos + 1)
        for head in range(h):
            kh = head // (h // HKV)
            s = [float(q[i, head].double() @ k[j, kh].double()) * scale for j in keys]
            s = [softcap * math.tanh(x / softcap) for x in s] if softcap else s
            top = max(s)
            w = [math.exp(x - top) for x in s]
            out[i, head] = sum(wj / sum(w) * v[j, kh].double() for wj, j in zip(w, keys))
    return out


def _quantized(x: torch.Tensor) -> torch.Tensor:
    """What the int8 cache gives back: symmetric per (token, head), scale amax / 127."""
    scale = x.abs().amax(dim=-1, keepdim=True) / 127.0
    return torch.round(x / scale).clamp(-127, 127) * scale


def _slots(table, positions) -> list[int]:
    return [table[p // BS] * BS + p % BS for p in positions]


@pytest.mark.parametrize("int8", [False, True], ids=["fp32", "int8"])
@pytest.mark.parametrize("softcap", [None, 1.5])
@pytest.mark.parametrize("seed", range(2))
def test_banded_attention_matches_brute_force(seed, softcap, int8):
    """Decode rows (contexts shorter and many blocks longer than the window), fresh prompts (two of one length run
    batched) and chunks continuing earlier context at random offsets, one step, scattered blocks, random windows."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    attn = Int8PagedAttention(torch.float32) if int8 else TorchPagedAttention()
    cache = torch.zeros(attn.kv_cache_shape(NUM_BLOCKS, BS, HKV, D), dtype=attn.cache_dtype or torch.float32)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    # (tokens already in the cache, new tokens this step)
    shapes = [(rng.randint(30, 50), 1), (2, 1), (rng.randint(5, 20), 1), (0, 11), (0, 11), (0, 6)]
    shapes += [(rng.randint(1, 20), rng.randint(2, 9)) for _ in range(3)]
    seqs = []
    for past, new in shapes:
        total = past + new
        table = [free.pop() for _ in range(-(-total // BS))]
        k, v, q = torch.randn(total, HKV, D), torch.randn(total, HKV, D), torch.randn(new, H, D)
        if past:
            attn.write_kv(cache, k[:past], v[:past], torch.tensor(_slots(table, range(past))))
        seqs.append((past, new, table, q, k, v))
    seqs.sort(key=lambda s: s[1] != 1)  # decodes first
    qs, ks, vs, slots, prefills, dec_tables, dec_lens = [], [], [], [], [], [], []
    for past, new, table, q, k, v in seqs:
        qs.append(q), ks.append(k[past:]), vs.append(v[past:])
        slots += _slots(table, range(past, past + new))
        if new == 1:
            dec_tables.append(table), dec_lens.append(past + 1)
        else:
            ctx = torch.tensor(_slots(table, range(past + new))) if past else None
            prefills.append(PrefillChunk(sum(len(x) for x in qs[:-1]), new, past + new, ctx))
    width = max(len(t) for t in dec_tables)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=len(dec_lens),
        decode_block_tables=torch.tensor([t + [0] * (width - len(t)) for t in dec_tables]),
        decode_context_lens=torch.tensor(dec_lens),
        decode_max_context_len=max(dec_lens),
        prefills=prefills,
    )
    scale = D**-0.5
    q_all, k_all, v_all = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    # Three windows in one step (as three layers would run it), each its own decode view, and full attention.
    windows = (rng.randint(1, 4), rng.randint(5, 13), None)
    for window in windows:
        out = attn.forward(q_all, k_all, v_all, cache, meta, scale, window=window, softcap=softcap)
        row = 0
        for past, new, _table, q, k, v in seqs:
            # Every row attends to K/V as the (int8) cache holds them, a fresh prompt too (as its chunks would read
            # them back: its tokens do not depend on the chunk size or on prefix-cache hits).
            kk, vv = (_quantized(k), _quantized(v)) if int8 else (k, v)
            ref = brute_force(q, kk, vv, past, scale, window, softcap)
            torch.testing.assert_close(out[row : row + new].double(), ref, atol=2e-5, rtol=0)
            oracle = reference_causal_attention(q.double(), kk.double(), vv.double(), scale, window, softcap)
            torch.testing.assert_close(oracle, ref, atol=1e-10, rtol=0)
            row += new
    assert set(meta.step_cache) == {("decode", w) for w in windows}  # one decode view per window, built once


def test_decode_reads_only_the_blocks_in_the_window():
    """A row 50 tokens long with a window of 6 gathers ceil(6 / 4) + 1 = 3 blocks, not 13."""
    attn = TorchPagedAttention()
    cache = torch.zeros(attn.kv_cache_shape(NUM_BLOCKS, BS, HKV, D))
    table = list(range(13))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([49]),
        num_decode_tokens=1,
        decode_block_tables=torch.tensor([table]),
        decode_context_lens=torch.tensor([50]),
        decode_max_context_len=50,
    )
    attn.forward(torch.randn(1, H, D), torch.randn(1, HKV, D), torch.randn(1, HKV, D), cache, meta, 1.0, window=6)
    tables, mask = meta.step_cache[("decode", 6)]
    assert tables.tolist() == [[11, 12, 12]]  # positions 44..55; 52.. lie past the row and are masked
    seen = [44 + i for i, m in enumerate(mask.flatten().tolist()) if m]
    assert seen == list(range(44, 50))


# --------------------------------------------------------------------------------------------- models against HF

WINDOW = 6
BLOCK = 4
MAX_LEN = 64
NEW_TOKENS = 30  # five windows past the prompt


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 13, 24, 34)]


FAMILIES = {
    # every layer windowed
    "mistral": dict(arch="mistral", sliding_window=WINDOW),
    # Qwen2: only the layers from max_window_layers on (layers 1 and 2 of 3)
    "qwen2": dict(
        arch="qwen2", num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
    ),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), std=0.2, **FAMILIES[request.param])
    hf = hf_model(path)
    prompts = _prompts(hf.config.vocab_size)
    _, reference = _generate(path, prompts, enable_prefix_caching=False)
    return request.param, path, hf, prompts, reference


def _generate(path, prompts, **engine):
    engine = {"max_model_len": MAX_LEN, **engine}
    llm = LLM(str(path), dtype="float32", block_size=BLOCK, **engine)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return llm, [o.outputs[0].token_ids for o in outs]


def test_prompt_logits_match_hf_and_the_window_matters(family):
    name, path, hf, prompts, _ = family
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    expected = {"mistral": (WINDOW, WINDOW), "qwen2": (None, WINDOW, WINDOW)}[name]
    assert llm.config.model.arch.layer_windows == expected
    prompt = prompts[-1]
    ours = llm.engine.executor.runner.prompt_logits(prompt, list(range(-(-len(prompt) // BLOCK))))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
        # The same model attending in full (every layer a full one): the window changes its logits.
        key, full_value = ("layer_types", ["full_attention"] * hf.config.num_hidden_layers)
        if getattr(hf.config, "layer_types", None) is None:  # Mistral windows every layer by sliding_window
            key, full_value = "sliding_window", None
        kept = getattr(hf.config, key)
        setattr(hf.config, key, full_value)
        full = hf(torch.tensor([prompt]), use_cache=False).logits[0]
        setattr(hf.config, key, kept)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)
    assert (full[WINDOW:] - ref[WINDOW:]).abs().max() > 0.1
    torch.testing.assert_close(full[:WINDOW], ref[:WINDOW], atol=1e-5, rtol=0)  # within the window, the same


def test_a_window_one_token_off_is_caught(family, tmp_path):
    """The same weights with a window of W + 1 (one key more, as an exclusive bound would keep) miss HF's logits."""
    _, path, hf, prompts, _ = family
    shutil.copytree(path, tmp_path, dirs_exist_ok=True)
    cfg = read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "sliding_window": WINDOW + 1}))
    runner = LLM(str(tmp_path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK).engine.executor.runner
    prompt = prompts[-1]
    ours = runner.prompt_logits(prompt, list(range(-(-len(prompt) // BLOCK))))
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0]
    assert (ours[WINDOW:] - ref[WINDOW:]).abs().max() > 1e-2


def test_greedy_batch_decodes_past_the_window_like_hf(family):
    _, path, hf, prompts, reference = family
    for p, o in zip(prompts, reference):
        assert len(o) == NEW_TOKENS
        assert_teacher_forced(hf, p, o)


# bytes of fp32 KV per token, every layer: layers x (K and V) x 2 KV heads x head_dim 16 x 4 bytes
def _kv_bytes(path) -> int:
    return read_config(path)["num_hidden_layers"] * 2 * 2 * 16 * 4


# Blocks of every layer's KV that the preemption mode's pool holds. The windowed layers free their blocks as they
# leave the window, so a sequence holds at most ceil((W - 1 + chunk) / 4) + 1 = 5 of theirs with chunks of 8: the
# Mistral batch needs 20 at its peak; Qwen2's full layer keeps 50 (its pool is 42 block ids of 1 layer's page: its
# 1 full and 2 windowed layers are 3 KV cache groups of one layer).
PREEMPTION_POOL = {"mistral": 10, "qwen2": 14}


def _modes(name, path) -> dict[str, dict]:
    """Engine settings that must give the reference run's tokens; each runs with the prefix cache on (the engine's
    default), the reference without."""
    return {
        "tiny-chunked-prefill": dict(max_num_batched_tokens=5),  # chunks that cross the window's edge
        "one-seq-at-a-time": dict(max_num_seqs=1),
        "preemption": dict(
            kv_cache_memory_bytes=_kv_bytes(path) * PREEMPTION_POOL[name] * BLOCK, max_num_batched_tokens=8
        ),
    }


@pytest.mark.parametrize("mode", ["tiny-chunked-prefill", "one-seq-at-a-time", "preemption"])
def test_engine_modes_match_hf(family, mode):
    name, path, hf, prompts, reference = family
    if mode == "one-seq-at-a-time" and name != "mistral":
        pytest.skip("batch 1 runs on the Mistral model only (the slowest mode; the batching is the family's same)")
    llm, outs = _generate(path, prompts, **_modes(name, path)[mode])
    assert_mode_matches(llm, mode, hf, prompts, outs, reference)


def _counted(forward, steps: list, *args, **kwargs):
    """forward, noting the tokens of each step it runs"""
    steps.append(args[0].shape[0])
    return forward(*args, **kwargs)


def _fused_against_per_module(path, hf, prompts, groups: int, again=(), every_step: bool = False, **engine) -> None:
    """bf16, greedy, NEW_TOKENS tokens: the engine with the fused decode step (every decode step ran there, and the
    prompts' step where the kernels take prompts: its own counters) and with the per-module path, their logprobs
    against HF transformers' in fp32; the fused step's errors, worst and mean, as small as the per-module path's.
    (These std-0.2 random models are noisy in bf16: the per-module path's picks fall up to 0.25 nats below HF's best
    too, so argmax is not asked.) again: prompts generated after `prompts` (prefix-cache hits on them); every_step:
    the fused engine's model never ran a step through its modules (chunked prompts and hits included)."""
    from test_kernels import _hf_logprob_errors, needs_fused

    from infertune.kernels import x86

    if needs_fused.args[0]:
        pytest.skip(needs_fused.kwargs["reason"])
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    worst, mean = {}, {}
    for mode in ("auto", "off"):
        llm = LLM(str(path), dtype="bfloat16", max_model_len=MAX_LEN, block_size=BLOCK, decode_kernels=mode, **engine)
        runner = llm.engine.executor.runner
        assert (runner.fused is not None) == (mode == "auto") and len(runner.kv_groups) == groups
        module_steps = []
        if mode == "auto":
            assert runner.decode_kernels is x86.kernels()
            runner.fused.step_timers(reset=True)
            runner.model.forward = functools.partial(_counted, runner.model.forward, module_steps)
        errs, later = [], []
        errs += _hf_logprob_errors(llm, [{"prompt_token_ids": p} for p in prompts], params, hf, argmax=False)
        if again:
            batch = [{"prompt_token_ids": p} for p in again]
            errs += _hf_logprob_errors(llm, batch, params, hf, argmax=False, outputs=later)
        worst[mode], mean[mode] = max(errs), sum(errs) / len(errs)
        if mode == "auto":  # the decode steps ran fused, and with a bf16 cache the prompts' step too
            prompts_fused = runner.fused.max_prefill_rows >= sum(map(len, prompts))
            want = NEW_TOKENS - 1 + (prompts_fused and engine.get("kv_cache_dtype", "auto") == "auto")
            assert runner.fused.step_timers()["calls"] >= want
            if every_step:
                assert not module_steps, f"steps of {module_steps} tokens ran through the modules"
            if engine.get("enable_prefix_caching"):
                assert all(o.metrics.num_cached_tokens for o in later), "a prompt of `again` missed the prefix cache"
    assert worst["auto"] <= 1.5 * worst["off"] + 0.02, worst
    assert mean["auto"] <= 1.25 * mean["off"] + 0.005, mean


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_fused_step_runs_windowed_models(family, kv):
    """Prompts and decodes several windows long (window 6, blocks of 4: a window's first key mid-block), a batch of
    4: the fused C decode step takes the windowed layers (Mistral: every layer, one KV cache group; Qwen2: layers 1-2
    windowed beside a full layer 0, two groups with their own block tables) as exactly as the per-module path
    (_fused_against_per_module). A step that attended to the whole context, or read one group's tables for
    another's layers, is far off (checked by breaking kv_window and the group choice)."""
    name, path, hf, prompts, _ = family
    # (Qwen2: 1 full and 2 windowed layers, cut into 3 groups of one layer: two groups of one window)
    _fused_against_per_module(path, hf.float(), prompts, {"mistral": 1, "qwen2": 3}[name], kv_cache_dtype=kv)


def test_fused_step_runs_chunked_prompts_and_prefix_cache_hits(family):
    """Prompts in chunks of 8 tokens (each chunk after the first attends to the earlier chunks through the cache,
    decodes beside it) and prompts that hit the prefix cache: every step of the fused engine runs in the fused step
    (its modules never run), windows and KV cache groups included, as close to HF as the per-module engine
    (_fused_against_per_module). A chunk attending to its own tokens only, or reading the first block of its
    context as its window's, is far off (checked by breaking _step_tables' lengths and tables)."""
    name, path, hf, prompts, _ = family
    g = torch.Generator().manual_seed(11)
    again = [
        p[:12] + torch.randint(0, hf.config.vocab_size, (k,), generator=g).tolist() for p, k in zip(prompts[2:], (3, 9))
    ]
    _fused_against_per_module(
        path,
        hf.float(),
        prompts,
        {"mistral": 1, "qwen2": 3}[name],
        again=again,
        every_step=True,
        max_num_batched_tokens=8,
        enable_prefix_caching=True,
    )


def test_fused_step_runs_a_policys_window_rules(tmp_path):
    """The long-context policy's window rules (kv_compression; its KV cache groups are found by layer, not by
    window) in the fused decode step: the Qwen2 family's weights saved without their windows, and the policy putting
    them back on layers 1-2, against HF transformers running the checkpoint with its own windows
    (_fused_against_per_module). (Reading the groups' metadata by window here gave every layer group 0's tables:
    the first decoded token already differed.)"""
    windowed = make_checkpoint(tmp_path / "windowed", std=0.2, **FAMILIES["qwen2"])
    hf = hf_model(windowed).float()
    plain = tmp_path / "plain"
    shutil.copytree(windowed, plain)
    cfg = read_config(plain)
    cfg.update(use_sliding_window=False, layer_types=["full_attention"] * cfg["num_hidden_layers"])
    (plain / "config.json").write_text(json.dumps(cfg))
    policy = {"policy": [{"layers": "1-2", "window": WINDOW}, {"press": "none"}]}
    _fused_against_per_module(plain, hf, _prompts(hf.config.vocab_size), 3, kv_compression=policy)


def test_prefix_cache_hits_longer_than_the_window(family):
    """A hit of 3 blocks (12 tokens, twice the window): the chunk after it reads its window back from the cache."""
    _, path, hf, _, _ = family
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(0, hf.config.vocab_size, (3 * BLOCK + 1,), generator=g).tolist()
    prompts = [shared + torch.randint(0, hf.config.vocab_size, (k,), generator=g).tolist() for k in (1, 4, 9)]
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)[0]
    later = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert [o.metrics.num_cached_tokens for o in later] == [3 * BLOCK, 3 * BLOCK]
    for p, out in zip(prompts, [first, *later]):
        assert_teacher_forced(hf, p, out.outputs[0].token_ids)


def test_int8_kv_cache_tracks_hf(family):
    """The INT8 cache with chunked prefill (every chunk after the first reads int8 K/V back) stays within the bound
    tests/test_kv_int8.py holds the demo model to: every pick at most 0.5 below HF's best, nearly all exactly it."""
    _, path, hf, prompts, _ = family
    _, outs = _generate(path, prompts, kv_cache_dtype="int8", max_num_batched_tokens=8)
    gaps = []
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            logits = hf(torch.tensor([p + o])).logits[0, len(p) - 1 : -1]
        gaps.append(logits.max(dim=1).values - logits.gather(1, torch.tensor(o).unsqueeze(1)).squeeze(1))
    gaps = torch.cat(gaps)
    assert (gaps <= 0.5).all(), gaps.max()
    assert (gaps == 0).float().mean() >= 0.9
