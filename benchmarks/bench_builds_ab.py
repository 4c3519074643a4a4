#!/usr/bin/env python3
"""Two checkouts of infertune against each other: full generates in alternating fresh processes.

A kernel change cannot be switched off inside one process (the C library is built from the source it ships
with), so each side runs from its own tree (`git worktree add /tmp/base <rev>`) in a fresh worker per round;
the sides take turns (A, B, B, A, ...) so that machine drift hits both alike. Each worker loads the 386M
benchmark model in bf16, runs one untimed warm-up generate and `--repeats` timed ones of B prompts x (input +
output) tokens, greedy, EOS ignored, and reports its medians. Prints the medians of the workers of each side and
the per-round ratios B / A.

    git worktree add -f /tmp/base HEAD --detach
    python benchmarks/bench_builds_ab.py --a /tmp/base --b . --batch 16 --rounds 3
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from ab_common import ab_parser, bench_model

WORKER = r"""
import json, statistics, sys
sys.path.insert(0, sys.argv[1])
import torch
from ab_common import timed_generate
from infertune import LLM
model, batch, input_len, output_len, repeats, threads = sys.argv[2], *map(int, sys.argv[3:8])
quantization = sys.argv[8] if sys.argv[8] != "none" else None
torch.set_num_threads(threads)
llm = LLM(model, dtype="bfloat16", max_model_len=input_len + output_len + 8, max_num_seqs=batch,
          enable_prefix_caching=False, quantization=quantization)
vocab = llm.engine.config.model.arch.vocab_size
timed_generate(llm, batch, input_len, output_len, vocab, -1)
runs = [timed_generate(llm, batch, input_len, output_len, vocab, r) for r in range(repeats)]
import infertune
print(json.dumps({"source": infertune.__file__, **{k: statistics.median(x[k] for x in runs) for k in runs[0]}}))
"""


def main() -> int:
    ap = ab_parser(__doc__, batch=16, output_len=128, rounds=3, rounds_help="workers per side")
    ap.add_argument("--a", required=True, help="the baseline checkout (a folder holding infertune/)")
    ap.add_argument("--b", default=".", help="the changed checkout (default: .)")
    ap.add_argument("--repeats", type=int, default=2, help="timed generates per worker (default: 2)")
    ap.add_argument(
        "--quantization", choices=["none", "w8a16", "w4a16", "w8a8"], default="none", help="(default: none)"
    )
    args = ap.parse_args()

    model = bench_model(args.model)
    here = str(Path(__file__).resolve().parent)
    sides = {"A": Path(args.a).resolve(), "B": Path(args.b).resolve()}
    for name, root in sides.items():
        if not (root / "infertune" / "__init__.py").is_file():
            ap.error(f"--{name.lower()} {root}: no infertune/ package there")
    print(
        f"$ python benchmarks/bench_builds_ab.py --a {args.a} --b {args.b} --batch {args.batch} "
        f"--input-len {args.input_len} --output-len {args.output_len} --rounds {args.rounds} --repeats {args.repeats}"
        + (f" --quantization {args.quantization}" if args.quantization != "none" else "")
    )
    print(
        f"model {model}, bf16 ({args.quantization}), {args.threads} threads; medians over {args.rounds} workers x {args.repeats} generates"
    )
    res: dict[str, list[dict]] = {"A": [], "B": []}
    for r in range(args.rounds):
        for name in ("A", "B") if r % 2 == 0 else ("B", "A"):
            env = {**os.environ, "PYTHONPATH": str(sides[name])}
            out = subprocess.run(
                [
                    sys.executable,
                    "-c",
                    WORKER,
                    here,
                    str(model),
                    str(args.batch),
                    str(args.input_len),
                    str(args.output_len),
                    str(args.repeats),
                    str(args.threads),
                    args.quantization,
                ],
                env=env,
                capture_output=True,
                text=True,
                cwd=str(sides[name]),
            )
            if out.returncode:
                print(out.stderr[-3000:], file=sys.stderr)
                return 1
            row = json.loads(out.stdout.strip().splitlines()[-1])
            if not row.pop("source").startswith(str(sides[name])):
                print(f"side {name} did not import infertune from {sides[name]}", file=sys.stderr)
                return 1
            res[name].append(row)
            print(
                f"  round {r} {name}: TTFT {row['ttft']:.3f} s, decode {row['dec']:.1f} tok/s, "
                f"output {row['out']:.1f} tok/s",
                file=sys.stderr,
                flush=True,
            )
    print("| side | checkout | TTFT s | decode tok/s | output tok/s | output B / A per round |")
    print("|---|---|---:|---:|---:|---|")
    ratios = ", ".join(f"{b['out'] / a['out']:.2f}" for a, b in zip(res["A"], res["B"]))
    for name in ("A", "B"):
        rows = res[name]
        print(
            f"| {name} | {sides[name]} | {statistics.median(x['ttft'] for x in rows):.3f} | "
            f"{statistics.median(x['dec'] for x in rows):.1f} | {statistics.median(x['out'] for x in rows):.1f} | "
            f"{ratios if name == 'B' else ''} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
