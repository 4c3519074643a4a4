"""What operators moving a deployment from `vllm serve` rely on, on a real server (uvicorn on 127.0.0.1, driven by the
openai SDK and httpx): vLLM's metric names with its model_name label, several --served-model-name, a YAML --config,
a server-wide --chat-template, and the Allow / WWW-Authenticate headers of 405 / 401 answers.

Oracles: prometheus_client's own text parser and the usage the SDK reads from the responses, the real CLI parsing a
YAML file, and transformers' apply_chat_template.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import MODEL, ServerThread, wait_until

from infertune.serve.metrics import VLLM_ALIASES


def sdk(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def scrape(server) -> dict:
    """/metrics as prometheus_client's parser reads it: family name (counters without _total) -> family."""
    return {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}


def value(family, sample_name: str, **labels) -> float:
    found = [s.value for s in family.samples if s.name == sample_name and labels.items() <= s.labels.items()]
    assert len(found) == 1, (sample_name, labels, family.samples)
    return found[0]


def keyed(family, drop=()) -> dict:
    """A family's samples as {(name past the family's name, labels): value}, vLLM's finished_reason read as our
    finish_reason and the labels in `drop` left out."""
    out = {}
    for s in family.samples:
        labels = {("finish_reason" if k == "finished_reason" else k): v for k, v in s.labels.items() if k not in drop}
        out[(s.name[len(family.name) :], tuple(sorted(labels.items())))] = s.value
    return out


# ---- 1. vLLM's metric names ------------------------------------------------------------------------------------------
VLLM_FAMILIES = {  # vLLM's names (vllm/v1/metrics/loggers.py) and their Prometheus types
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:gpu_cache_usage_perc": "gauge",
    "vllm:prefix_cache_queries": "counter",
    "vllm:prefix_cache_hits": "counter",
    "vllm:num_preemptions": "counter",
    "vllm:spec_decode_num_drafts": "counter",
    "vllm:spec_decode_num_draft_tokens": "counter",
    "vllm:spec_decode_num_accepted_tokens": "counter",
    "vllm:prompt_tokens": "counter",
    "vllm:generation_tokens": "counter",
    "vllm:request_success": "counter",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:time_per_output_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
}


def test_vllm_metric_names_carry_the_same_numbers_with_the_model_name(tiny_llama):
    with ServerThread(tiny_llama) as server:
        client = sdk(server)
        greedy = dict(model=MODEL, temperature=0, extra_body={"ignore_eos": True})
        usages = [client.completions.create(prompt="hello there, world", max_tokens=5, **greedy).usage]
        usages.append(
            client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], max_tokens=3, **greedy).usage
        )
        # the same prompt again (its full blocks are cached), streamed: its usage comes in the last chunk
        stream = client.completions.create(
            prompt="hello there, world", max_tokens=4, stream=True, stream_options={"include_usage": True}, **greedy
        )
        usages += [c.usage for c in stream if c.usage is not None]
        assert [u.completion_tokens for u in usages] == [5, 3, 4]
        completion_tokens = sum(u.completion_tokens for u in usages)
        prompt_tokens = sum(u.prompt_tokens for u in usages)
        assert wait_until(lambda: value(scrape(server)["vllm:generation_tokens"], "vllm:generation_tokens_total") > 0)
        families = scrape(server)

    # every vLLM family is there, typed as vLLM's, each sample labelled with the served name
    for name, kind in VLLM_FAMILIES.items():
        assert name in families and families[name].type == kind, name
        assert all(s.labels.get("model_name") == MODEL for s in families[name].samples), name
    # the same numbers as the infertune family it aliases, sample for sample
    for ours, aliases in VLLM_ALIASES.items():
        for alias in aliases:
            assert keyed(families[alias], drop=("model_name", "engine")) == keyed(families[ours]), alias
    # and the numbers are the responses' own: tokens as the SDK's usage says, one latency per request
    assert value(families["vllm:generation_tokens"], "vllm:generation_tokens_total") == completion_tokens
    assert value(families["vllm:prompt_tokens"], "vllm:prompt_tokens_total") == prompt_tokens
    assert value(families["vllm:request_success"], "vllm:request_success_total", finished_reason="length") == 3
    assert value(families["vllm:prefix_cache_queries"], "vllm:prefix_cache_queries_total") == prompt_tokens
    assert value(families["vllm:prefix_cache_hits"], "vllm:prefix_cache_hits_total") >= 4  # (a block of 4 at least)
    assert value(families["vllm:num_requests_running"], "vllm:num_requests_running") == 0
    e2e = families["vllm:e2e_request_latency_seconds"]
    assert value(e2e, "vllm:e2e_request_latency_seconds_count") == 3
    bounds = {float(s.labels["le"]) for s in e2e.samples if s.name.endswith("_bucket")}
    assert {240.0, 960.0, 7680.0} <= bounds  # (past 120 s, as vLLM's)


# ---- 5. the headers HTTP asks of a 405 and a 401 ---------------------------------------------------------------------
def test_405_says_allow_and_401_says_www_authenticate(tiny_llama):
    with ServerThread(tiny_llama, api_key="sekret") as server:
        for method, path, allowed in (
            ("GET", "/v1/completions", {"POST"}),
            ("DELETE", "/v1/chat/completions", {"POST"}),
            ("POST", "/health", {"GET"}),
            ("POST", "/metrics", {"GET"}),
        ):
            r = httpx.request(method, server.url + path, headers={"authorization": "Bearer sekret"})
            assert r.status_code == 405 and r.json()["error"]["message"] == "Method Not Allowed", (method, path)
            assert {m.strip() for m in r.headers["allow"].split(",")} >= allowed, (method, path, r.headers)
        with pytest.raises(openai.AuthenticationError) as refused:
            openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
        assert refused.value.response.headers["www-authenticate"] == "Bearer"
        r = httpx.get(server.url + "/v1/models")  # (no key at all)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        assert r.json()["error"]["code"] == "invalid_api_key"


# ---- 2. several --served-model-name ----------------------------------------------------------------------------------
def test_several_served_model_names(tiny_llama):
    from unittest import mock

    from infertune.cli import main

    names = ["tiny", "org/tiny-chat", "alias"]
    with mock.patch("infertune.serve.launcher.serve", return_value=0) as serve:  # the real CLI's parsing
        assert main(["serve", "--model", str(tiny_llama), "--served-model-name", *names, "--port", "9"]) == 0
        assert serve.call_args.kwargs["served_model_name"] == names and serve.call_args.kwargs["port"] == 9
        assert main(["serve", "--model", str(tiny_llama), "--served-model-name", "one"]) == 0
        assert serve.call_args.kwargs["served_model_name"] == ["one"]
    with ServerThread(tiny_llama, model=names) as server:
        client = sdk(server)
        assert [m.id for m in client.models.list().data] == names
        for name in names:  # each is accepted; the first is the one reported
            assert client.models.retrieve(name).id == name
            r = client.completions.create(model=name, prompt="hi", max_tokens=2, temperature=0)
            assert r.model == "tiny" and r.usage.completion_tokens >= 1
            chat = client.chat.completions.create(
                model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2, temperature=0
            )
            assert chat.model == "tiny"
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model="other", prompt="hi", max_tokens=2)
        assert "'tiny' or 'org/tiny-chat' or 'alias'" in str(missing.value)
        with pytest.raises(openai.NotFoundError):
            client.models.retrieve("other")
        families = scrape(server)
        assert {s.labels["model_name"] for s in families["vllm:request_success"].samples} == {"tiny"}


# ---- 4. a server-wide --chat-template --------------------------------------------------------------------------------
SERVER_TEMPLATE = (
    "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}[assistant] {% endif %}"
)
REQUEST_TEMPLATE = "{% for m in messages %}{{ m['content'] }}|{% endfor %}"
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]


def test_server_chat_template_from_a_file_or_inline(tiny_llama, tmp_path):
    import shutil
    from unittest import mock

    from transformers import AutoTokenizer

    from infertune.cli import main
    from infertune.serve.launcher import load_chat_template

    bare = tmp_path / "bare"  # the tiny model without a chat template (a base model)
    shutil.copytree(tiny_llama, bare)
    (bare / "chat_template.jinja").unlink()
    hf = AutoTokenizer.from_pretrained(bare)
    assert not hf.chat_template

    def hf_ids(template: str) -> list[int]:  # the oracle: transformers' own rendering, then its tokens
        text = hf.apply_chat_template(MESSAGES, chat_template=template, tokenize=False, add_generation_prompt=True)
        return hf.encode(text, add_special_tokens=False)

    # a file, or the template itself as a shell line writes it (\n for a newline), as vLLM reads --chat-template
    file = tmp_path / "template.jinja"
    file.write_text(SERVER_TEMPLATE)
    assert load_chat_template(str(file)) == SERVER_TEMPLATE
    assert load_chat_template(SERVER_TEMPLATE.replace("\n", "\\n")) == SERVER_TEMPLATE
    with pytest.raises(ValueError, match="looks like a file path"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="not a valid Jinja template"):
        load_chat_template("{% for m in messages %}")
    with mock.patch("infertune.serve.launcher.serve", return_value=0) as serve:
        assert main(["serve", "--model", str(bare), "--chat-template", str(file)]) == 0
    assert serve.call_args.kwargs["chat_template"] == str(file)
    assert main(["serve", "--model", str(bare), "--chat-template", str(tmp_path / "missing.jinja")]) == 2

    # no template anywhere: as before, a 400 that says so (chat and /tokenize)
    with ServerThread(bare) as server:
        with pytest.raises(openai.BadRequestError, match="has no chat template"):
            sdk(server).chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)
        assert httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).status_code == 400

    for path in (bare, tiny_llama):  # a model without a template, and one whose own template it replaces
        with ServerThread(path, app={"chat_template": load_chat_template(str(file))}) as server:
            client = sdk(server)
            r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
            assert r.usage.prompt_tokens == len(hf_ids(SERVER_TEMPLATE))
            tokenized = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
            assert tokenized["tokens"] == hf_ids(SERVER_TEMPLATE)
            # a request's own template still wins, in both routes
            r = client.chat.completions.create(
                model=MODEL, messages=MESSAGES, max_tokens=1, extra_body={"chat_template": REQUEST_TEMPLATE}
            )
            assert r.usage.prompt_tokens == len(hf_ids(REQUEST_TEMPLATE))
            body = {"messages": MESSAGES, "chat_template": REQUEST_TEMPLATE}
            assert httpx.post(server.url + "/tokenize", json=body).json()["tokens"] == hf_ids(REQUEST_TEMPLATE)
            assert httpx.get(server.url + "/tokenizer_info").json()["chat_template"] == SERVER_TEMPLATE
    assert hf_ids(SERVER_TEMPLATE) != hf_ids(AutoTokenizer.from_pretrained(tiny_llama).chat_template)


# ---- 3. a YAML --config, as vLLM's -----------------------------------------------------------------------------------
def test_yaml_config_with_the_long_flag_names(tiny_llama, tmp_path, capsys):
    from unittest import mock

    from server_utils import ServerProcess

    from infertune.cli import main

    template = tmp_path / "template.jinja"
    template.write_text(SERVER_TEMPLATE)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(
        "# a vLLM config file: the long flag names, with dashes or underscores\n"
        "served-model-name:\n  - tiny\n  - org/tiny-chat\n"
        f"chat-template: {template}\n"
        "max-num-seqs: 2\n"
        "max_model_len: 48\n"
        "graceful-timeout: 3\n"
        "enable-prefix-caching: true\n"
        "prepack_weights: false  # (an engine option with no flag)\n"
    )
    with mock.patch("infertune.serve.launcher.serve", return_value=0) as serve:
        assert main(["serve", "--model", str(tiny_llama), "--config", str(cfg), "--max-num-seqs", "9"]) == 0
    kw = serve.call_args.kwargs
    assert kw["served_model_name"] == ["tiny", "org/tiny-chat"] and kw["chat_template"] == str(template)
    # the file's values over the defaults, a flag written on the command line over the file (vLLM's order)
    assert (kw["max_num_seqs"], kw["max_model_len"], kw["graceful_timeout_s"]) == (9, 48, 3)
    assert kw["enable_prefix_caching"] is True and kw["prepack_weights"] is False
    # --flag=value and a --no- flag written on the command line win too; an option at its default does not
    argv = [
        "serve",
        "--model",
        str(tiny_llama),
        "--config",
        str(cfg),
        "--max-model-len=64",
        "--no-enable-prefix-caching",
    ]
    with mock.patch("infertune.serve.launcher.serve", return_value=0) as serve:
        assert main(argv) == 0
    kw = serve.call_args.kwargs
    assert (kw["max_model_len"], kw["enable_prefix_caching"], kw["max_num_seqs"]) == (64, False, 2)

    # a bad key is a one-line error naming it (and what is close), as is a serve flag a file cannot set
    for text, said in (
        ("max-num-seq: 4\n", "unknown key 'max-num-seq'; did you mean 'max_num_seqs' (--max-num-seqs)?"),
        ("port: 8000\nbogus_option: 1\n", "unknown key 'bogus_option'"),
        ("data-parallel-size: 2\n", "'data-parallel-size' is taken on the command line only"),
        ("max-num-seqs: [4\n", "cannot read options"),
        ("- a list\n", "expected a mapping"),
    ):
        bad = tmp_path / "bad.yaml"
        bad.write_text(text)
        assert main(["serve", "--model", str(tiny_llama), "--config", str(bad)]) == 2
        err = capsys.readouterr().err
        assert said in err and "Traceback" not in err, (text, err)

    # the whole way: `infertune serve --config FILE.yaml` in its own process
    unset = ("--served-model-name", "--max-model-len", "--max-num-seqs", "--graceful-timeout")  # (the file's)
    with ServerProcess(tiny_llama, "--config", str(cfg), unset=unset) as server:
        client = sdk(server)
        assert [m.id for m in client.models.list().data] == ["tiny", "org/tiny-chat"]
        messages = [{"role": "user", "content": "hello"}]
        r = client.chat.completions.create(model="org/tiny-chat", messages=messages, max_tokens=1, temperature=0)
        rendered = "[user] hello\n[assistant] "  # (SERVER_TEMPLATE's rendering; the byte tokenizer: one token a byte)
        assert r.model == "tiny" and r.usage.prompt_tokens == len(rendered.encode())
        assert httpx.get(server.url + "/v1/models/tiny").json()["max_model_len"] == 48
