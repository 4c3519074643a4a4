"""Qwen3 (dense, q/k norms) and the Llama-family mixture-of-experts models (Qwen2-MoE with its gated shared expert,
Qwen3-MoE, Mixtral) against Hugging Face transformers, and the MoE building blocks against their own oracles.

Oracles: HF's logits at every prompt position (within 1e-4) and teacher forcing (every greedy token is HF's top
within 1e-3 on the same prefix) on tiny random checkpoints (save_pretrained); HF's own router modules for route();
a per-token loop in fp64 for the grouped experts; HF's greedy text for `infertune generate` and `serve`, HF's
router picks for the expert-load table of `profile`. The engine modes (prefix cache, chunked prefill, preemption,
one sequence at a time, batch of one) must give the default run's tokens; both expert layouts and sharded files the
same logits; and loading allocates the experts once (the process's peak RSS).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import hf_model, make_checkpoint, make_tokenizer, read_config
from parity_utils import (
    BLOCK,
    MAX_LEN,
    NEW_TOKENS,
    assert_mode_matches,
    assert_rerouted_note,
    assert_teacher_forced,
    engine_modes,
    prompts_for,
    run,
    run_one_at_a_time,
)
from safetensors.torch import load_file, save_file

from infertune import LLM, SamplingParams
from infertune.config import MoeArch
from infertune.layers.moe import experts_reference, group_by_expert, route

MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32)
STD = 0.2  # weights N(0, 0.2): the routers' logits spread, so top-k picks and weights differ from token to token
VARIANTS = {
    # explicit head_dim (32, not hidden / heads = 16) and a q/k RMSNorm per head
    "qwen3": dict(arch="qwen3", head_dim=32),
    # a shared expert scaled by its sigmoid gate; softmax top-2 not renormalised; q/k/v bias
    "qwen2-moe": dict(arch="qwen2_moe", **MOE, shared_expert_intermediate_size=48, norm_topk_prob=False),
    "qwen3-moe": dict(arch="qwen3_moe", **MOE | dict(num_experts_per_tok=3), norm_topk_prob=True),
    # layers 1 and 3 are sparse by decoder_sparse_step=2, and mlp_only_layers takes 3 back: only layer 1 is MoE
    "qwen3-moe-sparse-step": dict(
        arch="qwen3_moe", **MOE, norm_topk_prob=False, num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]
    ),
    "mixtral": dict(arch="mixtral", num_local_experts=4, num_experts_per_tok=2, intermediate_size=32),
}
VARIANTS = {name: kw | dict(std=STD) for name, kw in VARIANTS.items()}


def kv_bytes_per_token(path) -> int:
    """fp32 K and V of every layer, from config.json."""
    cfg = read_config(path)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


@pytest.fixture(scope="module", params=list(VARIANTS))
def family(request, tmp_path_factory):
    """(variant, checkpoint, HF model, prompts, the default run's greedy tokens: prefix caching off)."""
    path = make_checkpoint(tmp_path_factory.mktemp(request.param), **VARIANTS[request.param])
    hf = hf_model(path)
    prompts = prompts_for(hf.config.vocab_size)
    _, reference = run(path, prompts, enable_prefix_caching=False)
    return request.param, path, hf, prompts, reference


def prompt_logits(llm, prompt: list[int]) -> torch.Tensor:
    return llm.engine.executor.runner.prompt_logits(prompt, list(range(-(-len(prompt) // BLOCK))))


def test_prompt_logits_match_hf(family):
    name, path, hf, prompts, _ = family
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    arch = llm.config.model.arch
    if name == "qwen3-moe-sparse-step":
        assert arch.moe.layers == (1,)
    for prompt in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([prompt])).logits[0]
        torch.testing.assert_close(prompt_logits(llm, prompt), ref, atol=1e-4, rtol=0)


def test_greedy_batch_matches_hf(family):
    _, _, hf, prompts, reference = family
    for p, o in zip(prompts, reference):
        assert len(o) == NEW_TOKENS
        assert_teacher_forced(hf, p, o)


@pytest.mark.parametrize("mode", list(engine_modes(0)))
def test_engine_modes_match_hf(family, mode):
    _, path, hf, prompts, reference = family
    llm, outs = run(path, prompts, **engine_modes(kv_bytes_per_token(path))[mode])
    assert_mode_matches(llm, mode, hf, prompts, outs, reference)


def test_batch_of_one_equals_batched(family):
    _, path, _, prompts, reference = family
    assert run_one_at_a_time(path, prompts) == reference


def test_prefix_cache_hits_match_hf(family):
    """A prompt sharing three full blocks with an earlier one reuses them, and still gets HF's tokens."""
    _, path, hf, _, _ = family
    g = torch.Generator().manual_seed(7)
    shared = torch.randint(0, hf.config.vocab_size, (3 * BLOCK + 2,), generator=g).tolist()
    prompts = [shared + torch.randint(0, hf.config.vocab_size, (k,), generator=g).tolist() for k in (1, 5)]
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = [llm.generate({"prompt_token_ids": p}, params)[0] for p in prompts]
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 3 * BLOCK]
    for p, o in zip(prompts, outs):
        assert_teacher_forced(hf, p, o.outputs[0].token_ids)


def hf_routers(hf) -> list[torch.nn.Module]:
    return [layer.mlp.gate for layer in hf.model.layers if hasattr(layer.mlp, "experts")]


def test_routing_is_spread_over_the_experts(family):
    """The random weights route for real: HF's routers pick nearly every expert and weigh them unevenly (else
    the parity above would not exercise the routing)."""
    name, _, hf, prompts, _ = family
    if name == "qwen3":
        pytest.skip("dense model: no router")
    picked: list[torch.Tensor] = []  # per MoE layer: expert ids [T, k]
    top: list[torch.Tensor] = []  # and each token's largest weight [T]

    def note(_module, _args, out) -> None:  # HF's router returns (logits, top-k weights, top-k ids)
        picked.append(out[2])
        top.append(out[1][:, 0])

    hooks = [r.register_forward_hook(note) for r in hf_routers(hf)]
    with torch.no_grad():
        hf(torch.tensor([prompts[-1]]))
    for h in hooks:
        h.remove()
    experts = hf_routers(hf)[0].num_experts
    assert all(len(ids.unique()) >= experts - 1 for ids in picked), [ids.unique().tolist() for ids in picked]
    assert float(torch.cat(top).std()) > 0.05


# ---- checkpoint layouts ------------------------------------------------------------------------------------


def copy_without_weights(src, dst):
    dst.mkdir()
    for f in src.iterdir():
        if not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, dst / f.name)
    return dst


@pytest.mark.parametrize("variant", ["qwen2-moe", "qwen3-moe-sparse-step", "mixtral"])
def test_fused_and_sharded_expert_layouts_give_identical_logits(variant, tmp_path):
    """transformers v5's fused 3-D experts (mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I], written here
    from the HF model's own state) and a sharded per-expert checkpoint load the very same weights."""
    per_expert = make_checkpoint(tmp_path / "per-expert", **VARIANTS[variant])
    hf = hf_model(per_expert)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in state)  # HF keeps them fused in memory
    fused = copy_without_weights(per_expert, tmp_path / "fused")
    save_file(state, fused / "model.safetensors", metadata={"format": "pt"})
    sharded = copy_without_weights(per_expert, tmp_path / "sharded")
    hf.save_pretrained(sharded, max_shard_size="60KB")
    assert len(list(sharded.glob("*.safetensors"))) > 2
    prompt = prompts_for(hf.config.vocab_size)[-1]
    logits = []
    for path in (per_expert, fused, sharded):
        llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
        logits.append(prompt_logits(llm, prompt))
    assert torch.equal(logits[0], logits[1]) and torch.equal(logits[0], logits[2])
    with torch.no_grad():
        torch.testing.assert_close(logits[0], hf(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=0)


@pytest.mark.parametrize(
    "variant, dropped",
    [
        ("qwen3-moe", "model.layers.1.mlp.experts.5.up_proj.weight"),
        ("mixtral", "model.layers.0.block_sparse_moe.experts.2.w3.weight"),  # named as the checkpoint names it
    ],
)
def test_a_missing_expert_tensor_is_named(variant, dropped, tmp_path):
    path = make_checkpoint(tmp_path, **VARIANTS[variant])
    weights = load_file(path / "model.safetensors")
    del weights[dropped]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=f"checkpoint is missing tensors: {dropped.replace('.', '[.]')}$"):
        LLM(str(path), dtype="float32", max_model_len=MAX_LEN)


# ---- config.json read as transformers reads it -------------------------------------------------------------


def drop_norm_topk_prob(path) -> None:
    cfg = read_config(path)
    del cfg["norm_topk_prob"]
    (path / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    "variant, overrides, edit",
    [
        ("qwen3-moe", {}, drop_norm_topk_prob),  # absent: transformers does not renormalise
        ("qwen2-moe", dict(qkv_bias=False), None),  # Qwen2-MoE's q/k/v bias has its own switch
        # a shared expert of size 0: transformers still writes its (empty) weights and its gate; nothing to add
        ("qwen2-moe", dict(shared_expert_intermediate_size=0), None),
    ],
)
def test_config_knobs_and_their_defaults_follow_transformers(variant, overrides, edit, tmp_path):
    path = make_checkpoint(tmp_path, **VARIANTS[variant] | overrides)
    if edit is not None:
        edit(path)
    hf = hf_model(path)
    prompt = prompts_for(hf.config.vocab_size)[-1]
    llm = LLM(str(path), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    with torch.no_grad():
        torch.testing.assert_close(prompt_logits(llm, prompt), hf(torch.tensor([prompt])).logits[0], atol=1e-4, rtol=0)


# ---- route() against transformers' routers; the experts against a per-token loop ----------------------------


def moe_arch(e: int, k: int, **kw) -> MoeArch:
    return MoeArch(num_experts=e, top_k=k, intermediate_size=8, layers=(0,), **kw)


def hf_router(kind: str, hidden: int, e: int, k: int, **kw):
    """A transformers router module and the MoeArch that names the same rule."""
    from transformers import DeepseekV2Config, DeepseekV3Config, MixtralConfig, Qwen3MoeConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    if kind == "qwen3-moe":
        norm = kw["norm_topk_prob"]
        cfg = Qwen3MoeConfig(hidden_size=hidden, num_experts=e, num_experts_per_tok=k, norm_topk_prob=norm)
        return Qwen3MoeTopKRouter(cfg), moe_arch(e, k, norm_topk_prob=norm)
    if kind == "mixtral":
        cfg = MixtralConfig(hidden_size=hidden, num_local_experts=e, num_experts_per_tok=k)
        return MixtralTopKRouter(cfg), moe_arch(e, k, norm_topk_prob=True)
    groups = dict(n_group=kw.get("n_group", 1), topk_group=kw.get("topk_group", 1))
    scale = kw.get("routed_scaling_factor", 1.0)
    if kind == "deepseek-v2":
        method = kw["topk_method"]
        cfg = DeepseekV2Config(
            hidden_size=hidden,
            num_attention_heads=4,
            n_routed_experts=e,
            num_experts_per_tok=k,
            topk_method=method,
            routed_scaling_factor=scale,
            **groups,
        )
        arch = moe_arch(e, k, norm_topk_prob=False, topk_method=method, routed_scaling_factor=scale, **groups)
        return DeepseekV2TopkRouter(cfg), arch
    cfg = DeepseekV3Config(
        hidden_size=hidden,
        num_attention_heads=4,
        n_routed_experts=e,
        num_experts_per_tok=k,
        routed_scaling_factor=scale,
        **groups,
    )
    arch = moe_arch(
        e,
        k,
        norm_topk_prob=True,
        scoring="sigmoid",
        topk_method="noaux_tc",
        routed_scaling_factor=scale,
        correction_bias=True,
        **groups,
    )
    return DeepseekV3TopkRouter(cfg), arch


ROUTERS = {
    "qwen3-moe-renormalised": ("qwen3-moe", 16, 4, dict(norm_topk_prob=True)),
    "qwen3-moe-raw": ("qwen3-moe", 16, 4, dict(norm_topk_prob=False)),
    "mixtral": ("mixtral", 8, 2, {}),
    "deepseek-v2-greedy": ("deepseek-v2", 16, 3, dict(topk_method="greedy", routed_scaling_factor=1.5)),
    "deepseek-v2-groups": (
        "deepseek-v2",
        16,
        3,
        dict(topk_method="group_limited_greedy", n_group=4, topk_group=2, routed_scaling_factor=1.5),
    ),
    "deepseek-v3-groups-bias": ("deepseek-v3", 16, 4, dict(n_group=4, topk_group=2, routed_scaling_factor=2.5)),
}


def tied_router_inputs(e: int, hidden: int, n_group: int, g: torch.Generator):
    """Router weight [E, H], a correction bias [E] and hidden states [T, H] full of ties: expert 1 duplicates
    expert 0 (tied logits on every row), the second group is the first one permuted (equal group scores, its
    bias permuted alike), and two rows are zero (every expert tied)."""
    w = torch.randn(e, hidden, generator=g)
    bias = 0.1 * torch.randn(e, generator=g)
    w[1], bias[1] = w[0], bias[0]
    if n_group > 1:
        size = e // n_group
        perm = torch.randperm(size, generator=g)
        w[size : 2 * size], bias[size : 2 * size] = w[:size][perm], bias[:size][perm]
    x = torch.randn(64, hidden, generator=g)
    x[5] = 0.0
    x[17] = 0.0
    return w, bias, x


@pytest.mark.parametrize("name", list(ROUTERS))
def test_route_matches_transformers_routers_on_ties(name):
    kind, e, k, kw = ROUTERS[name]
    hidden = 24
    router, arch = hf_router(kind, hidden, e, k, **kw)
    g = torch.Generator().manual_seed(5)
    for trial in range(3):
        w, bias, x = tied_router_inputs(e, hidden, arch.n_group, g)
        with torch.no_grad():
            router.weight.copy_(w)
            if arch.correction_bias:
                router.e_score_correction_bias.copy_(bias)
            logits, ref_weights, ref_ids = router(x)
        assert torch.equal(logits, F.linear(x, w))  # what our Router feeds route()
        weights, ids = route(logits, arch, bias if arch.correction_bias else None)
        assert ids.shape == ref_ids.shape == (x.shape[0], k)
        # the same experts per row (HF's DeepSeek routers do not sort them), with the same weight each
        mine, ref = ids.sort(dim=1), ref_ids.sort(dim=1)
        assert torch.equal(mine.values, ref.values), f"{name}, trial {trial}"
        torch.testing.assert_close(
            weights.gather(1, mine.indices), ref_weights.float().gather(1, ref.indices), atol=1e-6, rtol=0
        )


def test_grouped_experts_equal_a_per_token_loop_in_fp64():
    g = torch.Generator().manual_seed(3)
    t, e, k, hidden, inter = 23, 6, 2, 16, 12
    x = torch.randn(t, hidden, generator=g, dtype=torch.float64)
    gate_up = torch.randn(e, 2 * inter, hidden, generator=g, dtype=torch.float64)
    down = torch.randn(e, hidden, inter, generator=g, dtype=torch.float64)
    ids = torch.stack([torch.randperm(e - 1, generator=g)[:k] for _ in range(t)])  # expert e - 1 is never picked
    ids[:7, 0] = 2  # and expert 2 is picked by many
    weights = torch.rand(t, k, generator=g, dtype=torch.float64)
    expected = torch.zeros_like(x)
    for i in range(t):
        for slot in range(k):
            ex = int(ids[i, slot])
            h = gate_up[ex] @ x[i]
            expected[i] += weights[i, slot] * (down[ex] @ (F.silu(h[:inter]) * h[inter:]))
    torch.testing.assert_close(experts_reference(x, gate_up, down, weights, ids), expected, atol=1e-12, rtol=0)
    order, counts = group_by_expert(ids, e)
    assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=e).tolist() and counts[e - 1] == 0
    assert torch.equal(ids.reshape(-1)[order], ids.reshape(-1).sort(stable=True).values)


# ---- the tools on a MoE checkpoint ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """A Qwen2-MoE checkpoint (router, experts, gated shared expert) and its HF model."""
    path = make_checkpoint(tmp_path_factory.mktemp("tools-qwen2-moe"), **VARIANTS["qwen2-moe"])
    return path, hf_model(path)


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(hf(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def hf_expert_counts(hf, sequences: list[list[int]]) -> dict[str, list[int]]:
    """Tokens HF's routers send to each expert, per MoE layer, over full forwards of the sequences."""
    routers = {name: m for name, m in hf.named_modules() if name.endswith("mlp.gate") and hasattr(m, "num_experts")}
    counts = {name: torch.zeros(m.num_experts, dtype=torch.long) for name, m in routers.items()}

    def counter(name):
        def hook(_module, _args, out) -> None:
            counts[name] += torch.bincount(out[2].reshape(-1), minlength=len(counts[name]))

        return hook

    hooks = [m.register_forward_hook(counter(name)) for name, m in routers.items()]
    with torch.no_grad():
        for seq in sequences:
            hf(torch.tensor([seq]))
    for h in hooks:
        h.remove()
    return {name: c.tolist() for name, c in counts.items()}


def test_cli_generate_prints_hf_greedy_text(qwen2_moe, capsys):
    from infertune.cli import main

    path, hf = qwen2_moe
    tok = make_tokenizer()
    prompt = "def moe(x):"
    argv = ["generate", "--model", str(path), "--dtype", "float32", "--temperature", "0", "--ignore-eos"]
    assert main([*argv, "--max-tokens", "10", prompt]) == 0
    expected = tok.decode(hf_greedy(hf, tok.encode(prompt, add_special_tokens=False), 10), skip_special_tokens=True)
    assert capsys.readouterr().out.rstrip("\n") == expected


def chat_through_server(path, tok, messages: list[dict], max_tokens: int):
    """`serve` on the checkpoint at path, one greedy /v1/chat/completions through the openai SDK (EOS ignored) ->
    (the response, the chat template's prompt ids)."""
    import openai
    from server_utils import MODEL, ServerThread

    ids = tok.encode(
        tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False
    )
    with ServerThread(path) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, extra_body={"ignore_eos": True}
        )
    return r, ids


def test_serve_answers_a_chat_request_with_hf_greedy_tokens(qwen2_moe):
    path, hf = qwen2_moe
    tok = make_tokenizer()
    r, ids = chat_through_server(path, tok, [{"role": "user", "content": "Route me"}], 8)
    assert r.usage.prompt_tokens == len(ids)
    assert r.choices[0].message.content == tok.decode(hf_greedy(hf, ids, 8), skip_special_tokens=True)


def test_profile_splits_router_and_expert_matmuls_and_counts_the_experts_load(qwen2_moe):
    from infertune.profile.profile_categories import scope_kind
    from infertune.profile.profile_cmd import build_summary, format_report
    from infertune.profile.timeline import make_prompts, profile_workload

    path, hf = qwen2_moe
    input_len, output_len, batch = 9, 4, 2
    llm = LLM(str(path), dtype="float32", max_model_len=32, max_num_seqs=batch)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    result = profile_workload(llm, input_len, output_len, batch, params, warmup=False)
    routers = [m for name, m in llm.engine.executor.runner.model.named_modules() if name.endswith("mlp.gate")]
    assert routers and all(not r._forward_hooks for r in routers)  # the counting hooks left with the profiler

    # Every op under a router is router time (its matmul too); the experts' matmuls are matmul.
    op_category = {}
    for step in result.steps:
        op_category |= step.op_category
    seen = {"moe_router": 0, "experts_mm": 0, "shared_mm": 0}
    for e in result.prof.events():
        if e.id not in op_category or not e.name.startswith("aten::"):
            continue
        scopes, parent = [], e.cpu_parent  # the profiler's own nesting, innermost first
        while parent is not None:
            if scope_kind(parent.name) is not None:
                scopes.append((scope_kind(parent.name), parent.name))
            parent = parent.cpu_parent
        kinds = [k for k, _ in scopes]
        if "moe_router" in kinds:
            assert op_category[e.id] == "moe_router", e.name
            seen["moe_router"] += 1
        elif kinds and kinds[0] == "experts" and e.name in ("aten::linear", "aten::mm"):
            assert op_category[e.id] == "matmul", e.name
            seen["experts_mm"] += 1
        elif kinds[:1] == ["linear"] and "moe_block" in kinds and e.name == "aten::mm":
            assert op_category[e.id] == "matmul" and ".shared_expert." in scopes[0][1]
            seen["shared_mm"] += 1
    assert all(seen.values()), seen
    for phase in result.phases.values():
        assert phase.by_category["moe_router"] > 0 and phase.by_category["matmul"] > 0

    # The load table counts what HF's routers pick on the same tokens: each prompt and all but its last greedy
    # token went through the model (greedy tokens are HF's, by the parity tests above).
    prompts = make_prompts(hf.config.vocab_size, input_len, batch, salt=2)
    sequences = [p + hf_greedy(hf, p, output_len)[:-1] for p in prompts]
    expected = hf_expert_counts(hf, sequences)
    assert result.expert_load == expected
    summary = build_summary(result, {"model": str(path)} | CONTEXT)
    rows = {r["layer"]: r for r in summary["expert_load"]}
    assert set(rows) == set(expected)
    for name, counts in expected.items():
        r = rows[name]
        mean = sum(counts) / len(counts)
        assert r["routed"] == (input_len + output_len - 1) * batch * hf.config.num_experts_per_tok == sum(counts)
        assert r["max"] == max(counts) and r["imbalance"] == pytest.approx(max(counts) / mean)
        assert r["idle_experts"] == counts.count(0)
        assert r["hottest"][0] == [counts.index(max(counts)), max(counts)]
    report = format_report(summary)
    assert "expert load" in report and all(name in report for name in expected)
    assert "MoE router + dispatch" in report
    json.dumps(summary)  # what --json writes


CONTEXT = dict(
    device="cpu",
    dtype="float32",
    quantization=None,
    decode_kernels="off",
    batch=2,
    input_len=9,
    output_len=4,
    sampling="greedy",
    torch="-",
    torch_threads=1,
    timeline="cpu",
)


def test_debug_layers_on_a_moe_model(qwen2_moe):
    from infertune.profile.debug_layers import debug_layers

    path, hf = qwen2_moe
    prompt = prompts_for(hf.config.vocab_size)[-1]
    clean = debug_layers(str(path), prompt, dtype="float32")
    names = [m.module for m in clean.modules]
    for layer in (0, 1):
        assert {f"model.layers.{layer}.mlp.{m}" for m in ("gate", "experts", "shared_expert")} <= set(names)
    assert clean.first_divergent is None and clean.notes == []

    def nan_in_experts(model) -> None:  # every expert of layer 1: whichever a token picks goes NaN
        with torch.no_grad():
            model.model.layers[1].mlp.experts.gate_up_proj[:, 0, 0] = float("nan")

    broken = debug_layers(str(path), prompt, dtype="float32", perturb=nan_in_experts)
    assert broken.first_nonfinite["module"] == "model.layers.1.mlp.experts"

    def swap_experts(model) -> None:  # layer 1's router sends expert 0's tokens to 1 and back
        with torch.no_grad():
            model.model.layers[1].mlp.gate.weight[[0, 1]] = model.model.layers[1].mlp.gate.weight[[1, 0]].clone()

    rerouted = debug_layers(str(path), prompt, dtype="float32", perturb=swap_experts)
    assert_rerouted_note(hf, rerouted, prompt)


def test_quantize_w8a16_writes_int8_linears_and_experts_and_keeps_the_routers(qwen2_moe, tmp_path):
    from safetensors import safe_open

    from infertune.tools.quantizer import quantize

    path, hf = qwen2_moe
    out = tmp_path / "w8"
    quantize(str(path), "w8a16", str(out), show_progress=False)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        dtypes = {name: f.get_slice(name).get_dtype() for name in f.keys()}
    layer = "model.layers.1"
    for name in ("self_attn.q_proj", "shared_expert.down_proj", "experts.3.up_proj", "experts.0.down_proj"):
        name = f"{layer}.{name}" if name.startswith("self_attn") else f"{layer}.mlp.{name}"
        assert dtypes[f"{name}.weight"] == "I8" and dtypes[f"{name}.weight_scale"] == "F32", name
    assert dtypes[f"{layer}.mlp.gate.weight"] == dtypes[f"{layer}.mlp.shared_expert_gate.weight"] == "F32"
    prompt = prompts_for(hf.config.vocab_size)[-1]
    fly = LLM(str(path), dtype="float32", quantization="w8a16", max_model_len=MAX_LEN, block_size=BLOCK)
    saved = LLM(str(out), dtype="float32", max_model_len=MAX_LEN, block_size=BLOCK)
    torch.testing.assert_close(prompt_logits(saved, prompt), prompt_logits(fly, prompt), atol=1e-5, rtol=0)


# ---- loaded in place --------------------------------------------------------------------------------------------

LOAD_AND_MEASURE = """
import json, sys, torch
from infertune.config import ArchConfig
from infertune.layers.attention import attention_backend
from infertune.models.loader import load_model

def status(key):
    return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith(key))

def load(path):
    arch = ArchConfig.from_model_dir(path)
    return load_model(arch, path, torch.float32, torch.device("cpu"), 64, attention_backend(arch, "auto", torch.float32))

load(sys.argv[1])  # a small model first: the imports and one-time set-up a load triggers
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before = status("VmRSS")
model = load(sys.argv[2])
print(json.dumps({"peak_growth": status("VmHWM") - before, "params": sum(p.nbytes for p in model.parameters())}))
"""


def synthetic_moe(path, fused: bool, experts: int, hidden: int, inter: int, layers: int = 2):
    """A Qwen3-MoE checkpoint of zeros written with safetensors (no HF model: it would take the memory twice):
    (its path, the bytes of its tensors, the largest tensor's bytes)."""
    path.mkdir()
    cfg = dict(
        architectures=["Qwen3MoeForCausalLM"],
        model_type="qwen3_moe",
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=64,
        moe_intermediate_size=inter,
        num_experts=experts,
        num_experts_per_tok=2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=64,
        norm_topk_prob=True,
    )
    (path / "config.json").write_text(json.dumps(cfg))
    t = {
        "model.embed_tokens.weight": torch.zeros(256, hidden),
        "lm_head.weight": torch.zeros(256, hidden),
        "model.norm.weight": torch.ones(hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}"
        t |= {f"{p}.{n}.weight": torch.ones(hidden) for n in ("input_layernorm", "post_attention_layernorm")}
        t |= {f"{p}.self_attn.{n}.weight": torch.ones(16) for n in ("q_norm", "k_norm")}
        t |= {
            f"{p}.self_attn.{n}_proj.weight": torch.zeros(rows, hidden) for n, rows in (("q", 64), ("k", 32), ("v", 32))
        }
        t[f"{p}.self_attn.o_proj.weight"] = torch.zeros(hidden, 64)
        t[f"{p}.mlp.gate.weight"] = torch.zeros(experts, hidden)
        if fused:
            t[f"{p}.mlp.experts.gate_up_proj"] = torch.zeros(experts, 2 * inter, hidden)
            t[f"{p}.mlp.experts.down_proj"] = torch.zeros(experts, hidden, inter)
        else:
            for e in range(experts):
                t |= {f"{p}.mlp.experts.{e}.{n}.weight": torch.zeros(inter, hidden) for n in ("gate_proj", "up_proj")}
                t[f"{p}.mlp.experts.{e}.down_proj.weight"] = torch.zeros(hidden, inter)
    save_file(t, str(path / "model.safetensors"))
    return path, sum(v.nbytes for v in t.values()), max(v.nbytes for v in t.values())


@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="needs Linux's /proc peak-RSS reset")
@pytest.mark.parametrize("layout", ["per-expert", "fused"])
def test_loading_allocates_the_experts_once(layout, tmp_path):
    """The process's peak RSS while loading grows by the weights plus at most one checkpoint tensor (the read
    buffer) and a little slack: a second copy of the experts (96 MiB here) would add their size again."""
    fused = layout == "fused"
    small, _, _ = synthetic_moe(tmp_path / "small", fused, experts=2, hidden=64, inter=32)
    big, weights, largest = synthetic_moe(tmp_path / "big", fused, experts=8, hidden=512, inter=1024)
    experts = 2 * 8 * 3 * 512 * 1024 * 4
    r = subprocess.run(
        [sys.executable, "-c", LOAD_AND_MEASURE, str(small), str(big)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.splitlines()[-1])
    assert got["params"] == weights  # every tensor has its slot, sized as in the file
    slack = 24 * 2**20
    assert got["peak_growth"] <= weights + largest + slack < weights + experts, (got, weights, largest)
