"""OpenAI response and stream-chunk bodies built from RequestOutputs (completions and chat)."""

from __future__ import annotations

import json
import time

from infertune.engine.outputs import CompletionOutput, Logprob, RequestOutput


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Formatter:
    """Knows the request's id, model and tokenizer; renders choices, chunks and logprobs."""

    def __init__(self, request_id: str, model: str, tokenizer, chat: bool) -> None:
        self.id, self.model, self.tokenizer, self.chat = request_id, model, tokenizer, chat
        self.created = int(time.time())

    def _envelope(self, object_: str, choices: list[dict], usage_: dict | None = None) -> dict:
        body = {"id": self.id, "object": object_, "created": self.created, "model": self.model, "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def logprobs(self, entries: list[Logprob] | None, text_offset: int = 0) -> dict | None:
        if entries is None:
            return None
        if self.chat:

            def item(tid: int, lp: float) -> dict:
                tok = self._token(tid)
                return {"token": tok, "logprob": lp, "bytes": list(tok.encode("utf-8"))}

            return {
                "content": [
                    {**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]} for e in entries
                ]
            }
        tokens = [self._token(e.token_id) for e in entries]
        offsets, pos = [], text_offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{self._token(t): v for t, v in e.top} for e in entries],
            "text_offset": offsets,
        }

    def choice(self, index: int, c: CompletionOutput) -> dict:
        choice = {
            "index": index,
            "logprobs": self.logprobs(c.logprobs),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        if self.chat:
            choice["message"] = {"role": "assistant", "content": c.text}
        else:
            choice["text"] = c.text
        return choice

    def response(self, outputs: list[RequestOutput], n: int) -> dict:
        choices = [self.choice(i * n + c.index, c) for i, o in enumerate(outputs) for c in o.outputs]
        return self._envelope("chat.completion" if self.chat else "text_completion", choices, usage(outputs))

    def chunk(
        self, index: int, text: str, finish_reason: str | None, logprobs: dict | None = None, first: bool = False
    ) -> dict:
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("text_completion", [choice])

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage(outputs))
