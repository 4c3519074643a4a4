"""Tool-call parsers: a model's output text -> content and OpenAI tool calls, whole or while it streams.

One parser per model family's format (chosen with `infertune serve --tool-call-parser NAME`):

- `hermes` (alias `qwen2_5`): Hermes 2 Pro / Qwen2.5 / Qwen3, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one block per call; text before the first block is content.
- `llama3_json`: Llama 3.1 / 3.2 / 3.3 JSON tool calls, `{"name": ..., "parameters": {...}}` (after
  `<|python_tag|>` or as the whole output), several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer `[TOOL_CALLS]name[ARGS]{...}`.

Two more formats are what the structured-output masks produce for tool_choice "required" (a JSON list of
{"name", "parameters"}) and for a named function (the arguments object alone), as in vLLM.

`parse(text, final)` works on the cumulative text. With final=False (streaming) it returns only what can no
longer change: content up to a possible start of a tool-call marker (trailing whitespace held back), each call's
name once complete, and a prefix of each call's arguments. Arguments are the canonical JSON serialization of what
the model wrote (json.dumps with its default separators, token by token), so the chunks streamed add up to the
string a non-streamed response carries. With final=True, output that does not parse (malformed or truncated JSON)
is plain content with no tool calls.
"""

from __future__ import annotations

import json
import math
import re
import secrets
import string
from dataclasses import dataclass, field


class Malformed(ValueError):
    """The text where a tool call was expected is not one."""


@dataclass
class PartialCall:
    name: str | None = None  # set once the name is complete
    arguments: str = ""  # canonical JSON of the arguments so far (all of it once done)
    done: bool = False


@dataclass
class Parsed:
    content: str | None
    calls: list[PartialCall] = field(default_factory=list)


# ---- a JSON reader that tolerates a truncated end and re-serializes canonically ------------------------------
_WS = " \t\n\r"
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = {"true": True, "false": False, "null": None}


def _skip(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


def read_json(s: str, i: int = 0, members: dict | None = None) -> tuple[str, bool, int, object]:
    """Read one JSON value at s[i:] (leading whitespace skipped), which may be cut off at the end of s.

    Returns (canonical, done, end, value): canonical is json.dumps(value, ensure_ascii=False) of the value when
    done, else a prefix of what it will be; value is the decoded string (a prefix while not done) or scalar, None
    for containers. For an object, `members` (if given) receives key -> (canonical, done, value) of each member
    read so far. Raises Malformed where s cannot be the start of JSON.
    """
    i = _skip(s, i)
    if i >= len(s):
        return "", False, i, None
    c = s[i]
    if c == "{":
        return _object(s, i, members)
    if c == "[":
        return _array(s, i)
    if c == '"':
        return _string(s, i)
    if c == "-" or c.isdigit():
        j = i
        while j < len(s) and s[j] in "+-.eE0123456789":
            j += 1
        if j == len(s):  # the number may go on
            return "", False, j, None
        m = _NUMBER.fullmatch(s, i, j)
        if m is None:
            raise Malformed(f"bad number {s[i:j]!r}")
        value = json.loads(s[i:j])
        if isinstance(value, float) and not math.isfinite(value):
            # past a float's range (1e400): the number as written, which is JSON; json.dumps would write Infinity
            return s[i:j], True, j, value
        return json.dumps(value), True, j, value
    for word, value in _LITERALS.items():
        if s.startswith(word, i):
            return word, True, i + len(word), value
        if word.startswith(s[i:]):
            return "", False, len(s), None
    raise Malformed(f"unexpected {s[i : i + 10]!r}")


def _string(s: str, i: int) -> tuple[str, bool, int, str]:
    j, safe = i + 1, i + 1  # safe: the end of the last complete character or escape
    while j < len(s):
        c = s[j]
        if c == '"':
            try:
                value = json.loads(s[i : j + 1])
            except json.JSONDecodeError as e:
                raise Malformed(f"bad string: {e}") from None
            return json.dumps(value, ensure_ascii=False), True, j + 1, value
        if c == "\\":
            if j + 1 >= len(s):
                break
            if s[j + 1] == "u":
                if j + 6 > len(s):
                    break
                code = s[j + 2 : j + 6]
                if not all(h in string.hexdigits for h in code):
                    raise Malformed("bad \\u escape")
                if 0xD800 <= int(code, 16) < 0xDC00:  # a high surrogate: wait for its pair
                    if j + 12 > len(s):
                        break
                    j += 6
                j += 6
            else:
                j += 2
        else:
            j += 1
        safe = j
    try:
        value = json.loads(s[i:safe] + '"')
    except json.JSONDecodeError as e:
        raise Malformed(f"bad string: {e}") from None
    return json.dumps(value, ensure_ascii=False)[:-1], False, len(s), value


def _object(s: str, i: int, members: dict | None) -> tuple[str, bool, int, None]:
    text = "{"
    i = _skip(s, i + 1)
    if i < len(s) and s[i] == "}":
        return "{}", True, i + 1, None
    while True:
        i = _skip(s, i)
        if i >= len(s):
            return text, False, i, None
        if s[i] != '"':
            raise Malformed("an object key must be a string")
        key_text, key_done, i, key = _string(s, i)
        text += key_text
        if not key_done:
            return text, False, i, None
        i = _skip(s, i)
        if i >= len(s):
            return text, False, i, None
        if s[i] != ":":
            raise Malformed("expected ':' after an object key")
        text += ": "
        value_text, value_done, i, value = read_json(s, i + 1)
        text += value_text
        if members is not None:
            members[key] = (value_text, value_done, value)
        if not value_done:
            return text, False, i, None
        i = _skip(s, i)
        if i >= len(s):
            return text, False, i, None
        if s[i] == "}":
            return text + "}", True, i + 1, None
        if s[i] != ",":
            raise Malformed("expected ',' or '}' in an object")
        text += ", "
        i += 1


def _array(s: str, i: int) -> tuple[str, bool, int, None]:
    text = "["
    i = _skip(s, i + 1)
    if i < len(s) and s[i] == "]":
        return "[]", True, i + 1, None
    while True:
        item_text, item_done, i, _ = read_json(s, i)
        text += item_text
        if not item_done:
            return text, False, i, None
        i = _skip(s, i)
        if i >= len(s):
            return text, False, i, None
        if s[i] == "]":
            return text + "]", True, i + 1, None
        if s[i] != ",":
            raise Malformed("expected ',' or ']' in an array")
        text += ", "
        i += 1


# ---- calls -------------------------------------------------------------------------------------------------
def read_call(s: str, i: int, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> tuple[PartialCall, int]:
    """One {"name": ..., "arguments": {...}} object at s[i:] (maybe cut off) -> the call so far, and its end."""
    members: dict = {}
    i = _skip(s, i)
    if i < len(s) and s[i] != "{":
        raise Malformed("a tool call must be a JSON object")
    _, done, end, _ = read_json(s, i, members)
    call = PartialCall(done=done)
    name = members.get("name")
    if name is not None and name[1]:
        if not isinstance(name[2], str) or not name[2]:
            raise Malformed("a tool call's name must be a non-empty string")
        call.name = name[2]
    args = next((members[k] for k in args_keys if k in members), None)
    if args is not None:
        text, args_done, value = args
        if text.startswith('"'):  # arguments given as a JSON string: its content is the arguments
            call.arguments = value
        elif text and not text.startswith("{"):
            raise Malformed("a tool call's arguments must be an object")
        else:
            call.arguments = text
    elif done:
        call.arguments = "{}"
    if done and call.name is None:
        raise Malformed("a tool call without a name")
    return call, end


def read_arguments(s: str, i: int = 0) -> tuple[PartialCall, int]:
    """The arguments object alone (a named tool_choice's output): a call without its name."""
    i = _skip(s, i)
    if i < len(s) and s[i] != "{":
        raise Malformed("the arguments must be a JSON object")
    text, done, end, _ = read_json(s, i)
    return PartialCall(arguments=text, done=done), end


def read_call_list(s: str, i: int, args_keys=("arguments", "parameters")) -> tuple[list[PartialCall], bool, int]:
    """A JSON list of call objects at s[i:] (maybe cut off): the calls so far, whether the list closed, its end."""
    i = _skip(s, i)
    if i >= len(s):
        return [], False, i
    if s[i] != "[":
        raise Malformed("expected a JSON list of tool calls")
    calls: list[PartialCall] = []
    i = _skip(s, i + 1)
    if i < len(s) and s[i] == "]":
        return calls, True, i + 1
    while True:
        i = _skip(s, i)
        if i >= len(s):
            return calls, False, i
        call, i = read_call(s, i, args_keys)
        calls.append(call)
        if not call.done:
            return calls, False, i
        i = _skip(s, i)
        if i >= len(s):
            return calls, False, i
        if s[i] == "]":
            return calls, True, i + 1
        if s[i] != ",":
            raise Malformed("expected ',' or ']' between tool calls")
        i += 1


def _held(text: str, marker: str) -> int:
    """How many characters at the end of text could be the start of marker (held back while streaming)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


def _content(text: str) -> str | None:
    return text or None


def _streamed_content(text: str, marker: str | None) -> str:
    """Content safe to stream: neither a possible start of the marker nor trailing whitespace (which a later tool
    call would drop)."""
    if marker:
        text = text[: len(text) - _held(text, marker)]
    return text.rstrip()


# ---- the parsers ---------------------------------------------------------------------------------------------
class ToolParser:
    """Turns a model's output into content and tool calls; see the module docstring."""

    name = ""
    marker: str | None = None  # where tool calls start; content before it

    def parse(self, text: str, final: bool) -> Parsed:
        start = text.find(self.marker) if self.marker else -1
        if start < 0:
            return Parsed(_content(text) if final else _streamed_content(text, self.marker))
        content = text[:start].rstrip() or None
        try:
            calls, complete = self.calls(text, start)
        except Malformed:
            if final:
                return Parsed(_content(text))
            return Parsed(content)  # nothing more streams; the final parse makes it all content
        if final and (not complete or not calls or not all(c.done for c in calls)):
            return Parsed(_content(text))  # cut off (max_tokens) or empty: not a tool call after all
        return Parsed(content, calls)

    def calls(self, text: str, start: int) -> tuple[list[PartialCall], bool]:
        """The calls from text[start:] (the marker on), and whether the text holds all of them complete."""
        raise NotImplementedError

    def make_id(self) -> str:
        return f"call_{secrets.token_hex(12)}"


class HermesParser(ToolParser):
    name = "hermes"
    marker = "<tool_call>"
    end_marker = "</tool_call>"

    def calls(self, text: str, start: int) -> tuple[list[PartialCall], bool]:
        calls: list[PartialCall] = []
        i = start
        while True:
            i += len(self.marker)
            call, i = read_call(text, i)
            calls.append(call)
            if not call.done:
                return calls, False
            i = _skip(text, i)
            rest = text[i:]
            if not rest:
                return calls, True  # the closing tag may still come (or the model stopped at EOS)
            if not rest.startswith(self.end_marker):
                if self.end_marker.startswith(rest):
                    return calls, True
                raise Malformed("expected </tool_call>")
            i = _skip(text, i + len(self.end_marker))
            nxt = text.find(self.marker, i)
            if nxt < 0:
                return calls, True  # what follows the last block (whitespace, an EOS text) is dropped
            i = nxt


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    tag = "<|python_tag|>"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.tag):
            start = len(text) - len(body) + len(self.tag)
        elif body.startswith("{"):
            start = len(text) - len(body)
        elif not final and self.tag.startswith(body):  # nothing yet, or the tag's start
            return Parsed("")
        else:
            return Parsed(_content(text) if final else text.rstrip())
        try:
            calls, complete = self.calls(text, start)
        except Malformed:
            if final:
                return Parsed(_content(text))
            return Parsed(None, [])
        if final and (not complete or not calls or not all(c.done for c in calls)):
            return Parsed(_content(text))
        return Parsed(None, calls)

    def calls(self, text: str, start: int) -> tuple[list[PartialCall], bool]:
        calls: list[PartialCall] = []
        i = start
        while True:
            call, i = read_call(text, i)
            calls.append(call)
            if not call.done:
                return calls, False
            i = _skip(text, i)
            if i >= len(text):
                return calls, True
            if text[i] != ";":
                raise Malformed("expected ';' between tool calls")
            i += 1
            if _skip(text, i) >= len(text):
                return calls, False


class MistralParser(ToolParser):
    name = "mistral"
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"

    def calls(self, text: str, start: int) -> tuple[list[PartialCall], bool]:
        i = _skip(text, start + len(self.marker))
        if i >= len(text):
            return [], False
        if text[i] == "[":
            calls, closed, _ = read_call_list(text, i)
            return calls, closed
        if text[i] == "{":
            call, _ = read_call(text, i)
            return [call], call.done
        # The v11 tokenizer's form: [TOOL_CALLS]name[ARGS]{...}, repeated for several calls.
        calls = []
        while True:
            j = text.find(self.args_marker, i)
            if j < 0:
                if _held(text, self.args_marker) or re.fullmatch(r"[\w.-]*", text[i:]):
                    return calls, False
                raise Malformed("expected [ARGS] after a tool name")
            name = text[i:j].strip()
            if not re.fullmatch(r"[\w.-]+", name):
                raise Malformed(f"bad tool name {name!r}")
            call, end = read_arguments(text, j + len(self.args_marker))
            call.name = name
            calls.append(call)
            if not call.done:
                return calls, False
            i = _skip(text, end)
            if i >= len(text):
                return calls, True
            if not text.startswith(self.marker, i):
                raise Malformed("expected [TOOL_CALLS] before the next call")
            i += len(self.marker)

    def make_id(self) -> str:
        # Mistral's templates accept only 9 alphanumeric characters as a tool call id.
        return "".join(secrets.choice(string.ascii_letters + string.digits) for _ in range(9))


class _ForcedParser(ToolParser):
    """A parser of a forced tool_choice's output (required / named), whose call ids are in the form of the server's
    family parser where it has one: a Mistral template refuses any id but 9 alphanumeric characters when the
    calls come back in the next turn, whichever tool_choice made them."""

    def __init__(self, family: ToolParser | None = None) -> None:
        self.family = family

    def make_id(self) -> str:
        return self.family.make_id() if self.family is not None else super().make_id()


class RequiredParser(_ForcedParser):
    """tool_choice "required": the output is a JSON list of {"name", "parameters"} (what its schema allows)."""

    name = "required"

    def parse(self, text: str, final: bool) -> Parsed:
        try:
            calls, closed, _ = read_call_list(text, 0, ("parameters", "arguments"))
        except Malformed:
            return Parsed(_content(text) if final else None)
        if final and (not closed or not calls):
            return Parsed(_content(text))
        return Parsed(None, calls)


class NamedParser(_ForcedParser):
    """A named tool_choice: the output is that function's arguments object."""

    name = "named"

    def __init__(self, function: str, family: ToolParser | None = None) -> None:
        super().__init__(family)
        self.function = function

    def parse(self, text: str, final: bool) -> Parsed:
        try:
            call, _ = read_arguments(text, 0)
        except Malformed:
            return Parsed(_content(text) if final else None)
        if final and not call.done:
            return Parsed(_content(text))
        call.name = self.function
        return Parsed(None, [call])


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "qwen2_5": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
}


def get_parser(name: str) -> ToolParser:
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}") from None
