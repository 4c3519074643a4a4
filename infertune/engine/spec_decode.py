"""Speculative decoding's proposers (vLLM's "ngram" prompt lookup; a draft model's drafts) and adaptive K. Pure Python.

For a decoding sequence it finds the longest suffix of prompt_lookup_min .. prompt_lookup_max tokens that occurred
earlier in the sequence (prompt + output), takes the earliest such occurrence, and proposes the tokens that followed
it there (up to k; fewer where the sequence ends first, none without a match). The earliest occurrence has the most
tokens after it, and in a loop or a copied passage it is the start of what repeats.

Each sequence keeps an index (`NgramIndex`, on `Sequence.ngram_index`) from every n-gram of its tokens to where it
first ended, grown only by the tokens appended since the last call: a step costs O(new tokens x n-gram sizes) per
sequence, not a scan of its length. Tokens are only ever appended to a running sequence (a preempted one keeps them),
so the index never goes stale.

A draft model (method "draft_model") proposes in the worker (runner/draft_model.py): after a step, the worker drafts
the next step's tokens for each decoding sequence, and they come back with the step's output; `DraftModelProposer`
hands them to the scheduler at the next step.

`AdaptiveK` decides how many drafts a sequence carries (vLLM has K fixed): each sequence keeps an exponentially
decayed count of its drafts accepted and of the verifications that ended at a rejection, whose ratio estimates the
chance `a` that its next draft is accepted given the one before was. With d drafts a step then gives
1 + a + ... + a^d tokens in expectation, for 1 + draft_cost * d times a plain step's cost; the policy takes the d in
0..K with the most tokens per unit of cost. A sequence whose drafts stopped paying (d = 0) drafts one token every
probe_interval decode steps, so it resumes when its output starts to repeat. Every decision is a function of the
sequence's own history: greedy output stays that of plain decoding, and seeded sampling stays reproducible.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infertune.config import SpeculativeConfig
from infertune.engine.sequence import Sequence


class NgramIndex:
    """n -> {n-gram: the position of its last token where it first occurred}, over the first num_indexed positions."""

    __slots__ = ("first_end", "num_indexed")

    def __init__(self, sizes: range) -> None:
        self.first_end: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in sizes}
        self.num_indexed = 0


class NgramProposer:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens
        self.sizes = range(config.prompt_lookup_min, config.prompt_lookup_max + 1)

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k draft tokens to follow seq's last token ([] where its last tokens never occurred before)."""
        tokens = seq.token_ids
        index = seq.ngram_index
        if index is None:
            index = seq.ngram_index = NgramIndex(self.sizes)
        last = len(tokens) - 1
        # Index the n-grams that end before the last token: an earlier occurrence needs a token after it.
        for end in range(index.num_indexed, last):
            for n, table in index.first_end.items():
                if end + 1 >= n:
                    table.setdefault(tuple(tokens[end + 1 - n : end + 1]), end)
        index.num_indexed = max(index.num_indexed, last)
        for n in reversed(self.sizes):  # the longest match first
            if n > last:
                continue
            end = index.first_end[n].get(tuple(tokens[len(tokens) - n :]))
            if end is not None:
                return tokens[end + 1 : end + 1 + k]
        return []


class DraftModelProposer:
    """The drafts the worker's draft model proposed for seq after its last step (SpecDecodeState.proposal, set by
    Scheduler.keep_proposals)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.num_speculative_tokens = config.num_speculative_tokens

    def propose(self, seq: Sequence, k: int) -> list[int]:
        """Up to k of them; taken once, so that drafts never outlive the step they were proposed after."""
        state = seq.spec_state
        if state is None:
            return []
        drafts, state.proposal = state.proposal[:k], []
        return drafts


def make_proposer(config: SpeculativeConfig) -> NgramProposer | DraftModelProposer:
    return DraftModelProposer(config) if config.method == "draft_model" else NgramProposer(config)


@dataclass(slots=True)
class SpecDecodeState:
    """One sequence's speculation (on Sequence.spec_state): decayed counts of its drafts accepted and of its
    verifications that ended at a rejection, the decode steps since it last carried drafts, and (draft model) the
    drafts its worker proposed for its next step."""

    accepted: float
    rejections: float
    steps_without_drafts: int = 0
    proposal: list[int] = field(default_factory=list)


class AdaptiveK:
    """How many drafts each sequence carries: the d in 0..K that maximises expected tokens per unit of step cost."""

    # The prior: one accepted draft and no rejection, so a new sequence starts at K drafts and a few rejections
    # (3-5 steps at the defaults) take it to none.
    PRIOR_ACCEPTED = 1.0

    def __init__(self, config: SpeculativeConfig) -> None:
        self.k_max = config.num_speculative_tokens
        self.adaptive = config.adaptive
        self.cost = float(config.draft_cost)
        self.decay = float(config.acceptance_decay)
        self.probe_interval = config.probe_interval

    def state(self, seq: Sequence) -> SpecDecodeState:
        if seq.spec_state is None:
            seq.spec_state = SpecDecodeState(self.PRIOR_ACCEPTED, 0.0)
        return seq.spec_state

    @staticmethod
    def acceptance(state: SpecDecodeState) -> float:
        """The estimated chance that a draft is accepted, given the drafts before it were."""
        return state.accepted / (state.accepted + state.rejections)

    def best_k(self, a: float) -> int:
        """argmax over d in 0..K of (1 + a + ... + a^d) / (1 + cost * d); the smallest d on a tie."""
        best, best_value = 0, 1.0
        tokens, term = 1.0, 1.0
        for d in range(1, self.k_max + 1):
            term *= a
            tokens += term
            value = tokens / (1.0 + self.cost * d)
            if value > best_value * (1 + 1e-9):
                best, best_value = d, value
        return best

    def num_drafts(self, seq: Sequence) -> int:
        """How many drafts seq should carry at its next decode step. Pure: the same answer until record()."""
        if not self.adaptive:
            return self.k_max
        state = self.state(seq)
        k = self.best_k(self.acceptance(state))
        if k == 0 and state.steps_without_drafts >= self.probe_interval:
            return 1  # a probe: one draft, to notice when the output starts repeating
        return k

    def record(self, seq: Sequence, num_drafts: int, num_accepted: int) -> None:
        """After a decode step of seq that carried num_drafts drafts (0: none) and accepted the first num_accepted."""
        state = self.state(seq)
        if num_drafts == 0:
            state.steps_without_drafts += 1
            return
        assert 0 <= num_accepted <= num_drafts
        state.steps_without_drafts = 0
        state.accepted = self.decay * state.accepted + num_accepted
        state.rejections = self.decay * state.rejections + (num_accepted < num_drafts)
