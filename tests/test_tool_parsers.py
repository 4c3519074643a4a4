"""Tool-call parsers on recorded outputs of each family, whole and streamed, and the schemas of required / named.

Oracles: the tool calls each recorded output holds (written by hand from the family's format), json.loads of the
arguments, the openai SDK's own accumulation of streamed deltas (equal to the non-streamed message), jsonschema.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from infertune.serve.tool_parsers import Malformed, get_parser, read_json
from infertune.serve.tools import ToolPlan, ToolStream, named_schema, required_schema

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
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
TOOLS = [WEATHER, TIME]

# (parser, recorded output, expected content, expected [(name, arguments as a dict)])
RECORDED = [
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
        None,
        [("get_weather", {"city": "Paris", "unit": "c"})],
    ),
    (  # Qwen2.5: text first, two calls, unicode and escapes in the arguments
        "qwen2_5",
        'Let me look both up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Z\\u00fcrich \\"Z\\"",'
        ' "unit": "f"}}\n</tool_call>\n<tool_call>\n{"name":"get_time","arguments":{}}\n</tool_call>',
        "Let me look both up.",
        [("get_weather", {"city": 'Zürich "Z"', "unit": "f"}), ("get_time", {})],
    ),
    (  # Hermes 2 Pro emits no closing tag before EOS sometimes; arguments as a JSON string
        "hermes",
        '<tool_call>{"arguments": "{\\"city\\": \\"Oslo\\"}", "name": "get_weather"}',
        None,
        [("get_weather", {"city": "Oslo"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "n": [1, 2.5, -3e2, true, null]}}',
        None,
        [("get_weather", {"city": "Rome", "n": [1, 2.5, -300.0, True, None]})],
    ),
    (
        "llama3_json",
        '{"name": "get_weather", "parameters": {"city": "Lima"}}; {"name": "get_time", "parameters": {}}',
        None,
        [("get_weather", {"city": "Lima"}), ("get_time", {})],
    ),
    (
        "mistral",
        'Sure. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Nice"}}, {"name": "get_time", '
        '"arguments": {}}]',
        "Sure.",
        [("get_weather", {"city": "Nice"}), ("get_time", {})],
    ),
    (  # the v11 tokenizer's form
        "mistral",
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Bern"}[TOOL_CALLS]get_time[ARGS]{}',
        None,
        [("get_weather", {"city": "Bern"}), ("get_time", {})],
    ),
]

PLAIN = [
    ("hermes", "The weather in Paris is mild. <tool is not a marker"),
    ("hermes", '<tool_call>{"name": get_weather}</tool_call>'),  # not JSON
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'),  # no name
    ("llama3_json", "I cannot call tools for that."),
    ("llama3_json", '{"answer": 42}'),  # JSON, but not a call
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")'),
    ("mistral", "[TOOL_CALLS] [{'name': 'get_weather'}]"),
    ("mistral", '[TOOL_CALLS] [{"name": "get_weather", "arguments": 3}]'),
]


# Output cut off by max_tokens inside a call whose name is complete: (parser, text, content before it, the name, the
# arguments as far as they got). It stays a call with truncated arguments and finish_reason "length" (as OpenAI
# answers), streamed or not; with finish_reason "stop" (the model ended it there) it is malformed: content.
TRUNCATED = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par', None, "get_weather", '{"city": "Par'),
    (
        "hermes",
        'Let me look. <tool_call>{"name": "get_weather", "arguments": {"ci',
        "Let me look.",
        "get_weather",
        '{"ci',
    ),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Ro', None, "get_weather", '{"city": "Ro'),
]


def auto_plan(parser: str) -> ToolPlan:
    return ToolPlan.of(TOOLS, "auto", True, parser, True)


def calls_of(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message.get("tool_calls", [])]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), RECORDED)
def test_recorded_outputs_parse_into_their_calls(parser, text, content, calls):
    message, finish = auto_plan(parser).message(text, "stop")
    assert message["content"] == content
    assert calls_of(message) == calls
    assert finish == "tool_calls"
    for c in message["tool_calls"]:
        assert c["type"] == "function" and c["id"]
        # The arguments string is the canonical serialization: what json.dumps gives for the parsed arguments.
        assert c["function"]["arguments"] == json.dumps(json.loads(c["function"]["arguments"]), ensure_ascii=False)
    if parser == "mistral":
        assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in message["tool_calls"])


@pytest.mark.parametrize("reason", ["stop", "length"])
@pytest.mark.parametrize(("parser", "text"), PLAIN)
def test_malformed_or_plain_output_is_content_not_a_crash(parser, text, reason):
    message, finish = auto_plan(parser).message(text, reason)
    assert message == {"role": "assistant", "content": text}
    assert finish == reason


@pytest.mark.parametrize(("parser", "text", "content", "name", "arguments"), TRUNCATED)
def test_a_call_cut_off_by_max_tokens_stays_a_call_streamed_or_not(parser, text, content, name, arguments):
    plan = auto_plan(parser)
    message, finish = plan.message(text, "length")
    assert finish == "length"
    assert message["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [(name, arguments)]
    for step in (1, 4):
        deltas, s = stream(plan, text, step, "length")
        got_content, got_calls = sdk_accumulate(deltas)
        assert got_content == (content or "")  # the call's markup is never sent as content too
        assert [(c["name"], c["arguments"]) for c in got_calls.values()] == [(name, arguments)]
        assert s.finish_reason("length") == "length"
    # ended there by the model (not by max_tokens): malformed, so content; a stream already sent the call and does
    # not send its markup again as content
    message, finish = plan.message(text, "stop")
    assert message == {"role": "assistant", "content": text} and finish == "stop"
    deltas, _ = stream(plan, text, 1, "stop")
    got_content, got_calls = sdk_accumulate(deltas)
    assert got_content == (content or "") and len(got_calls) == 1


def sdk_accumulate(chunks: list[dict]) -> tuple[str, dict[int, dict]]:
    """What the openai SDK's stream accumulation does with chat deltas: content concatenated; tool calls by
    index, id / name from their first delta, arguments concatenated."""
    content, calls = "", {}
    for delta in chunks:
        content += delta.get("content") or ""
        for tc in delta.get("tool_calls", []):
            call = calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
            call["id"] = tc.get("id") or call["id"]
            fn = tc.get("function", {})
            call["name"] += fn.get("name") or ""
            call["arguments"] += fn.get("arguments") or ""
    return content, calls


def stream(plan: ToolPlan, text: str, step: int, reason: str = "stop") -> tuple[list[dict], ToolStream]:
    s, deltas = ToolStream(plan), []
    for end in range(step, len(text) + step, step):
        last = end >= len(text)
        deltas += s.deltas(text[:end], finished=last, finish_reason=reason if last else None)
    return deltas, s


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize(("parser", "text", "content", "calls"), RECORDED)
def test_streamed_deltas_add_up_to_the_non_streamed_message(parser, text, content, calls, step):
    plan = auto_plan(parser)
    message, _ = plan.message(text, "stop")
    deltas, s = stream(plan, text, step)
    got_content, got_calls = sdk_accumulate(deltas)
    assert got_content == (message["content"] or "")
    assert [(c["name"], c["arguments"]) for _, c in sorted(got_calls.items())] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]
    ]
    assert s.finish_reason("stop") == "tool_calls"
    # Arguments come in several chunks (not all at the end), unless the model wrote them before the name.
    if step == 1 and not text.find('"arguments"') < text.find('"name"'):
        assert sum(1 for d in deltas for tc in d.get("tool_calls", []) if tc["function"].get("arguments")) > len(calls)


@pytest.mark.parametrize(("parser", "text"), PLAIN)
def test_streamed_plain_output_is_all_content(parser, text):
    deltas, s = stream(auto_plan(parser), text, 1, "length")
    content, calls = sdk_accumulate(deltas)
    assert s.finish_reason("length") == "length"
    # A call whose name was complete went out before the rest turned out malformed (as in vLLM: a stream cannot
    # take back what it sent); the finish reason then says no tool call was made, and the call's markup is not sent
    # again as content. Otherwise all of the text reaches the client, as the non-streamed message has it.
    assert bool(calls) == ('"name": "get_weather"' in text)
    assert content == ("" if calls else text)


def test_text_that_could_start_a_marker_is_held_back_until_it_does_not():
    s = ToolStream(auto_plan("hermes"))
    assert s.deltas("Hi <tool", False) == [{"content": "Hi"}]
    assert s.deltas("Hi <tools are fun", False) == [{"content": " <tools are fun"}]


@pytest.mark.parametrize(
    "raw",
    ['{"a": [1, {"b": "x\\ny"}], "c": -0.5e3, "d": "\\ud83d\\ude00 é"}', "[]", '"plain"', "{}", "[true, false, null]"],
)
def test_read_json_is_canonical_and_every_prefix_is_a_prefix_of_it(raw):
    canonical, done, end, _ = read_json(raw)
    assert done and end == len(raw)
    assert canonical == json.dumps(json.loads(raw), ensure_ascii=False)
    for k in range(len(raw)):
        partial, partial_done, _, _ = read_json(raw[:k])
        assert canonical.startswith(partial), raw[:k]
        assert not partial_done or k == len(raw)


def _strict_json(text: str):
    """json.loads as JSON itself reads: Infinity, -Infinity and NaN are not JSON (JSON.parse refuses them)."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


@pytest.mark.parametrize("number", ["1e400", "-1.5E999"])
def test_a_number_past_a_floats_range_stays_json_in_the_arguments(number):
    """A number the model may write (and the masks of required / named allow) that Python reads as inf: the
    arguments, whole and streamed, are still JSON (they were Infinity)."""
    auto_text = f'<tool_call>\n{{"name": "get_weather", "arguments": {{"city": "x", "n": {number}}}}}\n</tool_call>'
    named = ToolPlan.of(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True, None, False)
    for plan, text in ((auto_plan("hermes"), auto_text), (named, f'{{"city": "x", "n": [{number}]}}')):
        message, _ = plan.message(text, "stop")
        (call,) = message["tool_calls"]
        assert _strict_json(call["function"]["arguments"])["city"] == "x"
        stream, streamed = ToolStream(plan), ""
        for k in range(1, len(text) + 1):
            for delta in stream.deltas(text[:k], k == len(text), "stop" if k == len(text) else None):
                for tc in delta.get("tool_calls", []):
                    streamed += tc["function"]["arguments"]
        assert streamed == call["function"]["arguments"]


def test_read_json_refuses_what_is_not_json():
    for bad in ("{'a': 1}", "[1 2]", '{"a" 1}', "nul!", "{1: 2}"):
        with pytest.raises(Malformed):
            read_json(bad)


def test_required_and_named_outputs_parse_and_their_schemas_accept_exactly_them():
    required = ToolPlan.of(TOOLS, "required", True, None, False)
    out = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    message, finish = required.message(out, "stop")
    assert calls_of(message) == [("get_weather", {"city": "Paris"}), ("get_time", {})] and finish == "tool_calls"
    schema = required_schema(TOOLS)
    jsonschema.validate(json.loads(out), schema)
    for bad in ([], [{"name": "nope", "parameters": {}}], [{"name": "get_weather", "parameters": {"unit": "c"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(json.loads(out), required_schema(TOOLS, parallel=False))

    named = ToolPlan.of(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True, None, False)
    message, finish = named.message('{"city": "Oslo", "unit": "f"}', "stop")
    assert calls_of(message) == [("get_weather", {"city": "Oslo", "unit": "f"})] and message["content"] is None
    assert finish == "stop"  # as OpenAI answers a forced call
    jsonschema.validate({"city": "Oslo"}, named_schema(TOOLS, "get_weather"))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"unit": "c"}, named_schema(TOOLS, "get_weather"))
    assert named_schema(TOOLS, "get_time") == TIME["function"]["parameters"]


def test_required_schema_keeps_the_references_of_nested_models():
    """pydantic's tools ($defs, "$ref": "#/$defs/X", and "#" for a recursive model) under tool_choice "required":
    the list's schema still resolves them (it pointed them at the list's own root, which has no $defs).
    Oracle: jsonschema on what a call list may and may not hold."""
    import openai
    import pydantic

    class Unit(pydantic.BaseModel):
        u: bool

    class Get(pydantic.BaseModel):
        unit: Unit

    class Tree(pydantic.BaseModel):
        kids: list[Tree]

    tools = [openai.pydantic_function_tool(Get), openai.pydantic_function_tool(Tree), WEATHER]
    schema = required_schema(tools)
    jsonschema.validate(
        [
            {"name": "Get", "parameters": {"unit": {"u": True}}},
            {"name": "Tree", "parameters": {"kids": [{"kids": []}]}},
            {"name": "get_weather", "parameters": {"city": "Oslo"}},
        ],
        schema,
    )
    for wrong in ({"unit": {"u": 1}}, {"unit": {}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate([{"name": "Get", "parameters": wrong}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "Tree", "parameters": {"kids": [{"kids": [1]}]}}], schema)


def test_required_and_named_choices_go_to_the_structured_output_masks():
    from infertune.sampling_params import SamplingParams

    params = ToolPlan.of(TOOLS, "required", False, None, False).sampling_params(SamplingParams())
    assert params.structured_outputs.json == required_schema(TOOLS, parallel=False)
    named = ToolPlan.of(TOOLS, {"type": "function", "function": {"name": "get_time"}}, True, None, False)
    assert named.sampling_params(SamplingParams()).structured_outputs.json == TIME["function"]["parameters"]
    auto = auto_plan("mistral").sampling_params(SamplingParams())
    assert auto.structured_outputs is None and auto.skip_special_tokens is False  # [TOOL_CALLS] stays in the text


@pytest.mark.parametrize(
    ("tools", "choice", "parser", "auto", "says"),
    [
        (None, "auto", None, False, "needs tools"),
        (None, "required", None, False, "needs tools"),
        (TOOLS, "auto", None, False, "--enable-auto-tool-choice"),
        (TOOLS, None, "hermes", False, "--enable-auto-tool-choice"),  # "auto" is the default with tools
        (TOOLS, {"type": "function", "function": {"name": "nope"}}, None, False, "not among the request's tools"),
    ],
)
def test_tool_choice_refusals_say_why(tools, choice, parser, auto, says):
    from infertune.serve.protocol import APIError

    with pytest.raises(APIError) as e:
        ToolPlan.of(tools, choice, True, parser, auto)
    assert e.value.status == 400 and says in e.value.message and e.value.param == "tool_choice"


def test_none_passes_the_tools_to_the_template_and_parses_nothing():
    plan = ToolPlan.of(TOOLS, "none", True, "hermes", True)
    assert plan.tools == TOOLS and not plan.active


def test_unknown_parser_name():
    with pytest.raises(ValueError, match="hermes"):
        get_parser("nope")
