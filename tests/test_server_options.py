"""The request options OpenAI's and vLLM's clients send beyond the basics, on a real server (uvicorn on 127.0.0.1,
driven by the openai SDK and httpx): logit_bias, min_tokens, allowed_token_ids, bad_words, truncate_prompt_tokens,
chat_template / chat_template_kwargs / continue_final_message; options this server does not do are a 400 naming
them (never silently ignored); text a tokenizer cannot take (a lone UTF-16 surrogate) is a 400, not a 500.

Oracles: an unconstrained run's own top logprobs (the token a constraint leaves is the best one it allows), the
tokenizer's count of the text a template renders, HF transformers' apply_chat_template, and the sampler's
processors against a plain re-implementation over the same logits.
"""

from __future__ import annotations

import httpx
import pytest
import torch
from server_utils import MODEL, ServerThread, post

from infertune import LLM, SamplingParams
from infertune.runner.sampler import SampleRequest, apply_logits_processors

GREEDY = dict(temperature=0, max_tokens=6)


def post_json(server, body):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    return r.json()


def first_step_ranking(offline: LLM, prompt: str) -> list[int]:
    """The first output step's tokens, best first (20 of them): the unconstrained run's own logprobs."""
    out = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=20, ignore_eos=True))[0]
    top = out.outputs[0].logprobs[0].top
    return [t for t, _ in sorted(top, key=lambda x: -x[1])]


# ---- the sampler's processors against a plain loop ------------------------------------------------------------------
def test_logits_processors_match_a_plain_reimplementation():
    g = torch.Generator().manual_seed(0)
    vocab = 40
    logits = torch.randn(4, vocab, generator=g)
    rows = [
        SampleRequest(SamplingParams(logit_bias={"3": 5.5, 7: -100}), [], [], 0),
        SampleRequest(SamplingParams(allowed_token_ids=[2, 9, 31]), [], [], 0),
        SampleRequest(SamplingParams(min_tokens=3, min_tokens_stop_ids=(1, 4)), [], [], 2),  # still held back
        SampleRequest(SamplingParams(bad_words_token_ids=[[6], [8, 9, 10], [11, 12]]), [], [5, 8, 9], None),
    ]
    got = apply_logits_processors(logits.clone(), rows)
    want = logits.clone()
    want[0, 3] += 5.5
    want[0, 7] -= 100
    for t in range(vocab):
        if t not in (2, 9, 31):
            want[1, t] = float("-inf")
    want[2, 1] = want[2, 4] = float("-inf")
    want[3, 6] = float("-inf")  # a one-token word: always
    want[3, 10] = float("-inf")  # the output ends in 8, 9: the word's last token
    assert torch.equal(got, want)  # ([11, 12]: the output does not end in 11, so 12 stays)
    # past min_tokens nothing is held back
    done = SampleRequest(SamplingParams(min_tokens=3, min_tokens_stop_ids=(1, 4)), [], [], 3)
    assert torch.equal(apply_logits_processors(logits[2:3].clone(), [done]), logits[2:3])


# ---- the options on the server -------------------------------------------------------------------------------
def both(server, offline, prompt: str, **options) -> tuple[list[int], dict]:
    """The output token ids of the offline API and the server's completion choice for the same options, the server's
    text checked against the offline text (token ids from the offline API: a byte token alone decodes to U+FFFD)."""
    ref = offline.generate(prompt, SamplingParams(**options))[0].outputs[0]
    got = post_json(server, {"prompt": prompt, **options})["choices"][0]
    assert got["text"] == ref.text and got["finish_reason"] == ref.finish_reason
    return list(ref.token_ids), got


def test_logit_bias_through_the_openai_sdk(client, server, offline):
    q = offline.get_tokenizer().encode("Q", add_special_tokens=False)[0]
    r = client.completions.create(model=MODEL, prompt="hello", temperature=0, max_tokens=3, logit_bias={str(q): 100})
    assert r.choices[0].text == "QQQ"
    ranking = first_step_ranking(offline, "hello")
    ids, _ = both(server, offline, "hello", temperature=0, max_tokens=1, logit_bias={str(ranking[0]): -100})
    assert ids == [ranking[1]]  # the best token but the banned one


def test_allowed_token_ids_leave_the_best_allowed_token(server, offline):
    ranking = first_step_ranking(offline, "hello")
    allowed = [ranking[7], ranking[3], ranking[12]]
    ids, _ = both(server, offline, "hello", temperature=0, max_tokens=5, allowed_token_ids=allowed)
    assert ids[0] == ranking[3] and set(ids) <= set(allowed)


def test_min_tokens_holds_back_stop_tokens_and_stop_strings(server, offline):
    ranking = first_step_ranking(offline, "hello")
    stop_id = ranking[0]
    base = dict(temperature=0, max_tokens=8, stop_token_ids=[stop_id])
    ids, choice = both(server, offline, "hello", **base)
    assert ids == [stop_id] and choice["finish_reason"] == "stop" and choice["stop_reason"] == stop_id
    ids, choice = both(server, offline, "hello", **base, min_tokens=4)
    assert len(ids) >= 4 and stop_id not in ids[:4]
    assert ids[0] == ranking[1]  # the best token once the stop token is held back
    # a stop string is not looked for before min_tokens either
    q = offline.get_tokenizer().encode("Q", add_special_tokens=False)[0]
    forced = dict(temperature=0, max_tokens=8, ignore_eos=True, logit_bias={str(q): 100})
    _, stopped = both(server, offline, "hello", **forced, stop=["Q"])
    assert stopped["text"] == "" and stopped["stop_reason"] == "Q"
    ids, late = both(server, offline, "hello", **forced, stop=["Q"], min_tokens=3)
    assert late["text"] == "QQQ" and late["stop_reason"] == "Q" and len(ids) == 4  # (the 4th Q is the stop)


def test_the_models_own_end_of_sequence_has_no_stop_reason(server, offline):
    eos = offline.get_tokenizer().eos_token_id
    r = post_json(server, {"prompt": "hello", "temperature": 0, "max_tokens": 4, "logit_bias": {str(eos): 100}})
    choice = r["choices"][0]
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] is None  # (vLLM's answer)


def test_bad_words_never_appear(server, offline):
    tok = offline.get_tokenizer()
    # (letters only, so that every token is a word of its own text: a lone byte past ASCII decodes to U+FFFD)
    letters = dict(allowed_token_ids=tok.encode("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False))
    opts = dict(temperature=0, max_tokens=12, ignore_eos=True, **letters)
    ids, _ = both(server, offline, "hello", **opts)
    word = ids[2]  # a one-token word the model does write here
    banned, _ = both(server, offline, "hello", **opts, bad_words=[tok.decode([word])])
    assert word not in banned and len(banned) == 12
    # a two-token word: its second token only where the first precedes it
    pair = tok.decode(ids[3:5])
    banned, _ = both(server, offline, "hello", **opts, bad_words=[pair])
    assert all(banned[i : i + 2] != ids[3:5] for i in range(len(banned) - 1))
    assert banned[:4] == ids[:4]  # (up to the word's first token, nothing changed)


def test_truncate_prompt_tokens_keeps_the_last_tokens(server):
    prompt = "the quick brown fox jumps over the lazy dog"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    cut = post_json(server, {"prompt": prompt, **GREEDY, "ignore_eos": True, "truncate_prompt_tokens": 10})
    assert cut["usage"]["prompt_tokens"] == 10
    tail = post_json(server, {"prompt": ids[-10:], **GREEDY, "ignore_eos": True})
    assert cut["choices"][0]["text"] == tail["choices"][0]["text"]


def test_chat_template_and_its_kwargs_and_continue_final_message(server, tiny_llama):
    from transformers import AutoTokenizer

    messages = [{"role": "user", "content": "hi"}]
    template = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    body = {"messages": messages, "max_tokens": 1, "temperature": 0, "chat_template": template}
    r = post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"greeting": "well hello"}})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] == len("well hello[hi]")  # one token a byte
    assert post(server, "/v1/chat/completions", body).json()["usage"]["prompt_tokens"] == len("[hi]")
    bad = post(server, "/v1/chat/completions", {**body, "chat_template_kwargs": {"tools": []}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template_kwargs"
    # continue_final_message: the checkpoint's template, as transformers renders it
    conv = [*messages, {"role": "assistant", "content": "Once upon"}]
    hf = AutoTokenizer.from_pretrained(tiny_llama)

    def rendered(**kw) -> int:  # the tokens of the text transformers renders (the template holds the specials)
        return len(hf.encode(hf.apply_chat_template(conv, tokenize=False, **kw), add_special_tokens=False))

    want = rendered(continue_final_message=True)
    cont = {"messages": conv, "max_tokens": 1, "continue_final_message": True, "add_generation_prompt": False}
    r = post(server, "/v1/chat/completions", cont)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == want
    closed = rendered()
    assert want < closed  # (the final message left open: its end-of-turn markup is not there)
    both = post(server, "/v1/chat/completions", {**cont, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"best_of": 3}, "best_of"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"return_tokens_as_token_ids": True}, "return_tokens_as_token_ids"),
        ({"logits_processors": ["x"]}, "logits_processors"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),  # (without stream)
        ({"temperature": float("inf")}, "temperature"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"logit_bias": {"3": 101}}, "logit_bias"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"min_tokens": 2, "guided_regex": "[a-z]+"}, "min_tokens"),
        ({"suffix": "return x"}, "suffix"),
    ],
)
def test_options_this_server_does_not_do_are_400_naming_them(server, extra, param):
    r = httpx.post(
        server.url + "/v1/completions",
        content=_json({"prompt": "x", "max_tokens": 2, **extra}),
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "best_of": 1}).status_code == 200


def _json(body: dict) -> bytes:
    import json

    return json.dumps(body).encode()  # (allow_nan: Infinity, as a JavaScript client may send it)


# ---- text a tokenizer cannot take ------------------------------------------------------------------------
def _raw(server, path: str, body: str) -> httpx.Response:
    return httpx.post(server.url + path, content=body.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/v1/completions", '{"prompt": "a\\ud800b", "max_tokens": 2}', "prompt"),
        ("/v1/completions", '{"prompt": ["ok", "\\ud83d"], "max_tokens": 2, "stream": true}', "prompt"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud83d"}]}', "messages"),
        ("/tokenize", '{"prompt": "a\\udfff"}', "prompt"),
    ],
)
def test_a_lone_surrogate_is_400_not_500(server, path, body, param):
    r = _raw(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert param in err["param"] and "surrogate" in err["message"]
    assert post(server, "/v1/completions", {"prompt": "a\U0001f600b", "max_tokens": 1}).status_code == 200


def test_a_lone_surrogate_in_the_python_api_is_a_clear_error(offline):
    with pytest.raises(ValueError, match="surrogate"):
        offline.generate("a\ud800b", SamplingParams(max_tokens=1))


def test_completions_top_logprobs_hold_the_sampled_token(server, offline):
    letters = offline.get_tokenizer().encode("abcdefghijklmnopqrstuvwxyz", add_special_tokens=False)
    body = {"prompt": "def f(x):", "max_tokens": 12, "temperature": 1.5, "seed": 3, "logprobs": 1}
    body["allowed_token_ids"] = letters  # (one-byte tokens that decode to distinct strings: the keys below)
    lp = post_json(server, body)["choices"][0]["logprobs"]
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == value and len(top) <= 2
    assert any(len(top) == 2 for top in lp["top_logprobs"])  # (a sampled token outside the top 1 came along)
    zero = post_json(server, {**body, "logprobs": 0})["choices"][0]["logprobs"]
    assert [list(t) for t in zero["top_logprobs"]] == [[t] for t in zero["tokens"]]


def test_a_chunked_body_over_the_limit_is_413(tiny_llama):
    with ServerThread(tiny_llama, max_body_bytes=2000) as s:

        def chunks():
            yield b'{"prompt": "'
            for _ in range(10):
                yield b"x" * 500
            yield b'", "max_tokens": 1}'

        r = httpx.post(s.url + "/v1/completions", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

        def small():
            yield b'{"prompt": "hi", '
            yield b'"max_tokens": 1}'

        ok = httpx.post(s.url + "/v1/completions", content=small(), headers={"content-type": "application/json"})
        assert ok.status_code == 200, ok.text


def test_the_python_api_takes_the_same_options(offline, tiny_llama):
    from transformers import AutoTokenizer

    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Once upon"}]
    params = SamplingParams(temperature=0, max_tokens=1)
    out = offline.chat(conv, params, continue_final_message=True, add_generation_prompt=False)[0]
    hf = AutoTokenizer.from_pretrained(tiny_llama)
    text = hf.apply_chat_template(conv, tokenize=False, continue_final_message=True)
    assert out.prompt_token_ids == hf.encode(text, add_special_tokens=False)
    with pytest.raises(ValueError, match="add_generation_prompt"):
        offline.chat(conv, params, continue_final_message=True)
    template = "{{ greeting }}{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    out = offline.chat(conv[:1], params, chat_template=template, chat_template_kwargs={"greeting": "yo"})[0]
    assert out.prompt == "yo[hi]"
