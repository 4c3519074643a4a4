"""Launch `infertune serve` instances and the router in front of them, from one command.

`serve --data-parallel-size N`: N colocated replicas. `serve --pd P:D`: P prefill instances (kv_role producer) and D
decode instances (kv_role consumer) with the local KV connector, in a KV directory of their own.

Each instance gets its own port and, unless OMP_NUM_THREADS is set, its share of the CPUs as threads (on a CPU host
N instances would otherwise oversubscribe the cores N times). By default the instances are child processes on
127.0.0.1; with placement "ray" each is a Ray actor that runs the server on one node (router/ray_instances.py).
Every instance's output is echoed with its name in front ([prefill-0] ...), and its last lines are kept: an
instance that exits while starting stops the others and raises an error naming it, with those lines. The router
runs in this process; when it stops (SIGINT / SIGTERM) the instances are stopped too.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import tempfile
import threading
from dataclasses import dataclass

from infertune.router.instances import ServeProcess, free_port, spawn_serve, stop, wait_all_healthy, wait_healthy

__all__ = ["free_port", "replica_argv", "serve_data_parallel", "serve_pd", "spawn_serve", "stop", "wait_healthy"]

log = logging.getLogger("infertune.router")

# serve's own flags that the launcher sets per instance (or that only the launcher reads), with whether each takes a
# value
_OWN_FLAGS = {
    "--data-parallel-size": True,
    "--port": True,
    "--host": True,
    "--pd": True,
    "--pd-device": True,
    "--placement": True,
}
PLACEMENTS = ("local", "ray")


def replica_argv(serve_argv: list[str]) -> list[str]:
    """serve's arguments without the flags the launcher sets per instance (--data-parallel-size, --port, --host,
    --pd, --pd-device, --placement)."""
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


def _exit_on_signal(signum, frame) -> None:
    raise SystemExit(128 + signum)


@dataclass(frozen=True)
class InstanceSpec:
    name: str  # prefill-0, decode-1, replica-0: how logs and errors name it
    argv: tuple[str, ...]  # serve's arguments, without --host / --port


def _start(specs: list[InstanceSpec], placement: str) -> tuple[list, int, object]:
    """The instances started (not yet healthy), the threads each got, and what stops the placement (or None)."""
    if placement == "ray":
        from infertune.router.ray_instances import RayPlacement

        ray_placement = RayPlacement(len(specs))
        try:
            return ray_placement.start(specs), ray_placement.threads, ray_placement
        except BaseException:
            ray_placement.close()
            raise
    threads = max(1, (os.cpu_count() or 1) // len(specs))
    return [ServeProcess(s.name, list(s.argv), threads) for s in specs], threads, None


def run_behind_router(specs: list[InstanceSpec], placement: str, host: str, port: int, **router) -> int:
    """Start the instances, wait until all are healthy, run the router (this process) on host:port in front of them
    (router: Router's prefill / decode / replicas as instance names); stop them all when it returns or fails."""
    import uvicorn

    from infertune.router.app import Router
    from infertune.serve.launcher import _graceful_server_class, listen_socket

    if placement not in PLACEMENTS:
        raise ValueError(f"--placement {placement!r}: choose one of {', '.join(PLACEMENTS)}")
    main_thread = threading.current_thread() is threading.main_thread()
    # (the router's port bound first: taken, it fails before any instance loads; free, nothing takes it meanwhile,
    # not even the ephemeral port of a health check to an instance)
    sock = listen_socket(host, port)
    port = sock.getsockname()[1]  # (port 0: the one the system gave)
    previous = signal.signal(signal.SIGTERM, _exit_on_signal) if main_thread else None  # (while starting: stop all)
    instances, ray_placement = [], None
    try:
        instances, threads, ray_placement = _start(specs, placement)
        wait_all_healthy(instances)
        for instance in instances:
            instance.serving = True  # (from here an instance's exit is news: logged by name, instances.log_exit)
        if main_thread:  # (the server's own handlers from here)
            signal.signal(signal.SIGTERM, previous)
        url = {i.name: i.url for i in instances}
        shown = ", ".join(f"{i.name} {i.url} (pid {i.pid})" for i in instances)
        log.info(
            "%d instances up, %d thread%s each (%s): %s; routing on http://%s:%d/v1",
            len(instances),
            threads,
            "s" * (threads > 1),
            "Ray actors on one node" if placement == "ray" else "child processes",
            shown,
            host,
            port,
        )
        app = Router(**{role: [url[n] for n in names] for role, names in router.items()}).app()
        # (uvicorn alone re-raises SIGTERM after its shutdown, which would end this process before the instances)
        _graceful_server_class()(uvicorn.Config(app, host=host, port=port, log_level="warning")).run(sockets=[sock])
    finally:
        sock.close()
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        stop(instances)
        if ray_placement is not None:
            ray_placement.close()
    return 0


def serve_data_parallel(serve_argv: list[str], size: int, host: str, port: int, placement: str = "local") -> int:
    """N replicas of `infertune serve` (serve_argv, the command's own arguments) and the router on host:port."""
    if size < 2:
        raise ValueError(f"--data-parallel-size {size}: give 2 or more replicas (1 is a plain serve)")
    argv = tuple(replica_argv(serve_argv))
    specs = [InstanceSpec(f"replica-{i}", argv) for i in range(size)]
    return run_behind_router(specs, placement, host, port, replicas=[s.name for s in specs])


def parse_pd(text: str) -> tuple[int, int] | int:
    """--pd's value: "P:D" -> (P, D); "auto" -> 2, "auto:N" -> N (instances in all, split by the planner)."""
    t = text.strip().lower()
    if t == "auto" or t.startswith("auto:"):
        n = t.partition(":")[2] or "2"
        if not n.isdigit() or int(n) < 2:
            raise ValueError(f"--pd {text!r}: auto:N needs N >= 2 instances in all (e.g. auto:4)")
        return int(n)
    p, sep, d = t.partition(":")
    if not sep or not p.isdigit() or not d.isdigit():
        raise ValueError(
            f"--pd {text!r}: give PREFILL:DECODE instance counts such as 1:1 or 1:3, or auto (auto:N for N instances)"
        )
    if int(p) < 1 or int(d) < 1:
        raise ValueError(f"--pd {text!r}: it takes at least 1 prefill and 1 decode instance")
    return int(p), int(d)


def _has_flag(argv: list[str], *names: str) -> bool:
    return any(a.split("=", 1)[0] in names for a in argv)


def serve_pd(
    serve_argv: list[str],
    pd: tuple[int, int],
    host: str,
    port: int,
    placement: str = "local",
    kv_connector_config: dict | None = None,
) -> int:
    """P prefill and D decode instances of `infertune serve` (serve_argv: the command's own arguments) with the local
    KV connector, and the router in P/D mode on host:port."""
    n_prefill, n_decode = pd
    argv = replica_argv(serve_argv)
    if _has_flag(argv, "--kv-role"):
        raise ValueError("--pd sets each instance's --kv-role (producer / consumer) itself: drop --kv-role")
    for i, a in enumerate(argv):
        name, _, value = a.partition("=")
        value = value or (argv[i + 1] if name == "--kv-connector" and i + 1 < len(argv) else "")
        if name == "--kv-connector" and value != "local":
            raise ValueError(
                f"--pd runs its instances on one host with the local KV connector, not --kv-connector {value}: "
                "start the instances by hand for another connector (docs/distributed.md)"
            )
    argv = [a for i, a in enumerate(argv) if not _own_connector_flag(argv, i)]
    cfg = dict(kv_connector_config or {})
    own_dir = "path" not in cfg
    if own_dir:  # a directory of its own, so that several launches on one host never see each other's producers
        base = "/dev/shm" if os.path.isdir("/dev/shm") else None
        cfg["path"] = tempfile.mkdtemp(prefix="infertune-kv-", dir=base)
    kv = ["--kv-connector", "local", "--kv-connector-config", json.dumps(cfg)]
    specs = [InstanceSpec(f"prefill-{i}", (*argv, "--kv-role", "producer", *kv)) for i in range(n_prefill)]
    specs += [InstanceSpec(f"decode-{i}", (*argv, "--kv-role", "consumer", *kv)) for i in range(n_decode)]
    log.info("P/D: %d prefill + %d decode instances, KV connector local under %s", n_prefill, n_decode, cfg["path"])
    try:
        return run_behind_router(
            specs,
            placement,
            host,
            port,
            prefill=[s.name for s in specs[:n_prefill]],
            decode=[s.name for s in specs[n_prefill:]],
        )
    finally:
        if own_dir:
            shutil.rmtree(cfg["path"], ignore_errors=True)


def _own_connector_flag(argv: list[str], i: int) -> bool:
    """argv[i] is --kv-connector / --kv-connector-config or its value (the launcher passes them itself)."""
    names = ("--kv-connector", "--kv-connector-config")
    if argv[i].split("=", 1)[0] in names:
        return True
    return i > 0 and argv[i - 1] in names
