"""Incremental detokenization and stop-string matching for one output stream.

Each new token is decoded together with a few tokens before it, and only the text past what those
earlier tokens already produced is emitted; text ending in an incomplete UTF-8 character is held back
until the character completes.

SentencePiece tokenizers with byte fallback (Llama 2, Mistral) spell rare characters as byte tokens (`<0xE4>`), and
their decoder turns a run of them into text only as a whole: a run that starts inside a character is invalid UTF-8,
and every token of it then decodes as U+FFFD. The few tokens of context therefore never start inside a character:
the window is moved back over byte tokens that continue one (at most 3 for valid UTF-8).
"""

from __future__ import annotations

import re
import weakref

_CONTEXT_TOKENS = 4
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
_byte_tokens_of: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def continuation_byte_tokens(tokenizer) -> frozenset[int]:
    """The ids of a byte-fallback tokenizer's byte tokens that continue a UTF-8 character (`<0x80>`..`<0xBF>`);
    empty for a tokenizer without all 256 byte tokens (byte-level BPE, whose decoder is not all-or-nothing)."""
    try:
        return _byte_tokens_of[tokenizer]
    except (KeyError, TypeError):
        pass
    try:
        vocab = tokenizer.get_vocab()
    except (AttributeError, NotImplementedError):
        vocab = {}
    byte_ids = {}
    for token, idx in vocab.items():
        m = _BYTE_TOKEN.fullmatch(token) if len(token) == 6 else None
        if m:
            byte_ids[int(m.group(1), 16)] = idx
    found = frozenset(i for b, i in byte_ids.items() if 0x80 <= b < 0xC0) if len(byte_ids) == 256 else frozenset()
    try:
        _byte_tokens_of[tokenizer] = found
    except TypeError:  # (not weak-referenceable: computed again next time)
        pass
    return found


def character_start(ids: list[int], start: int, continuation: frozenset[int]) -> int:
    """start, moved back over byte tokens that continue a character (at most 3: the longest UTF-8 character's)."""
    for _ in range(3):
        if start <= 0 or ids[start] not in continuation:
            break
        start -= 1
    return start


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True, strip_prefix: str = ""
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.continuation = continuation_byte_tokens(tokenizer)
        # Token healing: the output starts with the text taken off the prompt's end, which the caller already has.
        self.strip_prefix = strip_prefix
        # A little prompt context so the first output token keeps the leading space some tokenizers fold in.
        context = character_start(prompt_token_ids, max(len(prompt_token_ids) - _CONTEXT_TOKENS, 0), self.continuation)
        self.ids: list[int] = list(prompt_token_ids[context:])
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
        self.prefix_offset = character_start(self.ids, max(self.read_offset - _CONTEXT_TOKENS, 0), self.continuation)
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
