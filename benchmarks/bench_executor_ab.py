#!/usr/bin/env python3
"""What the worker process costs: the same model in-process (uni) and in a worker process (mp), side by side.

Both engines are loaded in one run and interleaved generate by generate, the order reversed every other round
(ab_common.interleave). Each mp step pickles its SchedulerOutput down a pipe and the SamplerOutput back; the
figures say what that round trip costs at batch 1 and 16.

    python benchmarks/bench_executor_ab.py --batch 1 --output-len 128
    python benchmarks/bench_executor_ab.py --batch 16 --output-len 128
"""

from __future__ import annotations

import statistics

from ab_common import ab_parser, bench_model, interleave


def main() -> int:
    args = ab_parser(__doc__, batch=1, output_len=128, rounds=4, rounds_help="timed generates per engine").parse_args()
    import torch

    from infertune import LLM
    from infertune.bench.offline import read_model_config

    torch.set_num_threads(args.threads)
    model = bench_model(args.model)
    kv = args.batch * (args.input_len + args.output_len)
    engines = {
        b: LLM(
            str(model),
            dtype="bfloat16",
            enable_prefix_caching=False,
            distributed_executor_backend=b,
            max_num_seqs=max(args.batch, 1),
            max_model_len=args.input_len + args.output_len,
        )
        for b in ("uni", "mp")
    }
    vocab = read_model_config(model)["vocab_size"]
    res = interleave(engines, args.batch, args.input_len, args.output_len, vocab, args.rounds)
    print(
        f"batch {args.batch}, {args.input_len} + {args.output_len} tokens, {args.rounds} rounds, {model} "
        f"({kv} KV tokens)"
    )
    print("| executor | output tok/s | decode tok/s | TTFT ms |\n|---|---:|---:|---:|")
    for name, runs in res.items():
        out, dec = (statistics.median(r[k] for r in runs) for k in ("out", "dec"))
        print(f"| {name} | {out:.1f} | {dec:.1f} | {statistics.median(r['ttft'] for r in runs) * 1e3:.1f} |")
    ratios = [m["dec"] / u["dec"] for m, u in zip(res["mp"], res["uni"])]
    print(
        "mp / uni decode tok/s per round: "
        + " ".join(f"{x:.3f}" for x in ratios)
        + f"; median {statistics.median(ratios):.3f}"
    )
    engines["mp"].engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
