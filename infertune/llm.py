"""Offline facade with vLLM's shape: LLM(model, **engine options).generate(prompts, sampling_params)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import replace
from itertools import count
from typing import TypedDict

from tqdm import tqdm

from infertune.config import EngineConfig
from infertune.engine.llm_engine import LLMEngine
from infertune.engine.outputs import RequestOutput
from infertune.sampling_params import RequestOutputKind, SamplingParams

log = logging.getLogger(__name__)


# vLLM's prompt types (vllm.inputs / `from vllm import TextPrompt, TokensPrompt`): plain dicts, as generate() takes them.
class _PromptOptions(TypedDict, total=False):
    multi_modal_data: dict  # (refused: text-only models)
    mm_processor_kwargs: dict
    cache_salt: str


class _TextOptions(_PromptOptions, total=False):
    add_special_tokens: bool


class TextPrompt(_TextOptions):
    prompt: str


class _TokensOptions(_PromptOptions, total=False):
    prompt: str  # (the output's prompt text, where the caller knows it)


class TokensPrompt(_TokensOptions):
    prompt_token_ids: list[int]


class LLM:
    """Load a Hugging Face folder once, then generate for batches of prompts with continuous batching.

    Engine options (all optional): dtype, max_model_len, max_num_seqs, max_num_batched_tokens,
    enable_chunked_prefill, block_size, kv_cache_memory_bytes, kv_cache_memory_fraction,
    enable_prefix_caching, device, seed, tokenizer. With model=None the built-in demo model is used.
    """

    def __init__(self, model: str | None = None, chat_template: str | None = None, **engine_options) -> None:
        show_progress = engine_options.pop("show_progress", False)
        self.config = EngineConfig.create(model, **engine_options)
        self.engine = LLMEngine(self.config, show_progress=show_progress)
        self._ids = count()
        # vLLM's LLM(chat_template=...): chat()'s template where a call gives none (a file, or the template itself)
        self.chat_template = _load_chat_template(chat_template)

    def shutdown(self) -> None:
        """Stop the engine's workers now (tensor-parallel processes, Ray actors); they also stop at exit. `with
        LLM(...) as llm:` does it on leaving the block."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def llm_engine(self):
        """The engine (vLLM's name: scripts reach `llm.llm_engine.get_tokenizer()`, `.add_request`, `.step()`)."""
        return self.engine

    def get_tokenizer(self):
        """The engine's tokenizer (vLLM's name for it)."""
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() and chat() use when given no SamplingParams: SamplingParams() with the model's
        generation_config.json defaults (temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens as
        max_tokens) where it has them, as vLLM's; engine option generation_config="vllm" for the neutral ones."""
        return self.engine.default_sampling_params()

    # vLLM's pooling and beam-search entry points: this engine generates text only (a named error, not an
    # AttributeError that reads like a typo).
    def _not_here(self, name: str, why: str):
        raise NotImplementedError(f"LLM.{name} is not supported: {why}")

    def encode(self, *args, **kwargs):
        self._not_here("encode", "this engine serves generative models only (no pooling / embedding models)")

    def embed(self, *args, **kwargs):
        self._not_here("embed", "this engine serves generative models only (no embedding models)")

    def classify(self, *args, **kwargs):
        self._not_here("classify", "this engine serves generative models only (no classification heads)")

    def reward(self, *args, **kwargs):
        self._not_here("reward", "this engine serves generative models only (no reward models)")

    def score(self, *args, **kwargs):
        self._not_here(
            "score",
            "no cross-encoder / embedding scoring; for the logprob of a text, generate with "
            "SamplingParams(prompt_logprobs=0, max_tokens=0)",
        )

    def beam_search(self, *args, **kwargs):
        self._not_here("beam_search", "no beam search; sample n candidates with SamplingParams(n=..., logprobs=0)")

    def sleep(self, *args, **kwargs):
        self._not_here("sleep", "the weights and the KV cache stay in memory (no sleep mode); shutdown() frees them")

    def wake_up(self, *args, **kwargs):
        self._not_here("wake_up", "there is no sleep mode (see LLM.sleep)")

    def start_profile(self, *args, **kwargs):
        self._not_here("start_profile", "profile a run with `infertune profile` (docs/tools.md)")

    def stop_profile(self, *args, **kwargs):
        self._not_here("stop_profile", "profile a run with `infertune profile` (docs/tools.md)")

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """Forget every cached prompt prefix (vLLM's: e.g. between the runs of a benchmark), so the next prompts are
        computed in full. True when the cache is empty after it; False where running requests still hold blocks."""
        return self.engine.reset_prefix_cache()

    def generate(
        self,
        prompts: str | dict | list,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] | None = None,
        lora_request=None,
        priority: list[int] | None = None,
        tokenization_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; results come back in input order.

        A prompt is text or {"prompt_token_ids": [...]}. A prompt that is invalid (empty, too long, ...)
        gets a RequestOutput whose .error says why while the others run; when every prompt is invalid,
        the first error is raised instead. sampling_params None: get_default_sampling_params(). use_tqdm: a
        progress bar (default: with more than one prompt), or a tqdm-like class to draw it with (vLLM's).
        lora_request and a non-zero priority (vLLM's) are refused by name: no LoRA adapters, first come first served.
        tokenization_kwargs (vLLM's): what the tokenizer is called with for text prompts, e.g.
        {"add_special_tokens": False} or {"truncation": True, "max_length": 512} (the tokenizer's own side).
        """
        if isinstance(lora_request, (list, tuple)) and not any(r is not None for r in lora_request):
            lora_request = None  # (vLLM's: one per prompt, all None)
        if lora_request is not None:
            raise NotImplementedError(
                "lora_request: LoRA adapters are not supported (merge the adapter into the weights)"
            )
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: this engine serves text-only models")
        if isinstance(priority, int):  # (vLLM's: one priority for every prompt)
            priority = [priority]
        if priority is not None and any(priority):
            raise ValueError("priority: requests are served first come first served here (no priority scheduling)")
        if sampling_params is not None and not isinstance(sampling_params, (SamplingParams, list, tuple)):
            raise ValueError(
                f"sampling_params must be a SamplingParams or a list of them (one per prompt), not "
                f"{type(sampling_params).__name__}"
            )
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError(f"prompts must be a string, a dict, or a list of them, not {type(prompts).__name__}")
        prompts = list(prompts)
        if not prompts:
            return []
        if tokenization_kwargs:
            prompts = [self.engine.tokenized(p, tokenization_kwargs) for p in prompts]
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        elif len(params) != len(prompts):
            raise ValueError(
                f"got {len(params)} SamplingParams for {len(prompts)} prompts; pass one, or one per prompt"
            )
        # (whole outputs: generate() returns each request's finished one, whatever output_kind says, as vLLM's)
        params = [replace(p, output_kind=RequestOutputKind.CUMULATIVE) if p.output_kind else p for p in params]

        results: dict[str, RequestOutput] = {}
        order: list[str] = []
        errors: list[ValueError] = []
        for prompt, sp in zip(prompts, params):
            request_id = str(next(self._ids))
            order.append(request_id)
            try:
                self.engine.add_request(request_id, prompt, sp)
            except ValueError as e:
                errors.append(e)
                results[request_id] = RequestOutput.rejected(request_id, prompt, str(e))
                log.warning("request %s rejected: %s", request_id, e)
        if len(errors) == len(prompts):
            raise errors[0]
        try:
            self._run(results, len(prompts) - len(errors), len(prompts) > 1 if use_tqdm is None else use_tqdm)
        finally:  # on an exception or Ctrl-C, leave no request of this call holding KV blocks
            for request_id in order:
                self.engine.abort_request(request_id)
        return [results[r] for r in order]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool | Callable[..., tqdm] | None = None,
        lora_request=None,
        priority: list[int] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        chat_template_kwargs: dict | None = None,
        tokenization_kwargs: dict | None = None,
        mm_processor_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with the model's chat template (or
        chat_template, or LLM(chat_template=...)); the arguments are vLLM's, in its order. Messages are OpenAI's:
        content given as text parts is their texts joined by newlines (chat_template_content_format "auto" or
        "string"; "openai" hands the parts to the template), a tool call's JSON arguments string becomes a dict.
        continue_final_message: the last message is continued, not closed (add_generation_prompt must then be
        False); chat_template_kwargs: more template variables, e.g. {"enable_thinking": False}; tools: OpenAI's
        function tools ({"type": "function", "function": {"name": ..., "parameters": ...}}), handed to the template
        (the reply's tool-call text is the model's: the server's tool parsers read it); lora_request, priority and
        tokenization_kwargs as generate() takes them."""
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message continues the last message: pass add_generation_prompt=False")
        if chat_template_content_format not in ("auto", "string", "openai"):
            raise ValueError(
                f"chat_template_content_format={chat_template_content_format!r}: expected 'auto', 'string' or 'openai'"
            )
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs: this engine serves text-only models")
        _check_tools(tools)
        if not isinstance(messages, (list, tuple)) or not messages:
            raise ValueError("messages must be a conversation (a list of message dicts) or a list of conversations")
        conversations = [list(messages)] if isinstance(messages[0], dict) else [list(c) for c in messages]
        content_format = "openai" if chat_template_content_format == "openai" else "string"
        prompts = [
            self.engine.render_chat(
                c,
                chat_template if chat_template is not None else self.chat_template,
                add_generation_prompt,
                tools=tools or None,
                continue_final_message=continue_final_message,
                template_kwargs=chat_template_kwargs,
                content_format=content_format,
            )
            for c in conversations
        ]
        return self.generate(
            prompts,
            sampling_params,
            use_tqdm,
            lora_request=lora_request,
            priority=priority,
            tokenization_kwargs=tokenization_kwargs,
        )

    def check_consistency(self, prompts: list | None = None, long: int | None = None, **kwargs) -> dict:
        """Run this LLM's model and options along the paths that must agree (batch 1 vs N, prefix cache, chunked
        prefill, preemption, kernels vs torch; int8 KV / quantization against a gate), or with long=N one long
        generation; each path builds its own engine. See infertune/profile/consistency.py and docs/consistency.md."""
        from infertune.profile import consistency

        if long is not None:
            return consistency.check_long(self.config, long, prompt=prompts[0] if prompts else None, **kwargs)
        return consistency.check_consistency(self.config, prompts, **kwargs)

    def _run(self, results: dict[str, RequestOutput], total: int, use_tqdm) -> None:
        bar_class = use_tqdm if callable(use_tqdm) else tqdm
        bar = bar_class(total=total, desc="generating", unit="req", disable=not use_tqdm)
        out_tokens = 0
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        results[out.request_id] = out
                        out_tokens += sum(len(c.token_ids) for c in out.outputs)
                        bar.update(1)
                        elapsed = bar.format_dict["elapsed"] or 1e-9
                        bar.set_postfix_str(f"{out_tokens / elapsed:.1f} out tok/s", refresh=False)
        finally:
            bar.close()


def _load_chat_template(template: str | None) -> str | None:
    """LLM(chat_template=...) as vLLM reads it: a file's text, else the template itself."""
    if template is None:
        return None
    from pathlib import Path

    try:
        path = Path(template)
        if path.is_file():
            return path.read_text()
    except (OSError, ValueError):  # (a template's text is not a path: too long, NUL)
        pass
    if not any(mark in template for mark in ("{{", "{%")):
        raise ValueError(f"chat_template={template!r} is neither a file nor a Jinja template")
    return template


def _check_tools(tools) -> None:
    """ValueError unless tools is None or a list of OpenAI function tools (each {"type": "function", "function":
    {"name": a non-empty string, ...}})."""
    if tools is None:
        return
    if not isinstance(tools, list):
        raise ValueError(f"tools must be a list of function tools, not {type(tools).__name__}")
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise ValueError(f'tools[{i}] must be {{"type": "function", "function": {{"name": ..., ...}}}}')
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise ValueError(f"tools[{i}].function.name must be a non-empty string")
