"""Launch `infertune serve` instances as child processes and the router in front (`serve --data-parallel-size N`).

Each replica gets its own port on 127.0.0.1 and, unless OMP_NUM_THREADS is set, its share of the CPUs as threads
(on a CPU host N replicas would otherwise oversubscribe the cores N times). The router runs in this process; when
it stops (SIGINT / SIGTERM) the replicas are stopped too, and a replica that exits while starting stops them all.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time

log = logging.getLogger("infertune.router")

# serve's own flags that the launcher sets per replica, with whether each takes a value
_OWN_FLAGS = {"--data-parallel-size": True, "--port": True, "--host": True}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def replica_argv(serve_argv: list[str]) -> list[str]:
    """serve's arguments without the flags the launcher sets per replica (--data-parallel-size, --port, --host)."""
    out, skip = [], False
    for a in serve_argv:
        if skip:
            skip = False
            continue
        name = a.split("=", 1)[0]
        if name in _OWN_FLAGS:
            skip = "=" not in a and _OWN_FLAGS[name]
            continue
        out.append(a)
    return out


def spawn_serve(argv: list[str], port: int, threads: int | None = None, stdout=None) -> subprocess.Popen:
    """`infertune serve ARGV --host 127.0.0.1 --port PORT` in a child process (threads: its OMP_NUM_THREADS)."""
    env = dict(os.environ)
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "infertune.cli", "serve", *argv, "--host", "127.0.0.1", "--port", str(port)]
    return subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT if stdout else None)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 600.0) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the instance for {url} exited with code {proc.returncode} while starting")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the instance for {url} did not become healthy within {timeout:g} s")


def stop(procs: list[subprocess.Popen], grace: float = 15.0) -> None:
    for p in procs:
        if p.poll() is None:
            p.terminate()
    deadline = time.time() + grace
    for p in procs:
        try:
            p.wait(max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def serve_data_parallel(serve_argv: list[str], size: int, host: str, port: int) -> int:
    """N replicas of `infertune serve` (serve_argv, the command's own arguments) and the router on host:port."""
    import uvicorn

    from infertune.router.app import Router

    if size < 2:
        raise ValueError(f"--data-parallel-size {size}: give 2 or more replicas (1 is a plain serve)")
    threads = max(1, (os.cpu_count() or 1) // size)
    argv = replica_argv(serve_argv)
    ports = [free_port() for _ in range(size)]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    procs = [spawn_serve(argv, p, threads) for p in ports]
    try:
        for url, proc in zip(urls, procs):
            wait_healthy(url, proc)
        log.info("%d replicas up (%s); routing on http://%s:%d/v1", size, ", ".join(urls), host, port)
        uvicorn.run(Router(replicas=urls).app(), host=host, port=port, log_level="warning")
    finally:
        stop(procs)
    return 0
