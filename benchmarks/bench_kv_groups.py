#!/usr/bin/env python3
"""KV cache groups of equal size against one group a kind: how many sequences of max_model_len a fixed KV budget
holds, and what the extra groups cost a decode step, side by side in one process.

The model is Gemma-3-1B-shaped (benchmarks/build_gemma3_1b_shape.py: 26 layers, a window of 512 on five of six, 1
KV head of 256, random bf16 weights; built on first use). "one group a kind" is the engine before the cut: the
windowed layers in one group and the full ones in another, a block id a page of each of the 22 windowed layers, so a
full-attention token paid 22 layers' pages (kv_cache_groups with max_groups=1); "equal groups" is the engine's
default (7 groups of 4 layers' pages). Capacity is the engine's own arithmetic: the blocks the budget buys over the
most blocks one sequence of max_model_len holds (KVCacheInfo.max_blocks_per_seq). Speed: --batch prompts of
--prompt-len random tokens then --decode tokens each, greedy, the two settings alternating for --rounds rounds;
decode tok/s from the engine's own request timings (first token to last).
"""

from __future__ import annotations

import argparse
import functools
import gc
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--model", type=Path, default=Path("/tmp/infertune-bench/gemma3-1b-v32k"))
ap.add_argument("--contexts", default="4096,32768", help="max_model_len values to count sequences at")
ap.add_argument("--budget", default="1Gi", help="the KV budget (kv_cache_memory_bytes) the capacity is counted in")
ap.add_argument("--batch", type=int, default=16)
ap.add_argument("--prompt-len", type=int, default=1024)
ap.add_argument("--decode", type=int, default=64)
ap.add_argument("--rounds", type=int, default=3, help="speed rounds (0: capacity only)")
ap.add_argument("--threads", type=int, default=2)
args = ap.parse_args()

print("$ python " + " ".join(shlex.quote(a) for a in sys.argv), flush=True)
if not (args.model / "config.json").exists():
    here = Path(__file__).resolve().parent
    subprocess.run([sys.executable, str(here / "build_gemma3_1b_shape.py"), str(args.model)], check=True)

import torch  # noqa: E402

import infertune.runner.model_runner as model_runner  # noqa: E402
from infertune import LLM, SamplingParams  # noqa: E402

torch.set_num_threads(args.threads)
EQUAL = model_runner.kv_cache_groups
SETTINGS = {"one group a kind": functools.partial(EQUAL, max_groups=1), "equal groups": EQUAL}


def engine(setting: str, **kw) -> LLM:
    model_runner.kv_cache_groups = SETTINGS[setting]
    try:
        return LLM(str(args.model), dtype="bfloat16", **kw)
    finally:
        model_runner.kv_cache_groups = EQUAL


def close(llm: LLM) -> None:
    llm.engine.shutdown() if hasattr(llm.engine, "shutdown") else None
    del llm
    gc.collect()


print(
    "\n| max_model_len | setting | groups (layers each) | pages a block | blocks a sequence | blocks in the budget "
    "| sequences at once |"
)
print("|---:|---|---|---:|---:|---:|---:|")
capacity = {}
for ctx in (int(c) for c in args.contexts.split(",")):
    for setting in SETTINGS:
        llm = engine(setting, max_model_len=ctx, kv_cache_memory_bytes=args.budget, max_num_seqs=1024)
        info = llm.engine.executor.kv_cache_info
        sizes = [len(g.layers) for g in info.groups]
        seqs = info.num_blocks // info.max_blocks_per_seq
        capacity[ctx, setting] = seqs
        print(
            f"| {ctx} | {setting} | {len(sizes)} ({','.join(map(str, sizes))}) | {max(sizes)} | "
            f"{info.max_blocks_per_seq} | {info.num_blocks} | {seqs} |",
            flush=True,
        )
        close(llm)
    print(
        f"| {ctx} | equal / one a kind | | | | | **{capacity[ctx, 'equal groups'] / capacity[ctx, 'one group a kind']:.2f}x** |"
    )

if args.rounds:
    g = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=args.decode, temperature=0.0, ignore_eos=True, detokenize=False)
    ctx = args.prompt_len + args.decode
    llms = {s: engine(s, max_model_len=ctx, kv_cache_memory_bytes=args.budget) for s in SETTINGS}
    rates: dict[str, list[float]] = {s: [] for s in SETTINGS}
    for r in range(args.rounds + 1):  # (round 0: warm-up)
        for setting in SETTINGS if r % 2 else reversed(list(SETTINGS)):
            prompts = [torch.randint(0, 32000, (args.prompt_len,), generator=g).tolist() for _ in range(args.batch)]
            t0 = time.perf_counter()
            outs = llms[setting].generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            total = time.perf_counter() - t0
            first = max(o.metrics.first_token_time for o in outs)
            last = max(o.metrics.finished_time for o in outs)
            rate = args.batch * (args.decode - 1) / (last - first)
            if r:
                rates[setting].append(rate)
            print(f"round {r} {setting}: {total:.2f} s, decode {rate:.1f} tok/s", flush=True)
    a, b = (statistics.median(rates[s]) for s in SETTINGS)
    print(
        f"\ndecode tok/s, {args.batch} x ({args.prompt_len} + {args.decode}), medians of {args.rounds}: one group a "
        f"kind {a:.1f}, equal groups {b:.1f} ({b / a:.3f}x; rounds "
        + ", ".join(f"{y / x:.3f}" for x, y in zip(*rates.values()))
        + ")"
    )
