"""Prefill/decode disaggregation: the local KV connector against the block manager, and router + 1P + 1D servers.

The oracle is one plain server (or engine) on the same checkpoint: greedy outputs through the router must be its
outputs exactly, and the consumer must have loaded the prompts instead of computing them (its counters).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn
from server_utils import MODEL, ServerProcess, ServerThread, free_port, metric, wait_until

from infertune.config import EngineConfig, SchedulerConfig
from infertune.engine.block_manager import BlockManager
from infertune.engine.llm_engine import LLMEngine
from infertune.engine.scheduler import Scheduler
from infertune.engine.sequence import Sequence, SequenceStatus
from infertune.kv_transfer import KVTransferError
from infertune.kv_transfer.local import LocalConnectorScheduler, connector_settings, prompt_hash
from infertune.kv_transfer.p2p import P2PConnectorScheduler
from infertune.kv_transfer.p2p import connector_settings as p2p_settings
from infertune.router.app import Router
from infertune.router.policy import Instance, Picker
from infertune.sampling_params import SamplingParams

LAYOUT = {"model": "m", "block_size": 4, "cache_dtype": "float32", "block_shape": [2, 2, 2, 16]}


def _connector(tmp_path, role, policy="recompute", layout=LAYOUT, **cfg):
    settings = connector_settings({"path": str(tmp_path), "engine_id": f"{role}-test", **cfg})
    return LocalConnectorScheduler(role, settings, dict(layout), 32, 4, policy)


def _leases(tmp_path) -> list[str]:
    return sorted(os.listdir(tmp_path / "leases"))


def _finish_prefill(sched: Scheduler, seq: Sequence) -> None:
    batch = sched.schedule()
    assert batch.seqs == [seq]
    sched.scheduler_output(batch)
    sched.update(batch, [7])


# ---- the scheduler side against the block manager ------------------------------------------------------------
def test_producer_keeps_blocks_on_a_lease_until_confirmed_or_expired(tmp_path):
    bm = BlockManager(32, 4)
    conn = _connector(tmp_path, "producer", lease_s=0.3, margin_s=0.0)
    sched = Scheduler(SchedulerConfig(), bm, conn)
    params = SamplingParams(max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    seq = Sequence(list(range(10)), 1, params)
    sched.add(seq)
    _finish_prefill(sched, seq)
    assert seq.status is SequenceStatus.FINISHED_LENGTH
    answer = seq.kv_transfer_params
    assert answer["num_tokens"] == 10 and answer["block_ids"] == seq.block_table and len(seq.block_table) == 3
    assert answer["prompt_hash"] == prompt_hash(list(range(10)))
    assert bm.num_free_blocks == 29  # held for the consumer
    lease = f"producer-test.{answer['transfer_id']}"
    assert _leases(tmp_path) == [lease]
    sched.release_kv_transfers()
    assert bm.num_free_blocks == 29
    os.unlink(tmp_path / "leases" / lease)  # what a consumer does once it copied them
    sched.release_kv_transfers()
    assert bm.num_free_blocks == 32 and conn.counts["leases_confirmed"] == 1

    seq2 = Sequence(list(range(6)), 1, params)
    sched.add(seq2)
    _finish_prefill(sched, seq2)
    assert bm.num_free_blocks == 30
    time.sleep(0.35)
    sched.schedule()  # each step releases what ran out
    assert bm.num_free_blocks == 32 and conn.counts["leases_expired"] == 1 and _leases(tmp_path) == []

    # an aborted request, and one that did not ask for a transfer, free at once
    for p in (params, SamplingParams(max_tokens=1)):
        s = Sequence(list(range(6)), 1, p)
        sched.add(s)
        sched.scheduler_output(sched.schedule())
        sched.finish(s, SequenceStatus.FINISHED_ABORTED if p is params else SequenceStatus.FINISHED_STOPPED)
        assert bm.num_free_blocks == 32 and s.kv_transfer_params is None
    conn.shutdown()
    assert not list(tmp_path.glob("producer-*.json"))


def _producer_card(tmp_path, pid=None, layout=LAYOUT, engine_id="p1"):
    card = {"engine_id": engine_id, "role": "producer", "pid": pid or os.getpid(), "layout": layout, "num_blocks": 64}
    (tmp_path / f"producer-{engine_id}.json").write_text(json.dumps(card))
    (tmp_path / "leases").mkdir(exist_ok=True)
    (tmp_path / "leases" / f"{engine_id}.t1").touch()


def _answer(prompt, engine_id="p1", lease_s=30.0, **over):
    n = len(prompt)
    blocks = list(range(40, 40 + -(-n // 4)))
    p = {
        "do_remote_prefill": True,
        "engine_id": engine_id,
        "transfer_id": "t1",
        "block_ids": blocks,
        "num_tokens": n,
        "prompt_hash": prompt_hash(prompt),
        "expires_at": time.time() + lease_s,
    }
    return {**p, **over}


def test_consumer_loads_past_its_own_prefix_hits_and_confirms(tmp_path):
    _producer_card(tmp_path)
    bm = BlockManager(32, 4)
    conn = _connector(tmp_path, "consumer")
    sched = Scheduler(SchedulerConfig(), bm, conn)
    prompt = list(range(100, 118))  # 18 tokens: blocks 0-4, the last one partial
    # a plain request first puts the prompt's first 8 tokens in the prefix cache
    warm = Sequence(prompt[:9], 1, SamplingParams(max_tokens=1))
    sched.add(warm)
    _finish_prefill(sched, warm)
    assert bm.num_free_blocks == 32

    remote = conn.check_request(_answer(prompt), prompt)
    seq = Sequence(prompt, 4, SamplingParams(max_tokens=4))
    seq.kv_transfer = remote
    sched.add(seq)
    batch = sched.schedule()
    out = sched.scheduler_output(batch)
    assert batch.num_scheduled_tokens == [1]  # only the prompt's last token is computed
    assert seq.num_cached_tokens == 8 and seq.num_computed_tokens == 17
    (load,) = out.kv_connector_metadata.loads
    assert (load.num_local_tokens, load.num_loaded_tokens) == (8, 9)
    assert load.src_block_ids == [42, 43, 44] and load.dst_block_ids == seq.block_table[2:5]
    assert out.new_requests[0].num_computed_tokens == 17
    assert _leases(tmp_path) == ["p1.t1"]
    conn.after_step(out.kv_connector_metadata, [])
    assert _leases(tmp_path) == []  # confirmed: the producer may free its blocks
    assert conn.counts["tokens_loaded"] == 9
    assert conn.check_request(_answer(prompt), prompt) is None  # the same answer again: not loaded twice
    assert conn.counts["load_failures"] == 1
    sched.update(batch, [5])
    sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == 32


def test_consumer_abort_before_admission_and_a_failed_load_leak_nothing(tmp_path):
    _producer_card(tmp_path)
    bm = BlockManager(32, 4)
    conn = _connector(tmp_path, "consumer")
    sched = Scheduler(SchedulerConfig(), bm, conn)
    prompt = list(range(200, 210))
    remote = conn.check_request(_answer(prompt), prompt)
    remote.users = 2  # two samples (n=2) load it: confirmed after both
    a, b = Sequence(prompt, 4, SamplingParams()), Sequence(prompt, 4, SamplingParams())
    a.kv_transfer = b.kv_transfer = remote
    sched.add(a)
    sched.add(b)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)  # aborted while waiting
    assert _leases(tmp_path) == ["p1.t1"]
    batch = sched.schedule()
    out = sched.scheduler_output(batch)
    conn.after_step(out.kv_connector_metadata, [str(b.seq_id)])  # the worker could not load it
    assert _leases(tmp_path) == [] and conn.counts["load_failures"] == 1
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert bm.num_free_blocks == 32


def test_consumer_policy_on_failed_transfers(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    _producer_card(tmp_path, pid=dead.pid, engine_id="gone")
    _producer_card(tmp_path)
    prompt = list(range(12))
    recompute = _connector(tmp_path, "consumer")
    fail = _connector(tmp_path, "consumer", policy="fail")
    cases = [
        (_answer(prompt, "gone"), "no longer running"),
        (_answer(prompt, "nobody"), "no producer nobody"),
        (_answer(prompt, lease_s=0.5), "lease on transfer t1 has run out"),  # (within margin_s of its end)
        (_answer(prompt, prompt_hash="0"), "not the 12 the producer prefilled"),
        (_answer(prompt, block_ids=[1, 2, 64]), "block_ids are not 12 tokens' blocks"),  # (the pool has 64)
        (_answer(prompt, transfer_id="t2"), "t2 was used already, or the producer released it"),
        ({"do_remote_prefill": True, "error": "prefill instance http://x failed: ConnectError"}, "ConnectError"),
    ]
    for params, reason in cases:
        assert recompute.check_request(params, prompt) is None
        with pytest.raises(KVTransferError, match=reason) as e:
            fail.check_request(params, prompt)
        assert e.value.status == 503 and "kv_load_failure_policy=fail" in str(e.value)
    assert recompute.counts["load_failures"] == len(cases)


def test_a_windowed_models_answer_is_checked_group_by_group(tmp_path):
    """With a full and a windowed KV cache group (window 4, blocks of 4): an answer must hold one table per group, the
    full group's blocks all real, the windowed group's real from the last prompt token's window on (earlier ones -1).
    Anything else is a failed transfer the policy decides, saying what was wrong; a good answer is accepted."""
    layout = {**LAYOUT, "kv_cache_groups": [None, 4]}
    _producer_card(tmp_path, layout=layout)
    prompt = list(range(12))  # 3 blocks; the query at token 11 reads tokens 8-11: block 2 of the windowed group
    recompute = _connector(tmp_path, "consumer", layout=layout)
    fail = _connector(tmp_path, "consumer", policy="fail", layout=layout)
    good = _answer(prompt, block_ids=[[40, 41, 42], [-1, -1, 43]])
    assert recompute.check_request(good, prompt).block_ids == [[40, 41, 42], [-1, -1, 43]]
    cases = [
        (_answer(prompt), "not one list for each of 2 KV groups"),  # (a flat list: a one-group producer's answer)
        (_answer(prompt, block_ids=[[40, 41, 42]]), "not one list for each of 2 KV groups"),
        (_answer(prompt, block_ids=[[40, -1, 42], [-1, -1, 43]]), "block_ids are not 12 tokens' blocks"),
        (_answer(prompt, block_ids=[[40, 41, 42], [-1, 42, -1]]), "block_ids are not 12 tokens' blocks"),
        (_answer(prompt, block_ids=[[40, 41, 42], [-1, 43]]), "block_ids are not 12 tokens' blocks"),
    ]
    for params, reason in cases:
        assert recompute.check_request(params, prompt) is None
        with pytest.raises(KVTransferError, match=reason):
            fail.check_request(params, prompt)
    assert recompute.counts["load_failures"] == len(cases)


def test_a_layout_mismatch_at_the_first_transfer_names_both_values(tmp_path):
    conn = _connector(tmp_path, "consumer")
    _producer_card(tmp_path, layout={**LAYOUT, "cache_dtype": "bfloat16"})  # (started after the consumer)
    prompt = list(range(8))
    with pytest.raises(KVTransferError, match="cache_dtype: this consumer has 'float32', the producer 'bfloat16'") as e:
        conn.check_request(_answer(prompt), prompt)
    assert e.value.status == 500
    with pytest.raises(KVTransferError, match="path: this consumer has"):
        conn.check_request(_answer(prompt, path="/elsewhere"), prompt)


def test_an_answer_from_another_kind_of_connector_is_a_named_mismatch_under_either_policy(tmp_path):
    """A local consumer handed a p2p producer's answer (or the other way round): not a failed transfer the policy may
    recompute silently, but a configuration error (HTTP 500) naming both connectors."""
    _producer_card(tmp_path)
    prompt = list(range(8))
    for policy in ("recompute", "fail"):
        conn = _connector(tmp_path, "consumer", policy=policy)
        answer = {**_answer(prompt, kv_connector="p2p"), "host": "10.0.0.2", "port": 5557}
        with pytest.raises(KVTransferError, match="kv_connector: this consumer has 'local', the producer 'p2p'") as e:
            conn.check_request(answer, prompt)
        assert e.value.status == 500 and e.value.code == "kv_transfer_mismatch"
        assert conn.check_request(_answer(prompt, kv_connector="local"), prompt) is not None
    p2p = P2PConnectorScheduler(
        "consumer",
        {**p2p_settings({"host": "127.0.0.1", "port": free_port()}), "engine_id": "c1", "check_peer": False},
        LAYOUT,
        64,
        4,
        "recompute",
    )
    with pytest.raises(KVTransferError, match="kv_connector: this consumer has 'p2p', the producer 'local'"):
        p2p.check_request(_answer(prompt, kv_connector="local"), prompt)


def test_what_a_killed_engine_left_is_swept_by_the_next_engine_of_either_role(tmp_path):
    """A SIGKILLed producer's pool (host memory under /dev/shm), lease and card, and a killed consumer's card, go when
    the next engine starts on the path, a consumer as well as a producer; a live engine's files stay."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / "leases").mkdir()
    killed = {
        "producer-gone.json": {"engine_id": "gone", "role": "producer", "pid": dead_pid},
        "consumer-gone2.json": {"engine_id": "gone2", "role": "consumer", "pid": dead_pid},
        "producer-live.json": {"engine_id": "live", "role": "producer", "pid": os.getpid(), "layout": LAYOUT},
    }
    for name, card in killed.items():
        (tmp_path / name).write_text(json.dumps(card))
    for name in ["gone-rank0.kv", "gone-rank1.kv", "live-rank0.kv", "leases/gone.abc", "leases/live.def"]:
        (tmp_path / name).write_bytes(b"\0" * 64)
    conn = _connector(tmp_path, "consumer")
    left = sorted(str(f.relative_to(tmp_path)) for f in tmp_path.rglob("*") if f.is_file())
    # (a consumer keeps the dead producer's card: it names that producer to a request still pointing at it)
    want = [
        "consumer-consumer-test.json",
        "leases/live.def",
        "live-rank0.kv",
        "producer-gone.json",
        "producer-live.json",
    ]
    assert left == want
    conn.shutdown()
    conn = _connector(tmp_path, "producer")  # (a producer sweeps the card too)
    assert not (tmp_path / "producer-gone.json").exists() and (tmp_path / "producer-live.json").exists()
    conn.shutdown()


def test_start_up_refuses_a_peer_with_another_layout(tiny_llama, tmp_path):
    kv = {"path": str(tmp_path)}
    base = dict(dtype="float32", max_model_len=64, max_num_seqs=4, kv_cache_memory_bytes=2**20)
    producer = LLMEngine(
        EngineConfig.create(str(tiny_llama), **base, block_size=4, kv_role="producer", kv_connector_config=kv)
    )
    try:
        with pytest.raises(ValueError, match="block_size: this consumer has 8, the producer 4"):
            LLMEngine(
                EngineConfig.create(str(tiny_llama), **base, block_size=8, kv_role="consumer", kv_connector_config=kv)
            )
        with pytest.raises(ValueError, match="kv_cache_dtype: this consumer has 'int8', the producer 'auto'"):
            LLMEngine(
                EngineConfig.create(
                    str(tiny_llama),
                    **base,
                    block_size=4,
                    kv_cache_dtype="int8",
                    kv_role="consumer",
                    kv_connector_config=kv,
                )
            )
    finally:
        producer.shutdown()


def test_affinity_sends_a_prefix_back_unless_its_replica_is_busier():
    picker = Picker([Instance("a", "replica"), Instance("b", "replica")], "affinity", slack=1)
    first = picker.pick("k1")
    assert picker.pick("k1") is first and picker.affinity_hits == 1
    first.inflight = 3
    other = picker.pick("k1")
    assert other is not first  # 3 in flight > 0 + slack: the least loaded takes it, and the key moves
    first.inflight = 0
    assert picker.pick("k1") is other


def test_data_parallel_launcher_sets_each_replicas_own_flags():
    from infertune.router.launch import replica_argv

    argv = ["--model", "m", "--port", "9", "--data-parallel-size=2", "--host", "0.0.0.0", "--dtype", "float32"]
    assert replica_argv(argv) == ["--model", "m", "--dtype", "float32"]


def test_pd_step_table_states_both_setups_and_the_decode_sides_counters():
    from infertune.bench.pd import render

    def summary(ttft, tpot):
        stats = lambda v: {"p50": v, "p99": 2 * v}  # noqa: E731
        return {"ttft_ms": stats(ttft), "tpot_ms": stats(tpot), "request_throughput": 0.5, "failed": 0}

    pd = {
        **summary(80.0, 3.0),
        "decode_side": {
            "infertune_prefill_tokens_computed_total": 4.0,
            "infertune_kv_transfer_tokens_loaded_total": 900.0,
        },
    }
    text = render({"pd": pd, "colocated": summary(40.0, 5.0)})
    assert "| router + 1 prefill + 1 decode | 80 | 160 | 3.0 | 6.0 | 0.50 | 0 |" in text
    assert "| router + 2 colocated replicas | 40 | 80 | 5.0 | 10.0 | 0.50 | 0 |" in text
    assert "4 prompt tokens computed, 900 loaded" in text


# ---- servers: router + 1 prefill + 1 decode -------------------------------------------------------------------
class RouterThread:
    def __init__(self, **kw):
        self.router = Router(**kw)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.router.app(), host="127.0.0.1", port=self.port, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        assert wait_until(lambda: self.server.started, 15)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


PROMPTS = ["The cat sat on", "def add(a, b):", "Once upon a time", "1, 2, 3, 4,", "hello", "The sky is"]


def _requests(k: int) -> list[tuple[str, dict]]:
    out = []
    for i in range(k):
        text = PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS))
        stream = i % 2 == 1
        if i % 3 == 2:
            body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 6 + i % 3}
            out.append(("/v1/chat/completions", {**body, "temperature": 0, "stream": stream}))
        else:
            body = {"model": MODEL, "prompt": text, "max_tokens": 6 + i % 4, "temperature": 0, "stream": stream}
            out.append(("/v1/completions", body))
    return out


def _answer_of(url: str, path: str, body: dict) -> tuple[int, str]:
    """(status, the generated text) of one request, streamed or not."""
    chat = "messages" in body
    if not body.get("stream"):
        r = httpx.post(url + path, json=body, timeout=60)
        if r.status_code != 200:
            return r.status_code, r.text
        choice = r.json()["choices"][0]
        return 200, choice["message"]["content"] if chat else choice["text"]
    text = ""
    with httpx.stream("POST", url + path, json=body, timeout=60) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return 599, json.dumps(event)
            delta = event["choices"][0]
            text += (delta["delta"].get("content") or "") if chat else delta["text"]
    return 200, text


def _run_all(url: str, requests, workers: int = 8) -> list[tuple[int, str]]:
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(lambda r: _answer_of(url, *r), requests))


@pytest.fixture(scope="module")
def reference(tiny_llama):
    with ServerThread(tiny_llama) as s:
        yield s


def test_router_with_one_prefill_and_one_decode_gives_one_servers_outputs(tiny_llama, tmp_path, reference):
    kv = {"path": str(tmp_path)}
    requests = _requests(64)
    expected = _run_all(reference.url, requests)
    assert all(status == 200 for status, _ in expected)
    with (
        ServerThread(tiny_llama, kv_role="producer", kv_connector_config=kv) as p,
        ServerThread(tiny_llama, kv_role="consumer", kv_connector_config=kv) as d,
        RouterThread(prefill=[p.url], decode=[d.url]) as router,
    ):
        got = _run_all(router.url, requests)
        assert got == expected
        # the decode side computed one token of each prompt and loaded the rest
        assert metric(d.url, "infertune_prefill_tokens_computed_total") == len(requests)
        loaded = metric(d.url, "infertune_kv_transfer_tokens_loaded_total")
        prompt_tokens = metric(d.url, "infertune_prompt_tokens_total")
        hits = round(metric(d.url, "infertune_prefix_cache_hit_rate") * prompt_tokens)  # its own prefix cache
        assert loaded > 0 and hits + loaded + len(requests) == prompt_tokens
        assert metric(d.url, "infertune_kv_transfer_load_failures_total") == 0
        assert metric(p.url, "infertune_kv_transfer_granted_total") == len(requests)
        assert wait_until(lambda: metric(p.url, "infertune_kv_blocks_used") == 0, 10)
        assert metric(p.url, "infertune_kv_transfer_leases_confirmed_total") == len(requests)
        assert metric(d.url, "infertune_kv_blocks_used") == 0
        assert httpx.get(router.url + "/health").json()["status"] == "ok"
        assert router.router.check_instances() == []  # each instance is what its place asks, with one layout
        assert httpx.get(router.url + "/v1/models").json()["data"][0]["id"] == MODEL
        # a client's mistake comes back from the prefill instance as its 400, once
        bad = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "temperature": -1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
        assert "infertune_router_requests_total" in httpx.get(router.url + "/metrics").text
        # parameters only the decode side sees (the prefill step asks for one token, one sample, no logprobs): its
        # 400 comes back, and the producer's lease on the prompt's blocks ends at once, not after lease_s (30 s)
        granted = metric(p.url, "infertune_kv_transfer_granted_total")
        for extra in ({"logprobs": 21}, {"n": 100000}, {"best_of": 2}, {"stream_options": {"include_usage": True}}):
            body = {"prompt": "a prompt of a few blocks", "max_tokens": 4, **extra}
            r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
            assert r.status_code == 400, (extra, r.text)
        assert metric(p.url, "infertune_kv_transfer_granted_total") == granted + 4  # (each prefill ran and leased)
        assert wait_until(lambda: metric(p.url, "infertune_kv_blocks_used") == 0, 5)
        assert metric(p.url, "infertune_kv_transfer_leases_held") == 0
        # the release route takes only this producer's own leases, and is a producer's only
        r = httpx.post(p.url + "/kv_transfer/release", json={"transfer_id": "../../etc/passwd"})
        assert r.status_code == 202 and httpx.post(d.url + "/kv_transfer/release", json={}).status_code == 404
        assert httpx.post(p.url + "/kv_transfer/release", json={"id": 1}).status_code == 400
        # a prefill for remote decode answers one transfer: several prompts, n > 1 or a stream would lease blocks
        # that no answer names (they were held for lease_s); now a 400 before anything runs
        granted = metric(p.url, "infertune_kv_transfer_granted_total")
        remote = {"kv_transfer_params": {"do_remote_decode": True}, "max_tokens": 1}
        for extra in ({"prompt": ["ab", "cd"]}, {"prompt": "ab", "n": 2}, {"prompt": "ab", "stream": True}):
            r = httpx.post(p.url + "/v1/completions", json={**remote, **extra})
            assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params", r.text
        chat = {**remote, "messages": [{"role": "user", "content": "x"}], "stream": True}
        assert httpx.post(p.url + "/v1/chat/completions", json=chat).status_code == 400
        assert metric(p.url, "infertune_kv_transfer_granted_total") == granted
        # two leases on prompts with a common prefix share its cached blocks: held counts each block once (the
        # producer's blocks in use, all of them on the leases now)
        for tail in ("one", "two"):
            r = httpx.post(p.url + "/v1/completions", json={**remote, "prompt": "a common prefix of blocks, " + tail})
            assert r.status_code == 200 and r.json()["kv_transfer_params"]["transfer_id"]
        assert wait_until(lambda: metric(p.url, "infertune_kv_transfer_leases_held") == 2, 5)
        used = metric(p.url, "infertune_kv_blocks_used")
        assert metric(p.url, "infertune_kv_transfer_blocks_held") == used > 0


def test_prompts_sharing_a_prefix_go_to_the_prefill_instance_that_holds_it(tiny_llama, tmp_path, reference):
    """Two prefill instances: requests whose prompts start alike (a long shared system prompt) all go to one of them
    (affinity), whose prefix cache then computes only their new tails, and the outputs stay one server's."""
    kv = {"path": str(tmp_path)}
    system = "You are a helpful assistant: answer briefly. "  # (the tiny model's 64 tokens hold prompt and answer)
    requests = [
        ("/v1/completions", {"model": MODEL, "prompt": system + q, "max_tokens": 4, "temperature": 0})
        for q in ("What is 2 + 2?", "A colour?", "Say hi.", "Count to 3.")
    ]
    expected = [_answer_of(reference.url, *r) for r in requests]
    assert all(status == 200 for status, _ in expected)
    with (
        ServerThread(tiny_llama, kv_role="producer", kv_connector_config=kv, enable_prefix_caching=True) as p0,
        ServerThread(tiny_llama, kv_role="producer", kv_connector_config=kv, enable_prefix_caching=True) as p1,
        ServerThread(tiny_llama, kv_role="consumer", kv_connector_config=kv) as d,
        RouterThread(prefill=[p0.url, p1.url], decode=[d.url]) as router,
    ):
        assert [_answer_of(router.url, *r) for r in requests] == expected  # one after another
        granted = [metric(p.url, "infertune_kv_transfer_granted_total") for p in (p0, p1)]
        assert sorted(granted) == [0, len(requests)], granted
        busy = (p0, p1)[granted.index(len(requests))]
        assert metric(busy.url, "infertune_prefix_cache_hit_rate") > 0.3  # the shared prefix computed once
        text = httpx.get(router.url + "/metrics").text
        assert f'infertune_router_affinity_hits{{role="prefill"}} {len(requests) - 1}.0' in text


def test_lease_expiry_frees_the_producers_blocks(tiny_llama, tmp_path, reference):
    kv = {"path": str(tmp_path), "lease_s": 1.0, "margin_s": 0.2}
    body = {"model": MODEL, "prompt": "The cat sat on", "max_tokens": 6, "temperature": 0}
    with (
        ServerThread(tiny_llama, kv_role="producer", kv_connector_config=kv) as p,
        ServerThread(tiny_llama, kv_role="consumer", kv_connector_config=kv) as d,
    ):
        pre = httpx.post(
            p.url + "/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}}
        )
        params = pre.json()["kv_transfer_params"]
        assert wait_until(lambda: metric(p.url, "infertune_kv_blocks_used") == len(params["block_ids"]) > 0, 0.7)
        assert wait_until(lambda: metric(p.url, "infertune_kv_blocks_used") == 0, 5)
        assert metric(p.url, "infertune_kv_transfer_leases_expired_total") == 1
        # the consumer, handed the expired lease, computes the prompt itself: same answer
        late = httpx.post(d.url + "/v1/completions", json={**body, "kv_transfer_params": params})
        assert late.json()["choices"][0]["text"] == _answer_of(reference.url, "/v1/completions", body)[1]
        assert metric(d.url, "infertune_kv_transfer_load_failures_total") == 1
        assert metric(d.url, "infertune_kv_blocks_used") == 0


def test_prefill_instance_killed_mid_run(tiny_llama, tmp_path, reference):
    """Requests after the prefill instance dies finish by recompute (policy recompute) or fail at once with a 503
    naming the cause (policy fail); the decode side holds no block afterwards."""
    kv = json.dumps({"path": str(tmp_path)})
    requests = _requests(12)
    expected = _run_all(reference.url, requests)
    with (
        ServerProcess(tiny_llama, "--kv-role", "producer", "--kv-connector-config", kv) as p,
        ServerThread(tiny_llama, kv_role="consumer", kv_connector_config={"path": str(tmp_path)}) as d,
        ServerThread(
            tiny_llama, kv_role="consumer", kv_connector_config={"path": str(tmp_path)}, kv_load_failure_policy="fail"
        ) as strict,
        RouterThread(prefill=[p.url], decode=[d.url], connect_timeout_s=2.0) as router,
        RouterThread(prefill=[p.url], decode=[strict.url], connect_timeout_s=2.0) as strict_router,
    ):
        assert _run_all(router.url, requests[:4], workers=2) == expected[:4]
        # One prefill done on the producer, as the router does it, whose blocks the producer holds when it dies: its
        # load must fail and recompute, however fast the requests in flight below finish before the kill.
        path, body = requests[0]
        ask = {**body, "max_tokens": 1, "stream": False, "kv_transfer_params": {"do_remote_decode": True}}
        held = httpx.post(p.url + path, json=ask, timeout=60).json()["kv_transfer_params"]
        with ThreadPoolExecutor(4) as pool:
            running = pool.map(lambda r: _answer_of(router.url, *r), requests[4:])
            time.sleep(0.3)
            p.proc.kill()
            assert list(running) == expected[4:]
        p.proc.wait(10)
        assert _answer_of(d.url, path, {**body, "kv_transfer_params": held}) == expected[0]
        assert metric(d.url, "infertune_kv_transfer_load_failures_total") >= 1
        assert wait_until(lambda: metric(d.url, "infertune_kv_blocks_used") == 0, 5)
        status, text = _answer_of(strict_router.url, *requests[0])
        assert status == 503 and "prefill instance" in text and "kv_load_failure_policy=fail" in text
        assert metric(strict.url, "infertune_kv_blocks_used") == 0
        assert httpx.get(router.url + "/health").status_code == 200  # the decode side still serves


def test_unreachable_decode_instance_is_a_502_not_a_hang(tiny_llama):
    with RouterThread(replicas=[f"http://127.0.0.1:{free_port()}"], connect_timeout_s=1.0) as router:
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"}, timeout=10)
        assert r.status_code == 502 and r.json()["error"]["code"] == "upstream_unavailable"
        assert httpx.get(router.url + "/health").status_code == 503


def test_data_parallel_router_keeps_a_prefix_on_one_replica(tiny_llama, reference):
    requests = _requests(12)
    expected = _run_all(reference.url, requests)
    with ServerThread(tiny_llama) as a, ServerThread(tiny_llama) as b, RouterThread(replicas=[a.url, b.url]) as r:
        assert _run_all(r.url, requests, workers=4) == expected
        served = [metric(x.url, "infertune_prompt_tokens_total") for x in (a, b)]
        assert all(s > 0 for s in served)  # both replicas took work
        body = {"model": MODEL, "prompt": "A long shared system prompt, then", "max_tokens": 2}
        before = [metric(x.url, "infertune_prompt_tokens_total") for x in (a, b)]
        for _ in range(4):
            assert httpx.post(r.url + "/v1/completions", json=body).status_code == 200
        after = [metric(x.url, "infertune_prompt_tokens_total") for x in (a, b)]
        assert sorted(y - x > 0 for x, y in zip(before, after)) == [False, True]  # all four on one replica


def test_the_routers_metrics_carry_each_instances_labelled_by_engine(tiny_llama):
    """As `vllm serve --data-parallel-size 2`'s port serves its engines' metrics (engine="0", "1"), so vLLM dashboards
    read the router's: each replica's families, its samples labelled engine=<its index> and role (the router served
    only its own before). The oracle: each replica's own /metrics, through prometheus_client's parser."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples(text: str, name: str) -> dict:
        return {
            tuple(sorted(s.labels.items())): s.value
            for family in text_string_to_metric_families(text)
            for s in family.samples
            if s.name == name
        }

    with ServerThread(tiny_llama) as a, ServerThread(tiny_llama) as b, RouterThread(replicas=[a.url, b.url]) as r:
        body = {"model": MODEL, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
        for i in range(4):
            assert httpx.post(r.url + "/v1/completions", json={**body, "prompt": f"{i} x"}).status_code == 200
        text = httpx.get(r.url + "/metrics").text
        assert "infertune_router_requests_total" in text  # its own too
        for name in ("vllm:generation_tokens_total", "vllm:num_requests_running", "infertune_prompt_tokens_total"):
            got = samples(text, name)
            for engine, server in enumerate((a, b)):
                own = samples(httpx.get(server.url + "/metrics").text, name)
                assert own, name
                for labels, value in own.items():
                    relabelled = {**dict(labels), "engine": str(engine), "role": "replica"}
                    assert got[tuple(sorted(relabelled.items()))] == value, (name, engine)
            assert len(got) == 2 * len(own)
        generated = samples(text, "vllm:generation_tokens_total")
        assert sum(generated.values()) == 4 * 3


def _generate(engine: LLMEngine, rid: str, prompt: str, params: SamplingParams):
    engine.add_request(rid, prompt, params)
    done = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            done = out if out.finished else done
    return done


def _prefill_for_transfer(producer: LLMEngine, rid: str, prompt: str) -> dict:
    """The prompt's prefill on a producer (one token, do_remote_decode) -> its kv_transfer_params for a consumer."""
    ask = SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    return _generate(producer, rid, prompt, ask).kv_transfer_params


def test_the_int4_tier_runs_on_both_sides_and_the_prompt_moves_as_int8(tiny_llama, tmp_path):
    """kv_int4_after with a KV connector: a producer never packs a prompt it hands to a consumer (do_remote_decode),
    even across chunks of its prefill, so the blocks move as int8; the consumer's own tier packs them as its decode
    ages them. Oracle: a plain engine with the same int8 cache and tier, whose prompt is computed in one step (int8
    throughout, as the producer's) and whose decode packs by the same ages: the same greedy tokens."""
    base = dict(
        dtype="float32", max_model_len=96, block_size=4, max_num_seqs=4, kv_cache_memory_bytes=2**20,
        kv_cache_dtype="int8", kv_int4_after=8,
    )  # fmt: skip
    kv = {"kv_connector_config": {"path": str(tmp_path)}}
    plain = LLMEngine(EngineConfig.create(str(tiny_llama), **base, max_num_batched_tokens=96))
    producer = LLMEngine(
        EngineConfig.create(str(tiny_llama), **base, kv_role="producer", max_num_batched_tokens=8, **kv)
    )
    consumer = LLMEngine(EngineConfig.create(str(tiny_llama), **base, kv_role="consumer", **kv))
    try:
        prompt = "The cat sat on the mat and looked at the dog, who looked back at the cat and then"
        want = _generate(plain, "r", prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        assert plain.block_manager.num_int4_packs > 0  # (its decode packed old blocks)
        answer = _prefill_for_transfer(producer, "p", prompt)
        assert producer.block_manager.num_int4_packs == 0  # its chunks ran past kv_int4_after, and it packed none
        assert all(0 <= b < producer.block_manager.num_blocks for b in answer["block_ids"])  # plain int8 blocks
        got = _generate(
            consumer,
            "d",
            prompt,
            SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, kv_transfer_params=answer),
        )
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert consumer.block_manager.num_int4_packs == plain.block_manager.num_int4_packs
        assert consumer.stats()["prefill_tokens_computed"] == 1
        # a request of the producer's own (no do_remote_decode) is packed there as usual
        _generate(producer, "own", prompt, SamplingParams(temperature=0, max_tokens=2))
        assert producer.block_manager.num_int4_packs > 0
    finally:
        for e in (producer, consumer):
            e.shutdown()


def test_tensor_parallel_ranks_move_their_own_kv_heads(tiny_llama, tmp_path):
    """TP = 2 on both sides: each rank's share of the KV heads goes through its own shared file, and the greedy
    tokens are one plain engine's (the plain-data metadata reaches the worker processes)."""
    base = dict(dtype="float32", max_model_len=64, block_size=4, max_num_seqs=4, kv_cache_memory_bytes=2**20)
    kv = {"kv_connector_config": {"path": str(tmp_path)}, "tensor_parallel_size": 2}
    plain = LLMEngine(EngineConfig.create(str(tiny_llama), **base))
    producer = LLMEngine(EngineConfig.create(str(tiny_llama), **base, kv_role="producer", **kv))
    consumer = LLMEngine(EngineConfig.create(str(tiny_llama), **base, kv_role="consumer", **kv))
    try:
        assert sorted(p.name.split("-")[-1] for p in tmp_path.glob("*.kv")) == ["rank0.kv", "rank1.kv"]
        for i, prompt in enumerate(["The cat sat on the mat and", "def add(a, b):"]):
            want = _generate(plain, f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=8))
            answer = _prefill_for_transfer(producer, f"p{i}", prompt)
            got = _generate(
                consumer, f"d{i}", prompt, SamplingParams(temperature=0, max_tokens=8, kv_transfer_params=answer)
            )
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
        stats = consumer.stats()
        assert stats["prefill_tokens_computed"] == 2 and stats["kv_transfer"]["kv_transfer_loads"][0] == 2
        producer.poll_kv_transfers()
        assert producer.block_manager.num_free_blocks == producer.block_manager.num_blocks
    finally:
        for e in (producer, consumer):
            e.shutdown()


def test_a_plugged_in_layer_by_layer_connector_loads_each_layer_when_the_model_asks(tiny_llama, tmp_path):
    """kv_connector="pkg.module:NAME" plugs in a transport from outside (tests/kv_layerwise_plugin.py): its consumer
    copies a layer's blocks only inside wait_for_layer_load, so its greedy tokens are a plain engine's only if the
    model's layer loop asks for every layer before reading it. Every step with the connector's metadata calls wait /
    save layer by layer in order (steps without it none: they may run the fused step); the finished loads reach the
    scheduler side through get_finished -> update_finished."""
    import kv_layerwise_plugin as plugin

    base = dict(dtype="float32", max_model_len=64, block_size=4, max_num_seqs=4, kv_cache_memory_bytes=2**20)
    kv = {"kv_connector": "kv_layerwise_plugin:LAYERWISE", "kv_connector_config": {"path": str(tmp_path)}}
    plain = LLMEngine(EngineConfig.create(str(tiny_llama), **base))
    producer = LLMEngine(EngineConfig.create(str(tiny_llama), **base, kv_role="producer", **kv))
    plugin.CALLS.clear()
    consumer = LLMEngine(EngineConfig.create(str(tiny_llama), **base, kv_role="consumer", **kv))
    layers = consumer.config.model.arch.num_hidden_layers
    try:
        assert plugin.CALLS == [("register", layers)]
        for i, prompt in enumerate(["The cat sat on the mat and", "def add(a, b): return a + b; print(add"]):
            want = _generate(plain, f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=8))
            answer = _prefill_for_transfer(producer, f"p{i}", prompt)
            assert answer["kv_connector"] == "layerwise-test"
            plugin.CALLS.clear()
            plugin.FINISHED.clear()
            got = _generate(
                consumer, f"d{i}", prompt, SamplingParams(temperature=0, max_tokens=8, kv_transfer_params=answer)
            )
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            per_layer = [c for n in range(layers) for c in (("wait", n), ("save", n))]
            (what, loaded), *rest = plugin.CALLS
            assert what == "start" and len(loaded) == 1 and rest == per_layer  # the load's step only
            assert plugin.FINISHED == [(set(), set(loaded))]  # (the engine's own id for the request)
        assert consumer.stats()["prefill_tokens_computed"] == 2  # one token of each prompt: the rest was loaded
    finally:
        for e in (producer, consumer):
            e.shutdown()


def test_a_kv_connector_that_is_not_one_is_named(tiny_llama, tmp_path):
    base = dict(dtype="float32", max_model_len=64, kv_role="consumer", kv_connector_config={"path": str(tmp_path)})
    with pytest.raises(ValueError, match="choose one of local, p2p, or name another transport's KVConnectorSpec"):
        EngineConfig.create(str(tiny_llama), **base, kv_connector="nixl")
    for name, why in [
        ("no_such_module_here:SPEC", "cannot import it \\(ModuleNotFoundError"),
        ("kv_layerwise_plugin:MISSING", "cannot import it \\(AttributeError"),
        ("kv_layerwise_plugin:NOT_A_SPEC", "is a object, not a KVConnectorSpec"),
    ]:
        with pytest.raises(ValueError, match=f"kv_connector='{name}':? {why}"):
            LLMEngine(EngineConfig.create(str(tiny_llama), **base, kv_connector=name))


@pytest.mark.parametrize(
    "arch,window",
    [
        ("mistral", dict(sliding_window=8)),  # one KV cache group, windowed
        ("qwen2", dict(use_sliding_window=True, sliding_window=8, max_window_layers=1)),  # a full and a windowed group
    ],
)
def test_sliding_window_models_move_each_groups_blocks(tmp_path, arch, window):
    """A model whose layers attend within a window: the producer's answer carries each KV cache group's table (the
    windowed group's entries before its window NULL, freed as the chunked prefill went), the consumer loads per group
    only what the query at the prompt's last token reads, and its greedy tokens are one plain engine's. The producer
    holds nothing once the consumer confirmed."""
    from conftest import make_checkpoint

    model = make_checkpoint(tmp_path / arch, arch, **window)
    base = dict(
        dtype="float32", max_model_len=96, block_size=4, max_num_seqs=4, kv_cache_memory_bytes=2**20,
        max_num_batched_tokens=16,
    )  # fmt: skip
    kv = {"kv_connector_config": {"path": str(tmp_path / "kv")}}
    plain = LLMEngine(EngineConfig.create(str(model), **base))
    producer = LLMEngine(EngineConfig.create(str(model), **base, kv_role="producer", **kv))
    consumer = LLMEngine(EngineConfig.create(str(model), **base, kv_role="consumer", **kv))
    prompts = [
        "The cat sat on the mat and looked at the dog, who",
        "def add(a, b):\n    return a + b\n\ndef mul(a, b):",
    ]
    try:
        groups = 2 if arch == "qwen2" else 1
        loaded = 0
        for i, prompt in enumerate(prompts):
            want = _generate(plain, f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=8))
            answer = _prefill_for_transfer(producer, f"p{i}", prompt)
            tables = answer["block_ids"] if groups > 1 else [answer["block_ids"]]
            n = answer["num_tokens"]
            assert n > 24 and len(tables) == groups and all(len(t) == -(-n // 4) for t in tables)
            assert tables[-1][0] == -1 and tables[-1][-1] >= 0  # the windowed group's first blocks were freed
            if groups > 1:
                assert all(b >= 0 for b in tables[0])  # the full group keeps every block
            got = _generate(
                consumer, f"d{i}", prompt, SamplingParams(temperature=0, max_tokens=8, kv_transfer_params=answer)
            )
            assert got.outputs[0].token_ids == want.outputs[0].token_ids
            loaded += n - 1
        stats = consumer.stats()
        kv_stats = {k: v[0] for k, v in stats["kv_transfer"].items()}
        assert stats["prefill_tokens_computed"] == len(prompts)
        assert kv_stats["kv_transfer_loads"] == len(prompts) and kv_stats["kv_transfer_load_failures"] == 0
        assert kv_stats["kv_transfer_tokens_loaded"] == loaded
        producer.poll_kv_transfers()
        assert producer.block_manager.num_free_blocks == producer.block_manager.num_blocks
    finally:
        for e in (producer, consumer, plain):
            e.shutdown()


def test_the_router_names_instances_that_do_not_fit_their_place(tiny_llama, tmp_path, reference):
    """Before serving, the router asks each instance what it is (GET /kv_transfer): instances in the wrong place, a
    plain server as a decode instance, or P and D instances with different KV layouts are one start-up error naming
    each; an instance that does not answer yet is left to its first transfer."""
    kv = {"path": str(tmp_path)}
    with (
        ServerThread(tiny_llama, kv_role="producer", kv_connector_config=kv) as p,
        ServerThread(tiny_llama, kv_role="consumer", kv_connector_config={"path": str(tmp_path / "b")}) as d,
    ):
        info = httpx.get(p.url + "/kv_transfer").json()
        assert info["kv_role"] == "producer" and info["kv_connector"] == "local" and info["path"] == str(tmp_path)
        assert info["layout"]["block_size"] == 4
        assert httpx.get(reference.url + "/kv_transfer").json() == {"kv_role": None, "kv_connector": None}
        with pytest.raises(ValueError) as e:
            Router(prefill=[d.url], decode=[p.url, reference.url]).check_instances()
        lines = str(e.value).splitlines()[1:]
        assert lines == [
            f"  prefill instance {d.url} runs with --kv-role consumer, not --kv-role producer",
            f"  decode instance {p.url} runs with --kv-role producer, not --kv-role consumer",
            f"  decode instance {reference.url} runs with no --kv-role, not --kv-role consumer",
        ]
        with pytest.raises(ValueError, match="replica instance .* runs with --kv-role producer, not no --kv-role"):
            Router(replicas=[p.url, reference.url]).check_instances()
        cli = subprocess.run(
            [sys.executable, "-m", "infertune.cli", "router", "--prefill", d.url, "--decode", p.url],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode != 0 and f"prefill instance {d.url} runs with --kv-role consumer" in cli.stderr
        gone = f"http://127.0.0.1:{free_port()}"
        assert Router(prefill=[p.url], decode=[d.url, gone]).check_instances(timeout_s=1.0) == [gone]
    with (
        ServerThread(tiny_llama, kv_role="producer", kv_connector_config=kv) as p,
        # (under another path: under the same one the consumer itself refuses to start beside this producer)
        ServerThread(
            tiny_llama, kv_role="consumer", kv_connector_config={"path": str(tmp_path / "c")}, kv_cache_dtype="int8"
        ) as d,
    ):
        with pytest.raises(
            ValueError,
            match=f"the decode instance {d.url} against the prefill instance {p.url}: "
            "kv_cache_dtype: this consumer has 'int8', the producer",
        ):
            Router(prefill=[p.url], decode=[d.url]).check_instances()


def test_the_layouts_model_is_its_config_values_and_its_weights(tmp_path):
    """Two engines exchange KV only for the same model: a checkpoint with the same config.json and other weights
    (another seed) is another model (its KV would be silently wrong), where a byte-for-byte copy of the weights whose
    config.json was rewritten (another transformers version, other indentation) is the same one."""
    import json
    import shutil

    from conftest import make_checkpoint

    from infertune.kv_transfer import _model_identity
    from infertune.kv_transfer.base import layout_mismatch

    a = make_checkpoint(tmp_path / "a", "llama")
    b = make_checkpoint(tmp_path / "b", "llama", seed=1)
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    cfg = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**cfg, "transformers_version": "9.9.9"}, indent=4, sort_keys=True))
    assert (a / "config.json").read_text() != (copy / "config.json").read_text()
    assert _model_identity(str(a)) == _model_identity(str(copy))
    ida, idb = _model_identity(str(a)), _model_identity(str(b))
    assert ida.split(", ")[0] == idb.split(", ")[0] and ida.split(", ")[1] != idb.split(", ")[1]  # (weights differ)
    bad = layout_mismatch({**LAYOUT, "model": idb}, {**LAYOUT, "model": ida}, "consumer", "producer")
    assert len(bad) == 1 and "weights" in bad[0]
