"""`infertune serve` instances as child processes: start one, echo its output under its name, wait until healthy, stop.

What the launcher (launch.py) and its Ray actors (ray_instances.py) share. An instance answers poll / terminate /
kill / wait as a subprocess.Popen does, so stop() and the health waits take a Popen, a ServeProcess or a Ray handle.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

TAIL_LINES = 40


_HANDED_OUT: set[tuple[str, int]] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, never one this process handed out before: the port is free only until someone
    binds it, so the launcher's several ports (each instance's HTTP port, a P2P store's) must differ among themselves
    even when the system offers the same one twice before any is bound."""
    for _ in range(1000):
        with socket.socket() as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if (host, port) not in _HANDED_OUT:
            _HANDED_OUT.add((host, port))
            return port
    raise RuntimeError(f"no free port on {host} that this process has not handed out already")


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: the child gets SIGTERM when the launcher dies, even by SIGKILL (no orphaned servers)."""
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def spawn_serve(
    argv: list[str], port: int, threads: int | None = None, stdout=None, host: str = "127.0.0.1"
) -> subprocess.Popen:
    """`infertune serve ARGV --host HOST --port PORT` in a child process (threads: its OMP_NUM_THREADS)."""
    env = dict(os.environ)
    if threads is not None and "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "infertune.cli", "serve", *argv, "--host", host, "--port", str(port)]
    return subprocess.Popen(
        cmd,
        env=env,
        stdout=stdout,
        stderr=subprocess.STDOUT if stdout else None,
        preexec_fn=_die_with_parent if sys.platform == "linux" else None,
    )


def log_exit(instance, code: int) -> None:
    """An instance (ServeProcess, RayInstance) that died while the router served in front of it, said once."""
    logging.getLogger("infertune.router").error(
        "%s (%s, pid %d) exited with code %d; the router routes around it, restart the command to bring it back",
        instance.name,
        instance.url,
        instance.pid,
        code,
    )


class ServeProcess:
    """One `infertune serve` child process: its name and URL; its output echoed with its name, the last lines kept.

    It answers poll / terminate / kill / wait as a Popen does, so stop() and wait_healthy() take it."""

    def __init__(self, name: str, argv: list[str], threads: int | None, host: str = "127.0.0.1") -> None:
        self.name, self.host, self.port = name, host, free_port(host)
        self.url = f"http://{host}:{self.port}"
        self.proc = spawn_serve(argv, self.port, threads, stdout=subprocess.PIPE, host=host)
        self.pid = self.proc.pid
        self.lines: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self._stopping = False  # (terminate / kill asked: its exit is no news)
        self.serving = False  # (set once the router serves in front of it: an exit before is the start's error)
        self._reader = threading.Thread(target=self._echo, daemon=True)
        self._reader.start()

    def _echo(self) -> None:
        for raw in self.proc.stdout:  # (a reader always: a full pipe would block the server's logging)
            line = raw.decode(errors="replace").rstrip("\n")
            self.lines.append(line)
            print(f"[{self.name}] {line}", file=sys.stderr, flush=True)
        code = self.proc.wait()  # (its output ended: it exited)
        if code != 0 and self.serving and not self._stopping:  # (killed, crashed: the router only sees failed checks)
            log_exit(self, code)

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def terminate(self) -> None:
        self._stopping = True
        self.proc.terminate()

    def kill(self) -> None:
        self._stopping = True
        self.proc.kill()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout)

    def tail(self) -> str:
        if self.proc.poll() is not None:
            self._reader.join(2)  # (the rest of a dead child's output)
        return "\n".join(self.lines)


def wait_healthy(url: str, proc, timeout: float = 600.0) -> None:
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


def wait_all_healthy(instances: list, timeout: float = 600.0) -> None:
    """Every instance answers /health, or an error that names the first that did not, with its last lines."""
    import httpx

    deadline = time.time() + timeout
    waiting = list(instances)
    while waiting:
        for inst in list(waiting):
            code = inst.poll()
            if code is not None:
                raise RuntimeError(
                    f"{inst.name} ({inst.url}) exited with code {code} while starting; its last lines:\n{inst.tail()}"
                )
            try:
                if httpx.get(inst.url + "/health", timeout=1).status_code == 200:
                    waiting.remove(inst)
            except httpx.HTTPError:
                pass
        if waiting and time.time() > deadline:
            raise RuntimeError(
                f"{waiting[0].name} ({waiting[0].url}) did not become healthy within {timeout:g} s; its last "
                f"lines:\n{waiting[0].tail()}"
            )
        if waiting:
            time.sleep(0.2)


def stop(procs: list, grace: float = 15.0) -> None:
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
