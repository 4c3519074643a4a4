"""Speculative decoding's n-gram proposer (vLLM's "ngram" method, prompt lookup). Pure Python.

For a decoding sequence it finds the longest suffix of prompt_lookup_min .. prompt_lookup_max tokens that occurred
earlier in the sequence (prompt + output), takes the earliest such occurrence, and proposes the tokens that followed
it there (up to k; fewer where the sequence ends first, none without a match). The earliest occurrence has the most
tokens after it, and in a loop or a copied passage it is the start of what repeats.

Each sequence keeps an index (`NgramIndex`, on `Sequence.ngram_index`) from every n-gram of its tokens to where it
first ended, grown only by the tokens appended since the last call: a step costs O(new tokens x n-gram sizes) per
sequence, not a scan of its length. Tokens are only ever appended to a running sequence (a preempted one keeps them),
so the index never goes stale.
"""

from __future__ import annotations

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
