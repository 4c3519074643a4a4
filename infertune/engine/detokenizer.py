"""Incremental detokenization and stop-string matching for one output stream.

Each new token is decoded together with a few tokens before it, and only the text past what those
earlier tokens already produced is emitted; text ending in an incomplete UTF-8 character is held back
until the character completes.
"""

from __future__ import annotations

_CONTEXT_TOKENS = 4


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True, strip_prefix: str = ""
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        # Token healing: the output starts with the text taken off the prompt's end, which the caller already has.
        self.strip_prefix = strip_prefix
        # A little prompt context so the first output token keeps the leading space some tokenizers fold in.
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before) :]
        self.prefix_offset = max(self.read_offset - _CONTEXT_TOKENS, 0)
        self.read_offset = len(self.ids)
        return self._emit(delta)

    def _emit(self, delta: str) -> str:
        if self.strip_prefix:  # (the grammar made the output start with it: drop it as it comes)
            cut = min(len(self.strip_prefix), len(delta))
            self.strip_prefix, delta = self.strip_prefix[cut:], delta[cut:]
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of the stream: emit whatever is held back, incomplete characters included."""
        before = self._decode(self.ids[self.prefix_offset : self.read_offset])
        after = self._decode(self.ids[self.prefix_offset :])
        delta = after[len(before) :] if len(after) > len(before) else ""
        self.read_offset = len(self.ids)
        return self._emit(delta)


def find_stop(text: str, delta_len: int, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last delta_len characters: (start index, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        window_start = max(len(text) - delta_len - len(stop) + 1, 0)
        idx = text.find(stop, window_start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best
