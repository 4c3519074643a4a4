"""OpenAI response and stream-chunk bodies built from RequestOutputs (completions and chat)."""

from __future__ import annotations

import json
import math
import time

from infertune.engine.outputs import CompletionOutput, Logprob, RequestOutput
from infertune.engine.tokenizer import token_bytes

# What a logprob of -inf (a token the sampling parameters ruled out) or NaN (logits overflowed, e.g. under an extreme
# repetition_penalty) is sent as: JSON has no infinities, and vLLM answers the same floor.
LOGPROB_FLOOR = -9999.0


def _finite(v: float) -> float:
    return v if math.isfinite(v) else (-LOGPROB_FLOOR if v > 0 else LOGPROB_FLOOR)


def sse(payload: dict | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n"


def usage(outputs: list[RequestOutput]) -> dict:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class Formatter:
    """Knows the request's id, model and tokenizer; renders choices, chunks and logprobs."""

    def __init__(self, request_id: str, model: str, tokenizer, chat: bool, echo: bool = False) -> None:
        self.id, self.model, self.tokenizer, self.chat = request_id, model, tokenizer, chat
        self.echo = echo and not chat  # (completions only: the prompt comes back before the completion)
        self.created = int(time.time())

    def _envelope(self, object_: str, choices: list[dict], usage_: dict | None = None) -> dict:
        body = {"id": self.id, "object": object_, "created": self.created, "model": self.model, "choices": choices}
        if usage_ is not None:
            body["usage"] = usage_
        return body

    def _token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.tokenizer.decode(out.prompt_token_ids)

    @staticmethod
    def prompt_entries(out: RequestOutput) -> list[Logprob | tuple[int]]:
        """The prompt's tokens as logprob entries: the first (and any the engine did not score) as (token_id,)."""
        scored = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        return [e if e is not None else (t,) for t, e in zip(out.prompt_token_ids, scored)]

    def logprobs(self, entries: list | None, text_offset: int = 0) -> dict | None:
        """OpenAI's logprobs object of these entries (Logprob, or (token_id,) for a prompt token without one)."""
        if entries is None:
            return None
        if self.chat:

            def item(tid: int, lp: float) -> dict:
                tok = self._token(tid)
                return {"token": tok, "logprob": _finite(lp), "bytes": list(token_bytes(self.tokenizer, tid, tok))}

            return {
                "content": [
                    {**item(e.token_id, e.logprob), "top_logprobs": [item(t, v) for t, v in e.top]} for e in entries
                ]
            }
        tokens = [self._token(e[0] if isinstance(e, tuple) else e.token_id) for e in entries]
        offsets, pos = [], text_offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [None if isinstance(e, tuple) else _finite(e.logprob) for e in entries],
            # (the token itself among its alternatives, as OpenAI's legacy completions and vLLM answer: up to
            # logprobs + 1 entries, and logprobs=0 gives the token alone)
            "top_logprobs": [None if isinstance(e, tuple) else self._top_with_token(e) for e in entries],
            "text_offset": offsets,
        }

    def _top_with_token(self, e: Logprob) -> dict[str, float]:
        top = {self._token(t): _finite(v) for t, v in e.top}
        top.setdefault(self._token(e.token_id), _finite(e.logprob))
        return top

    def echoed(self, out: RequestOutput, c: CompletionOutput, logprobs: list | None) -> tuple[str, dict | None]:
        """The text and logprobs of a completion choice, after the prompt's when echoing."""
        if not self.echo:
            return c.text, self.logprobs(logprobs)
        prompt = self.prompt_text(out)
        if logprobs is None:
            return prompt + c.text, None
        head, tail = self.logprobs(self.prompt_entries(out)), self.logprobs(logprobs, len(prompt))
        return prompt + c.text, {k: head[k] + tail[k] for k in head}

    def choice(self, index: int, c: CompletionOutput, out: RequestOutput | None = None) -> dict:
        text, logprobs = self.echoed(out, c, c.logprobs) if out is not None else (c.text, self.logprobs(c.logprobs))
        choice = {"index": index, "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return choice

    def response(self, outputs: list[RequestOutput], n: int) -> dict:
        choices = [self.choice(i * n + c.index, c, o) for i, o in enumerate(outputs) for c in o.outputs]
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices, usage(outputs))
        transfer = next((o.kv_transfer_params for o in outputs if o.kv_transfer_params), None)
        if transfer is not None:  # a producer's answer, for the consumer (infertune router reads it)
            body["kv_transfer_params"] = transfer
        return body

    def chunk(
        self,
        index: int,
        text: str,
        finish_reason: str | None,
        logprobs: dict | None = None,
        first: bool = False,
        stop_reason: str | int | None = None,
    ) -> dict:
        """One streamed choice; stop_reason (the stop string or token that ended it, as the whole response's) goes
        with the finish, null before it (vLLM's stream choices)."""
        stop_reason = stop_reason if finish_reason is not None else None
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [{**choice, "stop_reason": stop_reason}])
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._envelope("text_completion", [{**choice, "stop_reason": stop_reason}])

    def usage_chunk(self, outputs: list[RequestOutput]) -> dict:
        return self._envelope("chat.completion.chunk" if self.chat else "text_completion", [], usage(outputs))
