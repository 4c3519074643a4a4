"""The OpenAI-compatible server, run for real on 127.0.0.1 and driven by the official openai client and httpx
(the server, client and offline fixtures: conftest.py).

Oracle: the offline LLM API on the same checkpoint (greedy), and the OpenAI wire format.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from server_utils import MAX_LEN, MODEL, ServerThread, free_port, metric, post

from infertune import SamplingParams

GREEDY = dict(temperature=0, max_tokens=12)
NO_EOS = {"ignore_eos": True}


def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completion_matches_offline_and_stream(client, offline):
    ref = offline.generate("The cache", SamplingParams(**GREEDY, ignore_eos=True))[0]
    r = client.completions.create(model=MODEL, prompt="The cache", extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].text == ref.outputs[0].text
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    chunks = list(
        client.completions.create(
            model=MODEL,
            prompt="The cache",
            stream=True,
            extra_body=NO_EOS,
            stream_options={"include_usage": True},
            **GREEDY,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.outputs[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 12 and not chunks[-1].choices


@pytest.mark.parametrize("chat", [False, True])
def test_continuous_usage_stats_gives_every_chunk_its_choices_usage_so_far(client, offline, chat):
    """vLLM's stream_options.continuous_usage_stats (benchmark clients send it; it was ignored): each chunk's usage
    counts its choice's tokens so far, the tokens its logprob entries name; the prompt's count is the offline one."""
    ref = offline.generate("The cache", SamplingParams(**GREEDY, ignore_eos=True))[0]
    options = {"include_usage": True, "continuous_usage_stats": True}
    kw = dict(
        model=MODEL, n=2, stream=True, stream_options=options, extra_body=NO_EOS, logprobs=0 if not chat else True
    )
    if chat:
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "Hi"}], **GREEDY, **kw))
    else:
        chunks = list(client.completions.create(prompt="The cache", **GREEDY, **kw))
    tokens = {0: 0, 1: 0}
    for chunk in chunks[:-1]:
        (choice,) = chunk.choices
        logprobs = choice.logprobs.content if chat else choice.logprobs.tokens
        tokens[choice.index] += len(logprobs or [])
        assert chunk.usage.completion_tokens == tokens[choice.index]
        assert chunk.usage.total_tokens == chunk.usage.prompt_tokens + tokens[choice.index]
        if not chat:
            assert chunk.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert tokens == {0: 12, 1: 12}
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 24


def test_chat_matches_offline_and_stream(client, offline):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    ref = offline.chat(messages, SamplingParams(**GREEDY, ignore_eos=True))[0]
    r = client.chat.completions.create(model=MODEL, messages=messages, extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == ref.outputs[0].text
    assert r.usage.prompt_tokens == len(ref.prompt_token_ids) and r.usage.completion_tokens == 12
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=messages, stream=True, extra_body=NO_EOS, **GREEDY)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.outputs[0].text


def test_stop_string_and_several_prompts_and_n(client, offline):
    full = offline.generate("abc", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0].text
    stop = full[5:8]
    cut = full[: full.index(stop)]
    r = client.completions.create(
        model=MODEL, prompt="abc", stop=[stop], temperature=0, max_tokens=20, extra_body=NO_EOS
    )
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    streamed = client.completions.create(
        model=MODEL, prompt="abc", stop=[stop], temperature=0, max_tokens=20, stream=True, extra_body=NO_EOS
    )
    assert "".join(c.choices[0].text for c in streamed) == cut
    # Two prompts x n=2: choices are indexed prompt-major, 4 in all.
    r = client.completions.create(
        model=MODEL, prompt=["abc", "xyz"], n=2, temperature=0, max_tokens=5, extra_body=NO_EOS
    )
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    assert by_index[0] == by_index[1] == full[: len(by_index[0])]


def test_logprobs(client, offline):
    ref = offline.generate("hello", SamplingParams(temperature=0, max_tokens=4, logprobs=2, ignore_eos=True))[0]
    r = client.completions.create(
        model=MODEL, prompt="hello", temperature=0, max_tokens=4, logprobs=2, extra_body=NO_EOS
    )
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx([e.logprob for e in ref.outputs[0].logprobs], abs=1e-5)
    assert all(len(top) <= 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "x"}],
        temperature=0,
        max_tokens=3,
        logprobs=True,
        top_logprobs=2,
        extra_body=NO_EOS,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob for c in content)


def test_chat_logprobs_bytes_are_the_tokens_raw_bytes(client):
    """OpenAI's `bytes`: a token's own UTF-8 bytes, so that tokens splitting a character add up to it. The tiny
    tokenizer spells every byte as one token: a byte >= 0x80 decodes alone as U+FFFD, and its bytes were those of
    U+FFFD ([239, 191, 189]); oracle: Python's UTF-8 decode of the tokens' bytes against the message's text."""
    chat = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "日本語 🤖"}],
        temperature=1.0,
        seed=1,
        max_tokens=40,
        logprobs=True,
        top_logprobs=3,
        extra_body=NO_EOS,
    )
    content = chat.choices[0].logprobs.content
    entries = content + [t for c in content for t in c.top_logprobs]
    for e in entries:
        if e.token != "\ufffd":  # (a whole character, or a special token: its text's bytes)
            assert bytes(e.bytes) == e.token.encode("utf-8")
        else:
            assert len(e.bytes) == 1 and e.bytes[0] >= 0x80
    assert any(e.token == "\ufffd" for e in content)  # (the check above saw partial characters)
    raw = b"".join(bytes(e.bytes) for e in content)
    assert raw.decode("utf-8", errors="replace") == chat.choices[0].message.content


def test_64_concurrent_requests_match_offline(server, offline):
    prompts = [f"request number {i}" for i in range(64)]
    refs = offline.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)

    async def go():
        aclient = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        async with aclient:
            return await asyncio.gather(
                *[
                    aclient.completions.create(model=MODEL, prompt=p, temperature=0, max_tokens=8, extra_body=NO_EOS)
                    for p in prompts
                ]
            )

    results = asyncio.run(go())
    assert [r.choices[0].text for r in results] == [o.outputs[0].text for o in refs]


def test_disconnect_mid_stream_frees_blocks_and_counts_abort(tiny_llama):
    # A long request (240 tokens) on its own server, so it is surely still running when the client leaves.
    with ServerThread(tiny_llama, max_model_len=256) as server:
        # (the tiny model is fast enough to finish 240 tokens before the client reads 6 lines: slow its steps down)
        server.engine.step_listeners.append(lambda outputs, seconds: time.sleep(0.01))
        body = {
            "model": MODEL,
            "prompt": "a long story",
            "max_tokens": 240,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.Client(timeout=10) as h, h.stream("POST", server.url + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [line for line, _ in zip(lines, range(6)) if line.startswith("data:")]
            assert got  # mid-stream
        deadline = time.time() + 10
        while time.time() < deadline:
            if (
                metric(server.url, "infertune_requests_aborted_total") > 0
                and metric(server.url, "infertune_kv_blocks_used") == 0
            ):
                break
            time.sleep(0.05)
        assert metric(server.url, "infertune_requests_aborted_total") == 1
        assert metric(server.url, "infertune_kv_blocks_used") == 0


@pytest.mark.parametrize(
    "body, param, fragment",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens", ">= 1"),
        ({"prompt": "x", "temperature": -1}, "temperature", ">= 0"),
        ({"prompt": "x", "top_p": 1.5}, "top_p", "(0, 1]"),
        ({"prompt": "x", "n": "two"}, "n", "integer"),
        ({"prompt": "x", "logprobs": 99}, "logprobs", "[0, 20]"),
        ({"prompt": ""}, "prompt", "empty"),
        ({"prompt": [[]]}, "prompt", "empty"),
        ({}, "prompt", "required"),
    ],
)
def test_invalid_parameters_are_400_naming_the_parameter(server, body, param, fragment):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == param and fragment in err["message"] and err["type"] == "invalid_request_error"


def test_prompt_longer_than_context_is_400_with_both_numbers(server):
    r = post(server, "/v1/completions", {"prompt": [5] * 100})
    assert r.status_code == 400
    assert "100" in r.json()["error"]["message"] and str(MAX_LEN) in r.json()["error"]["message"]


def test_max_tokens_past_the_context_is_400_not_silently_shortened(server):
    r = post(server, "/v1/completions", {"prompt": [5] * 10, "max_tokens": 60})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "max_tokens" and "70" in err["message"] and "54" in err["message"]
    assert post(server, "/v1/completions", {"prompt": [5] * 10, "max_tokens": 54}).status_code == 200


def test_unknown_model_and_route_and_bad_json(server):
    r = post(server, "/v1/completions", {"prompt": "x", "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    r = httpx.post(server.url + "/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")


def test_api_key_401_and_body_limit_413(tiny_llama):
    with ServerThread(tiny_llama, api_key="sekret", max_body_bytes=2000) as s:
        assert post(s, "/v1/completions", {"prompt": "x"}).status_code == 401
        wrong = post(s, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["error"]["code"] == "invalid_api_key"
        ok = post(s, "/v1/completions", {"prompt": "x", "max_tokens": 2}, headers={"Authorization": "Bearer sekret"})
        assert ok.status_code == 200
        big = post(s, "/v1/completions", {"prompt": "x" * 5000}, headers={"Authorization": "Bearer sekret"})
        assert big.status_code == 413 and "2000" in big.json()["error"]["message"]
        assert httpx.get(s.url + "/health").status_code == 200  # health needs no key


def test_full_queue_is_429_and_nothing_leaks(tiny_llama):
    with ServerThread(tiny_llama, max_waiting=1, max_num_seqs=1) as s:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 40, "temperature": 0, "ignore_eos": True}

        async def go():
            async with httpx.AsyncClient(timeout=60) as h:
                return await asyncio.gather(*[h.post(s.url + "/v1/completions", json=body) for _ in range(8)])

        responses = asyncio.run(go())
        codes = [r.status_code for r in responses]
        assert set(codes) <= {200, 429} and 429 in codes and 200 in codes
        limited = next(r for r in responses if r.status_code == 429).json()["error"]
        assert limited["type"] == "rate_limit_error" and "retry" in limited["message"]
        deadline = time.time() + 5
        while metric(s.url, "infertune_kv_blocks_used") and time.time() < deadline:
            time.sleep(0.05)
        assert metric(s.url, "infertune_kv_blocks_used") == 0


# ---- fuzz: malformed and extreme bodies never cause a 5xx -------------------------------------------------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FIELDS = [
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "n",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "logprobs",
    "top_logprobs",
    "ignore_eos",
    "stream",
    "stream_options",
    "user",
    "echo",
    "unknown_field",
]
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, -1, 2**31, 64]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=20),
    st.sampled_from(["", "x", MODEL]),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["role", "content", "type", "text", "include_usage"]), inner, max_size=3)
    ),
    max_leaves=8,
)
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["user", "system", "assistant", "bogus"]),
        "content": st.one_of(st.text(max_size=30), values),
    }
)
bodies = (
    st.dictionaries(st.sampled_from(FIELDS), values, max_size=8)
    | st.fixed_dictionaries(
        {
            "prompt": st.one_of(st.text(max_size=40), st.lists(st.integers(-5, 400), max_size=70)),
            "max_tokens": st.integers(-3, 10**9),
            "temperature": st.floats(-1, 3),
            "stream": st.booleans(),
        },
        optional={
            "n": st.integers(-1, 3),
            "stop": values,
            "logprobs": st.integers(-2, 30),
            "top_p": st.floats(-1, 2),
            "top_k": st.integers(-3, 500),
            "seed": st.integers(-(2**63), 2**64),
        },
    )
    | st.fixed_dictionaries(
        {"messages": st.lists(message, max_size=3)},
        optional={
            "max_completion_tokens": st.integers(-3, 10**9),
            "logprobs": values,
            "top_logprobs": values,
            "stream": values,
        },
    )
)


@settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
@given(body=bodies, chat=st.booleans())
def test_fuzzed_bodies_never_5xx(server, body, chat):
    path = "/v1/chat/completions" if chat else "/v1/completions"
    r = httpx.post(server.url + path, json=body, timeout=60)
    assert r.status_code < 500, (body, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200))
def test_fuzzed_raw_bytes_never_5xx(server, raw):
    r = httpx.post(server.url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert r.status_code < 500, (raw, r.text)


def test_server_still_correct_after_fuzz(client, offline):
    ref = offline.generate("after the storm", SamplingParams(**GREEDY, ignore_eos=True))[0]
    r = client.completions.create(model=MODEL, prompt="after the storm", extra_body=NO_EOS, **GREEDY)
    assert r.choices[0].text == ref.outputs[0].text


# ---- SIGTERM: stop accepting, finish in-flight work, exit 0 --------------------------------------------------
def test_sigterm_finishes_in_flight_and_exits_zero(tiny_llama):
    import signal
    import subprocess
    import sys

    port = free_port()
    config = tiny_llama.parent / "serve-config.json"  # what `infertune tune --out-config` writes
    config.write_text(json.dumps({"max_model_len": 200, "max_num_seqs": 4}))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "infertune.cli",
            "serve",
            "--model",
            str(tiny_llama),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-model-len",
            "256",
            "--config",
            str(config),
            "--graceful-timeout",
            "20",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.1)
        body = {"prompt": "x", "max_tokens": 150, "temperature": 0, "ignore_eos": True, "stream": True}
        texts, finish = [], None
        with httpx.Client(timeout=60) as h, h.stream("POST", url + "/v1/completions", json=body) as resp:
            for line in resp.iter_lines():
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                if not texts:
                    proc.send_signal(signal.SIGTERM)  # mid-stream
                choice = json.loads(line[5:])["choices"][0]
                texts.append(choice["text"])
                finish = choice["finish_reason"] or finish
        assert finish == "length"  # the in-flight request ran to its end
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    log = proc.stdout.read()
    assert "KV cache:" in log and f"serving '{tiny_llama.name}'" in log  # the start-up report
    assert "max_model_len=256" in log  # a flag on the command line wins over the --config file's 200 (vLLM's order)
