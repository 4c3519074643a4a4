"""OpenAI request bodies (pydantic) and their translation to SamplingParams; OpenAI error bodies."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from infertune.engine.tokenizer import lone_surrogate
from infertune.sampling_params import SamplingParams, StructuredOutputsParams


class APIError(Exception):
    """An error that becomes {"error": {message, type, param, code}} with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        retry_after: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.retry_after, self.extra_headers = retry_after, dict(headers or {})

    @property
    def headers(self) -> dict[str, str] | None:
        """The answer's headers: Retry-After, and those given (a 405's Allow, a 401's WWW-Authenticate)."""
        headers = dict(self.extra_headers)
        if self.retry_after is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after)))
        return headers or None

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """What every refusal's body is (OpenAI's shape), declared in the OpenAPI schema for each status it can have."""

    error: ErrorDetail


STREAMED = {
    200: {
        "content": {"text/event-stream": {}},
        "description": "the completion as JSON, or with stream=true its chunks as server-sent events",
    }
}


def error_responses(*statuses: int) -> dict:
    meaning = {
        400: "invalid request: the parameter and its allowed range, or the numbers that cannot fit",
        401: "missing or wrong API key (with --api-key)",
        404: "unknown model",
        408: "the request passed --request-timeout and was aborted",
        413: "the body is over --max-body-bytes",
        429: "the waiting queue or the host-memory budget is full now (Retry-After)",
        503: "the process is over its memory ceiling (Retry-After), or the engine stopped",
    }
    return {status: {"model": ErrorBody, "description": meaning[status]} for status in statuses}


def _whole_unicode(text: str) -> str:
    """Text a tokenizer can take (engine/tokenizer.py lone_surrogate), else a validation error saying where."""
    at = lone_surrogate(text)
    if at is not None:
        raise ValueError(
            f"not valid Unicode text: a lone surrogate {text[at]!r} at character {at} (half of a UTF-16 pair); "
            "send whole characters"
        )
    return text


UnicodeText = Annotated[str, AfterValidator(_whole_unicode)]


class StreamOptions(BaseModel):
    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries its choice's usage so far (benchmark clients read it)
    continuous_usage_stats: bool = False


# ---- structured output (docs/structured-output.md): OpenAI's response_format, vLLM's guided_* -------------------
class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _StructuredFields(BaseModel):
    response_format: ResponseFormat | None = None
    guided_json: str | dict | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict | None = None  # vLLM's newer name: {"json": ..., "regex": ..., ...}

    def constraint_field(self) -> str:
        """The field that asked for the request's output constraint: what a 400 about its schema, regex or grammar
        names (the engine's compiler says "structured_outputs" for every kind)."""
        if self.response_format is not None and self.response_format.type != "text":
            return "response_format"
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                return name
        return "structured_outputs"

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one constraint the request asks for (None: none); 400 where it asks for several or is malformed."""
        asked: list[tuple[str, dict]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(
                    400, "response_format of type json_schema needs json_schema.schema", param="response_format"
                )
            # (strict: only the declared keys, as OpenAI's strict mode; vLLM's disable_additional_properties)
            strict = {"disable_additional_properties": True} if rf.json_schema.strict else {}
            asked.append(("response_format", {"json": rf.json_schema.schema_, **strict}))
        for name, key in (
            ("guided_json", "json"),
            ("guided_regex", "regex"),
            ("guided_choice", "choice"),
            ("guided_grammar", "grammar"),
        ):
            if getattr(self, name) is not None:
                asked.append((name, {key: getattr(self, name)}))
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", dict(self.structured_outputs)))
        if not asked:
            return None
        if len(asked) > 1:
            raise APIError(
                400,
                f"ask for one output constraint, not {len(asked)}: {', '.join(n for n, _ in asked)}",
                param=asked[1][0],
            )
        name, fields = asked[0]
        if self.guided_whitespace_pattern is not None:
            fields.setdefault("whitespace_pattern", self.guided_whitespace_pattern)
        known = {f.name for f in dataclasses.fields(StructuredOutputsParams)}
        unknown = sorted(set(fields) - known)
        if unknown:  # (an unknown key in structured_outputs)
            raise APIError(400, f"{name} takes {sorted(known)}, not {unknown}", param=name)
        try:
            return StructuredOutputsParams(**fields)
        except TypeError as e:
            raise APIError(400, f"{name}: {e}", param=name) from None
        except ValueError as e:
            raise APIError(400, f"{name}: {e}", param=name) from None


# ---- end structured output ----------------------------------------------------------------------------------------


def _stated(default, **bounds):
    """A field whose bounds the OpenAPI schema states. SamplingParams enforces them (a 400 naming the parameter and
    its range, tests/test_server.py), so the schema says what the server does without a second validator."""
    return Field(default=default, json_schema_extra=bounds)


class _SamplingFields(_StructuredFields):
    # Unknown fields are ignored, as OpenAI clients send options a server may not know.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = _stated(None, minimum=1)
    temperature: float | None = _stated(None, minimum=0)
    top_p: float | None = _stated(None, exclusiveMinimum=0, maximum=1)
    top_k: int | None = _stated(None, minimum=-1)
    min_p: float | None = _stated(None, minimum=0, maximum=1)
    n: int = _stated(1, minimum=1)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    presence_penalty: float | None = _stated(None, minimum=-2, maximum=2)
    frequency_penalty: float | None = _stated(None, minimum=-2, maximum=2)
    repetition_penalty: float | None = _stated(None, exclusiveMinimum=0)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Prefill/decode disaggregation (vLLM's field): what `infertune router` passes a producer and then a consumer.
    kv_transfer_params: dict | None = None
    # infertune's extension (docs/server.md): this request's own KV compression (SamplingParams.kv_compression), e.g.
    # {"press": "snapkv", "compression_ratio": 0.5} or {"press": "none"} for full KV in a compressing engine.
    kv_compression: dict | None = None
    # OpenAI's logit_bias (token id, as a string key -> bias in [-100, 100]) and vLLM's logits processors
    logit_bias: dict[str, float] | None = None
    min_tokens: int = _stated(0, minimum=0)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # vLLM's: keep only the last N prompt tokens (chat: of the rendered conversation); -1: up to max_model_len - 1
    truncate_prompt_tokens: int | None = _stated(None, minimum=-1)
    # Known fields of OpenAI's or vLLM's that this server does not do: a 400 naming the field where a request sets
    # one to something other than its no-op value, rather than an answer that silently ignores it.
    best_of: int | None = None
    use_beam_search: bool = False
    prompt_logprobs: int | None = None
    return_tokens_as_token_ids: bool = False
    logits_processors: list | None = None

    def check_supported(self) -> None:
        """400 for a known option set to something this server does not do (see the fields above)."""
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(
                400,
                "best_of is not supported (as in vLLM's V1 engine); use n and pick among the choices",
                param="best_of",
            )
        refused = {
            "use_beam_search": "beam search is not supported",
            "prompt_logprobs": "prompt_logprobs is not supported here; on /v1/completions use echo=true with "
            "logprobs (each prompt token's logprob and top alternatives come back before the completion)",
            "return_tokens_as_token_ids": "return_tokens_as_token_ids is not supported",
            "logits_processors": "logits_processors (server-side code by name) are not supported; logit_bias, "
            "min_tokens, allowed_token_ids and bad_words are",
        }
        for name, why in refused.items():
            if getattr(self, name) not in (None, False, []):
                raise APIError(400, why, param=name)
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or t == 0 or t < -1):
            raise APIError(
                400,
                f"truncate_prompt_tokens={t!r} is invalid: must be -1 (up to max_model_len - 1) or >= 1",
                param="truncate_prompt_tokens",
            )
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options can only be set with stream=true", param="stream_options")

    def sampling_params(
        self,
        max_tokens: int | None,
        logprobs: int | None,
        prompt_logprobs: int | None = None,
        defaults: dict | None = None,
        default_max_tokens: bool = False,
    ) -> SamplingParams:
        """The request's SamplingParams; `defaults` (the engine's sampling_defaults: the model's
        generation_config.json) fills the sampling fields the request left unset, as vLLM does."""
        fields = dict(
            prompt_logprobs=prompt_logprobs,
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
            structured_outputs=self.structured_outputs_params(),
            kv_transfer_params=self.kv_transfer_params,
            kv_compression=self.kv_compression,
            logit_bias=self.logit_bias,
            min_tokens=self.min_tokens or None,
            allowed_token_ids=self.allowed_token_ids,
            bad_words=self.bad_words,
        )
        for name, value in (defaults or {}).items():
            if name != "max_tokens" and name in fields and fields[name] is None:
                fields[name] = value
        soft = default_max_tokens  # (a default, not the client's: capped to the prompt's room, as vLLM does)
        if max_tokens is None and defaults and "max_tokens" not in self.model_fields_set:
            max_tokens = defaults.get("max_tokens")
            soft = soft or max_tokens is not None
        # None means "the default"; max_tokens None means "up to the context length".
        fields = {k: v for k, v in fields.items() if v is not None}
        return SamplingParams(max_tokens=max_tokens, max_tokens_is_default=soft, **fields)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields):
    # (an empty string or list is a 400: the schema says so for the string and the outer list)
    prompt: str | list[str] | list[int] | list[list[int]] = Field(json_schema_extra={"minLength": 1, "minItems": 1})
    max_tokens: int | None = _stated(16, minimum=0)  # (0 only with echo: the prompt alone)
    logprobs: int | None = _stated(None, minimum=0, maximum=20)
    # The prompt comes back before the completion (its text, and with logprobs each prompt token's logprob, the first
    # null): what eval harnesses read to score a continuation. max_tokens=0 then returns the prompt alone.
    echo: bool = False
    # infertune's extension (docs/server.md): heal the prompt's last token boundary (SamplingParams.token_healing).
    token_healing: bool = False
    # OpenAI's insertion mode (text after the completion): refused, as vLLM refuses it, rather than ignored
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(
                400,
                "suffix (insertion: text to complete before) is not supported; put the text in the prompt",
                param="suffix",
            )

    @field_validator("prompt")
    @classmethod
    def _prompt_text(cls, p):
        for text in [p] if isinstance(p, str) else p:
            if isinstance(text, str):
                _whole_unicode(text)
        return p

    def completion_params(self, defaults: dict | None = None) -> SamplingParams:
        scored = self.echo and (self.logprobs is not None or self.max_tokens == 0)
        max_tokens = self.max_tokens
        unset = "max_tokens" not in self.model_fields_set  # (16 or the model's: capped to the room, as vLLM does)
        if unset and (defaults or {}).get("max_tokens") is not None:
            max_tokens = min(max_tokens, defaults["max_tokens"])  # (vLLM's rule: the model's, at most 16)
        prompt_lp = (self.logprobs or 0) if scored else None
        params = self.sampling_params(max_tokens, self.logprobs, prompt_lp, defaults, default_max_tokens=unset)
        return replace(params, token_healing=True) if self.token_healing else params

    def prompts(self) -> list[object]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [{"prompt_token_ids": list(p)}]
        if all(isinstance(x, str) for x in p):
            return list(p)
        if all(isinstance(x, list) for x in p):
            return [{"prompt_token_ids": list(x)} for x in p]
        raise APIError(400, "prompt must be a string, a list of strings, or token ids", param="prompt")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["text"]
    text: UnicodeText


# ---- tool calling (serve/tools.py): the request's tools and tool_choice, assistant tool_calls, tool messages ----
class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    parameters: dict | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolChoiceFunction(BaseModel):
    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str
    arguments: str | dict = "{}"  # a JSON string (OpenAI); a dict is accepted too


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction

    def for_template(self) -> dict:
        # HF templates expect the arguments as a dict (`| tojson`), as vLLM hands them: parse the JSON string.
        arguments = self.function.arguments
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                pass
        call = {"type": "function", "function": {"name": self.function.name, "arguments": arguments}}
        if self.id is not None:
            call["id"] = self.id
        return call


# ---- end of tool calling ------------------------------------------------------------------------------------


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[ContentPart] | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _content_text(cls, content):
        if isinstance(content, str):
            _whole_unicode(content)
        return content

    def for_template(self) -> dict:
        """The message as the chat template reads it ("developer" is OpenAI's newer name for the system role)."""
        message = {"role": "system" if self.role == "developer" else self.role, "content": self.text()}
        if self.tool_calls:
            message["tool_calls"] = [c.for_template() for c in self.tool_calls]
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            message["name"] = self.name
        return message

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # (text parts are joined by newlines, as vLLM joins them, so that a conversation renders the same prompt)
        return "\n".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = _stated(None, minimum=1)
    logprobs: bool = False
    top_logprobs: int | None = _stated(None, minimum=0, maximum=20)
    add_generation_prompt: bool = True
    # vLLM's: the last (assistant) message is continued, not closed (add_generation_prompt must then be false)
    continue_final_message: bool = False
    # vLLM's: extra variables for the chat template, e.g. {"enable_thinking": false} for Qwen3's
    chat_template_kwargs: dict | None = None
    # vLLM's: a Jinja chat template for this request instead of the checkpoint's
    chat_template: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # OpenAI's deprecated form of tools: refused with what to send instead, rather than answered as if no function
    # were offered (an agent framework on the old API would wait for a function_call that never comes)
    functions: list | None = None
    function_call: str | dict | None = None

    def check_supported(self) -> None:
        super().check_supported()
        for name, no_op in (("functions", []), ("function_call", "none")):
            if getattr(self, name) not in (None, no_op):
                raise APIError(
                    400,
                    f"{name} (OpenAI's deprecated function calling) is not supported: send tools (each "
                    '{"type": "function", "function": {...}}) and tool_choice',
                    param=name,
                )

    def conversation(self) -> list[dict]:
        return [m.for_template() for m in self.messages]

    def logprobs_k(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs:
                raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
            return None
        return self.top_logprobs or 0
