"""Tool calling through a real server (uvicorn on 127.0.0.1) driven by the official openai client.

A random tiny model never writes a tool call by itself, so the server's scheduler is made to emit a recorded
output (the sampled ids are replaced by the script's before the engine appends them: detokenizing, stop checks
and everything after run as for a real model). Oracles: the calls the recorded output holds, the openai SDK's
parse of the non-streamed body and its accumulation of the streamed deltas (equal), transformers'
apply_chat_template on the same folder for the conversation with tool calls and tool messages.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from conftest import make_checkpoint
from server_utils import MODEL, ServerThread

from infertune.serve.api_server import create_app

HERMES_TEMPLATE = (
    "{%- if tools %}<|system|>\n# Tools\n<tools>\n{%- for tool in tools %}\n{{ tool | tojson }}\n{%- endfor %}\n"
    '</tools>\nCall one with <tool_call>{"name": ..., "arguments": ...}</tool_call><|end|>\n{% endif %}'
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}<|assistant|>\n{% if m.content %}{{ m.content }}\n{% endif %}"
    "{%- for tc in m.tool_calls %}<tool_call>\n"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|end|>\n"
    "{%- elif m.role == 'tool' %}<|user|>\n<tool_response>\n{{ m.content }}\n</tool_response><|end|>\n"
    "{%- else %}<|{{ m.role }}|>\n{{ m.content }}<|end|>\n{% endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DEMO_TEMPLATE = Path(__file__).resolve().parents[1] / "infertune" / "assets" / "demo-model" / "chat_template.jinja"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TOOLS = [WEATHER]
CALL_TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
)
ASK = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_model(tmp_path_factory) -> Path:
    path = make_checkpoint(tmp_path_factory.mktemp("tools"), "llama", max_position_embeddings=1024)
    (path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return path


class ScriptedServer(ServerThread):
    """A ServerThread whose app has the tool-call options, and whose model writes `self.script` (then EOS)."""

    def __init__(self, path, parser: str | None = "hermes", auto: bool = True, **engine):
        super().__init__(path, max_model_len=1024, **engine)
        app = create_app(self.engine, MODEL, tool_call_parser=parser, enable_auto_tool_choice=auto)
        self.server.config.app = app
        self.script: str | None = None
        llm = self.engine.engine
        original = llm.scheduler.update

        def update(batch, sampled, num_accepted=None):
            if self.script is not None:
                ids = llm.tokenizer.encode(self.script, add_special_tokens=False) + [llm.tokenizer.eos_token_id]
                for k, (seq, token) in enumerate(zip(batch.seqs, sampled)):
                    if token is not None:
                        sampled[k] = ids[min(seq.num_output_tokens, len(ids) - 1)]
            return original(batch, sampled, num_accepted)

        llm.scheduler.update = update


@pytest.fixture(scope="module")
def server(tool_model):
    with ScriptedServer(tool_model) as s:
        yield s


@pytest.fixture
def client(server):
    server.script = None
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def streamed(client, **kw):
    """The SDK's own accumulation of a stream: content, tool calls by index, the last finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for tc in choice.delta.tool_calls or []:
                call = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = tc.id or call["id"]
                if tc.function is not None:
                    call["name"] += tc.function.name or ""
                    call["arguments"] += tc.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_auto_tool_call_round_trip_streamed_and_not(server, client):
    server.script = CALL_TEXT
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check."
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "c"}

    content, calls, finish = streamed(client, messages=ASK, tools=TOOLS, temperature=0, tool_choice="auto")
    assert finish == "tool_calls" and content == choice.message.content
    assert [(c["name"], c["arguments"]) for c in calls] == [(call.function.name, call.function.arguments)]
    assert calls[0]["id"].startswith("call_")

    # The next turn: the assistant's call and the tool's answer go back through the template.
    messages = [
        *ASK,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'},
    ]
    server.script = "It is 21 degrees in Paris."
    r2 = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, temperature=0)
    assert r2.choices[0].message.content == "It is 21 degrees in Paris."
    assert not r2.choices[0].message.tool_calls and r2.choices[0].finish_reason == "stop"


def test_plain_answer_with_tools_is_content(server, client):
    server.script = "No tool needed."
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert r.choices[0].message.content == "No tool needed." and r.choices[0].finish_reason == "stop"
    assert not r.choices[0].message.tool_calls
    content, calls, finish = streamed(client, messages=ASK, tools=TOOLS)
    assert (content, calls, finish) == ("No tool needed.", [], "stop")


def test_malformed_call_is_content(server, client):
    server.script = '<tool_call>{"name": get_weather}</tool_call>'
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS)
    assert r.choices[0].message.content == server.script and not r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "stop"


def test_required_and_named_tool_choice(server, client):
    server.script = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]'
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required")
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    assert r.choices[0].finish_reason == "tool_calls"
    _, calls, finish = streamed(client, messages=ASK, tools=TOOLS, tool_choice="required")
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]
    assert finish == "tool_calls"

    server.script = '{"city": "Rome", "unit": "f"}'
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=named)
    (call,) = r.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Rome", "unit": "f"})
    _, calls, _ = streamed(client, messages=ASK, tools=TOOLS, tool_choice=named)
    assert [(c["name"], c["arguments"]) for c in calls] == [("get_weather", call.function.arguments)]


def test_none_renders_the_tools_and_parses_nothing(server, client):
    server.script = CALL_TEXT
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none")
    assert r.choices[0].message.content == CALL_TEXT and not r.choices[0].message.tool_calls
    # The template saw the tools: the prompt is longer than without them.
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert r.usage.prompt_tokens > plain.usage.prompt_tokens + len(json.dumps(WEATHER)) // 2


def test_the_conversation_with_tool_calls_renders_as_transformers_renders_it(server, tool_model):
    from transformers import AutoTokenizer

    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
    ]
    got = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    hf = AutoTokenizer.from_pretrained(tool_model)
    hf_messages = json.loads(json.dumps(messages))
    hf_messages[1]["content"] = ""
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}  # HF templates take a dict
    text = hf.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert "<tool_response>\n21 C" in text and '"arguments": {"city": "Paris"}' in text
    assert got["tokens"] == hf.encode(text, add_special_tokens=False)


def test_content_given_as_text_parts_renders_as_vllm_joins_them(server, tool_model):
    """Frameworks send content as a list of text parts (a tool's result too); vLLM joins their texts with newlines,
    so the prompt is transformers' rendering of that string (they were joined with nothing: "Weather inParis?")."""
    from transformers import AutoTokenizer

    parts = [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": parts},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": parts},
    ]
    got = httpx.post(server.url + "/tokenize", json={"messages": messages, "tools": TOOLS}).json()
    hf_messages = json.loads(json.dumps(messages))
    hf_messages[0]["content"] = hf_messages[2]["content"] = "Weather in\nParis?"
    hf_messages[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    hf = AutoTokenizer.from_pretrained(tool_model)
    text = hf.apply_chat_template(hf_messages, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert got["tokens"] == hf.encode(text, add_special_tokens=False)


@pytest.mark.parametrize(
    "choice, script",
    [
        ("required", '[{"name": "Get", "parameters": {"unit": {"u": true}}}]'),
        ({"type": "function", "function": {"name": "Get"}}, '{"unit": {"u": true}}'),
    ],
)
def test_a_pydantic_tool_with_a_nested_model_is_forced_and_parsed_by_the_sdk(server, client, choice, script):
    """openai.pydantic_function_tool of a model with a nested model ($defs and $ref): tool_choice "required" was a
    400 (the reference did not resolve inside the call list's schema). The model writes a call the masks allow.
    Oracle: the SDK's pydantic parse."""
    import pydantic

    class Unit(pydantic.BaseModel):
        u: bool

    class Get(pydantic.BaseModel):
        unit: Unit

    server.script = script
    r = client.chat.completions.parse(
        model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(Get)], tool_choice=choice, max_tokens=200
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.parsed_arguments == Get(unit=Unit(u=True))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_unit"}}])
def test_guided_whitespace_pattern_holds_for_a_forced_tool_choice(client, choice):
    """vLLM's guided_whitespace_pattern applies to the tools' JSON too (it was dropped: the random model wrote
    whitespace until max_tokens, the call cut off). With none allowed the call completes in few tokens."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[UNIT],
        tool_choice=choice,
        parallel_tool_calls=False,
        max_tokens=200,
        temperature=0,
        extra_body={"guided_whitespace_pattern": ""},
    )
    (call,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert json.loads(call.function.arguments)["unit"] in ("c", "f")
    want = '[{"name":"set_unit","parameters":{"unit":"c"}}]' if choice == "required" else '{"unit":"c"}'
    assert r.usage.completion_tokens <= len(want) + 1  # (no whitespace: byte tokens, EOS)


BAD_SCHEMA = {"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}


def test_tool_choice_mistakes_are_400s(server):
    url = server.url + "/v1/chat/completions"
    bodies = [
        ({"messages": ASK, "tool_choice": "required"}, "needs tools"),
        ({"messages": ASK, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "x"}}}, "x"),
        ({"messages": ASK, "tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
        ({"messages": ASK, "tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        # a forced choice's constraint is the tools' parameters: a schema the compiler refuses names tools
        ({"messages": ASK, "tools": [BAD_SCHEMA], "tool_choice": "required"}, "tools"),
        (
            {"messages": ASK, "tools": [BAD_SCHEMA], "tool_choice": {"type": "function", "function": {"name": "f"}}},
            "tools",
        ),
        # OpenAI's deprecated function calling (was answered as if no function were offered)
        ({"messages": ASK, "functions": [WEATHER["function"]]}, "functions"),
        ({"messages": ASK, "function_call": {"name": "get_weather"}}, "function_call"),
    ]
    for body, says in bodies:
        r = httpx.post(url, json=body)
        assert r.status_code == 400, body
        assert says in r.json()["error"]["message"] or says == r.json()["error"]["param"].split(".")[0], r.json()


def test_auto_without_the_server_flags_is_a_400_that_names_them(tool_model):
    with ScriptedServer(tool_model, parser=None, auto=False) as s:
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS})
        assert r.status_code == 400 and "--enable-auto-tool-choice" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "none"})
        assert r.status_code == 200


@pytest.fixture(scope="module")
def strict_template_model(tmp_path_factory) -> Path:
    """The demo model's template, which refuses any role but system, user and assistant."""
    path = make_checkpoint(tmp_path_factory.mktemp("strict"), "llama")
    (path / "chat_template.jinja").write_text(DEMO_TEMPLATE.read_text())
    return path


def test_tool_role_and_refused_messages_are_400s_never_500s(strict_template_model, tool_model):
    with ServerThread(strict_template_model) as s:
        for body in (
            {"messages": [{"role": "tool"}]},
            {"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]},
            {"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}], "stream": True},
        ):
            r = httpx.post(s.url + "/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert "Only system, user and assistant roles are supported, got: tool" in err["message"]
            assert err["param"] == "messages"
        r = httpx.post(s.url + "/tokenize", json={"messages": [{"role": "tool"}]})
        assert r.status_code == 400 and "roles are supported" in r.json()["error"]["message"]
    with ScriptedServer(tool_model) as s:  # a template that knows the tool role renders it
        s.script = "ok"
        r = httpx.post(s.url + "/v1/chat/completions", json={"messages": [{"role": "tool"}]})
        assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ok"


UNIT = {
    "type": "function",
    "function": {
        "name": "set_unit",
        "parameters": {
            "type": "object",
            "properties": {"unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["unit"],
            "additionalProperties": False,
        },
    },
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "set_unit"}}])
def test_required_and_named_are_enforced_on_a_model_that_never_calls_tools(client, choice):
    """No script: the random model's own output, held to the calls' schema by the structured-output masks."""
    for temperature in (0, 1.0):
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[UNIT], tool_choice=choice, max_tokens=600, temperature=temperature, seed=3
        )
        (call,) = r.choices[0].message.tool_calls
        assert call.function.name == "set_unit" and json.loads(call.function.arguments)["unit"] in ("c", "f")
        assert r.choices[0].finish_reason == ("tool_calls" if choice == "required" else "stop")


# Mistral-7B-Instruct-v0.3's check on call ids (its chat template raises for any id but 9 characters), around a
# minimal rendering of the turns.
MISTRAL_TEMPLATE = (
    "{%- if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{%- for tc in m.tool_calls %}"
    "{%- if not tc.id is defined or tc.id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    '{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}, "id": "{{ tc.id }}"}'
    "{%- endfor %}]</s>"
    "{%- elif m.role == 'tool' %}"
    "{%- if not m.tool_call_id is defined or m.tool_call_id | length != 9 %}"
    "{{ raise_exception('Tool call IDs should be alphanumeric strings with length 9!') }}{%- endif %}"
    '[TOOL_RESULTS]{"content": {{ m.content | tojson }}, "call_id": "{{ m.tool_call_id }}"}[/TOOL_RESULTS]'
    "{%- else %}[INST] {{ m.content }}[/INST]{% endif %}{%- endfor %}"
)


@pytest.mark.parametrize("choice", ["auto", "required", {"type": "function", "function": {"name": "set_unit"}}])
def test_a_mistral_server_gives_call_ids_its_template_takes_back_whatever_the_tool_choice(tmp_path, choice):
    """With --tool-call-parser mistral, the calls of every tool_choice (a forced one too, held by the masks) have
    ids the Mistral template accepts when the client sends them back with the tools' results in the next turn."""
    path = make_checkpoint(tmp_path, "llama", max_position_embeddings=1024)
    (path / "chat_template.jinja").write_text(MISTRAL_TEMPLATE)
    with ScriptedServer(path, parser="mistral") as s:
        if choice == "auto":
            s.script = '[TOOL_CALLS][{"name": "set_unit", "arguments": {"unit": "c"}}]'
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        r = client.chat.completions.create(
            model=MODEL, messages=ASK, tools=[UNIT], tool_choice=choice, max_tokens=600, temperature=0
        )
        s.script = None
        message = r.choices[0].message
        (call,) = message.tool_calls
        turn = [
            *ASK,
            message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "done"},
        ]
        # (a 400 quoting the template's refusal, openai.BadRequestError, where the id is not Mistral's)
        second = client.chat.completions.create(model=MODEL, messages=turn, tools=[UNIT], max_tokens=2, temperature=0)
    assert len(call.id) == 9 and call.id.isalnum()
    assert second.usage.prompt_tokens > r.usage.prompt_tokens  # (the call and its result were rendered)
