"""Structured output in the worker: one llguidance matcher per constrained request, the step's token masks as one
packed int32 bitmask [constrained rows, ceil(V / 32)], applied to the logits with torch ops (no Python loop over
the vocabulary).

Each step: `begin_step` forgets finished / preempted requests, builds a matcher for each new constrained one and
advances it by the outputs it already has (a preempted request comes back as new with its tokens: its matcher is
rebuilt from them), then starts filling the masks of the rows that sample, in a thread (llguidance releases the
GIL) while the forward runs; `StepMask.apply` (in the sampler) waits for them. `accept` advances each matcher by
its sampled token. Where a grammar has terminated only its EOS tokens are allowed, so the sequence stops there;
EOS is allowed only where the grammar accepts.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from infertune.runner.grammar import MatcherCache
from infertune.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)

_SHIFTS = torch.arange(32, dtype=torch.int32)


def bitmask_width(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, W] int32 (bit j of word w: token 32 w + j allowed) -> [R, vocab_size] bool; tokens past 32 W are off."""
    r, w = bitmask.shape
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1  # [R, W, 32]
    allowed = bits.view(r, w * 32).bool()
    if w * 32 >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.cat([allowed, allowed.new_zeros(r, vocab_size - w * 32)], dim=1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
    """logits [N, V] with the disallowed tokens of `rows` (all rows if None; bitmask row k is rows[k]) at -inf."""
    n, vocab = logits.shape
    bitmask = bitmask.to(logits.device)
    if rows is None or len(rows) == n and rows == list(range(n)):
        return logits.masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    out = logits.clone()
    out[idx] = logits[idx].masked_fill(~unpack_bitmask(bitmask, vocab), float("-inf"))
    return out


class StepMask:
    """The step's masks, maybe still being filled: `rows` (indices into the sampled rows) and their bitmask."""

    def __init__(self, rows: list[int], bitmask: torch.Tensor, pending: Future | None) -> None:
        self.rows, self._bitmask, self._pending = rows, bitmask, pending
        self.wait_s = 0.0  # how long apply() waited for the fill (0 where it was done before the forward ended)

    @property
    def bitmask(self) -> torch.Tensor:
        if self._pending is not None:
            import time

            t0 = time.perf_counter()
            self._pending.result()
            self.wait_s = time.perf_counter() - t0
            self._pending = None
        return self._bitmask

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return apply_token_bitmask(logits, self.bitmask, self.rows)


class StructuredOutputs:
    """The worker's matchers, by request id (plain data in, plain data out: the runner's per-request state)."""

    def __init__(self, tokenizer_path: str, vocab_size: int, overlap: bool | None = None) -> None:
        self.cache = MatcherCache(tokenizer_path, vocab_size)
        self.matchers: dict[str, object] = {}
        self.eos: dict[str, tuple[int, ...]] = {}
        # Fill masks in a thread while the forward runs (INFERTUNE_MASK_OVERLAP=0: fill before the forward).
        self.overlap = os.environ.get("INFERTUNE_MASK_OVERLAP", "1") != "0" if overlap is None else overlap
        self._pool: ThreadPoolExecutor | None = None
        self._executor = None  # llguidance.LLExecutor: fills several rows in parallel
        self._width: int | None = None

    def __len__(self) -> int:
        return len(self.matchers)

    def begin_step(self, out: SchedulerOutput, sampled_req_ids: list[str]) -> StepMask | None:
        for req_id in out.finished_req_ids:
            self.matchers.pop(req_id, None)
            self.eos.pop(req_id, None)
        for new in out.new_requests:
            spec = new.structured_output
            if spec is None:
                continue
            matcher = self.cache.matcher(spec)
            if self._width is None:
                self._width = bitmask_width(self.cache.tokenizer(spec).vocab_size)
            outputs = new.token_ids[new.num_prompt_tokens :]
            if outputs and not matcher.consume_tokens(outputs):  # recomputed after a preemption
                log.error(
                    "structured output: %s's outputs do not match its grammar: %s", new.req_id, matcher.get_error()
                )
            self.matchers[new.req_id] = matcher
            self.eos[new.req_id] = spec.eos_token_ids
        if not self.matchers:
            return None
        rows = [i for i, req_id in enumerate(sampled_req_ids) if req_id in self.matchers]
        if not rows:
            return None
        matchers = [(self.matchers[sampled_req_ids[i]], k) for k, i in enumerate(rows)]
        eos = [self.eos[sampled_req_ids[i]] for i in rows]
        bitmask = torch.empty(len(rows), self._width, dtype=torch.int32)
        if not self.overlap:
            self._fill(matchers, eos, bitmask)
            return StepMask(rows, bitmask, None)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="infertune-masks")
        return StepMask(rows, bitmask, self._pool.submit(self._fill, matchers, eos, bitmask))

    def _fill(self, matchers: list, eos: list[tuple[int, ...]], bitmask: torch.Tensor) -> None:
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(max(1, min(4, os.cpu_count() or 1)))
        n, w = bitmask.shape
        self._executor.unsafe_compute_mask_ptr(matchers, bitmask.data_ptr(), w * 4, n)
        # A matcher that allows nothing (in an error state, or a grammar with no way to go on: the compiler refuses
        # those that cannot start) ends its row with EOS, said in the log (its output does not complete the grammar).
        empty = (bitmask == 0).all(dim=1)
        if bool(empty.any()):
            for k in empty.nonzero().flatten().tolist():
                why = matchers[k][0].get_error() if matchers[k][0].is_error() else "no token can continue it"
                log.warning("structured output: the grammar allows no next token (%s); the output ends here", why)
                for t in eos[k]:
                    bitmask[k, t // 32] |= _bit(t % 32)

    def accept(self, sampled_req_ids: list[str], tokens: list[int]) -> None:
        for req_id, token in zip(sampled_req_ids, tokens):
            matcher = self.matchers.get(req_id)
            if matcher is not None and not matcher.consume_token(token) and not matcher.is_stopped():
                log.error("structured output: %s: token %d rejected: %s", req_id, token, matcher.get_error())

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _bit(j: int) -> int:
    """Bit j of an int32 word, as the signed value torch stores (bit 31 is the sign)."""
    return (1 << j) - (1 << 32) if j == 31 else 1 << j
