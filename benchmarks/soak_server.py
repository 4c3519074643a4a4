"""Start `infertune serve` (the built-in demo model unless --model), soak it, then SIGTERM it under load.

    python benchmarks/soak_server.py [--model DIR] [--requests 20000] [--concurrency 128] [--hangup 0.2]

Prints the soak's report (infertune/bench/soak.py: nothing lost, every hang-up let go, /health throughout, RSS
flat), the hostile requests' answers and times while the soak's clients are served, and how a SIGTERM in the
middle of a second load ends (exit status, seconds to drain). Exit status 1 when any of it fails.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx

from infertune.bench.soak import run_soak

HOSTILE = {
    "n=100000": {"prompt": "def ", "max_tokens": 1, "n": 100000},
    "100000 token lists": {"prompt": [[5]] * 100000, "max_tokens": 1},
    "a 1M-token prompt": {"prompt": [7] * 1_000_000, "max_tokens": 1},
    "1000 stop strings": {"prompt": "x", "stop": ["s"] * 1000},
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(args, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "infertune.cli",
        "serve",
        "--port",
        str(port),
        "--max-waiting",
        "4096",
        "--graceful-timeout",
        str(args.grace),
        *(["--model", args.model] if args.model else []),
        *args.serve_args,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("the server did not start")


def hostile(url: str) -> bool:
    ok = True
    for name, body in HOSTILE.items():
        t0 = time.perf_counter()
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        ms = (time.perf_counter() - t0) * 1000
        print(f"  {name:<20} -> {r.status_code} in {ms:.0f} ms: {r.json()['error']['message'][:90]}")
        ok &= r.status_code in (400, 413)
    return ok


async def sigterm_under_load(url: str, proc: subprocess.Popen, grace: float) -> tuple[int, float, dict]:
    body = {"prompt": "under load", "max_tokens": 64, "temperature": 0, "ignore_eos": True}
    outcomes: dict[str, int] = {}
    async with httpx.AsyncClient(base_url=url, timeout=120) as h:

        async def one():
            try:
                r = await h.post("/v1/completions", json=body)
                key = str(r.status_code)
            except httpx.HTTPError as e:
                key = type(e).__name__
            outcomes[key] = outcomes.get(key, 0) + 1

        tasks = [asyncio.create_task(one()) for _ in range(64)]
        await asyncio.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        t0 = time.perf_counter()
        await asyncio.gather(*tasks)
        code = await asyncio.to_thread(proc.wait, grace + 30)
        return code, time.perf_counter() - t0, outcomes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder to serve (default: the built-in demo model)")
    p.add_argument("--requests", type=int, default=20000)
    p.add_argument("--concurrency", type=int, default=128)
    p.add_argument("--hangup", type=float, default=0.2)
    p.add_argument("--long-words", type=int, default=40)
    p.add_argument("--grace", type=float, default=10.0, help="the server's --graceful-timeout (default: 10)")
    p.add_argument("serve_args", nargs="*", help="more `infertune serve` flags, after --")
    args = p.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(args, port)
    try:
        print(f"soak: {args.requests} requests, {args.concurrency} concurrent, {args.hangup:.0%} hang up")
        reports = []
        soaking = threading.Thread(
            target=lambda: reports.append(
                run_soak(
                    url,
                    requests=args.requests,
                    concurrency=args.concurrency,
                    hangup=args.hangup,
                    long_words=args.long_words,
                )
            )
        )
        soaking.start()
        time.sleep(5)
        print("hostile requests while the soak runs:")
        hostile_ok = hostile(url)
        soaking.join()
        report = reports[0]
        print(report.summary())
        print("SIGTERM with 64 requests in flight:")
        code, seconds, outcomes = asyncio.run(sigterm_under_load(url, proc, args.grace))
        print(f"  exit status {code} after {seconds:.1f} s (grace {args.grace:g} s); answers {outcomes}")
        return 0 if report.passed and hostile_ok and code == 0 else 1
    finally:
        if proc.poll() is None:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
