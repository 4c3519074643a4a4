"""Start the server: build the engine, log its capacity, run uvicorn, shut down gracefully on SIGTERM."""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import socket
from pathlib import Path

log = logging.getLogger("infertune.serve")


def serve(
    model: str | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | list[str] | None = None,
    max_body_bytes: int = 4 * 2**20,
    graceful_timeout_s: float = 10.0,
    log_level: str = "info",
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
    chat_template: str | None = None,
    **engine_options,
) -> int:
    import uvicorn

    # (imported here: the launcher of `serve --pd` / --data-parallel-size takes only the server class below, and its
    # process need not load torch)
    from infertune.config import EngineConfig
    from infertune.engine.async_engine import AsyncLLMEngine
    from infertune.engine.llm_engine import LLMEngine
    from infertune.serve.api_server import create_app

    if enable_auto_tool_choice and not tool_call_parser:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser NAME (docs/server.md)")

    template = load_chat_template(chat_template)  # (before the model loads: a bad template fails fast)
    with listen_socket(host, port) as sock:  # (so does a port in use; and nothing takes it while the model loads)
        port = sock.getsockname()[1]  # (port 0: the one the system gave)
        config = EngineConfig.create(model, **engine_options)
        engine = LLMEngine(config, show_progress=True)
        names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or ())
        names = names or [Path(config.model.model).name]
        name = names[0]  # (the one responses and /metrics report; every name is accepted)
        async_engine = AsyncLLMEngine(engine)
        app = create_app(
            async_engine,
            names,
            api_key=api_key,
            max_body_bytes=max_body_bytes,
            tool_call_parser=tool_call_parser,
            enable_auto_tool_choice=enable_auto_tool_choice,
            chat_template=template,
        )

        log.info("%s", async_engine.describe_limits())
        log.info(
            "serving %r (%s) on http://%s:%d/v1 with %s%s",
            name,
            config.model.model,
            host,
            port,
            engine.executor.describe(),
            f"; also named {', '.join(repr(n) for n in names[1:])}" if names[1:] else "",
        )
        server = _graceful_server_class()(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                log_level=log_level,
                timeout_graceful_shutdown=graceful_timeout_s,
            )
        )
        server.engine = async_engine  # (at the grace period's end its requests end, so their streams close cleanly)
        server.run(sockets=[sock])  # returns after SIGINT / SIGTERM once in-flight requests finish or the grace ends
    return 0


def listen_socket(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (uvicorn listens on it once the app is ready), as vLLM binds its own before the
    engine starts: a port in use is said at once rather than after minutes of loading, and while the model loads no
    other process, nor this one's own client connections (their ephemeral ports), can take it. Port 0: any free one."""
    try:
        found = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        family, kind, proto, _, addr = found[0]
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r}: not an address this machine can listen on ({e.strerror})") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as uvicorn: a restart may reuse a closing port)
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        raise ValueError(
            f"cannot listen on {host}:{port}: {e.strerror or e} (another server holds the port? pick another --port)"
        ) from None
    sock.set_inheritable(False)
    return sock


_JINJA_CHARS = "{}\n"
_ESCAPE = re.compile(r"\\[nrt]")  # (quotes and backslashes left to Jinja's own string literals)


def load_chat_template(value: str | None) -> str | None:
    """serve --chat-template as vLLM reads it: a file's text where the value names a readable file, else the value
    itself as a Jinja template (its \\n, \\t and \\r read as the newlines and tabs a shell line cannot hold); a value with
    none of { } or a newline that is not a readable file is an error naming it. The template is parsed here, so that
    a syntax error stops start-up instead of failing every chat request."""
    if value is None:
        return None
    try:
        text = Path(value).read_text(encoding="utf-8")
    except (OSError, ValueError) as e:  # (ValueError: a NUL in the value; OSError: a name too long, not a file ...)
        if not any(c in value for c in _JINJA_CHARS):
            raise ValueError(f"--chat-template {value!r} looks like a file path, but it cannot be read ({e})") from e
        text = _ESCAPE.sub(lambda m: {"n": "\n", "r": "\r", "t": "\t"}[m.group(0)[1]], value)
    import jinja2

    try:
        jinja2.Environment().parse(text)
    except jinja2.TemplateSyntaxError as e:
        raise ValueError(f"--chat-template: not a valid Jinja template (line {e.lineno}: {e.message})") from e
    return text


def _graceful_server_class():
    import uvicorn

    class GracefulServer(uvicorn.Server):
        """uvicorn re-raises SIGTERM after its graceful shutdown (so the process dies by the signal);
        a server that finished its work cleanly should exit 0 instead. Where it serves an engine (`engine`), the
        requests still running half a second before the grace period ends are ended (EngineDeadError "the server is
        shutting down"): a stream then closes with its error event and [DONE], a plain request gets its 503, where
        uvicorn would cancel their tasks mid-chunk."""

        engine = None

        async def shutdown(self, sockets=None):
            import asyncio

            grace, handle = self.config.timeout_graceful_shutdown, None
            if self.engine is not None and grace is not None:
                handle = asyncio.get_running_loop().call_later(max(grace - 0.5, 0.0), self.engine.end_in_flight)
            try:
                await super().shutdown(sockets)
            finally:
                if handle is not None:
                    handle.cancel()

        @contextlib.contextmanager
        def capture_signals(self):
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return GracefulServer
