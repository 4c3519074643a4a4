"""Servers for the server tests: uvicorn in a thread of the test process, or `infertune serve` in its own."""

from __future__ import annotations

import subprocess
import sys
import tempfile
import threading
import time

import httpx
import uvicorn

from infertune.config import EngineConfig
from infertune.engine.async_engine import AsyncLLMEngine
from infertune.engine.llm_engine import LLMEngine
from infertune.router.instances import free_port  # (never the same port twice in a process)
from infertune.serve.api_server import create_app

MAX_LEN = 64
MODEL = "tiny"
ENGINE = dict(dtype="float32", max_model_len=MAX_LEN, block_size=4, max_num_seqs=16)


class ServerThread:
    """uvicorn in a background thread, on a free port, stopped by should_exit."""

    def __init__(self, path, api_key=None, max_body_bytes=4 * 2**20, model=MODEL, app=None, **engine):
        """model: the served name (or names); app: more create_app options (chat_template ...)."""
        self.engine = AsyncLLMEngine(LLMEngine(EngineConfig.create(str(path), **{**ENGINE, **engine})))
        app = create_app(self.engine, model, api_key=api_key, max_body_bytes=max_body_bytes, **(app or {}))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.TransportError:
                time.sleep(0.05)
        raise RuntimeError("server did not start")

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)


def post(server, path: str, body, **kw) -> httpx.Response:
    """A JSON POST to one of server's routes."""
    return httpx.post(server.url + path, json=body, timeout=60, **kw)


def metric(url: str, name: str, default: float | None = None) -> float:
    """A sample's value from /metrics; `default` for a labelled series that has no sample yet (a counter whose
    label value never occurred), else KeyError."""
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:
        return default
    raise KeyError(name)


def wait_until(predicate, timeout: float = 15.0) -> bool:
    """Poll predicate every 50 ms until it holds or timeout passes; its last value."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def wait_healthy(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError("server did not start")


class ServerProcess:
    """`infertune serve` in its own process (so its RSS is its own, and signals reach only it)."""

    def __init__(self, model, *flags: str, grace: float = 10.0, unset: tuple[str, ...] = ()) -> None:
        """`unset`: flags of the defaults below left off the command line (for a --config file to set: a flag written
        on the command line wins over the file, as in vLLM)."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = [
            sys.executable,
            "-m",
            "infertune.cli",
            "serve",
            "--model",
            str(model),
            "--port",
            str(self.port),
            "--served-model-name",
            MODEL,
            "--dtype",
            "float32",
            "--max-model-len",
            str(MAX_LEN),
            "--block-size",
            "4",
            "--max-num-seqs",
            "16",
            "--graceful-timeout",
            str(grace),
            *flags,
        ]
        for flag in unset:  # (each default flag takes one value)
            i = self.args.index(flag)
            del self.args[i : i + 2]
        self.proc: subprocess.Popen | None = None
        self.log = ""

    def __enter__(self):
        # A file, not a pipe: nobody reads while the test runs, and a full pipe would block the server's logging.
        self._log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(self.args, stdout=self._log, stderr=subprocess.STDOUT, text=True)
        try:
            wait_healthy(self.url, proc=self.proc)
        except RuntimeError:
            self.__exit__()
            raise RuntimeError(f"the server did not start:\n{self.log[-3000:]}") from None
        return self

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        self._log.seek(0)
        self.log = self._log.read()
        self._log.close()
