#!/usr/bin/env python3
"""W8A16 prompts with AMX: the packed weight's words rebuilt in bf16 for the 12-bit weights' tile GEMM (with its SiLU
and residual epilogues), against AMX-INT8 tiles run twice on x's high and low bytes (gemm_w8p.c, it_w8p_tiles),
interleaved in one process on one engine so that machine drift cancels out; a bf16 engine (12-bit weights) beside
them for scale.

Each round times, in turn (the order reversed on odd rounds), a greedy generate of B random prompts x (input +
output) tokens with the tiles on, with them off, and on the bf16 engine. Reports the median TTFT and output tok/s of
each, and per-round TTFT ratios (tiles / int8 passes).

    python benchmarks/bench_w8p_tiles_ab.py --batch 16 --output-len 1 --rounds 5
    python benchmarks/bench_w8p_tiles_ab.py --batch 16 --output-len 1 --rounds 5 --model /tmp/infertune-bench/qwen3_moe-moe-random-bf16-v1
"""

from __future__ import annotations

import statistics

import torch
from ab_common import ab_parser, bench_model, timed_generate


def main() -> int:
    ap = ab_parser(__doc__, batch=16, output_len=1, rounds=5, rounds_help="timed rounds over the three runs")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from infertune import LLM
    from infertune.kernels import cpu

    lib = cpu.library()
    if not (cpu.available() and cpu.amx()):
        raise SystemExit(f"this A/B needs the AVX-512 library with AMX: {cpu.describe()}")
    path = str(bench_model(args.model))
    max_len = args.input_len + args.output_len + 8
    w8 = LLM(path, quantization="w8a16", max_model_len=max_len, enable_prefix_caching=False)
    bf16 = LLM(path, max_model_len=max_len, enable_prefix_caching=False)
    vocab = w8.config.model.arch.vocab_size

    def run(name: str, r: int) -> dict:
        if name == "bf16":
            return timed_generate(bf16, args.batch, args.input_len, args.output_len, vocab, r)
        lib.it_w8p_tiles(1 if name == "w8a16 tiles" else 0)
        try:
            return timed_generate(w8, args.batch, args.input_len, args.output_len, vocab, r)
        finally:
            lib.it_w8p_tiles(1)

    names = ["w8a16 tiles", "w8a16 int8 passes", "bf16"]
    for name in names:  # warm-up
        run(name, -1)
    res = {name: [] for name in names}
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            res[name].append(run(name, r))
    print(f"{path}: {args.batch} x ({args.input_len} + {args.output_len}), {args.threads} threads, {cpu.describe()}")
    print(f"{'run':20s} {'TTFT s':>8s} {'output tok/s':>13s}")
    for name in names:
        ttft = statistics.median(x["ttft"] for x in res[name])
        out = statistics.median(x["out"] for x in res[name])
        print(f"{name:20s} {ttft:8.3f} {out:13.1f}")
    ratios = [a["ttft"] / b["ttft"] for a, b in zip(res["w8a16 tiles"], res["w8a16 int8 passes"])]
    print("TTFT tiles / int8 passes by round:", ", ".join(f"{x:.2f}" for x in ratios))
    ratios = [a["ttft"] / b["ttft"] for a, b in zip(res["w8a16 tiles"], res["bf16"])]
    print("TTFT tiles / bf16 by round:", ", ".join(f"{x:.2f}" for x in ratios))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
