"""The P/D split measured: router + 2 colocated replicas against router + 1 prefill + 1 decode instance.

Each instance is an `infertune serve` process with `threads` threads (OMP_NUM_THREADS); both setups have the same
instances and threads, so they differ only in where the prefills run. The workload (`infertune bench serve`,
Poisson arrivals, greedy) alternates a long prompt with a short output and a short prompt with a long output, the
same requests at the same times for both. What P/D should show: a flatter TPOT (decode steps no longer wait for the
prompts arriving beside them), paid for with an HTTP hop and a KV copy per request. Used by
`benchmarks/bench_pd.py` and `infertune ledger --pd`.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from infertune.bench.serve_data import WORDS
from infertune.router.launch import free_port, spawn_serve, stop, wait_healthy

LABELS = {"pd": "router + 1 prefill + 1 decode", "colocated": "router + 2 colocated replicas"}


@dataclass(slots=True)
class Workload:
    num_prompts: int = 40
    request_rate: float = 2.0
    long_input: int = 600  # words of a long prompt (the bench's estimate counts a word as a token)
    short_input: int = 16
    long_output: int = 96
    short_output: int = 4


def write_dataset(path: Path, w: Workload) -> None:
    """Alternating requests: a long prompt with a short output, a short prompt with a long output."""
    rng = random.Random(0)
    with path.open("w") as f:
        for i in range(w.num_prompts):
            words, out = (w.long_input, w.short_output) if i % 2 == 0 else (w.short_input, w.long_output)
            prompt = " ".join(rng.choice(WORDS) for _ in range(words))
            f.write(json.dumps({"prompt": prompt, "output_len": out}) + "\n")


def run_setup(name: str, serve_flags: list[str], w: Workload, data: Path, workdir: Path, threads: int) -> dict:
    """Start the setup's two instances and router, run the workload through it, stop them; bench serve's summary
    (with, for P/D, the decode side's prompt tokens computed and loaded)."""
    logs = (workdir / f"{name}.log").open("w")
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{p}" for p in ports]
    if name == "pd":
        kv = json.dumps({"path": str(workdir / "kv")})
        extra = [["--kv-role", role, "--kv-connector-config", kv] for role in ("producer", "consumer")]
        router_args = ["--prefill", urls[0], "--decode", urls[1]]
    else:
        extra = [[], []]
        router_args = ["--replica", *urls, "--policy", "least_loaded"]
    procs = []
    try:
        for port, more in zip(ports, extra):
            procs.append(spawn_serve([*serve_flags, "--served-model-name", "m", *more], port, threads, stdout=logs))
            wait_healthy(f"http://127.0.0.1:{port}", procs[-1])  # one at a time: the consumer checks the producer
        rport = free_port()
        cmd = [sys.executable, "-m", "infertune.cli", "router", *router_args, "--port", str(rport)]
        procs.append(subprocess.Popen(cmd, stdout=logs, stderr=subprocess.STDOUT))
        rurl = f"http://127.0.0.1:{rport}"
        wait_healthy(rurl, procs[-1], 60)
        out = workdir / f"{name}.json"
        bench = [sys.executable, "-m", "infertune.cli", "bench", "serve", "--url", rurl, "--model", "m"]
        bench += ["--dataset", str(data), "--temperature", "0", "--no-progress", "--seed", "0"]
        subprocess.run([*bench, "--num-prompts", "4"], check=False, capture_output=True)  # warm-up
        run = ["--num-prompts", str(w.num_prompts), "--request-rate", str(w.request_rate), "--json", str(out)]
        subprocess.run([*bench, *run], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        summary = json.loads(out.read_text())["summary"]
        if name == "pd":  # the decode side must have loaded the prompts, not computed them
            import httpx

            text = httpx.get(urls[1] + "/metrics").text
            wanted = ("infertune_prefill_tokens_computed_total", "infertune_kv_transfer_tokens_loaded_total")
            summary["decode_side"] = {
                line.split(" ")[0]: float(line.split(" ")[1]) for line in text.splitlines() if line.startswith(wanted)
            }
        return summary
    finally:
        stop(procs)
        logs.close()


def compare(serve_flags: list[str], w: Workload, threads: int = 1, setups=("pd", "colocated"), log=None) -> dict:
    """{setup: summary} for each setup, run one after the other in a scratch folder."""
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory(prefix="bench-pd-") as tmp:
        workdir = Path(tmp)
        data = workdir / "mix.jsonl"
        write_dataset(data, w)
        for name in setups:
            t = time.perf_counter()
            results[name] = run_setup(name, serve_flags, w, data, workdir, threads)
            if log is not None:
                log(f"{name}: done in {time.perf_counter() - t:.0f} s")
    return results


def render(results: dict) -> str:
    """The setups' TTFT / TPOT percentiles as a markdown table, and the decode side's counters."""
    lines = [
        "| setup | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | req/s | failed |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda v, d: "–" if v is None else f"{v:.{d}f}"  # noqa: E731
    for name, s in results.items():
        t, p = s["ttft_ms"], s["tpot_ms"]
        lines.append(
            f"| {LABELS[name]} | {fmt(t['p50'], 0)} | {fmt(t['p99'], 0)} | {fmt(p['p50'], 1)} | {fmt(p['p99'], 1)} | "
            f"{fmt(s['request_throughput'], 2)} | {s['failed']} |"
        )
    decode = results.get("pd", {}).get("decode_side")
    if decode:
        computed = decode.get("infertune_prefill_tokens_computed_total")
        loaded = decode.get("infertune_kv_transfer_tokens_loaded_total")
        lines += ["", f"Decode side: {computed:.0f} prompt tokens computed, {loaded:.0f} loaded from the prefill side."]
    for name, s in results.items():
        if s["failed"]:
            lines.append(f"{LABELS[name]}: failed requests: {s['errors']}")
    return "\n".join(lines)
