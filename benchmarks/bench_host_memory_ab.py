#!/usr/bin/env python3
"""What keeping freed host memory gains: prefill TTFT and page faults with the CPU backend's malloc settings on
(the default) and off (INFERTUNE_KEEP_HOST_MEMORY=0), in alternating fresh processes.

The setting is made once per process, so each side runs in its own worker; the sides take turns (off, on, on,
off, ...) so that machine drift hits both alike. Each worker loads the 386M benchmark model in bf16, runs one
untimed warm-up generate, then `--repeats` timed prefills of B prompts (max_tokens=1) and reports the median TTFT
and the minor page faults per prefill.

    python benchmarks/bench_host_memory_ab.py --batch 1,16 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ab_common import bench_model

WORKER = r"""
import json, resource, statistics, sys, time
sys.path.insert(0, sys.argv[1])
import torch
from ab_common import timed_generate
from infertune import LLM
model, batch, input_len, repeats, threads = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
torch.set_num_threads(threads)
llm = LLM(model, dtype="bfloat16", max_model_len=input_len + 2, max_num_seqs=batch, kv_cache_memory_bytes=256 << 20,
          enable_prefix_caching=False)
vocab = llm.engine.config.model.arch.vocab_size
timed_generate(llm, batch, input_len, 2, vocab, -1)
ttft, faults = [], []
for r in range(repeats):
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    ttft.append(timed_generate(llm, batch, input_len, 1, vocab, r)["ttft"])
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
print(json.dumps({"ttft": statistics.median(ttft), "faults": statistics.median(faults)}))
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the 386m preset of bench throughput)")
    ap.add_argument("--batch", default="1,16", help="comma list of prompts per prefill (default: 1,16)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3, help="workers per side and batch (default: 3)")
    ap.add_argument("--repeats", type=int, default=3, help="timed prefills per worker (default: 3)")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    model = bench_model(args.model)
    here = str(Path(__file__).resolve().parent)
    print(
        f"$ python benchmarks/bench_host_memory_ab.py --batch {args.batch} --input-len {args.input_len} "
        f"--rounds {args.rounds} --repeats {args.repeats}"
    )
    print(f"model {model}, bf16, {args.threads} threads; medians over {args.rounds} workers x {args.repeats} prefills")
    print("| prompts | host memory | TTFT s | page faults per prefill | TTFT off / on (per round) |")
    print("|---:|---|---:|---:|---|")
    for batch in (int(b) for b in args.batch.split(",")):
        res: dict[str, list[dict]] = {"off": [], "on": []}
        for r in range(args.rounds):
            for side in ("off", "on") if r % 2 == 0 else ("on", "off"):
                env = {**os.environ, "INFERTUNE_KEEP_HOST_MEMORY": "1" if side == "on" else "0"}
                out = subprocess.run(
                    [
                        sys.executable,
                        "-c",
                        WORKER,
                        here,
                        str(model),
                        str(batch),
                        str(args.input_len),
                        str(args.repeats),
                        str(args.threads),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                if out.returncode:
                    print(out.stderr[-2000:], file=sys.stderr)
                    return 1
                res[side].append(json.loads(out.stdout.strip().splitlines()[-1]))
        ratios = ", ".join(f"{a['ttft'] / b['ttft']:.2f}" for a, b in zip(res["off"], res["on"]))
        for side in ("off", "on"):
            rows = res[side]
            print(
                f"| {batch} | {side} | {statistics.median(x['ttft'] for x in rows):.3f} | "
                f"{statistics.median(x['faults'] for x in rows):,.0f} | {ratios if side == 'on' else ''} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
