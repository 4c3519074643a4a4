"""What the engine hands back: RequestOutput with one CompletionOutput per sample (vLLM's shapes)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    token_id: int
    logprob: float
    # The top-k alternatives at this step, best first (the sampled token may or may not be among them).
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error" | None while running
    stop_reason: str | int | None = None  # the stop string or stop token that ended it
    logprobs: list[Logprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    arrival_time: float
    scheduled_time: float | None = None  # first step that computed any of its tokens (queue time ends)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def queue_time(self) -> float | None:
        return None if self.scheduled_time is None else self.scheduled_time - self.arrival_time

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


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

    @classmethod
    def rejected(cls, request_id: str, prompt: object, error: str) -> RequestOutput:
        text = prompt if isinstance(prompt, str) else None
        ids = list(prompt.get("prompt_token_ids") or []) if isinstance(prompt, dict) else []
        return cls(request_id, text, ids, [CompletionOutput(0, "", [], "error")], True, error=error)
