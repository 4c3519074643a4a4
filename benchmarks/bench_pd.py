"""Router + 1 prefill + 1 decode instance against router + 2 colocated replicas, under a mix of long prompts and
long outputs: TTFT and TPOT p50 / p99 from `infertune bench serve` (the same workload and arrivals for both).

Each instance is an `infertune serve` process with --threads-per-instance threads (OMP_NUM_THREADS); the two setups
use the same number of instances and threads, so the comparison is of where the prefills run, not of how much
hardware each setup has (infertune/bench/pd.py; `infertune ledger --pd` runs the same).

    python benchmarks/bench_pd.py                      # the built-in demo model, 40 requests at 2 req/s
    python benchmarks/bench_pd.py --model DIR --dtype bfloat16 --num-prompts 16 --request-rate 0.25
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
from pathlib import Path

from infertune.bench.pd import Workload, compare, render
from infertune.config import default_model_path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=default_model_path())
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-prompts", type=int, default=40)
    ap.add_argument("--request-rate", type=float, default=2.0)
    ap.add_argument("--long-input", type=int, default=600, help="words of a long prompt (default: 600)")
    ap.add_argument("--short-input", type=int, default=16)
    ap.add_argument("--long-output", type=int, default=96)
    ap.add_argument("--short-output", type=int, default=4)
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--threads-per-instance", type=int, default=1)
    ap.add_argument("--setups", default="pd,colocated", help="which setups, in this order (default: pd,colocated)")
    args = ap.parse_args()
    print("$ python " + " ".join(shlex.quote(a) for a in sys.argv), flush=True)
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = (re.findall(r"^model name\s*:\s*(.+)$", cpuinfo, re.M) or ["unknown CPU"])[0]
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"CPU: {cpu}, {os.cpu_count()} cores, load {load:.1f}; {args.threads_per_instance} thread(s) per instance")
    flags = ["--model", args.model, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len)]
    flags += ["--max-num-seqs", "32"]
    w = Workload(
        args.num_prompts, args.request_rate, args.long_input, args.short_input, args.long_output, args.short_output
    )
    results = compare(flags, w, args.threads_per_instance, args.setups.split(","), log=lambda m: print(m, flush=True))
    print(render(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
