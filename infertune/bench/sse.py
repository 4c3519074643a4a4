"""Incremental server-sent-events decoding and the text of one streamed OpenAI chunk."""

from __future__ import annotations

import codecs


class SSEDecoder:
    """Incremental server-sent-events decoder: feed() raw bytes as they arrive, get complete events.

    Returns (event type, data) pairs; the type is "message" unless an `event:` field set it. Handles
    UTF-8 characters and CRLF line ends split across reads, comments, multi-line data, `data:` with or
    without the space. A non-standard `error: ...` line (llama.cpp's server) is reported as an "error" event.
    """

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._buf = ""
        self._data: list[str] = []
        self._event = ""

    def feed(self, chunk: bytes) -> list[tuple[str, str]]:
        self._buf += self._utf8.decode(chunk)
        return self._drain(final=False)

    def close(self) -> list[tuple[str, str]]:
        """End of stream: decode what is left; a last event not ended by a blank line is still returned."""
        self._buf += self._utf8.decode(b"", final=True)
        events = self._drain(final=True)
        if self._buf:
            events += self._line(self._buf)
            self._buf = ""
        events += self._dispatch()
        return events

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        events: list[tuple[str, str]] = []
        buf, start = self._buf, 0
        while True:
            cr, lf = buf.find("\r", start), buf.find("\n", start)
            if cr < 0 and lf < 0:
                break
            if cr >= 0 and (lf < 0 or cr < lf):
                if cr + 1 == len(buf) and not final:
                    break  # a '\r' at the end may be the first half of '\r\n': wait for the next read
                end, nxt = cr, cr + 2 if buf.startswith("\n", cr + 1) else cr + 1
            else:
                end, nxt = lf, lf + 1
            events += self._line(buf[start:end])
            start = nxt
        self._buf = buf[start:]
        return events

    def _line(self, line: str) -> list[tuple[str, str]]:
        if line == "":
            return self._dispatch()
        if line.startswith(":"):
            return []  # comment / keep-alive
        name, sep, value = line.partition(":")
        if sep and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "error":
            return [("error", value)]
        return []

    def _dispatch(self) -> list[tuple[str, str]]:
        if not self._data:
            self._event = ""
            return []
        event = (self._event or "message", "\n".join(self._data))
        self._data, self._event = [], ""
        return [event]


def chunk_text(obj: dict) -> str:
    """The generated text in one streamed completions or chat chunk (all choices, reasoning included)."""
    parts = []
    for choice in obj.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        if isinstance(choice.get("text"), str):
            parts.append(choice["text"])
        delta = choice.get("delta")
        if isinstance(delta, dict):
            for key in ("reasoning_content", "reasoning", "content"):
                if isinstance(delta.get(key), str):
                    parts.append(delta[key])
    return "".join(parts)
