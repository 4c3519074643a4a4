"""Sequence: one generation stream's token ids, progress (num_computed_tokens) and KV block table. Pure Python."""

from __future__ import annotations

import enum
from itertools import count

from infertune.scheduler_output import TokenView


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            SequenceStatus.FINISHED_STOPPED,
            SequenceStatus.FINISHED_LENGTH,
            SequenceStatus.FINISHED_ABORTED,
        )


class Sequence(TokenView):
    """Tokens are prompt + output; the first num_computed_tokens of them have KV in the cache.

    The engine core reads only token ids, lengths and max_tokens; sampling details travel opaquely in `params`.
    """

    _ids = count()

    def __init__(
        self,
        prompt_token_ids: list[int],
        max_tokens: int,
        params: object = None,
        request_id: str | None = None,
        seq_id: int | None = None,
    ) -> None:
        assert prompt_token_ids, "an empty prompt must be rejected before it becomes a Sequence"
        self.seq_id = next(self._ids) if seq_id is None else seq_id
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.max_tokens = max_tokens
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at the last admission
        # One block table per KV cache group (layers grouped by sliding window: engine/kv_cache_coordinator.py);
        # block_table is the first group's, the only one of a model without windows.
        self.block_tables: list[list[int]] = [[]]
        self.block_hashes: list[int] = []  # chained hashes of the full blocks of token_ids (memo)
        self.num_hashed_blocks = 0  # leading blocks of block_table already offered to the prefix cache
        self.stop_token_ids: frozenset[int] = frozenset()
        self.num_preemptions = 0
        self.structured_output = None  # a scheduler_output.GrammarSpec where the output is constrained
        # Admit without prefix-cache hits: every prompt token is computed (prompt_logprobs need each one's logits).
        self.skip_prefix_cache = False
        # Speculative decoding: propose drafts for its decode steps (off where a request needs per-token grammar masks
        # or logprobs), the n-gram proposer's index of token_ids, and its acceptance and drafts (engine/spec_decode.py).
        self.spec_decode = False
        self.ngram_index = None
        self.spec_state = None
        # Prefill/decode disaggregation: what a consumer loads for it (the connector's RemoteKV, until admitted) and
        # what a producer answered when it finished (its kv_transfer_params, for the consumer).
        self.kv_transfer = None
        self.kv_transfer_params: dict | None = None
        # KV compression (engine/kv_cache_coordinator.py): per KV cache group, the tokens kept once this admission's
        # prefill is computed (None: no press), and the tokens' KV dropped since; a group holds the KV of
        # num_computed_tokens - num_evicted[g] tokens, so positions and cache slots part ways. Reset when freed.
        self.kv_kept: list[int] | None = None
        self.num_evicted: list[int] | None = None
        # The int4 tier (CacheConfig.kv_int4_after): per KV cache group, its table's leading int4 entries (two per
        # int4 block); None: none yet. Reset when freed.
        self.num_int4_entries: list[int] | None = None
        # Its own KV compression (a request's SamplingParams.kv_compression, a KVCompressionConfig), planned over the
        # engine's groups instead of the engine's kv_compression; None: the engine's.
        self.kv_compression = None

    @property
    def block_table(self) -> list[int]:
        return self.block_tables[0]

    @block_table.setter
    def block_table(self, table: list[int]) -> None:
        self.block_tables[0] = table

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, status={self.status.value}, len={len(self)}, "
            f"computed={self.num_computed_tokens}, blocks={self.block_table})"
        )
