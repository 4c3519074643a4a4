"""The serving load generator (infertune.bench.serve_load): its pure parts on exact numbers, and whole runs
against a small fake OpenAI streaming server (FastAPI + uvicorn in a thread) with known delays and failures."""

import argparse
import asyncio
import json
import math
import socket
import statistics
import threading
import time

import pytest

from infertune.bench import serve_load as sl

# ----------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------


def test_percentile_linear_interpolation():
    xs = list(range(101))  # 0..100: the q-th percentile is q exactly
    random_order = xs[::7] + [x for x in xs if x % 7]
    for q in (0, 1, 50, 90, 99, 100):
        assert sl.percentile(random_order, q) == q
    assert sl.percentile([1, 2, 3, 4], 50) == 2.5
    assert sl.percentile([4, 1, 3, 2], 25) == 1.75  # pos 0.75 between 1 and 2
    assert sl.percentile([7.0], 99) == 7.0
    with pytest.raises(ValueError):
        sl.percentile([], 50)
    with pytest.raises(ValueError):
        sl.percentile([1], 101)


def test_summarize_known_list():
    s = sl.summarize([1, 2, 3, 4])
    assert s["count"] == 4
    assert s["mean"] == 2.5
    assert s["p50"] == 2.5
    assert s["p90"] == pytest.approx(3.7, abs=1e-12)  # pos 2.7
    assert s["p99"] == pytest.approx(3.97, abs=1e-12)  # pos 2.97
    assert s["std"] == pytest.approx(math.sqrt(1.25), abs=1e-12)
    assert (s["min"], s["max"]) == (1, 4)
    empty = sl.summarize([])
    assert empty["count"] == 0 and all(empty[k] is None for k in ("mean", "p50", "p90", "p99", "std"))


def _result(i, ttft, latency, out, ok=True, itl=(), prompt_tokens=None, prompt_len=10):
    return sl.RequestResult(
        index=i,
        success=ok,
        ttft=ttft,
        latency=latency,
        output_tokens=out,
        itl=list(itl),
        prompt_tokens=prompt_tokens,
        prompt_len=prompt_len,
        usage_reported=ok,
        error=None if ok else "HTTP 500: boom",
    )


def test_summarize_results_exact():
    results = [
        _result(0, 0.100, 1.100, 11, itl=[0.1] * 10, prompt_tokens=20),  # TPOT (1.1-0.1)/10 = 0.1
        _result(1, 0.300, 0.700, 5, itl=[0.1] * 4, prompt_tokens=30),  # TPOT 0.1
        _result(2, 0.050, 0.050, 1, prompt_tokens=None, prompt_len=7),  # 1 token: no TPOT
        _result(3, None, None, 0, ok=False),
    ]
    s = sl.summarize_results(results, duration=2.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["total_input_tokens"] == 20 + 30 + 7  # the server's count when given, else the estimate
    assert s["total_output_tokens"] == 17
    assert s["request_throughput"] == 1.5
    assert s["output_throughput"] == 8.5
    assert s["input_throughput"] == 28.5
    assert s["ttft_ms"]["mean"] == pytest.approx(150.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(100.0)
    assert s["tpot_ms"]["count"] == 2 and s["tpot_ms"]["mean"] == pytest.approx(100.0)
    assert s["itl_ms"]["count"] == 14 and s["itl_ms"]["p99"] == pytest.approx(100.0)
    assert s["e2el_ms"]["max"] == pytest.approx(1100.0)
    # goodput: #0 meets both, #1 misses TTFT (300 > 200), #2 meets (no TPOT for one token), #3 failed
    assert s["good_requests"] == 2 and s["goodput"] == 1.0
    assert s["errors"] == {"HTTP 500: boom": 1}
    assert sl.summarize_results(results, 2.0)["goodput"] is None
    assert sl.summarize_results(results, 2.0, slo_tpot_ms=99)["good_requests"] == 1  # only the 1-token one
    text = sl.format_report(s)
    assert "Goodput" in text and "HTTP 500: boom" in text and len(text.splitlines()) < 30
    assert s["short_outputs"] == 0


def test_report_counts_short_outputs_and_groups_errors():
    results = [_result(0, 0.1, 0.5, 3), _result(1, 0.1, 0.5, 8)]
    for r in results:
        r.expected_output_len = 8
    for i, n in enumerate((298, 277, 298)):
        results.append(_result(2 + i, None, None, 0, ok=False))
        results[-1].error = f"HTTP 400: the prompt has {n} tokens"
    s = sl.summarize_results(results, 1.0)
    assert s["short_outputs"] == 1
    assert s["errors"] == {"HTTP 400: the prompt has 298 tokens": 2, "HTTP 400: the prompt has 277 tokens": 1}
    text = sl.format_report(s)
    assert "1 completed requests got fewer output tokens" in text
    assert "  3: HTTP 400: the prompt has 298 tokens" in text  # one kind: they differ only in a number


# ----------------------------------------------------------------------------------------------------
# Arrival schedule
# ----------------------------------------------------------------------------------------------------


def test_poisson_schedule():
    rate, n = 4.0, 20000
    gaps = sl.poisson_intervals(n, rate, seed=0)
    assert len(gaps) == n and all(g >= 0 for g in gaps)
    assert gaps == sl.poisson_intervals(n, rate, seed=0)  # seeded
    assert gaps[:10] != sl.poisson_intervals(10, rate, seed=1)
    # The mean gap of n exponential samples has standard error (1/rate)/sqrt(n) = 0.7% here: 3% is > 4 sigma.
    mean = statistics.fmean(gaps)
    assert abs(mean - 1 / rate) <= 0.03 / rate
    assert abs(statistics.pstdev(gaps) / mean - 1.0) <= 0.05  # exponential: std == mean
    assert sl.poisson_intervals(5, math.inf) == [0.0] * 5
    assert sl.arrival_offsets([0.5, 0.25, 1.0]) == [0.5, 0.75, 1.75]
    with pytest.raises(ValueError):
        sl.poisson_intervals(3, 0.0)


# ----------------------------------------------------------------------------------------------------
# Server-sent events
# ----------------------------------------------------------------------------------------------------

RECORDED = (
    b": keep-alive comment\r\n\r\n"
    b'data: {"choices":[{"index":0,"text":"caf\xc3\xa9 \xf0\x9f\x98\x80"}]}\r\n\r\n'
    b'data:{"choices":[{"index":0,"text":"no space"}]}\n\n'
    b"event: note\ndata: line one\ndata: line two\n\n"
    b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}\r\r'
    b"data: [DONE]\n\n"
)
EXPECTED = [
    ("message", '{"choices":[{"index":0,"text":"café 😀"}]}'),
    ("message", '{"choices":[{"index":0,"text":"no space"}]}'),
    ("note", "line one\nline two"),
    ("message", '{"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":2}}'),
    ("message", "[DONE]"),
]


def _decode(pieces):
    d = sl.SSEDecoder()
    events = []
    for p in pieces:
        events += d.feed(p)
    return events + d.close()


def test_sse_decoder_any_split():
    assert _decode([RECORDED]) == EXPECTED
    assert _decode([RECORDED[i : i + 1] for i in range(len(RECORDED))]) == EXPECTED  # byte by byte
    for cut in range(1, len(RECORDED)):  # every single cut: inside "\r\n", inside the UTF-8 of é and 😀, ...
        assert _decode([RECORDED[:cut], RECORDED[cut:]]) == EXPECTED, cut
    for a in range(1, len(RECORDED), 5):
        for b in range(a + 1, len(RECORDED), 3):
            assert _decode([RECORDED[:a], RECORDED[a:b], RECORDED[b:]]) == EXPECTED, (a, b)


def test_sse_decoder_edge_cases():
    # an unterminated last event is still returned at close(); llama.cpp's "error:" line is an error event
    assert _decode([b"data: a\n\ndata: b"]) == [("message", "a"), ("message", "b")]
    assert _decode([b'error: {"code":500}\n\n']) == [("error", '{"code":500}')]
    assert _decode([b"event: x\n\n", b"data: y\n\n"]) == [("message", "y")]  # an event with no data is dropped


def test_chunk_text():
    assert sl.chunk_text({"choices": [{"index": 0, "text": "ab"}]}) == "ab"
    assert sl.chunk_text({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) == ""
    assert sl.chunk_text({"choices": [{"delta": {"content": "hi"}}]}) == "hi"
    assert sl.chunk_text({"choices": [{"delta": {"reasoning_content": "hm", "content": None}}]}) == "hm"
    assert sl.chunk_text({"choices": [], "usage": {"completion_tokens": 3}}) == ""


# ----------------------------------------------------------------------------------------------------
# Datasets and payloads
# ----------------------------------------------------------------------------------------------------


def test_load_jsonl_both_shapes(tmp_path):
    path = tmp_path / "data.jsonl"
    records = [
        {"prompt": "hello there", "output_len": 7},
        {"prompt": "no length given"},
        {
            "conversations": [
                {"from": "system", "value": "be nice"},
                {"from": "human", "value": "question one"},
                {"from": "gpt", "value": "x" * 40},
                {"from": "human", "value": "later"},
            ]
        },
        {"conversations": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "abcdefgh"}]},
        {"conversations": [{"from": "gpt", "value": "an answer with no question"}]},  # skipped
        {"other": 1},  # skipped
    ]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    specs = sl.load_dataset(str(path), 4, input_len=99, output_len=5, seed=0)
    got = sorted((s.prompt, s.prompt_len, s.output_len) for s in specs)
    assert got == sorted(
        [
            ("hello there", 3, 7),  # 11 chars -> ~3 tokens
            ("no length given", 4, 5),  # --output-len
            ("question one", 3, 10),  # 40-char answer -> ~10 tokens
            ("q2", 1, 2),
        ]
    )
    assert [s.prompt for s in specs] == [s.prompt for s in sl.load_dataset(str(path), 4, 99, 5, seed=0)]
    # more prompts than records: cycled; an exact tokenizer replaces the estimate
    specs = sl.load_dataset(str(path), 9, 99, 5, seed=1, count_tokens=lambda t: len(t.split()))
    assert len(specs) == 9 and {s.prompt for s in specs} == {"hello there", "no length given", "question one", "q2"}
    assert {s.prompt: s.output_len for s in specs}["question one"] == 1  # one "word"
    # a JSON array file (the original ShareGPT file) works too
    arr = tmp_path / "data.json"
    arr.write_text(json.dumps(records))
    assert len(sl.load_dataset(str(arr), 4, 99, 5)) == 4
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\n{oops\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        sl.load_dataset(str(bad), 1, 1, 1)
    with pytest.raises(FileNotFoundError):
        sl.load_dataset(str(tmp_path / "missing.jsonl"), 1, 1, 1)


def test_random_prompts():
    specs = sl.random_prompts(20, input_len=32, output_len=9, seed=3)
    assert len(specs) == 20 and all(len(s.prompt.split()) == 32 and s.prompt_len == 32 for s in specs)
    assert all(s.output_len == 9 for s in specs) and len({s.prompt for s in specs}) == 20
    assert [s.prompt for s in specs] == [s.prompt for s in sl.random_prompts(20, 32, 9, seed=3)]
    assert set(specs[0].prompt.split()) <= set(sl.WORDS)

    def count(t):  # a "tokenizer" with one token per 3 characters
        return math.ceil(len(t) / 3)

    for s in sl.random_prompts(10, 100, 1, seed=0, count_tokens=count):
        assert s.prompt_len == count(s.prompt) and abs(s.prompt_len - 100) <= 3


def test_payload_and_urls():
    spec = sl.PromptSpec("hi", 1, 4)
    body = sl.build_payload("completions", "m", spec)
    assert body == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    chat = sl.build_payload("chat", "m", spec, ignore_eos=False, temperature=0.0)
    assert chat["messages"] == [{"role": "user", "content": "hi"}] and "ignore_eos" not in chat
    assert chat["max_completion_tokens"] == 4 and chat["temperature"] == 0.0
    for url in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert sl.base_url(url) == "http://h:1"


def _args(*argv):
    p = argparse.ArgumentParser()
    sl.add_arguments(p)
    return p.parse_args(list(argv))


def test_argument_defaults():
    a = _args()
    assert (a.url, a.endpoint, a.model, a.dataset, a.input_len, a.output_len, a.num_prompts) == (
        "http://127.0.0.1:8000",
        "completions",
        None,
        "random",
        128,
        128,
        100,
    )
    assert math.isinf(a.request_rate) and a.ignore_eos and a.max_concurrency is None and a.seed == 0
    assert _args("--request-rate", "2.5", "--no-ignore-eos").request_rate == 2.5
    with pytest.raises(SystemExit):
        _args("--request-rate", "0")


# ----------------------------------------------------------------------------------------------------
# Whole runs against a fake OpenAI streaming server
# ----------------------------------------------------------------------------------------------------

DELAY = 0.05  # seconds before each content chunk
API_KEY = "sk-test"


def _fake_app():
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    app.state.bodies, app.state.auth = [], []
    app.state.in_flight = app.state.max_in_flight = 0

    def sse(obj):
        return f"data: {json.dumps(obj)}\n\n"

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    async def handle(request: Request, chat: bool):
        body = await request.json()
        app.state.bodies.append(body)
        app.state.auth.append(request.headers.get("authorization"))
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        if "FAIL500" in prompt:
            return JSONResponse({"error": {"message": "internal boom", "type": "internal_error"}}, status_code=500)
        if "FAIL429" in prompt:
            return JSONResponse({"error": {"message": "queue full", "type": "rate_limit_error"}}, status_code=429)
        n = body.get("max_completion_tokens") or body["max_tokens"]
        usage = (body.get("stream_options") or {}).get("include_usage") and "NOUSAGE" not in prompt

        def chunk(text, finish=None):
            choice = (
                {"index": 0, "delta": {"content": text} if text else {}, "finish_reason": finish}
                if chat
                else {"index": 0, "text": text, "finish_reason": finish}
            )
            return sse({"id": "x", "object": "chunk", "choices": [choice]})

        async def events():
            app.state.in_flight += 1
            app.state.max_in_flight = max(app.state.max_in_flight, app.state.in_flight)
            try:
                if chat:  # a role-only first chunk, which must not count as the first token
                    yield sse({"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
                for i in range(n):
                    await asyncio.sleep(DELAY)
                    if "MIDERROR" in prompt and i == 1:
                        yield sse({"error": {"message": "engine died", "type": "service_unavailable"}})
                        return
                    yield chunk(f"t{i} ")
                yield chunk("", "length")
                if usage:
                    yield sse(
                        {
                            "choices": [],
                            "usage": {
                                "prompt_tokens": len(prompt.split()),
                                "completion_tokens": n,
                                "total_tokens": len(prompt.split()) + n,
                            },
                        }
                    )
                yield "data: [DONE]\n\n"
            finally:
                app.state.in_flight -= 1

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await handle(request, chat=True)

    return app


@pytest.fixture(scope="module")
def fake_server():
    import uvicorn

    app = _fake_app()
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "fake server did not start"
        time.sleep(0.01)
    try:
        yield app, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(5)
        sock.close()


def test_run_completions_with_failures(fake_server, tmp_path, capsys):
    app, url = fake_server
    app.state.bodies.clear()
    data = tmp_path / "mixed.jsonl"
    rows = [
        {"prompt": "alpha one", "output_len": 3},
        {"prompt": "beta two three", "output_len": 4},
        {"conversations": [{"from": "human", "value": "gamma"}, {"from": "gpt", "value": "x" * 20}]},  # 5 out
        {"prompt": "NOUSAGE here", "output_len": 2},  # no usage chunk: tokens counted from the chunks
        {"prompt": "please FAIL500", "output_len": 3},
        {"prompt": "please FAIL429", "output_len": 3},
        {"prompt": "MIDERROR now", "output_len": 3},  # an error event after one chunk
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "res" / "out.json"
    args = _args(
        "--url",
        url + "/v1",
        "--model",
        "fake-model",
        "--dataset",
        str(data),
        "--num-prompts",
        "7",
        "--json",
        str(out),
        "--no-progress",
        "--timeout",
        "30",
    )
    assert sl.run(args) == 0
    report = capsys.readouterr().out
    assert "Successful requests:" in report and "HTTP 500" in report

    result = json.loads(out.read_text())
    s = result["summary"]
    assert (s["completed"], s["failed"]) == (4, 3)
    assert s["total_output_tokens"] == 3 + 4 + 5 + 2
    assert s["total_input_tokens"] == 2 + 3 + 1 + 3  # server usage for three, the estimate (12 chars) for one
    assert s["output_tokens_from_usage"] is False
    errors = " | ".join(s["errors"])
    assert "HTTP 500" in errors and "internal boom" in errors and "HTTP 429" in errors and "engine died" in errors
    assert sum(s["errors"].values()) == 3

    reqs = result["requests"]
    assert len(reqs) == 7 and sorted(r["index"] for r in reqs) == list(range(7))
    failed = [r for r in reqs if not r["success"]]
    assert sorted(r["status"] for r in failed) == [200, 429, 500]
    ok = [r for r in reqs if r["success"]]
    assert sorted(r["output_tokens"] for r in ok) == [2, 3, 4, 5]
    assert all(len(r["itl_ms"]) == r["output_tokens"] - 1 for r in ok)
    assert s["itl_ms"]["count"] == 1 + 2 + 3 + 4
    delay_ms = DELAY * 1000
    # roughly the injected delays: ITL median within 50%; TTFT at least most of one delay, not far above
    assert 0.5 * delay_ms <= s["itl_ms"]["p50"] <= 1.5 * delay_ms
    assert 0.5 * delay_ms <= s["ttft_ms"]["p50"] <= delay_ms + 500
    for r in ok:
        assert r["e2el_ms"] >= r["ttft_ms"] + sum(r["itl_ms"]) - 1e-6
        assert r["tpot_ms"] == pytest.approx((r["e2el_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1))
    body = app.state.bodies[0]
    assert body["model"] == "fake-model" and body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_run_chat_discovers_model_limits_concurrency(fake_server, tmp_path, capsys):
    app, url = fake_server
    app.state.bodies.clear()
    app.state.auth.clear()
    app.state.max_in_flight = 0
    out = tmp_path / "chat.json"
    args = _args(
        "--url",
        url,
        "--endpoint",
        "chat",
        "--api-key",
        API_KEY,
        "--num-prompts",
        "6",
        "--input-len",
        "8",
        "--output-len",
        "3",
        "--request-rate",
        "200",
        "--max-concurrency",
        "2",
        "--slo-ttft-ms",
        "5000",
        "--slo-tpot-ms",
        "5000",
        "--json",
        str(out),
        "--no-progress",
    )
    assert sl.run(args) == 0
    s = json.loads(out.read_text())["summary"]
    assert (s["completed"], s["failed"], s["total_output_tokens"], s["total_input_tokens"]) == (6, 0, 18, 48)
    assert s["good_requests"] == 6 and s["goodput"] == pytest.approx(s["request_throughput"])
    assert s["ttft_ms"]["min"] >= 0.5 * DELAY * 1000  # the empty role chunk did not count as the first token
    assert app.state.max_in_flight <= 2
    assert {b["model"] for b in app.state.bodies} == {"fake-model"}
    assert all(len(b["messages"][0]["content"].split()) == 8 for b in app.state.bodies)
    assert set(app.state.auth) == {f"Bearer {API_KEY}"}
    assert "Goodput" in capsys.readouterr().out


def test_run_unreachable_server(capsys):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # nothing listens there now
    args = _args(
        "--url",
        url,
        "--model",
        "m",
        "--num-prompts",
        "3",
        "--input-len",
        "4",
        "--output-len",
        "2",
        "--no-progress",
        "--timeout",
        "5",
    )
    assert sl.run(args) == 1  # every request failed, but the run finished and reported it
    assert "ConnectError" in capsys.readouterr().out
    assert sl.run(_args("--url", url, "--num-prompts", "1", "--no-progress")) == 2  # cannot ask for the model
    assert "cannot reach" in capsys.readouterr().err
