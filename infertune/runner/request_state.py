"""A worker's own per-request state, kept up to date from each step's SchedulerOutput (plain data only)."""

from __future__ import annotations

from dataclasses import dataclass

from infertune.sampling_params import SamplingParams
from infertune.scheduler_output import SchedulerOutput, TokenView


@dataclass(slots=True)
class RequestState(TokenView):
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    # One block table per KV cache group (scheduler_output.KVCacheGroup); entries a windowed group freed keep their
    # old id (or are NULL_BLOCK): out of the window, no query reads them.
    block_tables: list[list[int]]
    num_computed_tokens: int
    # KV compression (kv_compression.py): per KV cache group, the tokens kept once the prefill (all of token_ids as
    # sent) is computed, None: no press; then the tokens evicted per group. Positions count every token
    # (num_computed_tokens), a group's cache slots num_computed_tokens - num_evicted[g]: they part ways here.
    kv_kept: list[int] | None = None
    num_evicted: list[int] | None = None
    press_queries: dict | None = None  # layer -> the prefill's last queries so far, while a SnapKV prefill runs
    kv_compression: object = None  # the request's own press (NewRequest.kv_compression); None: the engine's

    def slot_offsets(self) -> list[int]:
        """Per KV cache group, position - slot (the tokens compression dropped; 0 before or without it)."""
        return self.num_evicted or [0] * len(self.block_tables)

    @property
    def block_table(self) -> list[int]:
        """The first KV cache group's (the only one of a model without sliding windows)."""
        return self.block_tables[0]


class RequestStates:
    """req_id -> RequestState. `begin_step` applies a SchedulerOutput; `end_step` appends the accepted drafts and the
    sampled tokens."""

    def __init__(self) -> None:
        self.requests: dict[str, RequestState] = {}

    def begin_step(self, out: SchedulerOutput) -> list[tuple[RequestState, int, bool]]:
        """Apply out; return the step's (state, new tokens (drafts included), samples this step) in batch order."""
        for req_id in out.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in out.new_requests:
            assert new.req_id not in self.requests, f"request {new.req_id} sent as new twice"
            self.requests[new.req_id] = RequestState(
                list(new.token_ids),
                new.num_prompt_tokens,
                new.params,
                # (a windowed group's NULL_BLOCK entries, out of its window: block 0, a valid id no query reads)
                [[max(b, 0) for b in t] for t in (new.block_ids, *new.group_block_ids)],
                new.num_computed_tokens,
                new.kv_kept,
                kv_compression=new.kv_compression,
            )
        for cached in out.cached_requests:
            state = self.requests[cached.req_id]
            kept = [cached.num_kept_blocks, *cached.group_num_kept_blocks]
            for table, k, ids in zip(state.block_tables, kept, [cached.new_block_ids, *cached.group_new_block_ids]):
                del table[k:]
                table.extend(ids)
            state.num_computed_tokens = cached.num_computed_tokens
        step = []
        for req_id, n in zip(out.req_ids, out.num_scheduled_tokens):
            state = self.requests[req_id]
            num_drafts = len(out.scheduled_spec_decode_tokens.get(req_id, ()))
            step.append((state, n, state.num_computed_tokens + n - num_drafts == len(state.token_ids)))
        return step

    def end_step(
        self,
        step: list[tuple[RequestState, int, bool]],
        sampled: list[int | None],
        drafts: list[list[int]] | None = None,
        num_accepted: list[int] | None = None,
    ) -> None:
        """Per entry: its accepted drafts (the first num_accepted of its drafts) and its sampled token are appended;
        the rejected drafts' KV does not count as computed."""
        for i, ((state, n, _), token) in enumerate(zip(step, sampled)):
            if drafts and drafts[i]:
                accepted = drafts[i][: num_accepted[i]]
                state.num_computed_tokens += n - len(drafts[i]) + len(accepted)
                state.token_ids.extend(accepted)
            else:
                state.num_computed_tokens += n
            if token is not None:
                state.token_ids.append(token)
