"""The tokenizer's routes, with vLLM's shapes: POST /tokenize, POST /detokenize, GET /tokenizer_info, GET /version.

/tokenize takes {"prompt", "add_special_tokens" (default true)} or {"messages", "add_generation_prompt" (default
true), "continue_final_message", "chat_template_kwargs", "add_special_tokens" (default false), "tools",
"chat_template"} and answers {"tokens", "count", "max_model_len"} (with
"token_strs" when return_token_strs is true); a chat is rendered through the same template as
/v1/chat/completions, so its count is the prompt_tokens that request would use. /detokenize takes {"tokens"} and
answers {"prompt"} (special tokens kept, as transformers' decode does by default). /tokenizer_info is what
lm-evaluation-harness's `tokenizer_backend=remote` reads (eos / bos / pad tokens and the chat template).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field

from infertune.engine.tokenizer import FastTokenizer
from infertune.sampling_params import ParamError
from infertune.serve.protocol import APIError, ChatMessage, ChatTool, UnicodeText, error_responses


class TokenizeCompletionRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: UnicodeText
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # (vLLM's: the last message left open, add_generation_prompt false)
    chat_template_kwargs: dict | None = None
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: list[ChatTool] | None = None
    chat_template: str | None = None  # (as /v1/chat/completions': else the server's --chat-template, else the model's)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class TokenizerInfoResponse(BaseModel):
    """The tokenizer's special tokens, chat template and sizes (more keys may follow, as in vLLM)."""

    model_config = ConfigDict(extra="allow")
    tokenizer_class: str
    eos_token: str | None = None
    bos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    eos_token_id: int | None = None
    chat_template: str | None = None
    model_max_length: int | None = None
    vocab_size: int
    max_model_len: int


class VersionResponse(BaseModel):
    version: str


_SPECIAL = ("eos_token", "bos_token", "pad_token", "unk_token")


def tokenizer_info(tok, path: str, max_model_len: int) -> dict:
    """What /tokenizer_info answers for this tokenizer (a FastTokenizer answers from its folder's
    tokenizer_config.json, so that transformers is not loaded for it)."""
    if isinstance(tok, FastTokenizer):
        try:
            cfg = json.loads((Path(path) / "tokenizer_config.json").read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            cfg = {}

        def special(name: str):
            value = cfg.get(name)
            return value.get("content") if isinstance(value, dict) else value

        info = {name: special(name) for name in _SPECIAL}
        info["tokenizer_class"] = str(cfg.get("tokenizer_class") or "PreTrainedTokenizerFast")
        info["chat_template"] = None
        length = cfg.get("model_max_length")
    else:
        info = {name: _str_or_none(getattr(tok, name, None)) for name in _SPECIAL}
        info["tokenizer_class"] = type(tok).__name__
        template = getattr(tok, "chat_template", None)
        info["chat_template"] = template if isinstance(template, str) else None
        length = getattr(tok, "model_max_length", None)
    info["eos_token_id"] = tok.eos_token_id
    info["model_max_length"] = int(length) if isinstance(length, (int, float)) and length < 2**63 else None
    info["vocab_size"] = len(tok)
    info["max_model_len"] = max_model_len
    return info


def _str_or_none(value) -> str | None:
    return value if isinstance(value, str) else None


def add_tokenizer_routes(app: FastAPI, server) -> None:
    """Add the routes above to app, over the engine, tokenizer and check_model of server (an api_server.APIServer,
    not imported here: it imports this module)."""
    engine = server.engine.engine
    tok = server.tokenizer

    def encode(req: TokenizeCompletionRequest | TokenizeChatRequest) -> list[int]:
        if isinstance(req, TokenizeChatRequest):
            if req.continue_final_message and req.add_generation_prompt:
                raise APIError(
                    400,
                    "continue_final_message continues the last message: send add_generation_prompt=false with it",
                    param="continue_final_message",
                )
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            try:
                rendered = engine.render_chat(
                    [m.for_template() for m in req.messages],
                    chat_template=server.template_of(req.chat_template),
                    add_generation_prompt=req.add_generation_prompt,
                    tools=tools,
                    continue_final_message=req.continue_final_message,
                    template_kwargs=req.chat_template_kwargs,
                )
            except ParamError as e:  # (a chat_template_kwargs key the request sets itself)
                raise APIError(400, str(e), param=e.param) from None
            except ValueError as e:
                raise APIError(400, str(e), param="messages") from None
            return tok.encode(rendered["prompt"], add_special_tokens=req.add_special_tokens)
        return tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(400, 404, 413))
    async def tokenize(req: TokenizeCompletionRequest | TokenizeChatRequest):
        server.check_model(req.model)
        ids = await asyncio.to_thread(encode, req)
        strs = await asyncio.to_thread(tok.convert_ids_to_tokens, ids) if req.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids, token_strs=strs)

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=error_responses(400, 404, 413))
    async def detokenize(req: DetokenizeRequest):
        server.check_model(req.model)
        size = len(tok)
        bad = next((t for t in req.tokens if not 0 <= t < size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is not in this tokenizer's vocabulary [0, {size})", param="tokens")
        text = await asyncio.to_thread(tok.decode, req.tokens)
        return DetokenizeResponse(prompt=text)

    info = tokenizer_info(tok, engine.config.model.tokenizer, engine.max_model_len)
    if server.chat_template is not None:  # (the template chats render with here: --chat-template)
        info["chat_template"] = server.chat_template

    @app.get("/tokenizer_info", response_model=TokenizerInfoResponse)
    async def get_tokenizer_info():
        return info

    @app.get("/version", response_model=VersionResponse)
    async def version():
        from infertune import __version__

        return VersionResponse(version=__version__)
