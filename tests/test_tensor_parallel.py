"""Tensor parallel (layers/parallel.py, executor/multiproc.py): two ranks on gloo over 127.0.0.1, one CPU each.

Oracles: the same engine with one rank, greedy token for token in fp32, on each family's sharding (Llama with one KV
head replicated and a vocabulary that does not split evenly, Qwen3's q/k norms and qkv bias, Mixtral's experts,
Qwen2-MoE's gated shared expert, Gemma 2's soft-caps and windows, DeepSeek-V3's latent attention) with prefix caching,
chunked prefill and preemption on at once; HF transformers' greedy tokens by teacher forcing; exact arithmetic for how
a tensor splits; and a rank killed mid-run is reported by rank without a hang.
"""

from __future__ import annotations

import statistics
import threading
import time

import pytest
import torch
from conftest import hf_model, make_checkpoint, read_config
from parity_utils import BLOCK, assert_teacher_forced, prompts_for, run
from test_deepseek import VARIANTS as DEEPSEEK_VARIANTS
from test_deepseek import make_deepseek_checkpoint
from test_gemma import VARIANTS as GEMMA_VARIANTS
from test_gemma import make_gemma
from test_moe_models import VARIANTS as MOE_VARIANTS

from infertune import LLM, SamplingParams
from infertune.config import ArchConfig
from infertune.executor.multiproc import WorkerError
from infertune.layers.parallel import TensorParallel, _vocab_rows, block_of


def test_a_tensor_splits_by_rank_and_small_blocks_are_replicated():
    # 8 rows over 2 ranks of 4: rank r takes rows 4r..4r+3
    assert [block_of(8, 4, TensorParallel(r, 2)) for r in range(2)] == [0, 4]
    # one KV head of 16 rows, 4 ranks each keeping one head: every rank the same block
    assert [block_of(16, 16, TensorParallel(r, 4)) for r in range(4)] == [0, 0, 0, 0]
    # two KV heads, 4 ranks: ranks 0-1 share head 0, ranks 2-3 head 1 (their q heads' group)
    assert [block_of(32, 16, TensorParallel(r, 4)) for r in range(4)] == [0, 0, 16, 16]
    with pytest.raises(ValueError, match="does not split"):
        block_of(24, 16, TensorParallel(0, 2))
    # a vocabulary of 261 over 2 ranks: blocks of 131, the last one with 130 real rows and one of padding
    assert [_vocab_rows(261, TensorParallel(r, 2)) for r in range(2)] == [(131, 0, 131), (131, 131, 130)]


def test_shapes_that_do_not_split_are_clear_errors_before_any_worker_starts(tiny_llama):
    arch = ArchConfig.from_model_dir(str(tiny_llama))  # 4 heads, 2 KV heads, intermediate 128
    assert arch.for_tensor_parallel(2).num_attention_heads == 2 and arch.for_tensor_parallel(4).num_key_value_heads == 1
    start = time.monotonic()
    with pytest.raises(ValueError, match="does not divide num_attention_heads"):
        LLM(str(tiny_llama), dtype="float32", tensor_parallel_size=3)
    assert time.monotonic() - start < 5  # raised by the driver, not by spawned workers
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        LLM(str(tiny_llama), dtype="float32", tensor_parallel_size=0)


def _checkpoint(kind: str, path):
    if kind == "llama-kv1-odd-vocab":  # one KV head for two ranks (replicated), 261 rows of vocabulary (padded)
        return make_checkpoint(path, "llama", num_key_value_heads=1, vocab_size=261, tie_word_embeddings=True)
    if kind == "phi3-kv1-partial":  # fused qkv_proj / gate_up_proj: each rank's slice of each shard; KV replicated
        return make_checkpoint(path, "phi3", num_key_value_heads=1, partial_rotary_factor=0.5)
    if kind == "qwen3":  # q/k norms and explicit head_dim, with q/k/v/o bias (o's added on one rank only)
        return make_checkpoint(path, "qwen3", head_dim=16, attention_bias=True)
    if kind in MOE_VARIANTS:  # (the same tiny MoE models as test_moe_models.py)
        return make_checkpoint(path, **MOE_VARIANTS[kind])
    if kind in ("gemma2", "gemma3"):
        return make_gemma(path, **GEMMA_VARIANTS[kind])
    assert kind in ("deepseek-v3", "deepseek-v2-lite")
    return make_deepseek_checkpoint(path, **DEEPSEEK_VARIANTS[kind.removeprefix("deepseek-")])


@pytest.mark.parametrize(
    "kind",
    [
        "llama-kv1-odd-vocab",
        "qwen3",
        "phi3-kv1-partial",
        "mixtral",
        "qwen2-moe",
        "qwen3-moe",
        "gemma2",
        "gemma3",
        "deepseek-v3",
        "deepseek-v2-lite",
    ],
)
def test_two_ranks_give_one_rank_s_greedy_tokens(kind, tmp_path):
    path = _checkpoint(kind, tmp_path / kind)
    hf = hf_model(path)
    prompts = prompts_for(hf.config.vocab_size)
    one, reference = run(path, prompts)
    # prefix caching, 5-token chunks of prefill and a pool of 16 blocks a rank, where the batch needs 24 at its peak
    # (preemption). A rank keeps its share of the KV heads, all of an MLA latent, and a replica of a KV head it
    # shares with another rank. (Not for Gemma's windowed layers, whose KV needs are their own: test_kv_groups.py.)
    arch = ArchConfig.from_model_dir(str(path))
    share = 1.0 if arch.mla else arch.for_tensor_parallel(2).num_key_value_heads / arch.num_key_value_heads
    per_rank = int(one.engine.executor.kv_cache_info.bytes_per_token * share)
    pool = {} if arch.layer_windows else dict(kv_cache_memory_bytes=2 * per_rank * 16 * BLOCK)  # (all ranks')
    llm, got = run(
        path,
        prompts,
        tensor_parallel_size=2,
        enable_prefix_caching=True,
        max_num_batched_tokens=5,
        max_model_len=64,
        **pool,
    )
    try:
        assert "tensor parallel over 2 worker processes" in llm.engine.executor.describe()
        assert got == reference
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        again = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == reference
        stats = llm.engine.stats()
        assert stats["prefix_cache_hit_rate"] > 0 and (stats["num_preemptions"] > 0 or not pool), stats
    finally:
        llm.engine.shutdown()
    for prompt, out in zip(prompts, got):
        assert_teacher_forced(hf, prompt, out)
    assert not any(p.is_alive() for p in llm.engine.executor._procs)


def test_two_ranks_pack_the_int4_tier_as_one_rank(tiny_llama):
    """The int4 tier under tensor parallel: each rank packs its own share of the KV heads as the step's kv_packs say
    (blocks of 4, int4 after 4 tokens, prefill in chunks of 5 reading int4 context back, prefix caching): the greedy
    tokens of one rank exactly, and packs happened. A rank that skipped the packs or packed other pages would read
    garbage where the tables name int4 blocks."""
    prompts = prompts_for(read_config(tiny_llama)["vocab_size"])
    tier = dict(kv_cache_dtype="int8", kv_int4_after=4, max_num_batched_tokens=5, enable_prefix_caching=True)
    one, reference = run(tiny_llama, prompts, **tier)
    assert one.engine.block_manager.num_int4_packs > 0
    llm, got = run(tiny_llama, prompts, tensor_parallel_size=2, **tier)
    try:
        assert got == reference
        assert llm.engine.block_manager.num_int4_packs == one.engine.block_manager.num_int4_packs
    finally:
        llm.engine.shutdown()


def test_a_rank_that_dies_is_named_and_nothing_hangs(tiny_llama):
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, block_size=4, tensor_parallel_size=2)
    try:
        params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        assert len(llm.generate("x", params)[0].outputs[0].token_ids) == 4
        victim = llm.engine.executor._procs[1]
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        threading.Timer(0.5, victim.kill).start()  # mid-run
        start = time.monotonic()
        with pytest.raises(WorkerError, match="tensor-parallel rank 1"):
            for _ in range(100):
                llm.generate(["x y z"] * 4, long, use_tqdm=False)
        assert time.monotonic() - start < 30
        time.sleep(0.2)
        assert not any(p.is_alive() for p in llm.engine.executor._procs)  # the other rank was stopped too
        with pytest.raises(WorkerError, match="stopped after an earlier failure"):
            llm.generate("x", params)
    finally:
        llm.engine.shutdown()


_RAY_TOKEN: dict[str, str] = {}  # (ray_head's, one per test process)


@pytest.fixture
def ray_head(monkeypatch):
    """A Ray head on 127.0.0.1 started for the test (`ray start --head`) and stopped after it."""
    import importlib.util

    if importlib.util.find_spec("ray") is None:  # (not imported here: Ray reads its token settings at import)
        pytest.skip("Ray is not installed (pip install 'infertune[ray]'); CI installs it")
    import secrets
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from infertune.executor.worker import free_port

    ray_cli = shutil.which("ray") or str(Path(sys.executable).with_name("ray"))
    port = free_port()
    # Ray >= 2.59 authenticates a local cluster's clients by token: one for this head, its workers and the driver,
    # the same for every head of this test process (Ray keeps the first token it read: a second head with a new
    # one refused this process's ray.init)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", _RAY_TOKEN.setdefault("token", secrets.token_hex(32)))
    start = [ray_cli, "start", "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--num-cpus=2", "--block"]
    # --block: the head lives as long as this process, whose end stops the processes it started and no others (`ray
    # stop` would stop every Ray cluster of this user on the machine)
    head = subprocess.Popen(
        [*start, "--include-dashboard=false", "--disable-usage-stats"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    try:
        import socket
        import time

        deadline = time.monotonic() + 180
        while True:  # (the head's GCS port answers once it is up)
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert head.poll() is None and time.monotonic() < deadline, "the Ray head did not start"
                time.sleep(0.5)
        yield
    finally:
        head.terminate()
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait(10)
        # Ray's file of the last cluster started here names this head: a later ray.init() would try to join it
        current = Path("/tmp/ray/ray_current_cluster")
        if current.is_file() and current.read_text().strip().endswith(f":{port}"):
            current.unlink()


def test_ray_actors_give_the_same_greedy_tokens(ray_head, tiny_llama):
    """Two ranks, then four on the head's 2 CPUs (they share them, as the mp executor's do: this waited 120 s for a
    placement of 4 whole CPUs and then raised Ray's own timeout)."""
    prompts = prompts_for(256)
    _, reference = run(tiny_llama, prompts)
    for size in (2, 4):
        llm, got = run(tiny_llama, prompts, tensor_parallel_size=size, distributed_executor_backend="ray")
        try:
            assert f"tensor parallel over {size} Ray actors on 1 node(s)" in llm.engine.executor.describe()
            assert got == reference
        finally:
            llm.engine.shutdown()


def test_ray_without_a_cluster_to_join_is_one_clear_error(monkeypatch):
    """RAY_ADDRESS naming a port nobody listens on: a RuntimeError at once (Ray itself retried for minutes), and
    RAY_ADDRESS=auto with no cluster: Ray's ConnectionError said in one line with what to do."""
    from infertune.executor.ray_executor import init_ray
    from infertune.executor.worker import free_port

    class NoCluster:
        def is_initialized(self):
            return False

        def init(self, **kwargs):
            raise ConnectionError("Could not find any running Ray instance. Please specify the one to connect to")

    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")
    with pytest.raises(RuntimeError, match="no Ray cluster answers there"):
        init_ray(NoCluster())
    monkeypatch.setenv("RAY_ADDRESS", "auto")
    with pytest.raises(RuntimeError, match=r"Ray found no cluster to join \(Could not find any running Ray instance"):
        init_ray(NoCluster())


def test_ray_does_not_join_a_cluster_that_is_gone(monkeypatch, tmp_path):
    """Ray's file of the last cluster started here naming one that is gone (a head killed, a crash): ray.init()
    tried to join it for minutes; a local cluster is started instead."""
    from infertune.executor.ray_executor import init_ray
    from infertune.executor.worker import free_port

    class Recorder:
        def is_initialized(self):
            return False

        def init(self, **kwargs):
            self.kwargs = kwargs

    (tmp_path / "ray").mkdir()
    (tmp_path / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{free_port()}\n")
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray = Recorder()
    assert init_ray(ray) and ray.kwargs.get("address") == "local"
    (tmp_path / "ray" / "ray_current_cluster").unlink()  # no file: Ray's own choice
    assert init_ray(ray) and "address" not in ray.kwargs


def _prompt_logprobs(path, **engine) -> list[float]:
    llm = LLM(str(path), dtype="float32", max_model_len=64, block_size=BLOCK, **engine)
    try:
        ids = list(range(3, 40))
        out = llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        return [e.logprob for e in out.prompt_logprobs[1:]]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("method", ["w8a16", "w8a8"])
def test_each_rank_quantizes_its_share_within_the_one_rank_error(tiny_llama, method):
    """W8A16 / W8A8 quantize each rank's slices as they load: column-split layers get one rank's scales exactly; a
    row-split layer's per-channel scales (and W8A8's per-token activation scales) span only a rank's input columns
    (finer, not coarser). Oracle: the fp32 model's prompt logprobs; the quantized two-rank model stays within the
    one-rank quantized model's error (plus a margin)."""
    exact = torch.tensor(_prompt_logprobs(tiny_llama))
    one = (torch.tensor(_prompt_logprobs(tiny_llama, quantization=method)) - exact).abs().max()
    two = (torch.tensor(_prompt_logprobs(tiny_llama, quantization=method, tensor_parallel_size=2)) - exact).abs().max()
    assert 0 < one < 0.25 and 0 < two <= 1.5 * one + 1e-3, (float(one), float(two))


def test_an_fp8_checkpoint_splits_its_block_scales_over_the_ranks(tmp_path):
    """A block-scaled FP8 checkpoint (blocks of 32 x 32; an MLP of 80: a rank's 40 rows end inside a block) under
    TP=2: each rank dequantizes its slices with their blocks' scales. Oracle: the same checkpoint on one rank (the
    same dequantized weights, so the prompt logprobs agree to fp32 rounding)."""
    from test_fp8_checkpoint import to_fp8

    src = make_checkpoint(tmp_path / "src", "llama", intermediate_size=80)
    to_fp8(src, tmp_path / "fp8", (32, 32))
    one = torch.tensor(_prompt_logprobs(tmp_path / "fp8"))
    two = torch.tensor(_prompt_logprobs(tmp_path / "fp8", tensor_parallel_size=2))
    torch.testing.assert_close(two, one, atol=1e-4, rtol=0)


def test_profile_splits_each_step_into_compute_communication_and_driver(tiny_llama, tmp_path, capsys):
    """`infertune profile --tensor-parallel-size 2`: every rank times its collectives. Oracle: exact arithmetic of
    the sharding — a Llama step all-reduces once after the embedding and after each layer's o_proj and down_proj
    (2L + 1 calls) of rows x hidden fp32 values, and gathers the vocabulary-split head's logits once (a row a
    sequence, ceil(V / 2) values a rank)."""
    from conftest import read_config

    from infertune.cli import main

    cfg = read_config(tiny_llama)
    batch, input_len, output_len = 2, 12, 5
    out = tmp_path / "tp.json"
    args = ["profile", "--model", str(tiny_llama), "--dtype", "float32", "--tensor-parallel-size", "2", "--greedy"]
    args += ["--batch", str(batch), "--input-len", str(input_len), "--output-len", str(output_len), "--json", str(out)]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "tensor parallel over 2 ranks" in text and "communication" in text
    import json

    s = json.loads(out.read_text())
    assert set(s["phases"]) == {"prefill", "decode"}
    assert s["phases"]["prefill"]["steps"] == 1 and s["phases"]["decode"]["steps"] == output_len - 1
    hidden, layers, vocab = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    for phase, rows in (("prefill", batch * input_len), ("decode", batch)):
        p = s["phases"][phase]
        reduce = p["collectives_per_step"]["all_reduce (shared memory)"]
        gather = p["collectives_per_step"]["all_gather (shared memory)"]
        assert reduce["calls"] == 2 * layers + 1 and reduce["bytes_per_call"] == rows * hidden * 4, (phase, reduce)
        assert gather["calls"] == 1 and gather["bytes_per_call"] == batch * -(-vocab // 2) * 4, (phase, gather)
        parts = p["ms_per_step"]
        assert all(v >= 0 for v in parts.values()) and parts["communication"] > 0
        assert sum(parts.values()) == pytest.approx(p["step_ms_mean"], rel=1e-6) or parts["driver + IPC"] == 0
        for r in p["ranks"]:
            assert 0 < r["communication_ms"] < r["step_ms"]


@pytest.mark.parametrize("kind", ["qwen2-moe", "deepseek-v3"])
def test_expert_parallel_gives_one_rank_s_greedy_tokens(kind, tmp_path):
    """enable_expert_parallel: each rank keeps half the routed experts whole and runs only the pairs routed to them
    (Qwen2-MoE's gated shared expert and DeepSeek-V3's shared experts stay feature-split); the block's all-reduce
    sums the parts. Oracle: one rank's greedy tokens, with prefix caching and chunked prefill on."""
    path = _checkpoint(kind, tmp_path / kind)
    prompts = prompts_for(ArchConfig.from_model_dir(str(path)).vocab_size)
    _, reference = run(path, prompts)
    llm, got = run(
        path,
        prompts,
        tensor_parallel_size=2,
        enable_expert_parallel=True,
        enable_prefix_caching=True,
        max_num_batched_tokens=5,
        max_model_len=64,
    )
    try:
        assert got == reference
    finally:
        llm.engine.shutdown()


def test_expert_parallel_loads_each_rank_s_experts_whole(tmp_path):
    """Exact oracle: rank r's experts are the checkpoint's experts r * E / 2 .. (r + 1) * E / 2 - 1, unsplit, from
    per-expert tensors; a count of experts the ranks do not divide is a clear error before any worker starts."""
    from safetensors.torch import load_file

    from infertune.layers.attention import attention_backend
    from infertune.models.loader import load_model

    path = _checkpoint("mixtral", tmp_path / "mixtral")  # 4 experts, per-expert w1 / w2 / w3 tensors
    arch = ArchConfig.from_model_dir(str(path))
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(f))
    e, local = arch.moe.num_experts, arch.moe.num_experts // 2
    for rank in range(2):
        tp = TensorParallel(rank, 2, expert_parallel=True)
        shape = arch.for_tensor_parallel(2, expert_parallel=True)
        assert shape.moe.intermediate_size == arch.moe.intermediate_size  # whole experts
        model = load_model(shape, str(path), torch.float32, torch.device("cpu"), 64,
                           attention_backend(shape, "auto", torch.float32), tp=tp)  # fmt: skip
        experts = model.model.layers[0].mlp.experts
        assert experts.gate_up_proj.shape[0] == local and experts.expert_offset == rank * local
        for i in range(local):
            name = f"model.layers.0.block_sparse_moe.experts.{rank * local + i}"
            want = torch.cat([tensors[f"{name}.w1.weight"], tensors[f"{name}.w3.weight"]])
            torch.testing.assert_close(experts.gate_up_proj[i], want, rtol=0, atol=0)
            torch.testing.assert_close(experts.down_proj[i], tensors[f"{name}.w2.weight"], rtol=0, atol=0)
    assert e == 4
    six = make_checkpoint(tmp_path / "six", **(MOE_VARIANTS["mixtral"] | dict(num_local_experts=6)))
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"does not divide num_experts \(enable_expert_parallel"):
        LLM(str(six), dtype="float32", tensor_parallel_size=4, enable_expert_parallel=True)
    assert time.monotonic() - start < 5  # the driver's check, before any worker
    LLM(str(six), dtype="float32", tensor_parallel_size=1, enable_expert_parallel=True)  # (one rank: nothing to split)


@pytest.mark.parametrize("method", ["w8a16", "w4a16"])
def test_a_stored_quantized_checkpoint_splits_over_the_ranks(method, tmp_path):
    """`infertune quantize`'s output under TP=2: each rank loads its slices of the stored integers and scales (a
    row-split layer's per-channel scales are every rank's; int4 groups split with the columns). Oracle: the same
    stored checkpoint on one rank — the ranks multiply by the same dequantized weights, so the prompt logprobs agree
    to fp32 rounding; and the MoE experts of a stored Qwen2-MoE, split whole (expert parallel) or by features."""
    from infertune.tools.quantizer import quantize

    # (int4 groups of 32 do not divide the tiny Qwen2-MoE's shared expert of 48: the MoE case runs under w8a16)
    # (phi3: its stored qkv_proj / gate_up_proj keep the fused names, and their per-row scales split with them)
    kinds = ("llama-kv1-odd-vocab", "phi3-kv1-partial")
    for kind in (*kinds, "qwen2-moe") if method == "w8a16" else kinds:
        src = _checkpoint(kind, tmp_path / kind)
        out = tmp_path / f"{kind}-{method}"
        quantize(str(src), method, str(out), group_size=32, num_samples=2, show_progress=False)
        one = torch.tensor(_prompt_logprobs(out))
        for extra in ({}, {"enable_expert_parallel": True}) if kind == "qwen2-moe" else ({},):
            two = torch.tensor(_prompt_logprobs(out, tensor_parallel_size=2, **extra))
            torch.testing.assert_close(two, one, atol=1e-4, rtol=0, msg=f"{kind} {method} {extra}")


@pytest.mark.parametrize(
    "kind",
    [
        "llama-kv1-odd-vocab",
        "gemma2",
        "qwen2-moe",
        "qwen2-moe+ep",
        "mixtral+ep",
        "deepseek-v3+ep",
        "llama-kv1-odd-vocab+gloo",
        "deepseek-v3+ep+gloo",
    ],
)
def test_two_ranks_run_the_fused_step_in_bf16(kind, tmp_path, monkeypatch):
    """bf16 on the CPU's kernels: each rank runs its share of every layer in one fused C step, summing o_proj's and
    down's (a MoE block's) outputs over the ranks through the shared-memory all-reduce in C (csrc/fused_step.h
    tp_allreduce, the protocol of layers/shm_allreduce.py, whose sequence numbers it shares); MoE models with their
    experts' features split, or with expert parallel (+ep: each rank's block of whole experts, the others' pairs
    skipped); DeepSeek-V3 (latent attention: each rank's heads, the latent replicated; the fp32 router, expert
    parallel); +gloo: no shared-memory segment (INFERTUNE_TP_SHM=0, as ranks on two hosts have none), the step calling
    back the engine's gloo all-reduce between its kernels. Oracle: HF transformers in fp32, the logprobs as close as one rank's fused engine; and the
    collectives (exact counts): per step the embedding's all-reduce and the head's gather in Python, not the 2L + 1
    all-reduces of the per-module path, and the 2L in C (counted by the kernels, in the same bytes as the
    embedding's: rows x hidden fp32)."""
    from test_kernels import _hf_logprob_errors, needs_fused

    from infertune.kernels import cpu as kernels

    if needs_fused.args[0]:
        pytest.skip(needs_fused.kwargs["reason"])
    kind, *flags = kind.split("+")
    ep, gloo = "ep" in flags, "gloo" in flags
    if gloo:  # (the workers inherit it)
        monkeypatch.setenv("INFERTUNE_TP_SHM", "0")
    path = _checkpoint(kind, tmp_path / kind)
    hf = hf_model(path).float()
    prompts = [{"prompt_token_ids": p} for p in prompts_for(hf.config.vocab_size)]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    worst, median = {}, {}
    for size in (1, 2):
        # (+ep: expert parallel, each rank's fused step runs its block of the experts whole, the shared expert split)
        extra = {"enable_expert_parallel": True} if ep and size == 2 else {}
        llm = LLM(str(path), dtype="bfloat16", block_size=BLOCK, max_model_len=64, tensor_parallel_size=size, **extra)
        try:
            if size == 2:
                llm.engine.executor.comm_stats()  # (from zero)
            errs = _hf_logprob_errors(llm, prompts, params, hf, argmax=False)
            worst[size], median[size] = max(errs), statistics.median(errs)
            if size == 2:
                layers, steps = hf.config.num_hidden_layers, None
                # (MoE models: the prompts' step runs the per-module path, its 2L + 1 all-reduces in Python, but with
                # AMX, where the fused step takes MoE prompts with bf16 experts; DeepSeek's latent attention: always)
                moe_prompts_fused = kind in MOE_VARIANTS and kernels.amx()
                module_steps = (
                    1 if (kind in MOE_VARIANTS and not moe_prompts_fused) or kind.startswith("deepseek") else 0
                )
                for rank in llm.engine.executor.comm_stats():
                    steps = rank["steps"]
                    calls = {k: v["calls"] for k, v in rank["collectives"].items()}
                    if gloo:  # the embedding's and the per-module steps' in Python, the fused steps' called back
                        assert calls == {
                            "all_reduce (gloo)": steps + 2 * layers * module_steps,
                            "all_gather (gloo)": steps,
                            "all_reduce (gloo, called back by the fused step)": 2 * layers * (steps - module_steps),
                        }, (calls, steps)
                        continue
                    assert calls == {
                        "all_reduce (shared memory)": steps + 2 * layers * module_steps,
                        "all_gather (shared memory)": steps,
                        # o_proj's and the MLP's (MoE: the block's) in every layer of every fused step, in C
                        "all_reduce (fused step, in C)": 2 * layers * (steps - module_steps),
                    }, (calls, steps)
                    fused = rank["collectives"]["all_reduce (fused step, in C)"]
                    assert fused["ns"] > 0 and fused["ns"] < rank["exec_ns"]
                    assert fused["bytes"] % (4 * hf.config.hidden_size) == 0
                    if not module_steps:
                        # fp32 values of the hidden size a row, twice a layer: each step's rows (the embedding's
                        # all-reduce sums them in bf16) in every layer but the last, which goes on with the rows
                        # sampled only
                        embedding = rank["collectives"]["all_reduce (shared memory)"]["bytes"] * 2  # (as fp32)
                        assert 2 * (layers - 1) * embedding < fused["bytes"] <= 2 * layers * embedding
        finally:
            llm.engine.shutdown()
    assert worst[2] <= 1.5 * worst[1] + 0.02, worst
    # (these random MoE models in bf16 flip a token's experts now and then, which moves its logprob by nats either
    # way: the worst errors say little there, the median tells a wrong expert or a missing sum)
    assert median[2] <= 1.5 * median[1] + 0.02, median


def test_a_rank_that_dies_while_idle_turns_health_to_503(tiny_llama):
    """No request running when a rank dies: /health (what a load balancer probes) says so within a second or two and
    the other rank is stopped, rather than answering ok until a request finds the dead rank."""
    import httpx
    import psutil
    from server_utils import ServerThread, wait_until

    with ServerThread(tiny_llama, tensor_parallel_size=2) as server:
        procs = server.engine.engine.executor._procs
        ranks = [psutil.Process(p.pid) for p in procs]
        procs[1].kill()
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 503, timeout=10)
        body = httpx.get(server.url + "/health").json()
        assert "tensor-parallel rank 1" in body["error"]["message"]
        _, alive = psutil.wait_procs(ranks, timeout=10)
        assert not alive  # rank 0 was stopped too (it would wait for rank 1 in its next collective)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=30)
        assert r.status_code == 503 and "tensor-parallel rank 1" in r.text


def test_a_ray_actor_that_dies_while_idle_turns_health_to_503(ray_head, tiny_llama):
    """The same under Ray: an actor killed between requests is found by the idle pings (check_health)."""
    import httpx
    import ray
    from server_utils import ServerThread, wait_until

    with ServerThread(tiny_llama, tensor_parallel_size=2, distributed_executor_backend="ray") as server:
        ray.kill(server.engine.engine.executor._actors[1], no_restart=True)
        assert wait_until(lambda: httpx.get(server.url + "/health").status_code == 503, timeout=15)
        assert "tensor-parallel rank 1 (Ray actor) died" in httpx.get(server.url + "/health").text


def test_a_script_that_exits_without_shutdown_stops_its_ranks_cleanly(tiny_llama):
    """vLLM scripts seldom call shutdown(): at exit the ranks are told to stop, where multiprocessing's exit hook
    terminated them mid-wait and its resource tracker warned of leaked semaphores."""
    import subprocess
    import sys

    script = (
        "from infertune import LLM, SamplingParams\n"
        "if __name__ == '__main__':\n"
        f"    llm = LLM({str(tiny_llama)!r}, dtype='float32', max_model_len=64, tensor_parallel_size=2)\n"
        "    print(llm.generate('x', SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "leaked" not in done.stderr, done.stderr


def test_a_rank_that_dies_mid_run_fails_the_step_at_once(tiny_llama):
    """The driver no longer waits FAILURE_GRACE_S (5 s) for the surviving rank, which waits for the dead one in its
    next collective and cannot answer: the step fails as soon as the death is seen (a client's stream waited 5 s)."""
    from infertune.executor.multiproc import FAILURE_GRACE_S

    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, block_size=4, tensor_parallel_size=2)
    try:
        victim = llm.engine.executor._procs[1]
        killed_at = []
        threading.Timer(0.5, lambda: (killed_at.append(time.monotonic()), victim.kill())).start()
        long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        with pytest.raises(WorkerError, match="tensor-parallel rank 1"):
            for _ in range(100):
                llm.generate(["x y z"] * 4, long, use_tqdm=False)
        assert time.monotonic() - killed_at[0] < FAILURE_GRACE_S / 2
    finally:
        llm.engine.shutdown()


def test_pipeline_parallel_size_1_is_accepted_as_vllm_spells_it_and_more_is_a_clear_error(tiny_llama, capsys):
    """vLLM commands and configs often spell out --pipeline-parallel-size 1 (an unrecognized argument here before)."""
    from infertune.cli import main

    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, pipeline_parallel_size=1)
    assert llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    with pytest.raises(ValueError, match="pipeline_parallel_size=2: pipeline parallel is not supported"):
        LLM(str(tiny_llama), pipeline_parallel_size=2)
    assert main(["serve", "--model", str(tiny_llama), "--pipeline-parallel-size", "2"]) == 2
    assert "split the model over processes with tensor_parallel_size" in capsys.readouterr().err
