"""Soak test of an infertune server: many requests at high concurrency, a share of whose clients hang up.

Every request is drawn from a seeded mix: streamed or not, n of 1 to --max-n, short or long prompts, a few output
tokens. A --hangup share of clients go away mid-request: a streamed one after its first events, a non-streamed one
after a few milliseconds. Meanwhile /health and the server's RSS (its /metrics) are read every --probe-every
seconds. The verdict (exit status 1 when it fails):
- nothing lost: every client that stayed got an answer, a 200 with its n finished choices or a refusal with an
  OpenAI error body (429 counted apart), never a 5xx or a dropped connection;
- every hang-up let go: afterwards the server is idle (0 KV blocks used, 0 waiting, 0 running), its aborts at
  most the hang-ups;
- /health answered throughout, and RSS is flat: its growth from the first tenth of the run to the end is under
  --rss-growth-mib.

`infertune bench soak --url URL` runs it against a running server; `benchmarks/soak_server.py` starts one and
runs it. `run_soak(...)` is the same from Python (the test suite runs a small one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field

from infertune.files import add_json_flag, print_report

WORDS = ("cache", "block", "token", "layer", "prefill", "decode", "batch", "kernel", "tile", "vector", "queue", "shard")


@dataclass(slots=True)
class SoakReport:
    requests: int = 0
    hangups: int = 0
    ok: int = 0
    refused_429: int = 0
    refused_other: int = 0  # 4xx with an error body, other than 429
    lost: list[str] = field(default_factory=list)  # 5xx, dropped connections, bad bodies: what must not happen
    health_failures: int = 0
    aborted: float = 0.0  # the server's abort counter, over the run
    idle_after: bool = False
    final_state: dict = field(default_factory=dict)
    rss_mib: list[float] = field(default_factory=list)  # one reading a probe
    seconds: float = 0.0
    rss_growth_mib_limit: float = 64.0

    @property
    def rss_growth_mib(self) -> float:
        if len(self.rss_mib) < 2:
            return 0.0
        early = self.rss_mib[: max(1, len(self.rss_mib) // 10)]
        return self.rss_mib[-1] - max(early)

    @property
    def passed(self) -> bool:
        return (
            not self.lost
            and self.health_failures == 0
            and self.idle_after
            and self.aborted <= self.hangups
            and self.rss_growth_mib < self.rss_growth_mib_limit
        )

    def summary(self) -> str:
        rss = (
            f"{self.rss_mib[0]:.0f} -> peak {max(self.rss_mib):.0f} -> {self.rss_mib[-1]:.0f} MiB"
            if self.rss_mib
            else "not read"
        )
        lines = [
            f"requests {self.requests} in {self.seconds:.1f} s ({self.requests / max(self.seconds, 1e-9):.0f}/s), "
            f"hang-ups {self.hangups}",
            f"answered: 200 {self.ok}, 429 {self.refused_429}, other 4xx {self.refused_other}, lost {len(self.lost)}",
            f"server aborts {self.aborted:.0f} (<= hang-ups {self.hangups}), idle afterwards {self.idle_after} "
            f"{self.final_state}",
            f"/health failures {self.health_failures}; RSS {rss}, growth past the first tenth "
            f"{self.rss_growth_mib:+.1f} MiB (limit {self.rss_growth_mib_limit:g})",
            "PASS" if self.passed else "FAIL" + (f": first lost: {self.lost[:3]}" if self.lost else ""),
        ]
        return "\n".join(lines)


def read_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {name or name{labels}: value}."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            try:
                out[name] = float(value)
            except ValueError:
                continue
    return out


async def _server_state(client) -> dict[str, float]:
    m = read_metrics((await client.get("/metrics")).text)
    keys = (
        "infertune_kv_blocks_used",
        "infertune_requests_waiting",
        "infertune_requests_running",
        "infertune_requests_aborted_total",
        "infertune_process_resident_memory_bytes",
    )
    return {k: m.get(k, float("nan")) for k in keys}


def _workload(i: int, rng: random.Random, max_n: int, long_words: int, hangup: float) -> tuple[dict, float | None]:
    """(body, hang-up point or None): for a streamed request the number of events read, else seconds waited."""
    long = rng.random() < 0.25
    words = [rng.choice(WORDS) for _ in range(long_words if long else rng.randint(1, 6))]
    n = 1 if rng.random() < 0.6 else rng.randint(1, max_n)
    body = {
        "prompt": f"{i} " + " ".join(words),
        "max_tokens": rng.randint(1, 12),
        "n": n,
        "temperature": 0.8,
        "seed": i,
        "ignore_eos": True,
        "stream": rng.random() < 0.5,
    }
    if rng.random() >= hangup:
        return body, None
    return body, (rng.randint(1, 3) if body["stream"] else rng.uniform(0.002, 0.05))


def _check_answer(status: int, text: str, report: SoakReport, what: str) -> None:
    if status == 200:
        report.ok += 1
        return
    try:
        err = json.loads(text)["error"]
        assert err["message"]
    except (ValueError, KeyError, TypeError, AssertionError):
        report.lost.append(f"{what}: HTTP {status} without an error body: {text[:200]}")
        return
    if status == 429:
        report.refused_429 += 1
    elif 400 <= status < 500:
        report.refused_other += 1
    else:
        report.lost.append(f"{what}: HTTP {status}: {text[:200]}")


async def _one(client, body: dict, hang: float | None, report: SoakReport, i: int) -> None:
    import httpx

    what = f"request {i} ({'stream' if body['stream'] else 'plain'}, n={body['n']})"
    try:
        if body["stream"]:
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    _check_answer(resp.status_code, (await resp.aread()).decode(), report, what)
                    return
                events, finished = 0, set()
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    events += 1
                    if hang is not None and events >= hang:
                        return  # hang up: leaving the block closes the connection
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    chunk = json.loads(data)
                    if "error" in chunk:
                        report.lost.append(f"{what}: error event {chunk['error']}")
                        return
                    finished |= {c["index"] for c in chunk.get("choices", []) if c.get("finish_reason")}
                if hang is not None:
                    return  # it ended before the client hung up
                if len(finished) != body["n"]:
                    report.lost.append(f"{what}: {len(finished)} of {body['n']} choices finished")
                else:
                    report.ok += 1
        else:
            if hang is not None:
                try:
                    await asyncio.wait_for(client.post("/v1/completions", json=body), hang)
                except asyncio.TimeoutError:
                    pass
                return
            resp = await client.post("/v1/completions", json=body)
            _check_answer(resp.status_code, resp.text, report, what)
            if resp.status_code == 200 and sum(1 for c in resp.json()["choices"] if c["finish_reason"]) != body["n"]:
                report.lost.append(f"{what}: not every choice finished")
    except httpx.HTTPError as e:
        if hang is None:
            report.lost.append(f"{what}: {type(e).__name__}: {e}")


async def soak(
    url: str,
    requests: int,
    concurrency: int,
    hangup: float,
    max_n: int = 4,
    long_words: int = 40,
    seed: int = 0,
    probe_every: float = 0.5,
    rss_growth_mib: float = 64.0,
    progress: bool = True,
) -> SoakReport:
    import httpx
    from tqdm import tqdm

    report = SoakReport(requests=requests, rss_growth_mib_limit=rss_growth_mib)
    rng = random.Random(seed)
    work = [_workload(i, rng, max_n, long_words, hangup) for i in range(requests)]
    report.hangups = sum(1 for _, hang in work if hang is not None)
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    async with (
        httpx.AsyncClient(base_url=url.rstrip("/"), timeout=120, limits=limits) as client,
        httpx.AsyncClient(base_url=url.rstrip("/"), timeout=10) as probe,
    ):
        aborted_before = (await _server_state(probe))["infertune_requests_aborted_total"]
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                try:
                    ok = (await probe.get("/health")).status_code == 200
                    state = await _server_state(probe)
                    report.rss_mib.append(state["infertune_process_resident_memory_bytes"] / 2**20)
                except httpx.HTTPError:
                    ok = False
                report.health_failures += not ok
                try:
                    await asyncio.wait_for(done.wait(), probe_every)
                except asyncio.TimeoutError:
                    pass

        bar = tqdm(total=requests, desc="soak", unit="req", disable=not progress, file=sys.stderr)
        queue: asyncio.Queue = asyncio.Queue()
        for i, item in enumerate(work):
            queue.put_nowait((i, item))

        async def worker() -> None:
            while not queue.empty():
                i, (body, hang) = queue.get_nowait()
                await _one(client, body, hang, report, i)
                bar.update(1)

        t0 = time.perf_counter()
        watcher = asyncio.create_task(watch())
        await asyncio.gather(*[worker() for _ in range(concurrency)])
        report.seconds = time.perf_counter() - t0
        bar.close()
        deadline = time.perf_counter() + 15
        while True:  # every hang-up must be let go within a few steps
            state = await _server_state(probe)
            report.idle_after = (
                state["infertune_kv_blocks_used"] == 0
                and state["infertune_requests_waiting"] == 0
                and state["infertune_requests_running"] == 0
            )
            if report.idle_after or time.perf_counter() > deadline:
                break
            await asyncio.sleep(0.1)
        done.set()
        await watcher
        report.final_state = {
            k.removeprefix("infertune_"): v for k, v in state.items() if "resident" not in k and "aborted" not in k
        }
        report.aborted = state["infertune_requests_aborted_total"] - aborted_before
    return report


def run_soak(url: str, **kw) -> SoakReport:
    return asyncio.run(soak(url, **kw))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL (default: %(default)s)")
    p.add_argument("--requests", type=int, default=20000, help="requests in all (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=128, help="clients in flight at once (default: %(default)s)")
    p.add_argument(
        "--hangup",
        type=float,
        default=0.2,
        help="share of clients that hang up mid-request, streamed or not (default: %(default)s)",
    )
    p.add_argument("--max-n", type=int, default=4, help="largest n a request asks for (default: %(default)s)")
    p.add_argument(
        "--long-words",
        type=int,
        default=40,
        help="words in a long prompt (a quarter of the prompts) (default: %(default)s)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (default: %(default)s)")
    p.add_argument(
        "--rss-growth-mib",
        type=float,
        default=64.0,
        help="most RSS growth from the first tenth of the run to the end (default: %(default)s)",
    )
    add_json_flag(p, "the report")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def run(args: argparse.Namespace) -> int:
    report = run_soak(
        args.url,
        requests=args.requests,
        concurrency=args.concurrency,
        hangup=args.hangup,
        max_n=args.max_n,
        long_words=args.long_words,
        seed=args.seed,
        rss_growth_mib=args.rss_growth_mib,
        progress=not args.no_progress,
    )
    doc = {**asdict(report), "rss_growth_mib": report.rss_growth_mib, "passed": report.passed}
    print_report(args, report.summary(), doc)
    return 0 if report.passed else 1
