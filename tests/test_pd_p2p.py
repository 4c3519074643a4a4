"""Prefill/decode disaggregation across hosts: the p2p KV connector (TCPStore + gloo pairs) on 127.0.0.1.

The two sides load different copies of the checkpoint (separate folders) and share no directory, so the KV can only
travel through torch.distributed. The oracles: one plain engine / server on the same weights (greedy outputs equal
exactly), Hugging Face transformers' greedy tokens, and the consumer's counters (it loaded the prompts' blocks and
computed only each prompt's last token).
"""

from __future__ import annotations

import json
import shutil
import time

import httpx
import pytest
import torch
from server_utils import ServerProcess, ServerThread, free_port, metric, wait_until
from test_pd import RouterThread, _answer_of, _generate, _prefill_for_transfer, _requests, _run_all

from infertune.config import EngineConfig
from infertune.engine.llm_engine import LLMEngine
from infertune.kv_transfer import KVTransferError
from infertune.kv_transfer.base import KVConnectorMetadata, KVLoad
from infertune.kv_transfer.p2p import P2PConnectorWorker, connector_settings
from infertune.sampling_params import SamplingParams

BASE = dict(dtype="float32", max_model_len=64, block_size=4, max_num_seqs=4, kv_cache_memory_bytes=2**20)
PROMPTS = ["The cat sat on the mat and", "def add(a, b):", "Once upon a time"]


@pytest.fixture(scope="module")
def copies(tiny_llama, tmp_path_factory):
    """Two folders holding the same checkpoint: the producer reads one, the consumer the other."""
    root = tmp_path_factory.mktemp("p2p")
    return shutil.copytree(tiny_llama, root / "prefill"), shutil.copytree(tiny_llama, root / "decode")


def _p2p(role: str, port: int | None = None, **cfg) -> dict:
    """A producer's store port; a consumer learns its producer's address from kv_transfer_params (unless given)."""
    where = {} if port is None else {"port": port}
    return dict(kv_role=role, kv_connector="p2p", kv_connector_config={**where, "timeout_s": 2.0, **cfg})


def test_settings_are_checked():
    assert connector_settings(None)["host"] == "127.0.0.1" and connector_settings(None)["port"] == 29650
    assert not connector_settings(None)["check_peer"] and connector_settings({"port": 1})["check_peer"]
    with pytest.raises(ValueError, match=r"unknown keys \['path'\].*p2p"):
        connector_settings({"path": "/tmp"})
    with pytest.raises(ValueError, match="wildcard"):
        connector_settings({"host": "0.0.0.0"})
    with pytest.raises(ValueError, match="port="):
        connector_settings({"port": "80"})
    with pytest.raises(ValueError, match="timeout_s"):
        connector_settings({"timeout_s": 0})


def test_consumer_loads_the_prompts_kv_and_decodes_like_one_engine_and_hf(copies):
    from transformers import AutoModelForCausalLM

    prefill_dir, decode_dir = copies
    port = free_port()
    plain = LLMEngine(EngineConfig.create(str(decode_dir), **BASE))
    producer = LLMEngine(EngineConfig.create(str(prefill_dir), **BASE, **_p2p("producer", port)))
    consumer = LLMEngine(EngineConfig.create(str(decode_dir), **BASE, **_p2p("consumer")))
    hf = AutoModelForCausalLM.from_pretrained(decode_dir, dtype=torch.float32).eval()
    try:
        blocks = tokens = 0
        first = None
        for i, prompt in enumerate(PROMPTS):
            want = _generate(plain, f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=8))
            answer = _prefill_for_transfer(producer, f"p{i}", prompt)
            assert answer["host"] == "127.0.0.1" and answer["port"] == port and "path" not in answer
            got = _generate(
                consumer, f"d{i}", prompt, SamplingParams(temperature=0, max_tokens=8, kv_transfer_params=answer)
            )
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            ids = torch.tensor([got.prompt_token_ids])
            ref = hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1] :].tolist()
            assert got.outputs[0].token_ids == ref
            first = first or (answer, got.outputs[0].token_ids)
            n = len(got.prompt_token_ids)
            blocks, tokens = blocks + -(-n // 4), tokens + n - 1
        stats = consumer.stats()
        kv = {k: v[0] for k, v in stats["kv_transfer"].items()}
        # every prompt's KV but its last token came over the wire; only that token was computed here
        assert stats["prefill_tokens_computed"] == len(PROMPTS)
        assert kv["kv_transfer_loads"] == len(PROMPTS) and kv["kv_transfer_load_failures"] == 0
        assert kv["kv_transfer_tokens_loaded"] == tokens and kv["kv_transfer_blocks_loaded"] == blocks
        producer.poll_kv_transfers()  # the consumer confirmed every lease: the producer holds nothing
        assert producer.block_manager.num_free_blocks == producer.block_manager.num_blocks
        assert producer.stats()["kv_transfer"]["kv_transfer_leases_confirmed"][0] == len(PROMPTS)
        # a used lease is gone: handing it again is a failure the policy decides (recompute: the same tokens)
        reuse = SamplingParams(temperature=0, max_tokens=8, kv_transfer_params=first[0])
        assert _generate(consumer, "again", PROMPTS[0], reuse).outputs[0].token_ids == first[1]
        assert consumer.stats()["kv_transfer"]["kv_transfer_load_failures"][0] == 1
    finally:
        for e in (producer, consumer, plain):
            e.shutdown()


def test_a_layout_mismatch_is_refused(copies):
    prefill_dir, decode_dir = copies
    port = free_port()
    producer = LLMEngine(EngineConfig.create(str(prefill_dir), **BASE, **_p2p("producer", port)))
    try:
        other = {**BASE, "block_size": 8}
        # told where its producer is, a consumer refuses to start, naming both values
        with pytest.raises(ValueError, match="block_size: this consumer has 8, the producer 4"):
            LLMEngine(EngineConfig.create(str(decode_dir), **other, **_p2p("consumer", port, host="127.0.0.1")))
        # not told, it refuses the first transfer from that producer (HTTP 500, whatever the policy)
        consumer = LLMEngine(EngineConfig.create(str(decode_dir), **other, **_p2p("consumer")))
        try:
            answer = _prefill_for_transfer(producer, "p", PROMPTS[0])
            with pytest.raises(KVTransferError, match="block_size: this consumer has 8") as e:
                consumer.add_request("d", PROMPTS[0], SamplingParams(max_tokens=4, kv_transfer_params=answer))
            assert e.value.status == 500 and e.value.code == "kv_transfer_mismatch"
        finally:
            consumer.shutdown()
    finally:
        producer.shutdown()


def test_worker_receives_the_producers_bytes_and_fails_loads_it_cannot_do(copies):
    """The worker side alone: a leased block arrives byte for byte as the producer holds it; an unknown lease, a
    lease that ran out and a producer no longer there are failed loads (the step recomputes them), never a hang."""
    prefill_dir, _ = copies
    port = free_port()
    producer = LLMEngine(
        EngineConfig.create(str(prefill_dir), **BASE, **_p2p("producer", port, lease_s=1.0, margin_s=0.0))
    )
    worker = P2PConnectorWorker("consumer", connector_settings({"timeout_s": 1.0}), 0)
    try:
        source = producer.executor.runner._kv_storage  # [pages, 2, blocks, block_size, heads, head_dim]
        storage = torch.zeros_like(source)
        answer = _prefill_for_transfer(producer, "p", PROMPTS[0])
        src = answer["block_ids"]
        dst = list(range(len(src), 2 * len(src)))

        def load(transfer_id: str, peer: str = f"127.0.0.1:{port}") -> list[str]:
            item = KVLoad("r1", "eid", src, dst, source.shape[2], time.time() + 30, 0, 8, transfer_id, peer)
            return worker.start_load_kv(KVConnectorMetadata([item]), storage)

        assert load(answer["transfer_id"]) == []
        assert torch.equal(storage[:, :, dst], source[:, :, src]) and source[:, :, src].abs().sum() > 0
        storage.zero_()
        assert load("no-such-lease") == ["r1"]  # the producer answers: no such lease
        started = time.monotonic()
        assert load(answer["transfer_id"], f"127.0.0.1:{free_port()}") == ["r1"]  # nobody listens there
        assert time.monotonic() - started < 1.0 + 5
        assert wait_until(
            lambda: (
                producer.poll_kv_transfers()
                or producer.block_manager.num_free_blocks == producer.block_manager.num_blocks
            ),
            5,
        )
        assert producer.stats()["kv_transfer"]["kv_transfer_leases_expired"][0] == 1
        assert load(answer["transfer_id"]) == ["r1"]  # the lease ran out: the producer no longer serves it
        assert not storage.any()  # nothing was written by the failed loads
    finally:
        worker.shutdown()
        producer.shutdown()


def test_router_with_a_p2p_producer_process_then_its_death(copies, tiny_llama):
    """Router + a producer in its own process + a consumer server: one server's outputs; then the producer is killed
    holding leases that are handed over: recompute gives the same output, fail a 503, each within the timeout."""
    prefill_dir, decode_dir = copies
    port = free_port()
    kv = json.dumps({"port": port, "timeout_s": 2.0})
    requests = _requests(12)
    with ServerThread(tiny_llama) as reference:
        expected = _run_all(reference.url, requests)
    assert all(status == 200 for status, _ in expected)
    flags = ("--kv-role", "producer", "--kv-connector", "p2p", "--kv-connector-config", kv)
    strict = LLMEngine(EngineConfig.create(str(decode_dir), **BASE, **_p2p("consumer"), kv_load_failure_policy="fail"))
    with (
        ServerProcess(prefill_dir, *flags) as p,
        ServerThread(decode_dir, **_p2p("consumer")) as d,
        RouterThread(prefill=[p.url], decode=[d.url], connect_timeout_s=2.0) as router,
    ):
        assert _run_all(router.url, requests, workers=4) == expected
        computed = metric(d.url, "infertune_prefill_tokens_computed_total")
        loaded = metric(d.url, "infertune_kv_transfer_tokens_loaded_total")
        prompt_tokens = metric(d.url, "infertune_prompt_tokens_total")
        hits = round(metric(d.url, "infertune_prefix_cache_hit_rate") * prompt_tokens)
        assert computed == len(requests) and loaded > 0 and hits + loaded + computed == prompt_tokens
        assert metric(d.url, "infertune_kv_transfer_blocks_loaded_total") > 0
        assert metric(d.url, "infertune_kv_transfer_load_failures_total") == 0
        assert wait_until(lambda: metric(p.url, "infertune_kv_blocks_used") == 0, 10)
        assert metric(p.url, "infertune_kv_transfer_leases_confirmed_total") == len(requests)
        assert metric(d.url, "infertune_kv_blocks_used") == 0
        # a request only the decode side refuses: its 400, and the producer's lease ends at once (its store key)
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 4, "best_of": 2})
        assert r.status_code == 400 and metric(p.url, "infertune_kv_transfer_granted_total") == len(requests) + 1
        assert wait_until(lambda: metric(p.url, "infertune_kv_blocks_used") == 0, 5)

        # leases the producer holds when it dies
        path, body = requests[0]
        ask = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        held = [httpx.post(p.url + path, json=ask, timeout=60).json()["kv_transfer_params"] for _ in range(2)]
        p.proc.kill()
        p.proc.wait(10)
        started = time.monotonic()
        assert _answer_of(d.url, path, {**body, "kv_transfer_params": held[0]}) == expected[0]
        assert time.monotonic() - started < 2.0 + 5  # the timeout, and a loaded machine's slack
        assert metric(d.url, "infertune_kv_transfer_load_failures_total") == 1
        assert metric(d.url, "infertune_kv_blocks_used") == 0
    try:  # kv_load_failure_policy=fail: refused at admission (the server answers the error with its 503)
        started = time.monotonic()
        with pytest.raises(KVTransferError, match="does not answer.*kv_load_failure_policy=fail") as e:
            strict.add_request("s", body["prompt"], SamplingParams(max_tokens=4, kv_transfer_params=held[1]))
        assert e.value.status == 503 and time.monotonic() - started < 2.0 + 5
        assert strict.block_manager.num_free_blocks == strict.block_manager.num_blocks
    finally:
        strict.shutdown()


def test_a_model_with_a_windowed_kv_group_moves_each_groups_blocks(tmp_path):
    """Qwen2 with its last layer windowed (a full and a windowed KV cache group): the blocks travel per group over
    the gloo pair, and the consumer's greedy tokens are one plain engine's (test_pd.py holds the planning to it on
    the local connector)."""
    from conftest import make_checkpoint

    model = make_checkpoint(tmp_path / "qwen2", "qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    decode_dir = shutil.copytree(model, tmp_path / "decode")
    base = {**BASE, "max_model_len": 96, "max_num_batched_tokens": 16}
    port = free_port()
    plain = LLMEngine(EngineConfig.create(str(decode_dir), **base))
    producer = LLMEngine(EngineConfig.create(str(model), **base, **_p2p("producer", port)))
    consumer = LLMEngine(EngineConfig.create(str(decode_dir), **base, **_p2p("consumer")))
    try:
        prompt = "The cat sat on the mat and looked at the dog, who"
        want = _generate(plain, "r", prompt, SamplingParams(temperature=0, max_tokens=8))
        answer = _prefill_for_transfer(producer, "p", prompt)
        assert len(answer["block_ids"]) == 2 and answer["block_ids"][1][0] == -1  # (the windowed group's, freed)
        got = _generate(consumer, "d", prompt, SamplingParams(temperature=0, max_tokens=8, kv_transfer_params=answer))
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        stats = consumer.stats()
        assert stats["prefill_tokens_computed"] == 1 and stats["kv_transfer"]["kv_transfer_loads"][0] == 1
        producer.poll_kv_transfers()
        assert producer.block_manager.num_free_blocks == producer.block_manager.num_blocks
    finally:
        for e in (producer, consumer, plain):
            e.shutdown()
