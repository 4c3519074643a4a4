"""`infertune router`: one OpenAI-compatible endpoint in front of prefill + decode instances or of replicas."""

from __future__ import annotations

import argparse
import logging

from infertune.config import port_number
from infertune.router.policy import POLICIES

DESCRIPTION = (
    "Route OpenAI requests to other infertune servers. Prefill/decode disaggregation: --prefill URL... (servers "
    "started with --kv-role producer) and --decode URL... (--kv-role consumer): each request's prompt is computed "
    "on a prefill instance, its KV blocks move to a decode instance (the KV connector), which decodes and answers. "
    "Data parallel: --replica URL... (plain servers): each request goes whole to one replica, by prefix-cache "
    "affinity and requests in flight. Before serving it asks each instance what it is (GET /kv_transfer) and "
    "refuses to start, naming each one, where a --prefill URL is not a producer, a --decode URL not a consumer, a "
    "--replica has a role, or P and D instances differ in connector or KV layout. See docs/distributed.md."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--prefill", nargs="+", default=[], metavar="URL", help="prefill instances (serve --kv-role producer)"
    )
    p.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode instances (serve --kv-role consumer)")
    p.add_argument("--replica", nargs="+", default=[], metavar="URL", help="colocated replicas (data parallel)")
    p.add_argument(
        "--policy",
        choices=POLICIES,
        default=None,
        help="how an instance of each role is picked: round_robin, least_loaded (fewest requests in flight), "
        "affinity (the default: the instance that last served the prompt's first characters, where they are likely "
        "still in its prefix cache, unless it has 4 more requests in flight than the least loaded one)",
    )
    p.add_argument(
        "--prefix-chars",
        type=int,
        default=256,
        help="characters of the prompt that make its affinity key (default: 256)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1)")
    p.add_argument("--port", type=port_number, default=8000, help="port, 0-65535 (default: 8000)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds an upstream answer may take (default: 600)")
    p.add_argument("--connect-timeout", type=float, default=5.0, help="seconds to connect to an instance (default: 5)")


def build(args: argparse.Namespace):
    from infertune.router.app import Router

    return Router(
        args.prefill,
        args.decode,
        args.replica,
        args.policy,
        timeout_s=args.timeout,
        connect_timeout_s=args.connect_timeout,
        prefix_chars=args.prefix_chars,
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    router = build(args)
    log = logging.getLogger("infertune.router")
    logging.getLogger("infertune").setLevel(logging.INFO)
    try:
        unchecked = router.check_instances(args.connect_timeout)
    except ValueError as e:
        raise SystemExit(f"infertune router: {e}") from None
    for url in unchecked:
        log.warning("%s does not answer GET /kv_transfer now: its role and KV layout are checked by its first use", url)
    shown = ", ".join(f"{i.role} {i.url}" for i in router.instances())
    log.info("routing on http://%s:%d/v1 to %s", args.host, args.port, shown)
    uvicorn.run(router.app(), host=args.host, port=args.port, log_level="warning")
    return 0
