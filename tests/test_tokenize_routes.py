"""/tokenize, /detokenize, /tokenizer_info, /version and /v1/models against a real server.

Oracle: transformers' AutoTokenizer on the same folder (encode, apply_chat_template, decode, special tokens), and
the shapes vLLM answers with (what lm-evaluation-harness's remote tokenizer reads).
"""

from __future__ import annotations

import httpx
import pytest
from server_utils import MAX_LEN, MODEL, ServerThread

import infertune

TEXTS = ["The cache", "héllo wörld 🙂 <|end|>", "", "  spaces\n\ttabs  "]


@pytest.fixture(scope="module")
def server(tiny_llama):
    with ServerThread(tiny_llama) as s:
        yield s


@pytest.fixture(scope="module")
def hf(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("special", [True, False])
def test_tokenize_matches_transformers_and_detokenize_inverts_it(server, hf, text, special):
    r = httpx.post(server.url + "/tokenize", json={"model": MODEL, "prompt": text, "add_special_tokens": special})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["tokens"] == hf.encode(text, add_special_tokens=special)
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_LEN
    assert body.get("token_strs") is None
    back = httpx.post(server.url + "/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert back == {"prompt": hf.decode(body["tokens"])}
    assert back["prompt"] == text  # the byte-level tokenizer round-trips exactly


def test_tokenize_token_strs(server, hf):
    body = httpx.post(server.url + "/tokenize", json={"prompt": "ab c", "return_token_strs": True}).json()
    assert body["token_strs"] == hf.convert_ids_to_tokens(body["tokens"])


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_tokenize_chat_matches_the_template_and_the_chat_prompt_tokens(server, hf, generation_prompt):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    body = httpx.post(
        server.url + "/tokenize", json={"messages": messages, "add_generation_prompt": generation_prompt}
    ).json()
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert body["tokens"] == hf.encode(text, add_special_tokens=False)
    if generation_prompt:  # the count a chat request for these messages uses
        chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 1}).json()
        assert chat["usage"]["prompt_tokens"] == body["count"]


def test_tokenize_chat_continues_the_final_message_as_the_chat_request_does(server, hf):
    """vLLM's continue_final_message (and chat_template_kwargs) on /tokenize: the field was dropped, so the count
    closed the last message (its <|end|>) where the chat request continuing it did not. Oracle: transformers'
    apply_chat_template(continue_final_message=True)."""
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "日本 is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True}
    got = httpx.post(server.url + "/tokenize", json=body).json()
    text = hf.apply_chat_template(messages, tokenize=False, continue_final_message=True)
    assert text.endswith("日本 is")
    assert got["tokens"] == hf.encode(text, add_special_tokens=False)
    chat = httpx.post(server.url + "/v1/chat/completions", json={**body, "max_tokens": 1}).json()
    assert chat["usage"]["prompt_tokens"] == got["count"]
    both = httpx.post(server.url + "/tokenize", json={**body, "add_generation_prompt": True})
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"
    kwargs = httpx.post(server.url + "/tokenize", json={**body, "chat_template_kwargs": {"greeting": "x"}}).json()
    assert kwargs["tokens"] == got["tokens"]  # (a variable the template does not read changes nothing)
    taken = httpx.post(server.url + "/tokenize", json={**body, "chat_template_kwargs": {"add_generation_prompt": True}})
    assert taken.status_code == 400 and taken.json()["error"]["param"] == "chat_template_kwargs"


def test_tokenizer_routes_refuse_with_400_and_404(server, hf):
    url = server.url
    for path, body, param in [
        ("/detokenize", {"tokens": [len(hf)]}, "tokens"),
        ("/detokenize", {"tokens": [-1]}, "tokens"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/tokenize", {}, None),
        ("/tokenize", {"prompt": 3}, None),
        ("/tokenize", {"messages": []}, None),
    ]:
        r = httpx.post(url + path, json=body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["type"] == "invalid_request_error"
        if param:
            assert r.json()["error"]["param"] == param
    r = httpx.post(url + "/tokenize", json={"model": "other", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_tokenizer_info_has_what_lm_eval_reads(server, hf):
    info = httpx.get(server.url + "/tokenizer_info").json()
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        assert info[name] == getattr(hf, name), name
    assert info["eos_token_id"] == hf.eos_token_id and info["vocab_size"] == len(hf)
    assert info["chat_template"] == hf.chat_template and info["max_model_len"] == MAX_LEN
    # lm-eval's RemoteTokenizer takes eos_token_id as /tokenize(eos_token, add_special_tokens=False)[0].
    eos = httpx.post(server.url + "/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False})
    assert eos.json()["tokens"] == [hf.eos_token_id]


def test_version_and_max_model_len_in_models(server):
    assert httpx.get(server.url + "/version").json() == {"version": infertune.__version__}
    models = httpx.get(server.url + "/v1/models").json()["data"]
    assert [(m["id"], m["max_model_len"]) for m in models] == [(MODEL, MAX_LEN)]


def test_the_openapi_schema_declares_the_routes_and_their_answers(server):
    spec = httpx.get(server.url + "/openapi.json").json()
    paths = spec["paths"]
    for path in ("/tokenize", "/detokenize"):
        assert {"200", "400", "404", "413"} <= set(paths[path]["post"]["responses"]), path
    for path in ("/tokenizer_info", "/version"):
        assert "200" in paths[path]["get"]["responses"]
    schemas = spec["components"]["schemas"]
    assert {"TokenizeResponse", "DetokenizeResponse", "TokenizerInfoResponse", "VersionResponse"} <= set(schemas)
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert {"tools", "tool_choice", "parallel_tool_calls"} <= set(chat)


def test_tokenizer_info_of_a_template_folder(tmp_path):
    """A folder transformers loads (a chat template): the fields come from the transformers tokenizer."""
    from conftest import make_checkpoint
    from transformers import AutoTokenizer

    from infertune.engine.tokenizer import load_tokenizer
    from infertune.serve.tokenizer_routes import tokenizer_info

    path = make_checkpoint(tmp_path / "m", "llama")
    (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    info = tokenizer_info(load_tokenizer(str(path)), str(path), 64)
    hf = AutoTokenizer.from_pretrained(path)
    assert info["chat_template"] == hf.chat_template and info["eos_token"] == hf.eos_token
    assert info["tokenizer_class"] == type(hf).__name__
