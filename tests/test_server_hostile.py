"""Hostile clients against `infertune serve` in its own process: schemathesis from the OpenAPI schema, a soak
with hanging-up clients, SIGTERM under load, and a client process killed mid-request.

Oracles: schemathesis's not_a_server_error check, a watchdog that reads /health and the server's RSS (psutil on
its pid) throughout, the server's /metrics afterwards (0 KV blocks, 0 waiting, 0 running), its exit status.
"""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import psutil
import pytest
from server_utils import MODEL, ServerProcess, metric, wait_until

from infertune.bench.soak import run_soak

MEMORY_LIMIT = 2 * 2**30
CHECKS = ("not_a_server_error", "status_code_conformance", "content_type_conformance", "response_schema_conformance")


class Watchdog:
    """Reads /health and the server's RSS every 0.2 s in a thread until stopped; remembers every failure."""

    def __init__(self, url: str, pid: int, ceiling: int) -> None:
        self.url, self.proc, self.ceiling = url, psutil.Process(pid), ceiling
        self.failures: list[str] = []
        self.readings = 0
        self.peak_rss = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=5) as h:
            while not self._stop.is_set():
                try:
                    status = h.get(self.url + "/health").status_code
                    if status != 200:
                        self.failures.append(f"/health answered {status}")
                except httpx.HTTPError as e:
                    self.failures.append(f"/health: {type(e).__name__}")
                rss = self.proc.memory_info().rss
                self.peak_rss = max(self.peak_rss, rss)
                if rss > self.ceiling:
                    self.failures.append(f"RSS {rss / 2**20:.0f} MiB over the ceiling")
                self.readings += 1
                self._stop.wait(0.2)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(10)


def idle(url: str) -> bool:
    return all(
        metric(url, m) == 0
        for m in ("infertune_kv_blocks_used", "infertune_requests_waiting", "infertune_requests_running")
    )


def schemathesis_run(url: str, seed: int, report_dir) -> tuple[subprocess.CompletedProcess, int, int]:
    """One schemathesis run; returns it with its JUnit report's (failures, errors). Checks: no 5xx, and every
    status, content type and body the server answers is one its OpenAPI schema declares."""
    import xml.etree.ElementTree as ET

    # A high recursion limit: hypothesis describes deeply nested strategies, and CPython 3.11's ast.parse can fail
    # there ("AST constructor recursion depth mismatch"), an error of the generator, not of the server.
    cli = [
        sys.executable,
        "-c",
        "import sys; sys.setrecursionlimit(20000); from schemathesis.cli import schemathesis; sys.exit(schemathesis())",
    ]
    report_dir.mkdir(parents=True, exist_ok=True)
    run = subprocess.run(
        [
            *cli,
            "run",
            url + "/openapi.json",
            "--checks",
            ",".join(CHECKS),
            "--max-examples",
            "150",  # (a run over the nine operations generates ~1,800 bodies, most in the coverage phase)
            "--request-timeout",
            "60",
            "--workers",  # (one: hypothesis describes its strategies with ast.parse, which CPython 3.11 cannot run
            "1",  # on two threads at once: "AST constructor recursion depth mismatch", cpython gh-106905)
            "--seed",
            str(seed),
            "--no-color",
            "--report",
            "junit",
            "--report-dir",
            str(report_dir),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=report_dir,
    )
    suite = ET.parse(next(report_dir.glob("junit-*.xml"))).getroot()
    return run, int(suite.get("failures")), int(suite.get("errors"))


def test_schemathesis_thousands_of_bodies_no_5xx_rss_under_ceiling_health_throughout(tiny_llama, tmp_path):
    pytest.importorskip("schemathesis", reason="schemathesis is not installed (pip install -e '.[test]' brings it)")
    with (
        ServerProcess(tiny_llama, "--memory-limit", str(MEMORY_LIMIT)) as server,
        Watchdog(server.url, server.proc.pid, MEMORY_LIMIT) as dog,
    ):
        seeds = (20261201, 20261202, 20261203)
        for attempt, seed in enumerate(seeds):
            run, failures, errors = schemathesis_run(server.url, seed, tmp_path / str(seed))
            summary = run.stdout[-3000:]
            assert failures == 0, summary  # a 5xx, an undeclared answer, a dropped connection: never retried
            if errors == 0:
                break
            # The generator itself crashed on an operation (its traceback is in the report; seen on POST /tokenize,
            # both earlier seeds, in one run of 2026-12-02, not in the runs before or after it): another seed.
            assert attempt < len(seeds) - 1, summary
        assert run.returncode == 0, summary
        generated = int(re.search(r"(\d+) generated", summary).group(1))
        assert generated >= 1500, summary  # "thousands": coverage + fuzzing over the nine operations
        assert wait_until(lambda: idle(server.url))
    assert not dog.failures, dog.failures[:5]
    assert dog.readings >= 20 and 0 < dog.peak_rss < MEMORY_LIMIT


def test_soak_with_hanging_up_clients_loses_nothing_and_leaves_nothing(tiny_llama):
    with ServerProcess(tiny_llama, "--memory-limit", str(MEMORY_LIMIT)) as server:
        report = run_soak(
            server.url,
            requests=1500,
            concurrency=128,
            hangup=0.2,
            max_n=4,
            long_words=6,
            progress=False,
            probe_every=0.25,
        )
    print(report.summary())
    assert report.passed, report.summary()
    assert report.ok >= 0.7 * report.requests and report.refused_other == 0
    assert 0 < report.aborted <= report.hangups  # hang-ups were still running on the server, and were aborted
    assert len(report.rss_mib) >= 4


def test_sigterm_under_load_drains_in_flight_and_exits_zero(tiny_llama):
    with ServerProcess(tiny_llama, "--max-model-len", "256", grace=15) as server:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 60, "temperature": 0, "ignore_eos": True}

        async def load():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as h:

                async def one(i: int):
                    try:
                        if i % 2:
                            r = await h.post("/v1/completions", json=body)
                            ok = r.status_code == 200
                            return r.status_code, r.json()["choices"][0]["finish_reason"] if ok else None
                        finish = None
                        async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                            async for line in r.aiter_lines():
                                if line.startswith("data: {"):
                                    finish = json.loads(line[5:])["choices"][0]["finish_reason"] or finish
                        return r.status_code, finish
                    except httpx.HTTPError as e:
                        return type(e).__name__, None

                tasks = [asyncio.create_task(one(i)) for i in range(48)]
                await asyncio.sleep(1.0)  # requests in flight
                server.proc.send_signal(signal.SIGTERM)
                t0 = time.perf_counter()
                results = await asyncio.gather(*tasks)
                return results, time.perf_counter() - t0

        results, drained_s = asyncio.run(load())
        assert server.proc.wait(timeout=30) == 0
    served = [r for r in results if r[0] == 200]
    assert served and all(finish == "length" for _, finish in served)  # in-flight requests ran to their end
    assert all(r[0] in (200, "ConnectError", "RemoteProtocolError", "ReadError", 503) for r in results), results
    assert drained_s < 15 + 5


def test_streams_still_running_when_the_grace_period_ends_close_with_an_error_event(tiny_llama):
    """SIGTERM with a grace period of 1 s and streams far from done: they end with an error event ("the server is
    shutting down") and [DONE] just before uvicorn would cancel them mid-chunk (a cut transfer, tracebacks in the
    log); a plain request gets a 503; the process exits 0."""
    with ServerProcess(tiny_llama, "--max-model-len", "256", grace=1) as server:
        body = {"model": MODEL, "prompt": "x", "max_tokens": 250, "temperature": 0, "ignore_eos": True, "n": 64}

        async def load():
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as h:

                async def streamed():
                    lines = []
                    async with h.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                        async for line in r.aiter_lines():
                            if line.startswith("data: "):
                                lines.append(line)
                    return lines

                async def plain():
                    return await h.post("/v1/completions", json=body)

                tasks = [asyncio.create_task(streamed()), asyncio.create_task(plain())]
                await asyncio.sleep(1.0)  # both in flight, far from their 250 tokens
                server.proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks)

        lines, plain = asyncio.run(load())
        assert server.proc.wait(timeout=30) == 0
    assert lines[-1] == "data: [DONE]" and "the server is shutting down" in lines[-2], lines[-3:]
    assert plain.status_code == 503 and "shutting down" in plain.json()["error"]["message"]
    assert "Cancel" not in server.log and "Traceback" not in server.log, server.log[-2000:]


def test_sigkill_of_a_client_process_loses_nothing_on_the_server(tiny_llama, tmp_path):
    with ServerProcess(tiny_llama, "--max-model-len", "256", "--max-num-seqs", "1") as server:
        client = tmp_path / "client.py"
        client.write_text(
            textwrap.dedent(f"""
            import asyncio, httpx, sys
            async def main():
                async with httpx.AsyncClient(base_url={server.url!r}, timeout=300) as h:
                    body = {{"prompt": "x", "max_tokens": 200, "temperature": 0, "ignore_eos": True}}
                    async def stream():
                        async with h.stream("POST", "/v1/completions", json={{**body, "stream": True}}) as r:
                            async for _ in r.aiter_lines():
                                pass
                    tasks = [h.post("/v1/completions", json=body) for _ in range(6)] + [stream() for _ in range(6)]
                    gathered = asyncio.gather(*tasks)
                    await asyncio.sleep(0.5)
                    print("sent", flush=True)
                    await gathered
            asyncio.run(main())
        """)
        )
        proc = subprocess.Popen([sys.executable, str(client)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "sent"

        def finished() -> float:
            return metric(server.url, 'infertune_requests_total{finish_reason="length"}', default=0.0)

        def accepted() -> float:
            queued = metric(server.url, "infertune_requests_running") + metric(server.url, "infertune_requests_waiting")
            return queued + finished()

        # All 12 reached the engine before the kill (on a loaded machine the last may still be in flight at "sent").
        assert wait_until(lambda: accepted() == 12, 30), accepted()
        assert metric(server.url, "infertune_requests_running") + metric(server.url, "infertune_requests_waiting") > 0
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        assert wait_until(lambda: idle(server.url), 10)
        # Nothing lost: each of the 12 requests either finished or was aborted; one runs at a time, so most aborted.
        # Counted by the engine, so one that finished as its client died counts as finished (none finish, if slow).
        aborted = metric(server.url, "infertune_requests_aborted_total")
        finished = finished()
        assert finished + aborted == 12 and aborted >= 6, (finished, aborted)
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 3}, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
