"""LLMEngine: add_request / step / abort. Owns the tokenizer, the scheduler and the executor.

A request becomes n Sequences (one per sample). Each step schedules, runs the executor once, lets the
scheduler advance the sequences, then detokenizes new tokens and applies stop strings. With speculative decoding a
step may give a sequence several tokens: they are detokenized and checked in order, and a stop string ends the
output at the token that completes it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import numbers
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path

from infertune.config import EngineConfig
from infertune.engine.admission import HostCost, check_kv_compression
from infertune.engine.detokenizer import (
    IncrementalDetokenizer,
    character_start,
    continuation_byte_tokens,
    find_stop,
)
from infertune.engine.kv_cache_coordinator import describe_groups, group_label, kv_cache_manager
from infertune.engine.outputs import CompletionOutput, Logprob, OutputShaper, RequestMetrics, RequestOutput
from infertune.engine.scheduler import Scheduler
from infertune.engine.sequence import Sequence, SequenceStatus
from infertune.engine.tokenizer import load_tokenizer, lone_surrogate
from infertune.kv_transfer import scheduler_connector
from infertune.runner.grammar import GrammarCompiler
from infertune.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from infertune.scheduler_output import KVCacheGroup

log = logging.getLogger(__name__)
# the keys a dict prompt may carry (vLLM's TextPrompt / TokensPrompt; multi_modal_data refused, mm_processor_kwargs
# and cache_salt taken as vLLM's text-only path ignores them)
_PROMPT_KEYS = {
    "prompt",
    "prompt_token_ids",
    "add_special_tokens",
    "multi_modal_data",
    "mm_processor_kwargs",
    "cache_salt",
}


@dataclass(slots=True, frozen=True)
class PreparedPrompt:
    text: str | None
    token_ids: list[int]
    max_tokens: int  # what the request runs to at most: its max_tokens, or the room left in max_model_len
    healed: str = ""  # token healing: the text of the prompt token taken off, which the output must start with


@dataclass(slots=True)
class _Sample:
    seq: Sequence
    detok: IncrementalDetokenizer | None  # None: detokenize=False (the text stays empty)
    text: str = ""
    stop_reason: str | int | None = None
    logprobs: list[Logprob] | None = None
    discard: bool = False  # max_tokens=0 (prompt logprobs alone): the one token sampled after the prompt is dropped
    num_tokens: int = 0  # output tokens taken so far (stop strings are looked for once past min_tokens)


@dataclass(slots=True)
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample] = field(default_factory=list)
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.perf_counter()))
    prompt_logprobs: list[Logprob | None] | None = None
    shaper: OutputShaper | None = None  # params.output_kind DELTA / FINAL_ONLY: what step() hands back of it


# The attribute an exception raised by LLMEngine.step carries: the ids of the step's requests (the async engine
# aborts them and goes on). The exception itself is re-raised as it was: callers catch the types they know.
STEP_REQUESTS = "infertune_step_request_ids"


class LLMEngine:
    def __init__(self, config: EngineConfig, show_progress: bool = False) -> None:
        from infertune.executor import create_executor  # torch is imported only with the executor

        self.config = config
        # what a request that leaves a sampling field unset gets (the model's generation_config.json, as vLLM)
        self.sampling_defaults = config.model.sampling_defaults()
        if self.sampling_defaults:
            log.info(
                "sampling defaults from the model's generation_config: %s (a request's own values win; "
                "generation_config='vllm' for neutral ones)",
                ", ".join(f"{k}={v}" for k, v in self.sampling_defaults.items()),
            )
        self.tokenizer = load_tokenizer(config.model.tokenizer)
        self.executor = create_executor(config, show_progress)
        # (a KV cache coordinator where layers attend within sliding windows: their groups free what leaves them)
        self.block_manager = kv_cache_manager(
            self.executor.kv_cache_info,
            config.cache.enable_prefix_caching,
            config.scheduler.max_num_batched_tokens,
            config.cache.kv_compression,
            config.cache.kv_int4_after,
        )
        # prefill/decode disaggregation (config.parallel.kv_role): the KV connector's scheduler side, else None
        self.kv_connector = scheduler_connector(config, self.executor.kv_cache_info)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.kv_connector)
        self.num_prefill_tokens = 0  # prompt tokens computed here (not loaded from a producer nor prefix-cached)
        self.num_generation_tokens = 0  # output tokens made, of every request (those aborted later included)
        groups = self.executor.kv_cache_info.groups
        self._kv_group_labels = [group_label(g) for g in groups or [KVCacheGroup(None, ())]]
        self._kv_group_labels_once = list(dict.fromkeys(self._kv_group_labels))
        self.eos_token_ids = self._eos_token_ids()
        # structured output: compiled once per schema (LRU), each new one's first step tried on the tokenizer
        self.grammars = GrammarCompiler(
            self.eos_token_ids, tokenizer_path=config.model.tokenizer, vocab_size=config.model.arch.vocab_size
        )
        self.requests: dict[str, _Request] = {}
        self.num_steps = 0
        log.info("%s", self.describe_kv_cache())

    @classmethod
    def from_engine_args(cls, engine_args, *args, **kwargs) -> LLMEngine:
        """vLLM's constructor: an engine from an EngineArgs (infertune.EngineArgs); vLLM's other arguments
        (usage_context, stat_loggers, ...) have nothing to set here."""
        return cls(engine_args.create_engine_config(), show_progress=vars(engine_args).get("show_progress", False))

    def describe_kv_cache(self) -> str:
        info = self.executor.kv_cache_info
        per_seq = info.max_blocks_per_seq or -(-self.max_model_len // info.block_size)
        text = (
            f"KV cache: {info.num_blocks} blocks x {info.block_size} tokens = {info.num_tokens} tokens "
            f"({info.total_bytes / 2**20:.1f} MiB); up to {info.num_blocks // per_seq} sequences of "
            f"max_model_len={self.max_model_len} at once"
        )
        if any(g.window is not None or g.compressed for g in info.groups):  # each group's share (its own table)
            text += "; KV cache groups, each block a page of every group: " + "; ".join(
                describe_groups(info, self.max_model_len, self.config.scheduler.max_num_batched_tokens)
            )
        if self.config.cache.kv_int4_after is not None:
            short = self.block_manager.max_blocks_per_seq(self.max_model_len, 1)  # (a short prompt's peak, aged)
            text += (
                f"; int4 tier: a sequence's tokens {self.config.cache.kv_int4_after} or more behind its newest are "
                "re-stored as int4, two int8 blocks in one (full-attention layers): up to "
                f"{info.num_blocks // max(short, 1)} sequences of max_model_len at once where the prompts are short "
                "(a prompt is held at int8 until its first decode step)"
            )
        return text

    def default_sampling_params(self) -> SamplingParams:
        """SamplingParams() with the model's sampling defaults (sampling_defaults) in place of the neutral ones."""
        return SamplingParams(**self.sampling_defaults)

    def _eos_token_ids(self) -> frozenset[int]:
        ids = set(self.config.model.arch.eos_token_ids)
        gen_cfg = Path(self.config.model.model) / "generation_config.json"
        if gen_cfg.is_file():
            eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
            ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return frozenset(int(i) for i in ids)

    def shutdown(self) -> None:
        """Stop the executor's workers (a worker process, with distributed_executor_backend="mp")."""
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        self.executor.shutdown()

    @property
    def max_model_len(self) -> int:
        return self.config.model.max_model_len

    # ---- requests --------------------------------------------------------------------------------
    def tokenize(self, prompt: str | dict | list[int]) -> tuple[str | None, list[int]]:
        """A prompt is text, a token-id list, or {"prompt_token_ids": [...]} / {"prompt": text} (a dict may
        also say "add_special_tokens": False, for text that already holds them, like a rendered chat)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(_unicode_text(prompt))
        if isinstance(prompt, dict):
            if prompt.get("multi_modal_data") is not None:  # (vLLM's key: silently text-only would answer wrongly)
                raise ValueError("multi_modal_data: this engine serves text-only models; send the prompt's text")
            unknown = sorted(set(prompt) - _PROMPT_KEYS)
            if unknown:
                raise ValueError(f"a dict prompt takes {sorted(_PROMPT_KEYS)}, not {unknown}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"])
            if isinstance(prompt.get("prompt"), str):
                text = _unicode_text(prompt["prompt"])
                return text, self.tokenizer.encode(text, add_special_tokens=prompt.get("add_special_tokens", True))
            raise ValueError("a dict prompt needs 'prompt' (text) or 'prompt_token_ids' (a list of token ids)")
        if isinstance(prompt, list):
            return None, _token_ids(prompt)
        raise ValueError(f"a prompt must be a string, a list of token ids or a dict, not {type(prompt).__name__}")

    def render_chat(
        self,
        conversation: list[dict],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        continue_final_message: bool = False,
        template_kwargs: dict | None = None,
        content_format: str = "string",
    ) -> dict:
        """A conversation -> a prompt dict, through the checkpoint's chat template (or the one given); `tools`
        (OpenAI's function tools) go to the template as HF apply_chat_template(tools=...) hands them. A message the
        template refuses (raise_exception, a role it does not know) is a ValueError that says why.

        continue_final_message: the last message is left open for the model to continue (HF's option, with
        add_generation_prompt False); template_kwargs: more variables for the template (e.g. Qwen3's
        enable_thinking), which may not replace the ones set here (a ParamError naming them). Messages are read as
        vLLM reads OpenAI's: content given as text parts is their texts joined by newlines (content_format "string";
        "openai" hands the parts to the template as they are), no content is "", a tool call's JSON arguments string
        is parsed into the dict templates expect."""
        extra = dict(template_kwargs or {})
        taken = sorted(set(extra) & _TEMPLATE_ARGS)
        if taken:
            raise ParamError(
                "chat_template_kwargs", f"chat_template_kwargs cannot set {', '.join(taken)} (set by the request)"
            )
        tok = self.tokenizer
        if chat_template is None and not getattr(tok, "chat_template", None):
            raise ValueError(
                f"the tokenizer of {self.config.model.tokenizer!r} has no chat template; pass chat_template=... "
                "or send plain text"
            )
        if not isinstance(conversation, list) or not conversation:
            raise ValueError("a conversation must be a non-empty list of messages")
        conversation = [_template_message(m, content_format) for m in conversation]
        from jinja2 import TemplateError

        try:
            text = tok.apply_chat_template(
                conversation,
                chat_template=chat_template,
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                **({"continue_final_message": True} if continue_final_message else {}),
                **extra,
            )
        except (TemplateError, TypeError, KeyError, IndexError) as e:  # the template's own checks, or bad shapes
            raise ValueError(f"the chat template cannot render these messages: {e}") from None
        # The template already holds any BOS / special tokens: do not add them twice.
        return {"prompt": text, "add_special_tokens": False}

    def add_request(
        self,
        request_id: str,
        prompt: str | dict | list[int],
        params: SamplingParams | None = None,
        arrival_time: float | None = None,
        lora_request=None,
        tokenization_kwargs: dict | None = None,
        trace_headers=None,
        priority: int = 0,
        *,
        cap_max_tokens: bool = True,
    ) -> None:
        """Validate and queue a request. A bad request raises ValueError and leaves the engine unchanged.

        A max_tokens that would run past max_model_len is capped to fit (finish_reason "length"), or with
        cap_max_tokens=False (the OpenAI server's rule) rejected. The other arguments are vLLM's, in its order:
        arrival_time (time.time() seconds, for the metrics), tokenization_kwargs (as LLM.generate takes them),
        trace_headers (no tracing here: unread); a lora_request and a non-zero priority are refused by name.
        """
        check_request_options(lora_request, priority)
        if tokenization_kwargs:
            prompt = self.tokenized(prompt, tokenization_kwargs)
        params = params or self.default_sampling_params()
        arrival = None if arrival_time is None else time.perf_counter() - max(0.0, time.time() - arrival_time)
        self.enqueue(request_id, self.prepare(prompt, params, cap_max_tokens), params, arrival)

    def tokenized(self, prompt, kwargs: dict):
        """A text prompt (or {"prompt": text}) as {"prompt", "prompt_token_ids"} from tokenizer(text, **kwargs) (vLLM's
        tokenization_kwargs); other prompts as they are. A kwarg the tokenizer refuses is a ValueError naming
        tokenization_kwargs."""
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        if not isinstance(text, str) or (isinstance(prompt, dict) and "prompt_token_ids" in prompt):
            return prompt
        if isinstance(prompt, dict) and "add_special_tokens" in prompt:  # (a rendered chat holds them already)
            kwargs = {"add_special_tokens": prompt["add_special_tokens"], **kwargs}
        try:
            ids = self.tokenizer(text, **kwargs)["input_ids"]
        except (TypeError, ValueError) as e:
            raise ValueError(f"tokenization_kwargs {kwargs}: the tokenizer refuses them: {e}") from None
        return {"prompt": text, "prompt_token_ids": list(ids)}

    def prepare(
        self, prompt: str | dict | list[int], params: SamplingParams, cap_max_tokens: bool = True
    ) -> PreparedPrompt:
        """Tokenize and validate one prompt for params: its text, token ids and the max_tokens it will run to."""
        self.check_params(params)
        text, ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty (0 tokens); give at least one token of text")
        keep = params.truncate_prompt_tokens
        keep = self.max_model_len - 1 if keep == -1 else keep
        if keep is not None and len(ids) > keep:  # (vLLM's rule: the last tokens stay; the text no longer matches)
            text, ids = None, ids[len(ids) - keep :]
        vocab = self.config.model.arch.vocab_size
        bad = next(
            (i for i, t in enumerate(ids) if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab), None
        )
        if bad is not None:
            raise ValueError(
                f"prompt_token_ids must be integers in [0, {vocab}) for this model; position {bad} is {ids[bad]!r}"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"the prompt has {len(ids)} tokens but max_model_len is {self.max_model_len}, which must leave room "
                f"for at least one new token; shorten the prompt or raise max_model_len"
            )
        room = self.max_model_len - len(ids)
        if not (cap_max_tokens or params.max_tokens_is_default) and (params.max_tokens or 0) > room:
            raise ParamError(
                "max_tokens",
                (
                    f"this model's context is max_model_len={self.max_model_len} tokens, but the prompt has {len(ids)} "
                    f"and max_tokens={params.max_tokens} asks for {len(ids) + params.max_tokens}; lower max_tokens to "
                    f"at most {room} or shorten the prompt"
                ),
            )
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        # (max_tokens=0, allowed with prompt_logprobs: the prompt runs, and the token sampled after it is dropped)
        if params.token_healing:
            ids, healed = self.heal(ids)
            if healed:
                return PreparedPrompt(text, ids, max(max_tokens, 1), healed)
        return PreparedPrompt(text, ids, max(max_tokens, 1))

    def heal(self, ids: list[int]) -> tuple[list[int], str]:
        """Token healing: (the prompt without its last token, that token's text), or (ids, "") where there is
        nothing to heal: a one-token prompt, a special last token, or a tokenizer whose text does not split there."""
        if len(ids) < 2 or ids[-1] in set(getattr(self.tokenizer, "all_special_ids", ())):
            return ids, ""
        # A few tokens of context, so a leading space folded into the last token survives decoding; never starting
        # inside a character spelled in byte-fallback tokens (a run of them that starts mid-character decodes as U+FFFD).
        tail = ids[character_start(ids, max(len(ids) - 5, 0), continuation_byte_tokens(self.tokenizer)) :]
        full = self.tokenizer.decode(tail, skip_special_tokens=False)
        head = self.tokenizer.decode(tail[:-1], skip_special_tokens=False)
        # (a byte-level BPE's tail may still start inside a character, U+FFFD in both: only the healed text counts)
        if len(full) <= len(head) or not full.startswith(head) or "\ufffd" in full[len(head) :]:
            return ids, ""
        return ids[:-1], full[len(head) :]

    def check_params(self, params: SamplingParams) -> None:
        """The engine's bounds on what one request may ask for (LimitsConfig), beyond SamplingParams' own rules.
        Those rules run again first: a field set after the object was built (`sp.stop = [...]`, as vLLM's examples
        do) is checked and takes effect (stop strings, logit_bias keys, structured_outputs as a dict)."""
        params.__post_init__()
        lim = self.config.limits
        if params.n > lim.max_n:
            raise ParamError(
                "n",
                f"n={params.n} is more than the engine's limit of {lim.max_n} samples a request (engine option max_n)",
            )
        if len(params.stop_list) > lim.max_stop:
            raise ParamError("stop", f"{len(params.stop_list)} stop strings is more than the limit of {lim.max_stop}")
        longest = max((len(x) for x in params.stop_list), default=0)
        if longest > lim.max_stop_len:
            raise ParamError(
                "stop", f"a stop string of {longest} characters is longer than the limit of {lim.max_stop_len}"
            )
        if len(params.stop_token_ids) > lim.max_stop_token_ids:
            raise ParamError(
                "stop_token_ids",
                f"{len(params.stop_token_ids)} stop_token_ids is more than the limit of {lim.max_stop_token_ids}",
            )
        vocab = self.config.model.arch.vocab_size
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ParamError("stop_token_ids", f"stop_token_ids must be token ids in [0, {vocab}) for this model")
        for name in ("logit_bias", "allowed_token_ids"):
            ids = getattr(params, name) or ()
            if any(not 0 <= t < vocab for t in ids):
                raise ParamError(name, f"{name}: token ids must be in [0, {vocab}) for this model")
            if len(ids) > vocab:
                raise ParamError(name, f"{name}: {len(ids)} token ids is more than this model's vocabulary ({vocab})")
        if len(params.bad_words or ()) > lim.max_stop:
            raise ParamError("bad_words", f"{len(params.bad_words)} bad_words is more than the limit of {lim.max_stop}")
        if params.min_tokens and params.structured_outputs is not None:
            raise ParamError(
                "min_tokens", "min_tokens cannot be combined with structured output (the grammar decides where it ends)"
            )
        self.structured_output_spec(params)  # a schema the library cannot compile: ParamError, with its reason
        groups = self.executor.kv_cache_info.groups
        groups = groups or (KVCacheGroup(None, tuple(range(self.config.model.arch.num_hidden_layers))),)
        check_kv_compression(params.kv_compression, self.config, groups)  # a press this engine cannot run: 400

    def structured_output_spec(self, params: SamplingParams):
        """The compiled grammar (scheduler_output.GrammarSpec) of params.structured_outputs, None without one;
        ParamError where it cannot be compiled. Cached by the schema's text, so a second call costs a lookup."""
        constrained = "structured_outputs" if params.structured_outputs is not None else None
        constrained = constrained or ("token_healing" if params.token_healing else None)
        if constrained and not (Path(self.config.model.tokenizer) / "tokenizer.json").is_file():
            raise ParamError(constrained, f"{constrained} needs the tokenizer's tokenizer.json (a fast tokenizer)")
        return self.grammars.spec(params)

    def enqueue(
        self, request_id: str, prepared: PreparedPrompt, params: SamplingParams, arrival_time: float | None = None
    ) -> None:
        """Queue a prompt that prepare() accepted, as params.n sequences (arrival_time: perf_counter seconds)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        text, ids, max_tokens = prepared.text, prepared.token_ids, prepared.max_tokens
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        if params.min_tokens or params.bad_words:  # (the logits processors' token ids, for the workers' samplers)
            params = replace(
                params,
                min_tokens_stop_ids=tuple(sorted(stop_ids)) if params.min_tokens else (),
                bad_words_token_ids=self._bad_words_token_ids(params.bad_words) if params.bad_words else None,
            )
        grammar = self.structured_output_spec(params)
        if prepared.healed:  # the output must start with the text taken off the prompt, then anything
            grammar = self.grammars.compile(StructuredOutputsParams(regex=_starts_with(prepared.healed)))
        if grammar is not None:  # the grammar allows EOS only where it accepts, and ends there (even with ignore_eos)
            stop_ids |= set(grammar.eos_token_ids)
        # (a consumer: what to load from the producer; a KVTransferError refuses the request, changing nothing)
        remote = self.kv_connector.check_request(params.kv_transfer_params, ids) if self.kv_connector else None
        if remote is not None:
            remote.users = params.n
        req = _Request(request_id, text, ids, params)
        if params.output_kind:
            req.shaper = OutputShaper(params.output_kind)
        speculate = self.config.scheduler.speculative_config is not None
        if arrival_time is not None:
            req.metrics.arrival_time = arrival_time
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        for i in range(params.n):
            sample_params = params.for_sample(i) if params.n > 1 else params
            if i > 0 and params.prompt_logprobs is not None:  # the prompt is scored once, by the first sample
                sample_params = replace(sample_params, prompt_logprobs=None)
            seq = Sequence(ids, max_tokens, sample_params, request_id=request_id)
            seq.stop_token_ids = frozenset(stop_ids)
            seq.structured_output = grammar
            seq.kv_transfer = remote
            seq.kv_compression = params.kv_compression  # its own press (None: the engine's), checked in prepare
            # Drafts are verified by sampling each of their rows alone: not with a grammar's masks (they advance a
            # matcher token by token) nor with logprobs (one entry a row). Those requests decode a token a step.
            seq.spec_decode = speculate and grammar is None and params.logprobs is None
            # A prefix-cache hit would skip the logits of the cached tokens: a scored prompt is computed whole.
            seq.skip_prefix_cache = sample_params.prompt_logprobs is not None
            req.samples.append(
                _Sample(
                    seq,
                    IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens, prepared.healed)
                    if params.detokenize
                    else None,
                    logprobs=[] if params.logprobs is not None else None,
                    discard=params.max_tokens == 0,
                )
            )
        self.requests[request_id] = req
        for s in req.samples:
            self.scheduler.add(s.seq)

    def _bad_words_token_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token spellings: the word as written (less leading spaces) and after a space, without
        special tokens; each distinct one once."""
        seqs: list[list[int]] = []
        for w in words:
            for text in (w.lstrip(), " " + w.lstrip()):
                ids = self.tokenizer.encode(_unicode_text(text, "bad_words"), add_special_tokens=False)
                if ids and ids not in seqs:
                    seqs.append(ids)
        return seqs

    def abort_request(self, request_id: str | list[str]) -> bool:
        """Stop a request and free its KV blocks at once. False when the id is unknown or already done. A list of
        ids (vLLM's LLMEngine.abort_request takes one) stops each of them: True when any was running."""
        if not isinstance(request_id, str) and isinstance(request_id, Iterable):
            return any([self.abort_request(str(r)) for r in request_id])
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        for s in req.samples:
            self.scheduler.finish(s.seq, SequenceStatus.FINISHED_ABORTED)
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prompt prefixes that no running request holds (vLLM's name). True when nothing cached
        is left: no request holds blocks."""
        self.block_manager.reset_prefix_cache()
        return not self.requests

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def get_num_unfinished_requests(self) -> int:
        """Requests added and not yet finished or aborted (vLLM's LLMEngine name)."""
        return len(self.requests)

    def get_tokenizer(self):
        """The engine's tokenizer (vLLM's LLMEngine name)."""
        return self.tokenizer

    def release_kv_transfer(self, transfer_id: str) -> bool:
        """A producer's lease that no consumer will load (the router saw the decode side refuse the request): its
        blocks are freed now, not when the lease runs out. False where there is no such lease."""
        if self.kv_connector is None or not self.kv_connector.release(transfer_id):
            return False
        self.scheduler.release_kv_transfers()
        return True

    def poll_kv_transfers(self) -> None:
        """Free the blocks a KV connector released (a producer's confirmed or expired leases); steps do it too, an
        idle server calls this between them."""
        self.scheduler.release_kv_transfers()

    # ---- one step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the current state of every request that progressed."""
        batch = self.scheduler.schedule()
        if batch.is_empty:
            if self.kv_connector is not None and self.kv_connector.holds_blocks():
                time.sleep(0.002)  # a producer's leases hold the blocks the queue needs: they end by confirm or expiry
                return []
            assert not self.scheduler.has_unfinished(), "scheduler made no progress with requests pending"
            return []
        try:
            return self._run_batch(batch)
        except Exception as e:  # (the step's requests are the caller's to abort: AsyncLLMEngine._step_failed)
            with contextlib.suppress(AttributeError, TypeError):
                setattr(e, STEP_REQUESTS, list(dict.fromkeys(s.request_id for s in batch.seqs)))
            raise

    def _run_batch(self, batch) -> list[RequestOutput]:
        """step()'s work on the scheduled batch: the model, then each request's new tokens and outputs."""
        started = time.perf_counter()
        for seq in batch.seqs:
            req = self.requests.get(seq.request_id)
            if req is not None and req.metrics.scheduled_time is None:
                req.metrics.scheduled_time = started
        self.num_prefill_tokens += sum(
            max(0, min(s.num_computed_tokens + n, s.num_prompt_tokens) - s.num_computed_tokens)
            for s, n in zip(batch.seqs, batch.num_scheduled_tokens)
        )
        scheduled = self.scheduler.scheduler_output(batch)
        out = self.executor.execute_model(scheduled)
        if self.kv_connector is not None and out.kv_finished is not None:
            self.kv_connector.update_finished(*out.kv_finished)
        if self.kv_connector is not None and scheduled.kv_connector_metadata is not None:
            failed = out.kv_load_failed or []
            self.kv_connector.after_step(scheduled.kv_connector_metadata, failed)
            loads = scheduled.kv_connector_metadata.loads
            self.num_prefill_tokens += sum(x.num_loaded_tokens for x in loads if x.req_id in set(failed))
        self.scheduler.update(batch, out.token_ids, out.num_accepted)
        if out.draft_token_ids is not None:  # a draft model's drafts for the next step
            self.scheduler.keep_proposals(batch, out.draft_token_ids)
        self.num_steps += 1
        now = time.perf_counter()
        touched: dict[str, _Request] = {}
        for seq, scored in zip(batch.seqs, out.prompt_logprobs or ()):
            req = self.requests.get(seq.request_id)
            if scored is not None and req is not None and req.prompt_logprobs is not None:
                first, entries = scored  # (a recomputed prefill scores the same tokens again: overwrite them)
                for j, (value, top, *rank) in enumerate(entries):
                    token = req.prompt_token_ids[first + j]
                    req.prompt_logprobs[first + j] = Logprob(token, value, top, *rank, decode=self._decode_one)
        for seq, new, lp in zip(batch.seqs, batch.new_token_ids, out.logprobs):
            req = self.requests.get(seq.request_id)
            if not new or req is None:
                continue
            touched[req.request_id] = req
            req.metrics.last_token_time = now
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
                req.metrics.num_cached_tokens = seq.num_cached_tokens
            sample = next(s for s in req.samples if s.seq is seq)
            for k, token in enumerate(new):
                last = k == len(new) - 1
                self._on_new_token(sample, token, lp if last else None, req.params, last)
                if sample.stop_reason is not None and not last:  # a stop string inside accepted drafts ends there
                    del seq.token_ids[len(seq) - (len(new) - 1 - k) :]
                    break
        outputs = []
        for req in touched.values():
            done = all(s.seq.is_finished for s in req.samples)
            if done:
                req.metrics.finished_time = now
                del self.requests[req.request_id]
            output = self._output(req, done)
            if req.shaper is not None and (output := req.shaper(output)) is None:
                continue
            outputs.append(output)
        return outputs

    def _decode_one(self, token: int) -> str:
        """One token's text, as the server's logprobs show it (Logprob's decoded_token, on first access)."""
        return self.tokenizer.decode([token])

    def _on_new_token(self, sample: _Sample, token: int, lp, params: SamplingParams, last: bool = True) -> None:
        """One token of the output, in order; `last`: the last one this step gave (only it can have finished seq)."""
        if sample.discard:
            return
        sample.num_tokens += 1
        self.num_generation_tokens += 1
        if sample.logprobs is not None and lp is not None:
            decode = self._decode_one if sample.detok is not None else None  # (detokenize=False: ids only)
            sample.logprobs.append(Logprob(token, lp[0], lp[1], lp[2] if len(lp) > 2 else None, decode))
        if sample.detok is None:  # detokenize=False: ids only (and no stop strings: the params refuse them)
            return
        seq = sample.seq
        ended = last and seq.is_finished
        stopped_by_token = ended and seq.status is SequenceStatus.FINISHED_STOPPED and token in seq.stop_token_ids
        # Like a stop string, a stop token's own text stays out of the output unless asked for.
        delta = "" if stopped_by_token and not params.include_stop_str_in_output else sample.detok.add(token)
        if ended:
            delta += sample.detok.flush()
        if not delta or sample.stop_reason is not None:
            return
        sample.text += delta
        if params.stop_list and sample.num_tokens > params.min_tokens:
            hit = find_stop(sample.text, len(delta), params.stop_list)
            if hit is not None:
                idx, stop = hit
                sample.text = sample.text[: idx + len(stop)] if params.include_stop_str_in_output else sample.text[:idx]
                sample.stop_reason = stop
                if sample.seq.is_finished:  # it also hit max_tokens or EOS on this token; the stop string wins
                    sample.seq.status = SequenceStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(sample.seq, SequenceStatus.FINISHED_STOPPED)

    def _output(self, req: _Request, finished: bool) -> RequestOutput:
        completions = []
        for i, s in enumerate(req.samples):
            seq = s.seq
            reason = seq.status.value if seq.is_finished else None
            stop_reason = s.stop_reason
            if s.discard and reason is not None and reason != "abort":
                reason = "length"  # (max_tokens=0: no token was asked for)
            elif reason == "stop" and stop_reason is None and seq.output_token_ids:
                # one of the request's stop_token_ids (the model's own end-of-sequence token: None, as in vLLM)
                last_token = seq.output_token_ids[-1]
                stop_reason = last_token if last_token in req.params.stop_token_ids else None
            text = s.text
            if req.params.stop_list and not seq.is_finished:
                # Hold back what could be the start of a stop string, so streamed text never has to be retracted.
                hold = max(len(stop) for stop in req.params.stop_list) - 1
                text = text[: max(len(text) - hold, 0)]
            completions.append(
                CompletionOutput(
                    i,
                    text,
                    [] if s.discard else list(seq.output_token_ids),
                    reason,
                    stop_reason,
                    list(s.logprobs) if s.logprobs is not None else None,
                )
            )
        prompt_logprobs = list(req.prompt_logprobs) if req.prompt_logprobs is not None else None
        transfer = next((s.seq.kv_transfer_params for s in req.samples if s.seq.kv_transfer_params), None)
        return RequestOutput(
            req.request_id,
            req.prompt,
            req.prompt_token_ids,
            completions,
            finished,
            req.metrics,
            None,
            prompt_logprobs,
            transfer,
        )

    # ---- introspection ---------------------------------------------------------------------------
    def measure_host_cost(self, response_of=None, seqs: int = 4, tokens: int = 128, logprobs: int = 5) -> HostCost:
        """Measure (tracemalloc) the host bytes a request holds: its samples' token ids, detokenizer, text and
        logprob entries, the final RequestOutput, and what response_of(output) keeps (the server's response body).

        Built from the engine's own structures with token ids spread over the vocabulary, outside the scheduler.
        """
        import random
        import tracemalloc

        vocab = self.config.model.arch.vocab_size
        block_size = self.config.cache.block_size
        rng = random.Random(0)
        pool_tokens: list[tuple[int, ...]] = []

        def held(num_tokens: int, k: int | None) -> int:
            params = SamplingParams(n=seqs, max_tokens=num_tokens, logprobs=k)
            prompt = [rng.randrange(vocab)]
            before = tracemalloc.get_traced_memory()[0]
            req = _Request("measure", None, prompt, params)
            for _ in range(seqs):
                seq = Sequence(prompt, num_tokens, params, request_id="measure")
                sample = _Sample(
                    seq, IncrementalDetokenizer(self.tokenizer, prompt, True), logprobs=[] if k is not None else None
                )
                for _ in range(num_tokens):
                    token = rng.randrange(vocab)
                    seq.append_token(token)
                    sample.text += sample.detok.add(token)
                    if k is not None:
                        top = [(rng.randrange(vocab), -rng.random()) for _ in range(k)]
                        sample.logprobs.append(Logprob(token, -rng.random(), top))
                # The block table, the chained hashes and the token tuples the pool keeps for the prefix cache.
                for j in range(len(seq) // block_size):
                    seq.block_table.append(j)
                    pool_tokens.append(tuple(seq.token_ids[j * block_size : (j + 1) * block_size]))
                    seq.block_hashes.append(hash((seq.block_hashes[-1] if j else None, pool_tokens[-1])))
                seq.status = SequenceStatus.FINISHED_LENGTH
                req.samples.append(sample)
            out = self._output(req, True)
            kept = response_of(out) if response_of is not None else None
            size = tracemalloc.get_traced_memory()[0] - before
            del req, out, kept
            pool_tokens.clear()
            return size

        was_tracing = tracemalloc.is_tracing()
        if not was_tracing:
            tracemalloc.start()
        try:
            short, full = held(tokens // 2, None), held(tokens, None)
            with_lp = held(tokens, logprobs)
        finally:
            if not was_tracing:
                tracemalloc.stop()
        per_token = max(full - short, 0) / (seqs * (tokens - tokens // 2))
        per_seq = max(full / seqs - tokens * per_token, 0.0)
        per_logprob = max(with_lp - full, 0) / (seqs * tokens * (1 + logprobs))
        return HostCost(per_seq=per_seq, per_token=per_token, per_logprob=per_logprob)

    def _by_label(self, per_group: list[int]) -> list[int]:
        """Per-group counts summed over the groups of each kind (label), in the labels' order."""
        sums = dict.fromkeys(self._kv_group_labels_once, 0)
        for label, value in zip(self._kv_group_labels, per_group):
            sums[label] += value
        return list(sums.values())

    def stats(self) -> dict:
        bm = self.block_manager
        return {
            "num_running": self.scheduler.num_running,
            "num_waiting": self.scheduler.num_waiting,
            "kv_blocks_total": bm.num_blocks,
            "kv_blocks_free": bm.num_free_blocks,
            # per kind of KV cache group (full attention, each sliding window; a kind cut into several equal groups
            # counts once, its groups' blocks summed): its label and the blocks sequences hold in it
            "kv_groups": list(zip(self._kv_group_labels_once, self._by_label(bm.blocks_used_by_group))),
            # how many groups each kind is cut into (each holds the same blocks: tokens = blocks x size / this)
            "kv_group_counts": [self._kv_group_labels.count(label) for label in self._kv_group_labels_once],
            # the int4 tier (kv_int4_after): per kind, the int4 blocks held (two blocks' tokens each), and the packs
            "kv_int4_blocks": self._by_label(bm.int4_blocks_by_group),
            "kv_int4_packs": bm.num_int4_packs,
            "kv_block_size": bm.block_size,
            "prefix_cache_hit_rate": bm.prefix_hit_rate,
            "prefix_cache_queries": bm.prefix_queries,  # (prompt tokens looked up, and found: vLLM's counters)
            "prefix_cache_hits": bm.prefix_hits,
            "num_preemptions": self.scheduler.num_preemptions,
            "spec_decode_num_drafts": self.scheduler.num_drafts,
            "spec_decode_num_draft_tokens": self.scheduler.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.scheduler.num_accepted_tokens,
            "prefill_tokens_computed": self.num_prefill_tokens,
            "generation_tokens": self.num_generation_tokens,
            # name -> (value, kind, help) of the KV connector's counters (prefill/decode disaggregation)
            "kv_transfer": self.kv_connector.stats() if self.kv_connector is not None else {},
        }


def _starts_with(text: str) -> str:
    """A regex of every string that starts with `text` (each character escaped by its code point)."""
    return "".join(c if c.isalnum() and c.isascii() else f"\\x{{{ord(c):x}}}" for c in text) + r"[\s\S]*"


# apply_chat_template's own arguments, which chat_template_kwargs may not set
_TEMPLATE_ARGS = frozenset(
    {
        "conversation",
        "chat_template",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def check_request_options(lora_request=None, priority=0) -> None:
    """vLLM's per-request lora_request and priority: refused by name unless unset (no LoRA adapters here, first come
    first served)."""
    if lora_request is not None:
        raise NotImplementedError("lora_request: LoRA adapters are not supported (merge the adapter into the weights)")
    if priority:
        raise ValueError("priority: requests are served first come first served here (no priority scheduling)")


def _token_ids(value) -> list:
    """A prompt's token ids as a list, each integer (numpy's, torch's too) a Python int; a 1-D numpy array or torch
    tensor is taken as its list. What is not an integer is left for prepare() to refuse by position."""
    if not isinstance(value, list) and callable(getattr(value, "tolist", None)):
        value = value.tolist()
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise ValueError(f"prompt_token_ids must be a list of token ids, not {type(value).__name__}")
    return [int(t) if isinstance(t, numbers.Integral) and not isinstance(t, bool) else t for t in value]


def _template_message(message, content_format: str = "string") -> dict:
    """An OpenAI chat message as chat templates read it, as vLLM hands it to them: text parts' texts joined by newlines
    (content_format "openai": the parts as they are), None or no content as "", a tool call's arguments as a dict.
    The message's other keys are kept. A ValueError for what is not a message or a part that is not text."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"each chat message must be a dict with 'role' and 'content', got {message!r}")
    if "content" not in message and not message.get("tool_calls"):
        raise ValueError(f"each chat message must be a dict with 'role' and 'content', got {message!r}")
    out = dict(message)
    content = out.get("content")
    if content is None:
        out["content"] = ""
    elif isinstance(content, list):
        texts = []
        for part in content:
            kind = part.get("type", "text") if isinstance(part, dict) else None
            if kind not in ("text", "input_text") or not isinstance(part.get("text"), str):
                raise ValueError(
                    f"a message's content part must be text ({{'type': 'text', 'text': ...}}), got {part!r}: this "
                    "engine serves text-only models"
                )
            texts.append(part["text"])
        if content_format != "openai":
            out["content"] = "\n".join(texts)
    if isinstance(out.get("tool_calls"), list):
        calls = []
        for call in out["tool_calls"]:
            fn = call.get("function") if isinstance(call, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
                try:
                    call = {**call, "function": {**fn, "arguments": json.loads(fn["arguments"])}}
                except json.JSONDecodeError:
                    pass
            calls.append(call)
        out["tool_calls"] = calls
    return out


def _unicode_text(text: str, param: str = "prompt") -> str:
    """text, where it is valid Unicode; a lone surrogate is a ParamError naming where it is."""
    at = lone_surrogate(text)
    if at is not None:
        raise ParamError(
            param,
            f"{param} is not valid Unicode text: a lone surrogate {text[at]!r} at character {at} (half of a UTF-16 "
            "pair); send whole characters",
        )
    return text
