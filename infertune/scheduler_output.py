"""The plain-data contract between the engine and its workers: what one step schedules (vLLM v1's SchedulerOutput).

A request (one sequence) is sent whole once, the first step it is scheduled (`NewRequest`: its tokens, sampling
params, blocks); after that each step sends only what changed (`CachedRequest`: new block ids, computed count).
A worker keeps its own per-request state (runner/request_state.py), appends the tokens it samples itself, and
forgets the requests in `finished_req_ids` (finished, aborted or preempted; a preempted one comes back later as
a NewRequest with the tokens it had). Everything here is picklable plain data, so a worker can live in another
process. It sits at the bottom of the layering because the engine, the executors and the runner all read it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infertune.sampling_params import SamplingParams


class TokenView:
    """Prompt / output views of `token_ids` (prompt first), for the engine's Sequence and a worker's RequestState."""

    __slots__ = ()
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class NewRequest:
    req_id: str
    token_ids: list[int]  # prompt + the outputs it already has (non-empty after a preemption: recomputed)
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hits)
    # The grammar its output must match (structured output), None if unconstrained. The worker builds a matcher
    # from it and advances it by the outputs already in token_ids (after a preemption) and by each token sampled.
    structured_output: GrammarSpec | None = None


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """A compiled, validated structured-output grammar as plain data (docs/structured-output.md)."""

    key: str  # what it was compiled from (kind, options, schema text): the workers' cache key
    grammar: str  # the library's grammar (llguidance's serialized form), already validated by the engine
    eos_token_ids: tuple[int, ...]  # the tokens that end the output once the grammar accepts


@dataclass(slots=True)
class CachedRequest:
    req_id: str
    new_block_ids: list[int]  # appended to the worker's block table, after it is cut to num_kept_blocks
    num_computed_tokens: int
    # How many of the blocks sent before the request still holds: all of them, but where speculative decoding gave
    # back the blocks that only rejected drafts used.
    num_kept_blocks: int


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    # The step's requests in batch order with their new tokens; a worker answers one sampled token (or None) each.
    req_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # forget these before running the step
    # Speculative decoding: req_id -> the draft tokens that follow its last token in this step (its scheduled tokens
    # are that token plus them); the worker answers the drafts it accepted and one token after them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
