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
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Sequence

# The pure parts live in their own modules; their names are re-exported here.
from infertune.bench.serve_data import (  # noqa: F401
    ASSISTANT_ROLES,
    HUMAN_ROLES,
    WORDS,
    PromptSpec,
    approx_token_count,
    load_dataset,
    parse_record,
    random_prompts,
    read_records,
)
from infertune.bench.serve_stats import (  # noqa: F401
    PERCENTILES,
    RequestResult,
    format_report,
    meets_slo,
    percentile,
    summarize,
    summarize_results,
)
from infertune.bench.sse import SSEDecoder, chunk_text
from infertune.files import add_json_flag, emit_json, json_to_stdout

DEFAULT_URL = "http://127.0.0.1:8000"


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
# Requests and results
# ----------------------------------------------------------------------------------------------------


def base_url(url: str) -> str:
    """The server's root URL: trailing '/' and '/v1' removed."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def endpoint_path(endpoint: str) -> str:
    return {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[endpoint]


def build_payload(
    endpoint: str, model: str, spec: PromptSpec, ignore_eos: bool = True, temperature: float | None = None
) -> dict:
    body: dict = {
        "model": model,
        "max_tokens": spec.output_len,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
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


async def send_request(
    client, url: str, payload: dict, headers: dict, res: RequestResult, t0: float, timeout: float | None = None
) -> RequestResult:
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
    p.add_argument("--url", default=DEFAULT_URL, help=f"server base URL; '/v1' is added (default: {DEFAULT_URL})")
    p.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default="completions",
        help="/v1/completions or /v1/chat/completions (default: completions)",
    )
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument(
        "--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (default: $OPENAI_API_KEY if set)"
    )
    p.add_argument(
        "--dataset",
        default="random",
        help='\'random\' (random words) or a JSONL file of {"prompt": ..., "output_len": N} or '
        'ShareGPT-style {"conversations": [...]} records (default: random)',
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="optional Hugging Face tokenizer (folder or name) to count prompt/output tokens exactly "
        "when building the workload (default: estimate)",
    )
    p.add_argument(
        "--input-len",
        type=_positive_int,
        default=128,
        help="random dataset: prompt length in tokens, approximately (default: 128)",
    )
    p.add_argument(
        "--output-len",
        type=_positive_int,
        default=128,
        help="output tokens per request (random dataset; records without a length) (default: 128)",
    )
    p.add_argument("--num-prompts", type=_positive_int, default=100, help="number of requests (default: 100)")
    p.add_argument(
        "--request-rate",
        type=_rate,
        default=float("inf"),
        help="mean requests/s with Poisson arrivals, or inf to send all at once (default: inf)",
    )
    p.add_argument(
        "--max-concurrency",
        type=_positive_int,
        default=None,
        help="most requests in flight at once (default: no limit)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the dataset and arrival times (default: 0)")
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send ignore_eos=true so every output has the asked length (default: on)",
    )
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature to send (default: server's)")
    p.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on time to first token (ms)")
    p.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on time per output token (ms)")
    add_json_flag(p, "all numbers and per-request records")
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds one request may take in all before it counts as failed; 0 = none (default: 600)",
    )
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
        specs = load_dataset(
            args.dataset,
            args.num_prompts,
            args.input_len,
            args.output_len,
            args.seed,
            _load_tokenizer_counter(args.tokenizer),
        )
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
        config.update(
            model=model,
            url=base_url(args.url) + endpoint_path(args.endpoint),
            request_rate=None if math.isinf(args.request_rate) else args.request_rate,
        )
        out = {
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "config": config,
            "summary": summary,
            "requests": [r.record() for r in results],
        }
        emit_json(args.json, out)
        if not json_to_stdout(args):
            print(f"wrote {args.json}", file=sys.stderr)
    return 0 if summary["completed"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infertune.bench.serve_load",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
