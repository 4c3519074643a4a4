"""The multiprocess executor: the model runner in a spawned worker process that sees only pickled
SchedulerOutputs. Oracles: HF transformers' greedy tokens, and the in-process executor token for token (with
logprobs, seeded sampling, chunked prefill, prefix-cache hits and forced preemption)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from infertune import LLM, SamplingParams
from infertune.config import default_model_path
from infertune.executor.multiproc import WorkerError

PROMPT = "def __init__(self"


def test_worker_process_greedy_matches_hf_and_the_cli_runs_it():
    from transformers import AutoModelForCausalLM

    llm = LLM(dtype="float32", max_model_len=256, distributed_executor_backend="mp")
    try:
        assert "in worker process" in llm.engine.executor.describe()
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0]
    finally:
        llm.engine.shutdown()
    hf = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids])
    assert out.outputs[0].token_ids == hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
    assert not llm.engine.executor._proc.is_alive()
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "infertune.cli",
            "generate",
            PROMPT,
            "--max-tokens",
            "24",
            "--dtype",
            "float32",
            "--distributed-executor-backend",
            "mp",
            "--no-token-healing",  # (on by default for the demo model: the offline run above is not healed)
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.rstrip("\n") == out.outputs[0].text and "in worker process" in cli.stderr


def test_worker_process_matches_in_process_through_chunks_prefix_hits_and_preemption(tiny_llama):
    # A pool of 24 blocks of 4 tokens for 6 sequences of up to 40 tokens: they preempt each other.
    engine = dict(
        dtype="float32",
        max_model_len=64,
        block_size=4,
        max_num_seqs=6,
        max_num_batched_tokens=12,
        kv_cache_memory_bytes=24 * 2048,
    )  # 2 layers x K, V x 2 heads x 16 x 4 tokens x 4 B
    shared = "The same long system prompt, "
    prompts = [shared + tail for tail in ("one", "two", "three")] + ["short", "x" * 20]
    params = [
        SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, top_k=20, seed=7, n=2, max_tokens=20, ignore_eos=True),
    ]
    results = {}
    for backend in ("uni", "mp"):
        llm = LLM(str(tiny_llama), distributed_executor_backend=backend, **engine)
        try:
            assert llm.engine.executor.kv_cache_info.num_blocks == 24
            results[backend] = [
                [
                    (
                        c.token_ids,
                        [
                            (e.token_id, round(e.logprob, 4), [(t, round(v, 4)) for t, v in e.top])
                            for e in c.logprobs or []
                        ],
                    )
                    for c in o.outputs
                ]
                for sp in params
                for o in llm.generate(prompts, sp, use_tqdm=False)
            ]
            stats = llm.engine.stats()
            assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_rate"] > 0
        finally:
            llm.engine.shutdown()
    assert results["mp"] == results["uni"]


def test_worker_failures_reach_the_driver_as_clear_errors(tiny_llama):
    with pytest.raises(ValueError, match="KV-cache budget"):  # raised in the worker while loading
        LLM(
            str(tiny_llama),
            dtype="float32",
            max_model_len=64,
            kv_cache_memory_bytes=64,
            distributed_executor_backend="mp",
        )
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=64, block_size=4, distributed_executor_backend="mp")
    assert llm.generate("x", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    with pytest.raises(AttributeError, match="distributed_executor_backend='uni'"):
        llm.engine.executor.runner  # noqa: B018 - the tools that read the runner get told what to change
    llm.engine.executor._proc.kill()
    llm.engine.executor._proc.join(10)
    with pytest.raises(WorkerError, match="worker process exited"):
        llm.generate("x", SamplingParams(max_tokens=2))
    llm.engine.shutdown()


def test_server_with_a_worker_process_serves_the_same_text_and_leaves_no_process(tiny_llama):
    import signal

    import httpx
    import psutil
    from server_utils import ENGINE, ServerProcess

    ref = (
        LLM(str(tiny_llama), **ENGINE)
        .generate("The cache", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0]
        .outputs[0]
        .text
    )
    with ServerProcess(tiny_llama, "--distributed-executor-backend", "mp") as server:
        workers = psutil.Process(server.proc.pid).children(recursive=True)
        assert workers  # the model runs in a child process
        r = httpx.post(
            server.url + "/v1/completions",
            json={"prompt": "The cache", "max_tokens": 12, "temperature": 0, "ignore_eos": True},
            timeout=60,
        )
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == ref
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(30) == 0
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive
    assert "in worker process" in server.log
