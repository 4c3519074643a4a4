"""Load generator for any OpenAI-compatible HTTP server (infertune, vLLM, llama.cpp's server, ...).

Sends --num-prompts streaming requests (stream=true, stream_options.include_usage=true) to
/v1/completions or /v1/chat/completions with Poisson arrivals at --request-rate (inf = all at once),
optionally capped at --max-concurrency in flight, and measures for every request:

  TTFT    time from sending the request to the first chunk with non-empty content
  ITL     time between successive content chunks (one value per chunk after the first)
  TPOT    (E2E - TTFT) / (output tokens - 1), for requests with at least 2 output tokens
  E2E     time from sending the request to the end of its stream
  output tokens   usage.completion_tokens from the stream's usage chunk, else the number of content chunks

Times are taken when a network read returns, so chunks that arrive in one read share a timestamp
(and give ITL values of 0). A failed request (HTTP error status, error event in the stream, connection
error, --timeout) is recorded with its error and counted; it never stops the run.

The pure parts (arrival schedule, statistics, SSE decoding, datasets, payloads) are separate functions.
`add_arguments(parser)` and `run(args)` are the command-line entry points.
"""

from __future__ import annotations

import argparse
import asyncio
import codecs
import json
import math
import os
import random
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

DEFAULT_URL = "http://127.0.0.1:8000"
PERCENTILES = (50, 90, 99)

# Common English words that are one token (with their leading space) in the GPT-2, Llama, Mistral and
# Qwen tokenizers, so a prompt of N random words is close to N tokens on most servers.
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more other its can what "
    "into about them some time could these two may first then do any like my now over such our man me even "
    "most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three"
).split()


# ----------------------------------------------------------------------------------------------------
# Arrival schedule
# ----------------------------------------------------------------------------------------------------

def poisson_intervals(n: int, rate: float, seed: int = 0) -> list[float]:
    """n inter-arrival gaps (seconds) of a Poisson process with `rate` requests/s; all 0.0 for rate inf.

    The first gap is the wait before the first request, so every request's arrival is a Poisson point.
    """
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    return [rng.expovariate(rate) for _ in range(n)]


def arrival_offsets(intervals: Sequence[float]) -> list[float]:
    """Cumulative sums of the gaps: each request's send time in seconds after the benchmark start."""
    out, t = [], 0.0
    for gap in intervals:
        t += gap
        out.append(t)
    return out


# ----------------------------------------------------------------------------------------------------
# Statistics
# ----------------------------------------------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict:
    """count, mean, std (population), min, max and p<q> for each q; the statistics are None for no values."""
    n = len(values)
    out: dict = {"count": n}
    if n == 0:
        out.update(mean=None, std=None, min=None, max=None)
        out.update({f"p{q:g}": None for q in percentiles})
        return out
    mean = math.fsum(values) / n
    out.update(mean=mean, std=math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n),
               min=min(values), max=max(values))
    out.update({f"p{q:g}": percentile(values, q) for q in percentiles})
    return out


# ----------------------------------------------------------------------------------------------------
# Server-sent events
# ----------------------------------------------------------------------------------------------------

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


# ----------------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------------

@dataclass
class PromptSpec:
    prompt: str
    prompt_len: int  # estimated (or counted with --tokenizer); the server's usage count is reported when given
    output_len: int


def approx_token_count(text: str) -> int:
    """Rough BPE token count when no tokenizer is given: about 4 characters per token."""
    return max(1, round(len(text) / 4)) if text else 0


def random_prompts(n: int, input_len: int, output_len: int, seed: int = 0,
                   count_tokens: Callable[[str], int] | None = None) -> list[PromptSpec]:
    """n prompts of input_len random common words (~input_len tokens on most tokenizers).

    With count_tokens (a real tokenizer), words are added or dropped until the count is input_len or
    within a word of it.
    """
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(input_len)]
        length = input_len
        if count_tokens is not None:
            words, length = _fit_words(words, input_len, count_tokens, rng)
        specs.append(PromptSpec(" ".join(words), length, output_len))
    return specs


def _fit_words(words: list[str], target: int, count_tokens: Callable[[str], int],
               rng: random.Random) -> tuple[list[str], int]:
    """Resize words so that count_tokens(' '.join(words)) is target, or the nearest count a word boundary allows."""

    def resize(n: int) -> None:
        if n < len(words):
            del words[n:]
        else:
            words.extend(rng.choice(WORDS) for _ in range(n - len(words)))

    length = count_tokens(" ".join(words))
    for _ in range(6):  # proportional steps first
        want = max(1, round(len(words) * target / max(length, 1)))
        if length == target or want == len(words):
            break
        resize(want)
        length = count_tokens(" ".join(words))
    for _ in range(64):  # then a word at a time, stopping at the count nearest the target
        if length == target:
            break
        step = -1 if length > target else 1
        if len(words) + step < 1:
            break
        saved = list(words)
        resize(len(words) + step)
        new = count_tokens(" ".join(words))
        if (new > target) != (length > target):  # crossed the target: keep the closer side
            if abs(new - target) > abs(length - target):
                words[:] = saved
                new = length
            length = new
            break
        length = new
    return words, length


HUMAN_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "assistant", "chatgpt", "bard", "bing", "model"}


def parse_record(rec: dict, default_output_len: int, count_tokens: Callable[[str], int]) -> PromptSpec | None:
    """One dataset record -> PromptSpec, or None if it has no usable prompt.

    {"prompt": str, "output_len": N (optional, default --output-len)}, or ShareGPT-like
    {"conversations" (or "messages"): [{"from"|"role": ..., "value"|"content": ...}, ...]}: the first human
    turn is the prompt and the first assistant turn after it sets the output length (its token count).
    """
    if not isinstance(rec, dict):
        return None
    if isinstance(rec.get("prompt"), str):
        prompt = rec["prompt"]
        out = rec.get("output_len", default_output_len)
        if not prompt or not isinstance(out, int) or isinstance(out, bool):
            return None
        return PromptSpec(prompt, count_tokens(prompt), max(1, out))
    turns = rec.get("conversations", rec.get("messages"))
    if not isinstance(turns, list):
        return None
    prompt, answer = None, None
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = str(turn.get("from", turn.get("role", ""))).lower()
        text = turn.get("value", turn.get("content"))
        if not isinstance(text, str):
            continue
        if prompt is None:
            if role in HUMAN_ROLES and text:
                prompt = text
        elif role in ASSISTANT_ROLES:
            answer = text
            break
    if prompt is None:
        return None
    out = max(1, count_tokens(answer)) if answer else default_output_len
    return PromptSpec(prompt, count_tokens(prompt), out)


def read_records(path: str | Path) -> list[dict]:
    """Records of a JSONL file (one JSON object a line; blank lines skipped) or of a JSON array file."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        data = json.loads(text)
        return list(data)
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None
    return records


def load_dataset(dataset: str, num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                 count_tokens: Callable[[str], int] | None = None) -> list[PromptSpec]:
    """num_prompts PromptSpecs: `random`, or from a JSONL/JSON file (seeded shuffle; cycled if too short)."""
    if num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if dataset == "random":
        return random_prompts(num_prompts, input_len, output_len, seed, count_tokens)
    path = Path(dataset)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {dataset} (use 'random' or a .jsonl path)")
    count = count_tokens or approx_token_count
    specs = [s for s in (parse_record(r, output_len, count) for r in read_records(path)) if s is not None]
    if not specs:
        raise ValueError(f"{dataset}: no usable records (need 'prompt' or 'conversations' with a human turn)")
    random.Random(seed).shuffle(specs)
    return [specs[i % len(specs)] for i in range(num_prompts)]


# ----------------------------------------------------------------------------------------------------
# Requests and results
# ----------------------------------------------------------------------------------------------------

def base_url(url: str) -> str:
    """The server's root URL: trailing '/' and '/v1' removed."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def endpoint_path(endpoint: str) -> str:
    return {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[endpoint]


def build_payload(endpoint: str, model: str, spec: PromptSpec, ignore_eos: bool = True,
                  temperature: float | None = None) -> dict:
    body: dict = {"model": model, "max_tokens": spec.output_len, "stream": True,
                  "stream_options": {"include_usage": True}}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": spec.prompt}]
        body["max_completion_tokens"] = spec.output_len
    else:
        body["prompt"] = spec.prompt
    if ignore_eos:
        body["ignore_eos"] = True
    if temperature is not None:
        body["temperature"] = temperature
    return body


@dataclass
class RequestResult:
    index: int
    prompt_len: int = 0  # estimated from the dataset
    expected_output_len: int = 0
    success: bool = False
    error: str | None = None
    status: int | None = None
    start: float = 0.0  # seconds after the benchmark start when the request was sent
    ttft: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float | None = None  # seconds, end to end
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the server's usage, when given
    chunks: int = 0  # content chunks received
    usage_reported: bool = False

    @property
    def tpot(self) -> float | None:
        if not self.success or self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def record(self) -> dict:
        """JSON-ready per-request record, times in milliseconds."""
        ms = lambda s: None if s is None else s * 1000.0  # noqa: E731
        d = asdict(self)
        d.update(start_ms=ms(self.start), ttft_ms=ms(self.ttft), tpot_ms=ms(self.tpot), e2el_ms=ms(self.latency),
                 itl_ms=[x * 1000.0 for x in self.itl])
        for k in ("start", "ttft", "itl", "latency"):
            del d[k]
        return d


class StreamState:
    """Folds the SSE events of one response into a RequestResult; returns an error string to stop."""

    def __init__(self, res: RequestResult, t_sent: float) -> None:
        self.res, self.t_sent = res, t_sent
        self.last: float | None = None
        self.done = False

    def on_event(self, event: str, data: str, now: float) -> str | None:
        res = self.res
        if event == "error":
            return f"error event in stream: {data[:1000]}"
        if data.strip() == "[DONE]":
            self.done = True
            return None
        try:
            obj = json.loads(data)
        except json.JSONDecodeError:
            return f"stream data is not JSON: {data[:200]!r}"
        if not isinstance(obj, dict):
            return f"stream data is not a JSON object: {data[:200]!r}"
        if obj.get("error"):
            err = obj["error"]
            msg = err.get("message", err) if isinstance(err, dict) else err
            return f"error in stream: {msg}"
        usage = obj.get("usage")
        if isinstance(usage, dict):
            if isinstance(usage.get("completion_tokens"), int):
                res.output_tokens = usage["completion_tokens"]
                res.usage_reported = True
            if isinstance(usage.get("prompt_tokens"), int):
                res.prompt_tokens = usage["prompt_tokens"]
        if chunk_text(obj):
            if res.ttft is None:
                res.ttft = now - self.t_sent
            else:
                res.itl.append(now - self.last)
            self.last = now
            res.chunks += 1
        return None


async def send_request(client, url: str, payload: dict, headers: dict, res: RequestResult,
                       t0: float, timeout: float | None = None) -> RequestResult:
    """POST one streaming request and fill res; never raises (errors are recorded in res.error)."""
    t_sent = time.perf_counter()
    res.start = t_sent - t0
    state = StreamState(res, t_sent)

    async def go() -> None:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            res.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace").strip()
                res.error = f"HTTP {resp.status_code}: {body[:1000]}"
                return
            ctype = resp.headers.get("content-type", "")
            if "text/event-stream" not in ctype:
                body = (await resp.aread()).decode("utf-8", "replace").strip()
                res.error = f"expected a text/event-stream response, got {ctype!r}: {body[:300]}"
                return
            decoder = SSEDecoder()
            async for raw in resp.aiter_bytes():
                now = time.perf_counter()
                for event, data in decoder.feed(raw):
                    if err := state.on_event(event, data, now):
                        res.error = err
                        return
            now = time.perf_counter()
            for event, data in decoder.close():
                if err := state.on_event(event, data, now):
                    res.error = err
                    return
        res.latency = time.perf_counter() - t_sent
        if not res.usage_reported:
            res.output_tokens = res.chunks
        res.success = True

    try:
        if timeout:
            await asyncio.wait_for(go(), timeout)
        else:
            await go()
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout:g} s"
    except Exception as e:  # noqa: BLE001 - a failed request is data, not a crash
        res.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    if not res.success:
        res.latency = None
    return res


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether a request succeeded within the given SLOs (a 1-token output has no TPOT and meets it)."""
    if not r.success:
        return False
    if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > slo_ttft_ms):
        return False
    if slo_tpot_ms is not None:
        tpot = r.tpot
        if tpot is None and r.output_tokens >= 2:
            return False
        if tpot is not None and tpot * 1000 > slo_tpot_ms:
            return False
    return True


def summarize_results(results: Sequence[RequestResult], duration: float, slo_ttft_ms: float | None = None,
                      slo_tpot_ms: float | None = None) -> dict:
    """All run-level numbers: counts, token totals, throughputs, latency statistics (ms), goodput, errors."""
    ok = [r for r in results if r.success]
    ms = lambda xs: [x * 1000.0 for x in xs]  # noqa: E731
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    summary = {
        "duration_s": duration,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "input_tokens_from_server": all(r.prompt_tokens is not None for r in ok) if ok else None,
        "output_tokens_from_usage": all(r.usage_reported for r in ok) if ok else None,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(input_tokens),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "ttft_ms": summarize(ms([r.ttft for r in ok if r.ttft is not None])),
        "tpot_ms": summarize(ms([r.tpot for r in ok if r.tpot is not None])),
        "itl_ms": summarize(ms([x for r in ok for x in r.itl])),
        "e2el_ms": summarize(ms([r.latency for r in ok if r.latency is not None])),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "goodput": None,
        "good_requests": None,
        "short_outputs": sum(r.output_tokens < r.expected_output_len for r in ok),
        "errors": dict(Counter(r.error for r in results if not r.success).most_common()),
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results)
        summary.update(good_requests=good, goodput=per_s(good))
    return summary


def format_report(summary: dict, title: str = "Serving benchmark") -> str:
    """A one-screen plain-text table of a summary."""
    width = 62

    def num(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    lines = [f" {title} ".center(width, "=")]

    def row(label, value):
        lines.append(f"{label:<40}{value:>{width - 40}}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Duration (s):", num(summary["duration_s"]))
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total output tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", num(summary["request_throughput"]))
    row("Input token throughput (tok/s):", num(summary["input_throughput"]))
    row("Output token throughput (tok/s):", num(summary["output_throughput"]))
    row("Total token throughput (tok/s):", num(summary["total_token_throughput"]))
    if summary.get("good_requests") is not None:
        slos = [f"TTFT<={summary['slo_ttft_ms']:g}ms" if summary["slo_ttft_ms"] is not None else "",
                f"TPOT<={summary['slo_tpot_ms']:g}ms" if summary["slo_tpot_ms"] is not None else ""]
        row(f"Goodput (req/s) {' '.join(s for s in slos if s)}:", num(summary["goodput"]))
        row("Requests meeting the SLOs:", f"{summary['good_requests']}/{summary['num_requests']}")
    lines.append("-" * width)
    lines.append(f"{'Latency (ms)':<14}" + "".join(f"{h:>12}" for h in ("mean", "p50", "p90", "p99")))
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2el_ms")):
        s = summary[key]
        lines.append(f"{name:<14}" + "".join(f"{num(s[k]):>12}" for k in ("mean", "p50", "p90", "p99")))
    lines.append("=" * width)
    if summary.get("short_outputs"):
        lines.append(f"Note: {summary['short_outputs']} completed requests got fewer output tokens than asked "
                     "(EOS, stop, or a server cap)")
    if summary["errors"]:
        # Messages that differ only in numbers (token counts, ids) are one kind here; --json keeps them all.
        kinds: Counter = Counter()
        example: dict[str, str] = {}
        for msg, count in summary["errors"].items():
            msg = " ".join(str(msg).split())
            key = re.sub(r"\d+", "N", msg)
            kinds[key] += count
            example.setdefault(key, msg)
        lines.append("Errors (count: first message of the kind):")
        for i, (key, count) in enumerate(kinds.most_common()):
            if i == 3:
                lines.append(f"  ... and {len(kinds) - 3} more kinds (see --json)")
                break
            lines.append(f"  {count}: {example[key][:width * 2]}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------

def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number or 'inf': {text!r}") from None
    if not rate > 0:
        raise argparse.ArgumentTypeError("must be > 0 (or inf)")
    return rate


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the load generator's options to parser (for `infertune bench serve`)."""
    p = parser
    p.add_argument("--url", default=DEFAULT_URL,
                   help=f"server base URL; '/v1' is added (default: {DEFAULT_URL})")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions or /v1/chat/completions (default: completions)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default=None,
                   help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY if set)")
    p.add_argument("--dataset", default="random",
                   help="'random' (random words) or a JSONL file of {\"prompt\": ..., \"output_len\": N} or "
                   "ShareGPT-style {\"conversations\": [...]} records (default: random)")
    p.add_argument("--tokenizer", default=None,
                   help="optional Hugging Face tokenizer (folder or name) to count prompt/output tokens exactly "
                   "when building the workload (default: estimate)")
    p.add_argument("--input-len", type=_positive_int, default=128,
                   help="random dataset: prompt length in tokens, approximately (default: 128)")
    p.add_argument("--output-len", type=_positive_int, default=128,
                   help="output tokens per request (random dataset; records without a length) (default: 128)")
    p.add_argument("--num-prompts", type=_positive_int, default=100, help="number of requests (default: 100)")
    p.add_argument("--request-rate", type=_rate, default=float("inf"),
                   help="mean requests/s with Poisson arrivals, or inf to send all at once (default: inf)")
    p.add_argument("--max-concurrency", type=_positive_int, default=None,
                   help="most requests in flight at once (default: no limit)")
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset and arrival times (default: 0)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos=true so every output has the asked length (default: on)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature to send (default: server's)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on time to first token (ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on time per output token (ms)")
    p.add_argument("--json", default=None, metavar="OUT", help="write all numbers and per-request records here")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds one request may take in all before it counts as failed; 0 = none (default: 600)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def _load_tokenizer_counter(name: str | None) -> Callable[[str], int] | None:
    if not name:
        return None
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(name)
    return lambda text: len(tok.encode(text, add_special_tokens=False))


async def fetch_model(client, root: str, headers: dict) -> str:
    """The id of the first model in GET /v1/models."""
    url = root + "/v1/models"
    import httpx

    try:
        resp = await client.get(url, headers=headers)
    except httpx.HTTPError as e:
        raise RuntimeError(f"cannot reach {url}: {type(e).__name__}: {e}") from None
    if resp.status_code != 200:
        raise RuntimeError(f"GET {url} returned HTTP {resp.status_code}: {resp.text[:300]}")
    try:
        return resp.json()["data"][0]["id"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise RuntimeError(f"GET {url} listed no model: {resp.text[:300]}; pass --model") from None


async def benchmark(args: argparse.Namespace, specs: list[PromptSpec]) -> tuple[str, list[RequestResult], float]:
    """Run the load; returns (model name, results in request order, duration in seconds)."""
    import httpx
    from tqdm import tqdm

    root = base_url(args.url)
    url = root + endpoint_path(args.endpoint)
    api_key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = args.timeout if args.timeout and args.timeout > 0 else None
    # No pool limit: a queue inside the client would add to TTFT without the server being slow.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout), trust_env=False) as client:
        model = args.model or await fetch_model(client, root, headers)
        offsets = arrival_offsets(poisson_intervals(len(specs), args.request_rate, args.seed))
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=len(specs), unit="req", desc="requests", file=sys.stderr, disable=args.no_progress)

        async def one(i: int, spec: PromptSpec, t0: float) -> RequestResult:
            res = RequestResult(index=i, prompt_len=spec.prompt_len, expected_output_len=spec.output_len)
            payload = build_payload(args.endpoint, model, spec, args.ignore_eos, args.temperature)
            if sem is None:
                await send_request(client, url, payload, headers, res, t0, timeout)
            else:
                async with sem:
                    await send_request(client, url, payload, headers, res, t0, timeout)
            bar.update(1)
            return res

        tasks = []
        t0 = time.perf_counter()
        try:
            for i, (spec, at) in enumerate(zip(specs, offsets)):
                wait = t0 + at - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                tasks.append(asyncio.create_task(one(i, spec, t0)))
            results = list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()
            bar.close()
        duration = time.perf_counter() - t0
    return model, results, duration


def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by args (see add_arguments); print the report, write --json.

    Exit code: 0 when at least one request completed, 1 when none did, 2 when the run could not start
    (bad dataset, server unreachable while asking for the model name).
    """
    try:
        specs = load_dataset(args.dataset, args.num_prompts, args.input_len, args.output_len, args.seed,
                             _load_tokenizer_counter(args.tokenizer))
        model, results, duration = asyncio.run(benchmark(args, specs))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"bench serve: error: {e}", file=sys.stderr)
        return 2
    summary = summarize_results(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    rate = "inf" if math.isinf(args.request_rate) else f"{args.request_rate:g}/s"
    title = f"{model} | {args.endpoint} | rate {rate} | conc {args.max_concurrency or '-'}"
    print(format_report(summary, title=title if len(title) <= 56 else "Serving benchmark"))
    if args.json:
        config = {k: v for k, v in vars(args).items() if k != "func" and k != "api_key"}
        config.update(model=model, url=base_url(args.url) + endpoint_path(args.endpoint),
                      request_rate=None if math.isinf(args.request_rate) else args.request_rate)
        out = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "config": config, "summary": summary,
               "requests": [r.record() for r in results]}
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1, default=str) + "\n", encoding="utf-8")
        print(f"wrote {path}", file=sys.stderr)
    return 0 if summary["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infertune.bench.serve_load", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
