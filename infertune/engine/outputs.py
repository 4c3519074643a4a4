"""What the engine hands back: RequestOutput with one CompletionOutput per sample (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, replace


class TokenLogprob:
    """One token's entry in a position's logprobs (vLLM's `Logprob`): its logprob, its rank in the vocabulary (1: the
    most likely; None where the engine did not compute it) and its text (decoded on first access)."""

    __slots__ = ("logprob", "rank", "_token_id", "_decode", "_text")

    def __init__(self, logprob: float, rank: int | None, token_id: int, decode=None) -> None:
        self.logprob, self.rank, self._token_id, self._decode, self._text = logprob, rank, token_id, decode, None

    @property
    def decoded_token(self) -> str | None:
        if self._text is None and self._decode is not None:
            self._text = self._decode(self._token_id)
        return self._text

    def __eq__(self, other) -> bool:
        return isinstance(other, TokenLogprob) and (self.logprob, self.rank) == (other.logprob, other.rank)

    __hash__ = None

    def __repr__(self) -> str:
        return f"Logprob(logprob={self.logprob!r}, rank={self.rank!r}, decoded_token={self.decoded_token!r})"


class Logprob(dict):
    """The logprobs of one position of an output (or a prompt): the chosen token's (`token_id`, `logprob`, `rank`)
    and the `top` k alternatives, best first ([(token, logprob)]; the chosen token may or may not be among them).
    It is also vLLM's shape, a dict token id -> TokenLogprob (logprob, rank, decoded_token) holding the top k and the
    chosen token, so code written for vLLM's `output.logprobs[i][token_id].logprob` runs unchanged. decode: a
    function token id -> text for decoded_token (the engine's tokenizer; None: decoded_token is None)."""

    __slots__ = ("token_id", "logprob", "top", "rank")

    def __init__(self, token_id: int, logprob: float, top=(), rank: int | None = None, decode=None) -> None:
        self.token_id, self.logprob, self.top, self.rank = token_id, logprob, list(top), rank
        super().__init__((t, TokenLogprob(v, i + 1, t, decode)) for i, (t, v) in enumerate(self.top))
        if token_id not in self:
            self[token_id] = TokenLogprob(logprob, rank, token_id, decode)
        elif rank is None:
            self.rank = self[token_id].rank

    def __eq__(self, other) -> bool:
        if not isinstance(other, Logprob):
            return dict.__eq__(self, other)
        key = (self.token_id, self.logprob, self.top, self.rank)
        return key == (other.token_id, other.logprob, other.top, other.rank)

    __hash__ = None

    def __reduce__(self):  # (pickled without the decoder: decoded_token is None on the other side)
        return (Logprob, (self.token_id, self.logprob, self.top, self.rank))

    def __repr__(self) -> str:
        return f"Logprob(token_id={self.token_id!r}, logprob={self.logprob!r}, top={self.top!r}, rank={self.rank!r})"


class _Finished(int):
    """True or False (an int, as bool cannot be subclassed) that may also be called: vLLM's CompletionOutput.finished
    is a method, infertune's a property; both spellings read the same."""

    __slots__ = ()

    def __call__(self) -> bool:
        return bool(self)

    def __repr__(self) -> str:
        return repr(bool(self))


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[Logprob] | None = None
    # A DELTA output's running total of the sampled tokens' logprobs (its logprobs hold the new tokens' alone)
    logprob_total: float | None = None

    @property
    def finished(self) -> _Finished:
        """Whether this completion has ended: a bool that may also be called, `c.finished()` as vLLM's method."""
        return _Finished(self.finish_reason is not None)

    @property
    def cumulative_logprob(self) -> float | None:
        """The sum of the sampled tokens' logprobs so far (vLLM's field; None without logprobs)."""
        if self.logprob_total is not None:
            return self.logprob_total
        return None if self.logprobs is None else sum(lp.logprob for lp in self.logprobs)


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    scheduled_time: float | None = None  # first step that computed any of its tokens (queue time ends)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0
    last_token_time: float | None = None  # the step that gave the request its newest token (vLLM's name)

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    # vLLM's names of the same figures (its RequestMetrics: time_in_queue, first_scheduled_time; first_token_latency)
    @property
    def time_in_queue(self) -> float | None:
        return self.queue_time

    @property
    def first_scheduled_time(self) -> float | None:
        return self.scheduled_time

    @property
    def first_token_latency(self) -> float | None:
        return self.ttft


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request was rejected; the other requests of a batch still run
    # With SamplingParams.prompt_logprobs: one entry per prompt token, None for the first (nothing predicts it).
    prompt_logprobs: list[Logprob | None] | None = None
    # A producer's answer for a consumer (prefill/decode disaggregation), once finished: see SamplingParams.
    kv_transfer_params: dict | None = None

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens served from the prefix cache (vLLM's field; also metrics.num_cached_tokens)."""
        return self.metrics.num_cached_tokens if self.metrics is not None else 0

    @classmethod
    def rejected(cls, request_id: str, prompt: object, error: str) -> RequestOutput:
        text = prompt if isinstance(prompt, str) else None
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else None
        ids = list(ids) if isinstance(ids, (list, tuple)) else []
        return cls(request_id, text, ids, [CompletionOutput(0, "", [], "error")], True, error=error)


class OutputShaper:
    """One request's outputs as its SamplingParams.output_kind asks (vLLM's RequestOutputKind, 0 / 1 / 2), made from
    the engine's cumulative ones: CUMULATIVE as they are; FINAL_ONLY the finished one alone (None for the others);
    DELTA what each completion added since the last output (its new text, token ids and logprobs; only the
    completions that advanced or finished), the prompt's logprobs in the first output alone; None when nothing did."""

    __slots__ = ("kind", "_sent", "_first")

    def __init__(self, kind: int) -> None:
        self.kind = int(kind)
        self._sent: dict[int, tuple[int, int, bool]] = {}  # completion index -> (tokens, characters, finished)
        self._first = True

    def __call__(self, out: RequestOutput) -> RequestOutput | None:
        if self.kind == 0:
            return out
        if self.kind == 2:
            return out if out.finished else None
        completions = []
        for c in out.outputs:
            tokens, chars, finished = self._sent.get(c.index, (0, 0, False))
            if finished or (len(c.token_ids) == tokens and len(c.text) == chars and not c.finished):
                continue
            self._sent[c.index] = (len(c.token_ids), len(c.text), c.finished)
            logprobs = None if c.logprobs is None else c.logprobs[tokens:]
            completions.append(
                replace(
                    c,
                    text=c.text[chars:],
                    token_ids=c.token_ids[tokens:],
                    logprobs=logprobs,
                    logprob_total=c.cumulative_logprob,
                )
            )
        if not completions and not out.finished:
            return None
        first, self._first = self._first, False
        return replace(out, outputs=completions, prompt_logprobs=out.prompt_logprobs if first else None)
