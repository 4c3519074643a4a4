"""One request must never take the server down: each hostile request is answered at once with the right status
while other clients are served, every disconnect aborts, deadlines and the memory ceiling hold.

Oracles: the HTTP status and body OpenAI clients act on, the server's own /metrics (KV blocks, waiting
sequences, aborts), the offline LLM's greedy text for the clients served meanwhile, and the process's RSS.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest
from server_utils import MAX_LEN, MODEL, ServerThread, metric, wait_until

from infertune import LLM, SamplingParams
from infertune.engine.host_memory import process_rss

GREEDY = dict(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def server(tiny_llama):
    with ServerThread(tiny_llama, max_waiting=64) as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_llama):
    from server_utils import ENGINE

    llm = LLM(str(tiny_llama), **ENGINE)
    return {p: llm.generate(p, SamplingParams(**GREEDY))[0].outputs[0].text for p in ("calm", "steady")}


def idle(server) -> bool:
    return (
        metric(server.url, "infertune_kv_blocks_used") == 0
        and metric(server.url, "infertune_requests_waiting") == 0
        and metric(server.url, "infertune_requests_running") == 0
    )


HOSTILE = [
    ({"prompt": "def ", "max_tokens": 1, "n": 100000}, 400, "n", "128"),
    ({"prompt": "def ", "max_tokens": 1, "n": 129}, 400, "n", "limit of 128"),
    ({"prompt": "def ", "max_tokens": 1, "n": 40}, 400, "n", "at most 32"),  # share 0.5 of max_waiting=64
    ({"prompt": ["a"] * 129, "max_tokens": 1}, 400, "prompt", "limit of 128"),
    ({"prompt": [[5]] * 100000, "max_tokens": 1}, 400, "prompt", "limit of 128"),
    ({"prompt": ["a"] * 9, "max_tokens": 1, "n": 4}, 400, "n", "36 sequences"),
    ({"prompt": [7] * 200000, "max_tokens": 1}, 400, None, "200000 tokens"),
    ({"prompt": "x", "stop": ["s"] * 17}, 400, "stop", "17 stop strings"),
    ({"prompt": "x", "stop": "s" * 257}, 400, "stop", "257 characters"),
    ({"prompt": "x", "stop_token_ids": list(range(257))}, 400, "stop_token_ids", "257 stop_token_ids"),
    ({"prompt": "x", "stop_token_ids": [10**12]}, 400, "stop_token_ids", "token ids in [0,"),
    ({"prompt": "x", "logprobs": 10**6}, 400, "logprobs", "[0, 20]"),
    ({"prompt": [5] * MAX_LEN, "max_tokens": 1}, 400, None, f"max_model_len is {MAX_LEN}"),
]


@pytest.mark.parametrize("body, status, param, fragment", HOSTILE)
def test_hostile_request_is_answered_at_once_with_the_numbers(server, body, status, param, fragment):
    t0 = time.perf_counter()
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert fragment in err["message"], err
    if param is not None:
        assert err["param"] == param
    assert time.perf_counter() - t0 < 5.0
    assert idle(server)  # nothing was queued


def test_prompt_exactly_at_the_limit_is_served_and_one_past_is_not(server):
    at = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * (MAX_LEN - 1), "max_tokens": 1}, timeout=30)
    assert at.status_code == 200 and at.json()["usage"]["prompt_tokens"] == MAX_LEN - 1
    past = httpx.post(server.url + "/v1/completions", json={"prompt": [5] * MAX_LEN, "max_tokens": 1}, timeout=30)
    assert past.status_code == 400 and str(MAX_LEN) in past.json()["error"]["message"]
    n_at = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "n": 32}, timeout=30)
    assert n_at.status_code == 200 and len(n_at.json()["choices"]) == 32


def test_other_clients_are_served_normally_while_hostile_requests_arrive(server, reference):
    async def go():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as h:
            hostile = [h.post("/v1/completions", json=body) for body, *_ in HOSTILE for _ in range(3)]
            good = [h.post("/v1/completions", json={"prompt": p, **GREEDY}) for p in reference for _ in range(4)]
            return await asyncio.gather(*hostile), await asyncio.gather(*good)

    bad, good = asyncio.run(go())
    assert all(r.status_code == 400 for r in bad)
    assert [r.json()["choices"][0]["text"] for r in good] == [reference[p] for p in reference for _ in range(4)]
    assert idle(server)


def test_rejections_are_counted_by_reason(server):
    before = metric(server.url, 'infertune_requests_rejected_total{reason="request_too_large",status="400"}')
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "x", "n": 40}, timeout=30).status_code == 400
    after = metric(server.url, 'infertune_requests_rejected_total{reason="request_too_large",status="400"}')
    assert after == before + 1


def test_queue_counts_sequences_and_429_says_when_to_retry(tiny_llama):
    with ServerThread(tiny_llama, max_waiting=8, max_num_seqs=1) as s:
        body = {"prompt": "x", "max_tokens": 30, "temperature": 0, "ignore_eos": True, "n": 4}

        async def go():
            async with httpx.AsyncClient(timeout=60) as h:
                return await asyncio.gather(*[h.post(s.url + "/v1/completions", json=body) for _ in range(6)])

        responses = asyncio.run(go())
        ok = [r for r in responses if r.status_code == 200]
        limited = [r for r in responses if r.status_code == 429]
        assert len(ok) + len(limited) == 6 and ok and limited
        assert all(len(r.json()["choices"]) == 4 for r in ok)
        err = limited[0].json()["error"]
        assert err["code"] == "queue_full" and "of 8 waiting sequences" in err["message"]
        assert int(limited[0].headers["retry-after"]) >= 1
        assert wait_until(lambda: idle(s))


def test_non_streamed_request_is_aborted_when_its_client_hangs_up(tiny_llama):
    with ServerThread(tiny_llama, max_model_len=256) as s:
        s.engine.step_listeners.append(lambda outputs, seconds: time.sleep(0.01))  # 200 steps take >= 2 s
        for path, body in (
            ("/v1/completions", {"prompt": "a long story"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a long story"}]}),
        ):
            before = metric(s.url, "infertune_requests_aborted_total")
            body = {**body, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "n": 3}
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(s.url + path, json=body, timeout=httpx.Timeout(10, read=0.3))
            assert wait_until(
                lambda before=before: metric(s.url, "infertune_requests_aborted_total") == before + 1 and idle(s)
            )
        # the tokens the two made before their clients left are counted (3 samples, >= 30 steps of 10 ms each)
        made = metric(s.url, "infertune_generation_tokens_total")
        assert made >= 2 * 3 * 10
        # and a request that runs to its end adds exactly its usage's completion tokens
        done = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 7, "ignore_eos": True})
        assert (
            metric(s.url, "infertune_generation_tokens_total")
            == made + done.json()["usage"]["completion_tokens"]
            == made + 7
        )


def test_request_timeout_aborts_and_answers_408(tiny_llama):
    with ServerThread(tiny_llama, max_model_len=256, request_timeout=0.3, max_num_seqs=2) as s:
        s.engine.step_listeners.append(lambda outputs, seconds: time.sleep(0.01))  # 240 steps take >= 2.4 s
        long = {"prompt": "x", "max_tokens": 240, "temperature": 0, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=long, timeout=30)
        assert r.status_code == 408 and r.json()["error"]["code"] == "request_timeout"
        assert "0.3 s" in r.json()["error"]["message"]
        with httpx.stream("POST", s.url + "/v1/completions", json={**long, "stream": True}, timeout=30) as resp:
            data = [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]
        assert data[-1] == "[DONE]"  # the stream ends as every stream does, after the error event (as vLLM's)
        events = [json.loads(d) for d in data[:-1]]
        assert events[-1]["error"]["code"] == "request_timeout"
        assert any(e.get("choices") for e in events[:-1])  # tokens came before the deadline
        short = httpx.post(s.url + "/v1/completions", json={**long, "max_tokens": 2}, timeout=30)
        assert short.status_code == 200
        assert metric(s.url, "infertune_requests_timed_out_total") == 2
        assert wait_until(lambda: idle(s))
        assert metric(s.url, "infertune_request_queue_time_seconds_count") >= 1


def test_memory_budget_refuses_what_would_not_fit_and_the_rss_ceiling_sheds_load(tiny_llama):
    ceiling = process_rss() + 256 * 2**20
    with ServerThread(tiny_llama, max_model_len=256, max_num_seqs=8, memory_limit=ceiling) as s:
        one = s.engine.host_cost.bytes(8, 1 + 200, 20)  # what a request of n=8, 200 tokens, logprobs=20 holds
        # This test process holds more than a server's start-up footprint: leave exactly 1.5 such requests of room.
        s.engine.admission.baseline_bytes = ceiling - int(1.5 * one)
        assert metric(s.url, "infertune_host_memory_ceiling_bytes") == ceiling
        body = {"prompt": [5], "max_tokens": 200, "n": 8, "logprobs": 20, "ignore_eos": True}
        too_big = httpx.post(s.url + "/v1/completions", json={**body, "n": 16}, timeout=30)
        assert too_big.status_code == 400 and "host memory" in too_big.json()["error"]["message"]

        async def two():
            async with httpx.AsyncClient(timeout=60) as h:
                return await asyncio.gather(
                    h.post(s.url + "/v1/completions", json=body), h.post(s.url + "/v1/completions", json=body)
                )

        codes = sorted(r.status_code for r in asyncio.run(two()))
        assert codes == [200, 429]
        assert wait_until(lambda: metric(s.url, "infertune_host_memory_reserved_bytes") == 0 and idle(s))

        # The process itself over its ceiling: every new request is shed with 503 + Retry-After, /health answers.
        ballast = bytearray(b"\x01") * (ceiling - process_rss() + 32 * 2**20)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["code"] == "memory_rss" and r.headers["retry-after"] == "5"
        assert httpx.get(s.url + "/health").status_code == 200
        assert metric(s.url, "infertune_process_resident_memory_bytes") > ceiling
        del ballast
        assert wait_until(
            lambda: (
                httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, timeout=30).status_code
                == 200
            )
        )


POISON = 200  # a prompt starting with this token id makes its step raise (the injected failure below)


def _poisoned(server: ServerThread) -> None:
    """Make every step that runs a request whose prompt starts with POISON raise, as a request the checks let through
    and the model code cannot run would (an even SnapKV kernel did: a shape error after the forward pass)."""
    engine = server.engine.engine
    run = engine._run_batch

    def run_batch(batch):
        if any(s.prompt_token_ids[:1] == [POISON] for s in batch.seqs):
            raise RuntimeError("boom: this step cannot run")
        return run(batch)

    engine._run_batch = run_batch


def test_a_step_that_raises_fails_its_requests_and_the_server_goes_on(tiny_llama):
    """The failed step's request is a 500 naming the cause (streamed: an error event), nothing leaks, and the next
    requests are served as before (the offline engine's tokens); only failures in a row stop the engine."""
    body = {"model": MODEL, "prompt": [POISON, 5, 6, 7], "max_tokens": 4, "temperature": 0}
    good = {"model": MODEL, "prompt": [9, 10, 11], "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    offline = LLM(str(tiny_llama), dtype="float32", max_model_len=MAX_LEN, block_size=4)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = offline.generate([{"prompt_token_ids": good["prompt"]}], params)[0].outputs[0].text
    with ServerThread(tiny_llama) as s:
        _poisoned(s)
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 500, r.text
        err = r.json()["error"]
        assert err["code"] == "step_failed" and "RuntimeError: boom: this step cannot run" in err["message"]
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as r:
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert '"step_failed"' in events[-2] and events[-1] == "data: [DONE]"
        for _ in range(2):  # (a good request between failures resets the count)
            r = httpx.post(s.url + "/v1/completions", json={**good, "logprobs": 0}, timeout=30)
            assert r.status_code == 200
            assert r.json()["choices"][0]["logprobs"]["tokens"] and s.engine.error is None
        got = httpx.post(s.url + "/v1/completions", json=good, timeout=30).json()
        assert got["usage"]["completion_tokens"] == 6 and got["choices"][0]["text"] == want
        assert httpx.get(s.url + "/health").status_code == 200
        assert wait_until(lambda: metric(s.url, "infertune_kv_blocks_used") == 0)
        assert s.engine.num_failed_steps == 2
        # failures in a row: the engine is taken for broken and stops (503 for everyone, as before)
        for _ in range(3):
            httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert wait_until(lambda: s.engine.error is not None)
        assert httpx.post(s.url + "/v1/completions", json=good, timeout=30).status_code == 503


def test_a_failed_step_with_workers_elsewhere_stops_the_engine(tiny_llama):
    """An executor whose workers live in other processes (recovers_from_step_errors false: a rank that raised may
    leave the others mid-collective) stops at the first failed step: 503s, as before, rather than a hang later."""
    with ServerThread(tiny_llama) as s:
        _poisoned(s)
        s.engine.engine.executor.recovers_from_step_errors = False
        body = {"model": MODEL, "prompt": [POISON, 5], "max_tokens": 2}
        assert httpx.post(s.url + "/v1/completions", json=body, timeout=30).status_code == 503
        assert wait_until(lambda: s.engine.error is not None)
        assert httpx.get(s.url + "/health").status_code == 503
