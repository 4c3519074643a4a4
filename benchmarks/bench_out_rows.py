#!/usr/bin/env python3
"""What taking only the sampled rows through the last layer's o_proj and MLP saves in a prefill (one engine).

A fresh-prompt step through the fused step needs every row's K / V in every layer, but past the last layer's
attention only the rows that are sampled from (a prompt's last token). The runner passes those rows to the fused
step (out_rows); here one engine alternates between that and computing every row (the runner's forward wrapped
to drop out_rows), generate by generate, order swapped each round. Prints median TTFT per mode and the per-round
ratios.

    python benchmarks/bench_out_rows.py --batch 1 --output-len 1
    python benchmarks/bench_out_rows.py --batch 16 --output-len 1 --rounds 6
"""

from __future__ import annotations

import statistics

from ab_common import ab_parser, bench_model, timed_generate


def main() -> int:
    args = ab_parser(__doc__, batch=1, output_len=1, rounds=12, rounds_help="timed generates per mode").parse_args()
    import torch

    from infertune import LLM
    from infertune.bench.offline import read_model_config

    torch.set_num_threads(args.threads)
    model = bench_model(args.model)
    llm = LLM(str(model), dtype="bfloat16", enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    forward = runner._forward
    modes = {"sampled rows": forward, "every row": lambda ids, pos, meta, rows=None: forward(ids, pos, meta)}
    vocab = read_model_config(model)["vocab_size"]
    ttft = {m: [] for m in modes}
    names = list(modes)
    for r in range(-1, args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            runner._forward = modes[name]
            res = timed_generate(llm, args.batch, args.input_len, args.output_len, vocab, r)
            if r >= 0:
                ttft[name].append(res["ttft"] * 1e3)
    print(f"batch {args.batch} x {args.input_len} prompt tokens, {args.rounds} rounds, {model}")
    print("| mode | median TTFT ms |\n|---|---:|")
    for name in names:
        print(f"| {name} | {statistics.median(ttft[name]):.1f} |")
    ratios = [a / b for a, b in zip(ttft[names[0]], ttft[names[1]])]
    print(
        f"{names[0]} / {names[1]} per round: "
        + " ".join(f"{x:.2f}" for x in ratios)
        + f"; median {statistics.median(ratios):.2f}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
