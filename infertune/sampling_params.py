"""Per-request sampling parameters, validated on construction (temperature 0 means greedy)."""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field

from infertune.kv_compression import KVCompressionConfig


class RequestOutputKind(enum.IntEnum):
    """What a stream of a request's outputs carries (vLLM's names): CUMULATIVE each output the whole text and tokens
    so far; DELTA only what is new since the last one (each completion that advanced, the prompt's fields and
    prompt_logprobs in the first); FINAL_ONLY only the finished output. AsyncLLM.generate and LLMEngine.step honour
    it; LLM.generate returns the finished outputs whatever it says."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


_GREEDY_EPS = 1e-5
_INT_FIELDS = (
    "n",
    "top_k",
    "seed",
    "max_tokens",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "min_tokens",
)


def _integer(value) -> bool:
    """An int that is not a bool (True would pass isinstance(value, int))."""
    return isinstance(value, int) and not isinstance(value, bool)


class ParamError(ValueError):
    """An invalid sampling parameter; `param` names it (the server reports it in the error's "param")."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs returned with each sampled token
    # Logprobs of the prompt's own tokens (None for the first), each with this many top alternatives (vLLM's name).
    # With it, max_tokens=0 is allowed: the prompt is scored and nothing is generated.
    prompt_logprobs: int | None = None
    # vLLM's: keep only the prompt's last this many tokens (-1: max_model_len - 1, the most that leaves room for one
    # new token); the output's `prompt` is then None, as the kept tokens need not start on a character.
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's name: False leaves the outputs' text empty and returns the token ids alone, skipping the per-token
    # decode (offline runs that read ids, benchmarks: vLLM's own throughput bench sets it). Stop strings need text.
    detokenize: bool = True
    # vLLM's: True only (the tokenizer's decode spaces special tokens as it does; False is refused, not ignored).
    spaces_between_special_tokens: bool = True
    # vLLM's: free-form values for plugins and custom code reading the params; the engine carries them unread.
    extra_args: dict | None = None
    # Constrained decoding: a JSON schema, regex, choice, grammar or any JSON object (docs/structured-output.md).
    structured_outputs: StructuredOutputsParams | None = None
    # Token healing: the prompt's last token is taken off and the output must start with its text, so the model
    # picks the token boundary there itself (a prompt ending in a space or half a word no longer lands the model
    # on a boundary it never saw in training). The returned text continues the prompt as given; the first output
    # token may re-spell its end. Not with structured_outputs or prompt_logprobs.
    token_healing: bool = False
    # Prefill/decode disaggregation (infertune/kv_transfer/): {"do_remote_decode": True} asks a producer to keep the
    # prompt's KV for a consumer; what it answers ({"do_remote_prefill": True, ...}) tells a consumer what to load.
    kv_transfer_params: dict | None = None
    # KV compression for this request alone (kv_compression.py's forms, kvpress's names): a press, or a policy of
    # press rules by layer and prompt length; {"press": "none"} keeps its full KV. None: the engine's kv_compression.
    # Here rather than in an engine call because it is per request like the rest (it reaches the workers with the
    # params) and the OpenAI body's field of the same name maps onto it. Parsed into a KVCompressionConfig; what
    # the engine can do with it (its KV cache groups, the model's layers) is checked at admission.
    kv_compression: KVCompressionConfig | dict | None = None
    # -- logits processors (vLLM's and OpenAI's names), applied before the penalties (vLLM's and transformers' order);
    # logprobs stay the raw ones --
    # OpenAI's logit_bias: token id -> a bias in [-100, 100] added to its logit (-100 in effect bans it, 100 all but
    # forces it). JSON object keys arrive as strings and are taken as ints.
    logit_bias: dict[int, float] | None = None
    # No end-of-sequence or stop token (nor a stop string) before this many output tokens.
    min_tokens: int = 0
    # Only these tokens may be sampled.
    allowed_token_ids: list[int] | None = None
    # Words never to generate: the last token of each word's spellings (as is and after a space) is banned wherever
    # the output ends in the tokens before it. The engine tokenizes them (bad_words_token_ids, set at admission).
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    # Set by the server where max_tokens is the model's default (generation_config.json's max_new_tokens) rather than
    # the request's: capped to the room the prompt leaves in max_model_len, as vLLM does, instead of refused.
    max_tokens_is_default: bool = False
    # Set by the engine at admission: the tokens min_tokens holds back (end-of-sequence and stop_token_ids).
    min_tokens_stop_ids: tuple[int, ...] = ()
    # vLLM's: what AsyncLLM.generate / LLMEngine.step hand back for this request, whole outputs, deltas or the final
    # one alone (RequestOutputKind).
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    stop_list: tuple[str, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> ParamError:
            return ParamError(name, f"{name}={getattr(self, name)!r} is invalid: {rule}")

        # (numpy's and torch's integers, e.g. a max_tokens drawn with numpy, are Python ints here, as vLLM takes them)
        for name in _INT_FIELDS:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (int, bool)):
                setattr(self, name, int(value))
        if self.stop_token_ids is not None and callable(getattr(self.stop_token_ids, "tolist", None)):
            self.stop_token_ids = self.stop_token_ids.tolist()

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", "must be an integer >= 1")
        if not 0 <= self.temperature < float("inf"):  # written so that NaN fails too
            raise bad("temperature", "must be a finite number >= 0 (0 means greedy)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "must be in (0, 1]")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "must be 0 or -1 (disabled) or a positive integer")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "must be in [0, 1]")
        if not 0 < self.repetition_penalty < float("inf"):
            raise bad("repetition_penalty", "must be a finite number > 0 (1.0 disables it)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "must be in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "must be in [-2, 2]")
        # (a bool is an int to Python, and True reached the sampler's topk as k, failing the whole step)
        if self.prompt_logprobs is not None and (
            not _integer(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= 20
        ):
            raise bad("prompt_logprobs", "must be an integer in [0, 20]")
        least = 0 if self.prompt_logprobs is not None else 1
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < least):
            raise bad("max_tokens", "must be an integer >= 1 (0 only with prompt_logprobs: score the prompt alone)")
        if self.logprobs is not None and (not _integer(self.logprobs) or not 0 <= self.logprobs <= 20):
            raise bad("logprobs", "must be an integer in [0, 20]")
        t = self.truncate_prompt_tokens
        if t is not None and (not isinstance(t, int) or isinstance(t, bool) or not (t == -1 or t >= 1)):
            raise bad("truncate_prompt_tokens", "must be -1 (up to max_model_len - 1) or an integer >= 1")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "must be an integer")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stops):
            raise bad("stop", "must be a non-empty string or a list of non-empty strings")
        self.stop_list = tuple(stops)
        if not isinstance(self.detokenize, bool):
            raise bad("detokenize", "must be true or false")
        if stops and not self.detokenize:
            raise bad("detokenize", "must be true with stop strings (they are matched in the text)")
        self.stop_token_ids = [int(t) for t in (self.stop_token_ids or [])]
        if self.spaces_between_special_tokens is not True:
            raise bad(
                "spaces_between_special_tokens",
                "only true is supported (special tokens decode as the tokenizer spells them)",
            )
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise bad("extra_args", "must be a dict")
        if isinstance(self.output_kind, bool) or self.output_kind not in tuple(RequestOutputKind):
            raise bad("output_kind", "must be a RequestOutputKind (CUMULATIVE, DELTA or FINAL_ONLY)")
        self.output_kind = RequestOutputKind(self.output_kind)
        # -- structured output (docs/structured-output.md) --
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise bad("structured_outputs", "must be a StructuredOutputsParams (or a dict of its fields)")
        # -- end structured output --
        if self.token_healing and self.structured_outputs is not None:
            raise bad("token_healing", "cannot be combined with structured_outputs (both constrain the output)")
        if self.token_healing and self.prompt_logprobs is not None:
            raise bad("token_healing", "cannot be combined with prompt_logprobs (the healed prompt is one token short)")
        self._check_logits_processors(bad)
        if self.kv_transfer_params is not None and not isinstance(self.kv_transfer_params, dict):
            raise bad("kv_transfer_params", "must be a JSON object")
        if self.kv_compression is not None and not isinstance(self.kv_compression, KVCompressionConfig):
            try:
                self.kv_compression = KVCompressionConfig.from_dict(self.kv_compression)
            except ValueError as e:
                raise ParamError("kv_compression", str(e)) from None
        if self.kv_compression is not None and any(r.window is not None for r in self.kv_compression.rules):
            raise ParamError(
                "kv_compression",
                "kv_compression: a request cannot add window rules (sliding windows shape the engine's KV cache "
                "groups); put them in the engine's kv_compression, and send press rules only",
            )

    def _check_logits_processors(self, bad) -> None:
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise bad("logit_bias", "must be an object of token id -> bias")
            biases = {}
            for k, v in self.logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise ParamError("logit_bias", f"logit_bias: {k!r} is not a token id") from None
                if isinstance(v, bool) or not isinstance(v, (int, float)) or not -100.0 <= v <= 100.0:
                    raise ParamError("logit_bias", f"logit_bias: the bias of token {k} must be a number in [-100, 100]")
                biases[tid] = float(v)
            self.logit_bias = biases or None
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) or self.min_tokens < 0:
            raise bad("min_tokens", "must be an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        if self.allowed_token_ids is not None:
            if not isinstance(self.allowed_token_ids, (list, tuple)) or not self.allowed_token_ids:
                raise bad("allowed_token_ids", "must be a non-empty list of token ids")
            if any(isinstance(t, bool) or not isinstance(t, int) for t in self.allowed_token_ids):
                raise bad("allowed_token_ids", "must be a list of integer token ids")
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            if isinstance(self.bad_words, str) or any(not isinstance(w, str) or not w for w in self.bad_words):
                raise bad("bad_words", "must be a list of non-empty strings")
            self.bad_words = list(self.bad_words) or None
        self.min_tokens_stop_ids = tuple(int(t) for t in self.min_tokens_stop_ids)

    @property
    def adjusts_logits(self) -> bool:
        """Whether a logits processor (logit_bias, min_tokens, allowed_token_ids, bad words) touches this request's
        logits (runner/sampler.py apply_logits_processors)."""
        return bool(self.logit_bias or self.min_tokens or self.allowed_token_ids or self.bad_words_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS or self.top_k == 1

    @property
    def uses_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def clone(self) -> SamplingParams:
        """A deep copy (vLLM's name): changing it leaves this one as it is."""
        import copy

        return copy.deepcopy(self)

    def for_sample(self, index: int) -> SamplingParams:
        """The parameters of the index-th of n samples: n=1 and, when seeded, its own derived seed."""
        from dataclasses import replace

        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)


# ---- structured output (docs/structured-output.md) ---------------------------------------------------------------
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass(slots=True)
class StructuredOutputsParams:
    """What the output must match, vLLM's names: exactly one of json (a JSON schema, dict or text), regex, choice
    (a list of strings), grammar (Lark, or GBNF / EBNF as llama.cpp writes it) or json_object=True (any JSON
    object). The options shape JSON: disable_any_whitespace (compact JSON, no free whitespace),
    disable_additional_properties (objects without "additionalProperties" get false), whitespace_pattern (a regex
    for the whitespace JSON may have). structural_tag is vLLM's too, and refused here (not supported yet)."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if self.json_object is False:
            self.json_object = None
        given = [k for k in _STRUCTURED_KINDS if getattr(self, k) is not None]
        if len(given) != 1:
            raise ParamError(
                "structured_outputs",
                "structured_outputs needs exactly one of json, regex, choice, grammar, json_object"
                + (f"; got {', '.join(given)}" if given else ""),
            )
        if self.structural_tag is not None:
            raise ParamError("structured_outputs", "structural_tag is not supported; use json, regex or grammar")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ParamError("structured_outputs", "json must be a JSON schema: a dict or its JSON text")
        if self.regex is not None and not isinstance(self.regex, str):
            raise ParamError("structured_outputs", "regex must be a string")
        if self.grammar is not None and not isinstance(self.grammar, str):
            raise ParamError("structured_outputs", "grammar must be a string")
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice:
                raise ParamError("structured_outputs", "choice must be a non-empty list of strings")
            if any(not isinstance(c, str) for c in self.choice):
                raise ParamError("structured_outputs", "choice must be a list of strings")
            self.choice = list(self.choice)
        if self.json_object is not None and self.json_object is not True:
            raise ParamError("structured_outputs", "json_object must be true")

    @property
    def kind(self) -> str:
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) is not None)


# ---- end structured output ----------------------------------------------------------------------------------------
