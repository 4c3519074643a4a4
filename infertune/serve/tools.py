"""Tool calling in /v1/chat/completions: what `tools` and `tool_choice` ask for, and the answers they get.

- "none" (or no tools): the template still receives the tools; the output is plain content.
- "auto" (the default when tools are given): needs `--enable-auto-tool-choice` and `--tool-call-parser NAME`, as
  in vLLM; the family's parser (serve/tool_parsers.py) turns the output into content and tool calls, and
  finish_reason is "tool_calls" when it holds any.
- "required": the output is constrained to a JSON list of {"name": one of the tools, "parameters": its schema}
  (`required_schema`), parsed into tool calls; finish_reason "tool_calls".
- {"type": "function", "function": {"name": F}}: the output is constrained to F's parameters schema and is F's
  arguments (finish_reason "stop", as OpenAI answers a forced call).

"required" and a named function are enforced through the structured-output masks (`constrain`), where the
engine has them (SamplingParams.structured_outputs); see that function.
"""

from __future__ import annotations

import dataclasses
import logging

from infertune.engine.outputs import CompletionOutput
from infertune.runner.grammar import no_additional_properties
from infertune.sampling_params import SamplingParams
from infertune.serve.protocol import APIError
from infertune.serve.responses import Formatter
from infertune.serve.tool_parsers import NamedParser, Parsed, RequiredParser, ToolParser, get_parser

log = logging.getLogger(__name__)


def required_schema(tools: list[dict], parallel: bool = True) -> dict:
    """JSON schema of what tool_choice="required" lets the model write: a list (of one with parallel_tool_calls
    false) of {"name": a tool's name, "parameters": that tool's parameters}.

    A parameters schema with local references ("#/$defs/X", as pydantic writes nested models) sits in this
    schema's $defs, its references rebased there: left where it is, "#" would mean this list's schema."""
    options, defs = [], {}
    for k, t in enumerate(tools):
        parameters = _parameters(t["function"])
        if _has_local_ref(parameters):
            defs[f"tool{k}"] = _rebased(parameters, f"#/$defs/tool{k}")
            parameters = {"$ref": f"#/$defs/tool{k}"}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": parameters},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
        )
    item = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {"type": "array", "minItems": 1, "items": item}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def _has_local_ref(node) -> bool:
    if isinstance(node, dict):
        ref = node.get("$ref")
        return (isinstance(ref, str) and ref.startswith("#")) or any(_has_local_ref(v) for v in node.values())
    return isinstance(node, list) and any(_has_local_ref(v) for v in node)


def _rebased(node, base: str):
    """node with each local $ref ("#", "#/...") pointing under base, the JSON pointer where node now sits."""
    if isinstance(node, dict):
        return {
            k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else _rebased(v, base)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [_rebased(v, base) for v in node]
    return node


def named_schema(tools: list[dict], name: str) -> dict:
    """JSON schema of a named function's arguments (its parameters; any object where it declares none)."""
    return _parameters(_find(tools, name)["function"])


def _parameters(function: dict) -> dict:
    """A function's arguments schema; with "strict": true every object in it closed to undeclared keys (OpenAI's
    strict mode: only the declared keys) where it does not say otherwise."""
    params = function.get("parameters")
    params = params if isinstance(params, dict) and params else {"type": "object"}
    return no_additional_properties(params) if function.get("strict") else params


def _find(tools: list[dict], name: str) -> dict:
    for t in tools:
        if t["function"]["name"] == name:
            return t
    raise APIError(
        400,
        f"tool_choice names the function {name!r}, which is not among the request's tools "
        f"({', '.join(repr(t['function']['name']) for t in tools)})",
        param="tool_choice",
    )


def constrain(params: SamplingParams, schema: dict, whitespace_pattern: str | None = None) -> SamplingParams | None:
    """params whose output must match the JSON schema (the structured-output masks), or None where this engine
    has no structured outputs (then the output runs unconstrained and is parsed as the schema's format anyway).
    whitespace_pattern: vLLM's guided_whitespace_pattern, which holds for the tools' JSON as for any JSON."""
    try:
        from infertune.sampling_params import StructuredOutputsParams
    except ImportError:
        return None
    if "structured_outputs" not in {f.name for f in dataclasses.fields(SamplingParams)}:
        return None
    try:
        so = StructuredOutputsParams(json=schema, whitespace_pattern=whitespace_pattern)
        return dataclasses.replace(params, structured_outputs=so)
    except ValueError as e:
        raise APIError(
            400, f"the tools' parameters are not a schema the server can enforce: {e}", param="tools"
        ) from None


@dataclasses.dataclass
class ToolPlan:
    """What one chat request asks of tool calling, checked against the server's options."""

    tools: list[dict] | None  # for the chat template (OpenAI's shape), None without tools
    choice: str  # "none" | "auto" | "required" | "named"
    parser: ToolParser | None = None  # None: the output is plain content
    parallel: bool = True

    @classmethod
    def of(
        cls,
        tools: list[dict] | None,
        tool_choice: str | dict | None,
        parallel: bool,
        parser_name: str | None,
        auto_enabled: bool,
    ) -> ToolPlan:
        if hasattr(tool_choice, "model_dump"):  # protocol.NamedToolChoice
            tool_choice = tool_choice.model_dump()
        if not tools:
            if tool_choice not in (None, "none"):
                raise APIError(400, "tool_choice needs tools: the request lists none", param="tool_choice")
            return cls(None, "none")
        if tool_choice is None:
            tool_choice = "auto"
        family = get_parser(parser_name) if parser_name else None  # (forced calls' ids in the family's form)
        if isinstance(tool_choice, dict):
            name = tool_choice["function"]["name"]
            _find(tools, name)
            return cls(tools, "named", NamedParser(name, family), parallel)
        if tool_choice == "none":
            return cls(tools, "none")
        if tool_choice == "required":
            return cls(tools, "required", RequiredParser(family), parallel)
        if tool_choice != "auto":
            raise APIError(400, f"tool_choice {tool_choice!r} is not one of none, auto, required", param="tool_choice")
        if not (auto_enabled and parser_name):
            raise APIError(
                400,
                '"auto" tool choice (the default when tools are given) needs the server started with '
                '--enable-auto-tool-choice and --tool-call-parser NAME; or send tool_choice "none", '
                '"required" or a named function',
                param="tool_choice",
            )
        return cls(tools, "auto", get_parser(parser_name), parallel)

    @property
    def active(self) -> bool:
        return self.parser is not None

    def sampling_params(self, params: SamplingParams, whitespace_pattern: str | None = None) -> SamplingParams:
        """The request's params for this plan: special tokens kept in the text for a family's parser (they may
        mark the call, like <|python_tag|> or [TOOL_CALLS]), the output constrained for required / named (with
        the request's guided_whitespace_pattern)."""
        if self.choice == "auto":
            return dataclasses.replace(params, skip_special_tokens=False)
        if self.choice in ("required", "named"):
            if params.structured_outputs is not None:  # (one constraint a request, as two guided_* fields)
                choice = "a named function" if self.choice == "named" else '"required"'
                raise APIError(
                    400,
                    f"tool_choice {choice} constrains the output to the tool calls' JSON; the request also asks for "
                    "response_format, guided_* or structured_outputs: one constraint a request, drop one of them",
                    param="tool_choice",
                )
            schema = (
                required_schema(self.tools, self.parallel)
                if self.choice == "required"
                else named_schema(self.tools, self.parser.function)
            )
            constrained = constrain(params, schema, whitespace_pattern)
            if constrained is None:
                log.warning("tool_choice %r is not enforced: this engine has no structured outputs", self.choice)
                return params
            return constrained
        return params

    def parse(self, text: str, final: bool) -> Parsed:
        parsed = self.parser.parse(text, final)
        if not self.parallel and len(parsed.calls) > 1:
            parsed.calls = parsed.calls[:1]
        return parsed

    def finish_reason(self, reason: str | None, has_calls: bool) -> str | None:
        if has_calls and reason == "stop" and self.choice in ("auto", "required"):
            return "tool_calls"
        return reason

    def final_parse(self, text: str, finish_reason: str | None) -> Parsed:
        """A finished choice's content and calls. Output cut off by max_tokens (finish_reason "length") inside a
        call keeps the calls as far as they got (arguments truncated), as OpenAI answers and as they were streamed;
        otherwise output that does not parse is content (the parsers' final=True)."""
        whole = self.parse(text, final=True)
        if finish_reason != "length" or whole.calls:
            return whole
        cut = self.parse(text, final=False)
        cut.calls = [c for c in cut.calls if c.name is not None]
        return cut if cut.calls else whole  # (no call begun: all of it is content, nothing held back)

    def message(self, text: str, finish_reason: str | None) -> tuple[dict, str | None]:
        """A finished choice's message (content and tool_calls) and its finish_reason."""
        parsed = self.final_parse(text, finish_reason)
        message: dict = {"role": "assistant", "content": parsed.content}
        if parsed.calls:
            message["tool_calls"] = [
                {
                    "id": self.parser.make_id(),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in parsed.calls
            ]
        elif parsed.content is None:
            message["content"] = ""
        return message, self.finish_reason(finish_reason, bool(parsed.calls))


class ToolStream:
    """One streamed choice's state: what content and which tool-call parts were sent already."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.content_sent = 0
        self.ids: list[str] = []  # one per call whose id and name were sent
        self.args_sent: list[int] = []
        self.has_calls = False  # as the latest parse says (the final one decides finish_reason)

    def deltas(self, text: str, finished: bool, finish_reason: str | None = None) -> list[dict]:
        """The chat deltas (content, then tool-call parts) that text adds to what was sent; once finished, its last
        text is parsed as a non-streamed message is (finish_reason: the choice's)."""
        parsed = self.plan.final_parse(text, finish_reason) if finished else self.plan.parse(text, False)
        out = []
        content = parsed.content or ""
        if self.ids and not parsed.calls:
            # Calls went out, then the whole turned out malformed (a non-streamed answer is all content): what was
            # streamed cannot be taken back, and the call's markup is not sent again as content.
            content = ""
        if len(content) > self.content_sent and content.startswith(text[: self.content_sent]):
            out.append({"content": content[self.content_sent :]})
            self.content_sent = len(content)
        for index, call in enumerate(parsed.calls):
            if index >= len(self.ids):
                if call.name is None:
                    break
                self.ids.append(self.plan.parser.make_id())
                self.args_sent.append(0)
                out.append(
                    {
                        "tool_calls": [
                            {
                                "index": index,
                                "id": self.ids[index],
                                "type": "function",
                                "function": {"name": call.name, "arguments": ""},
                            }
                        ]
                    }
                )
            sent = self.args_sent[index]
            if len(call.arguments) > sent:
                out.append({"tool_calls": [{"index": index, "function": {"arguments": call.arguments[sent:]}}]})
                self.args_sent[index] = len(call.arguments)
        self.has_calls = bool(parsed.calls)
        return out

    def finish_reason(self, reason: str | None) -> str | None:
        return self.plan.finish_reason(reason, self.has_calls and bool(self.ids))


def template_tools(tools) -> list[dict] | None:
    """The request's tools as the chat template receives them (HF apply_chat_template(tools=...): OpenAI's shape)."""
    if not tools:
        return None
    return [t.model_dump(exclude_none=True) for t in tools]


class ToolFormatter(Formatter):
    """A chat Formatter whose choices carry tool calls: messages parsed by the plan, chunks as tool-call deltas."""

    def __init__(self, plan: ToolPlan, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.plan = plan
        self.streams: dict[int, ToolStream] = {}

    def choice(self, index: int, c: CompletionOutput, *args, **kwargs) -> dict:
        choice = super().choice(index, c, *args, **kwargs)
        choice["message"], choice["finish_reason"] = self.plan.message(c.text, c.finish_reason)
        return choice

    def tool_chunks(self, index: int, c: CompletionOutput, logprobs: dict | None, first: bool) -> list[dict]:
        """The chunks of one streamed step of choice `index`: its content and tool-call deltas, the finish last."""
        stream = self.streams.setdefault(index, ToolStream(self.plan))
        deltas = stream.deltas(c.text, c.finish_reason is not None, c.finish_reason)
        if first:
            deltas = [{"role": "assistant", "content": ""}, *deltas]
        if c.finish_reason is not None or (logprobs and not deltas):
            deltas.append({})
        chunks = []
        for k, delta in enumerate(deltas):
            last = k == len(deltas) - 1
            finish = stream.finish_reason(c.finish_reason) if last and c.finish_reason is not None else None
            choice = {
                "index": index,
                "delta": delta,
                "logprobs": logprobs if k == 0 else None,
                "finish_reason": finish,
                "stop_reason": c.stop_reason if finish is not None else None,
            }
            chunks.append(self._envelope("chat.completion.chunk", [choice]))
        return chunks
