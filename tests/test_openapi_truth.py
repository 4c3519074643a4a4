"""The OpenAPI schema states the bounds the server enforces: for every bound /openapi.json gives a sampling field,
the value on the bound is served and the value just past it is a 400 that names the field."""

from __future__ import annotations

import httpx
import pytest
from server_utils import ServerThread

BASE = {
    "/v1/completions": {"prompt": "x", "max_tokens": 1},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
}
REQUEST = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}


@pytest.fixture(scope="module")
def server(tiny_llama):
    with ServerThread(tiny_llama) as s:
        yield s


def _bounds(schema: dict, name: str) -> list[tuple[str, str, float]]:
    out = []
    for field, spec in schema["components"]["schemas"][name]["properties"].items():
        for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
            if key in spec:
                out.append((field, key, spec[key]))
    return out


def _integer(spec: dict) -> bool:
    types = [spec.get("type")] + [a.get("type") for a in spec.get("anyOf", [])]
    return "integer" in types


def test_every_stated_bound_is_the_one_enforced(server):
    schema = httpx.get(server.url + "/openapi.json").json()
    checked = 0
    for path, name in REQUEST.items():
        props = schema["components"]["schemas"][name]["properties"]
        bounds = _bounds(schema, name)
        assert {f for f, _, _ in bounds} >= {"temperature", "top_p", "n", "presence_penalty", "max_tokens"}, bounds
        for field, key, bound in bounds:
            step = 1 if _integer(props[field]) else 0.01
            inside = bound if key in ("minimum", "maximum") else bound + (step if "Minimum" in key else -step)
            outside = bound - step if "inimum" in key else bound + step
            extra = {"logprobs": True} if field == "top_logprobs" else {}
            if path == "/v1/completions" and field == "max_tokens" and inside == 0:
                extra = {"echo": True}  # (max_tokens=0 is the prompt alone, with echo)
            ok = httpx.post(server.url + path, json={**BASE[path], **extra, field: inside}, timeout=30)
            assert ok.status_code == 200, (path, field, inside, ok.text)
            bad = httpx.post(server.url + path, json={**BASE[path], **extra, field: outside}, timeout=30)
            assert bad.status_code == 400 and bad.json()["error"]["param"] == field, (path, field, outside, bad.text)
            checked += 1
    assert checked >= 20


def test_an_empty_prompt_is_declared_invalid_and_refused(server):
    prompt = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
    spec = prompt["properties"]["prompt"]
    assert spec["minLength"] == 1 and spec["minItems"] == 1
    for empty in ("", []):
        r = httpx.post(server.url + "/v1/completions", json={"prompt": empty}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


def test_logprobs_of_ruled_out_tokens_are_json_numbers(server):
    """An extreme repetition_penalty (on its bound) drives logits to +-inf: the logprobs still go out as JSON numbers
    (-9999.0 for -inf, as vLLM sends), never a 500 from the JSON encoder (schemathesis found this one)."""
    import math

    for path, extra in (
        ("/v1/completions", {"logprobs": 2}),
        ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 2}),
    ):
        body = {**BASE[path], **extra, "repetition_penalty": 5e-324, "top_p": 5e-324, "max_tokens": 3}
        r = httpx.post(server.url + path, json=body, timeout=30)
        assert r.status_code == 200, r.text
        lp = r.json()["choices"][0]["logprobs"]
        values = lp["token_logprobs"] if "token_logprobs" in lp else [c["logprob"] for c in lp["content"]]
        assert values and all(isinstance(v, float) and math.isfinite(v) for v in values)
