#!/usr/bin/env python3
"""The sampler's cost per decode step: infertune's Sampler against the sort + exponential-race sampler it
replaced (kept here as the baseline), on B rows of a V-token vocabulary; and greedy rows through the torch formula
against the CPU kernels' greedy_tokens (one pass a row, no copy).

Two kinds of logits: "peaked" (a trained model's: a few tokens hold most of the mass; here N(0, 1) * 4 plus a
Zipf-like ramp), where top-p finds its prefix among the 256 candidates, and "flat" (the random benchmark
model's), where it falls back to the full sort. The two samplers alternate; prints the median ms per call.

    python benchmarks/bench_sampler.py --batch 16 --vocab 32000
"""

from __future__ import annotations

import argparse
import statistics

from ab_common import alternating_ms


def race_sampler(logits, params, generator):
    """The previous algorithm: full sort for top-k / top-p, then argmax(p / q) with q ~ Exp(1) per token."""
    import torch

    temps = torch.tensor([p.temperature for p in params]).unsqueeze(1)
    logits = logits / temps
    vocab = logits.shape[-1]
    if any(0 < p.top_k < vocab or p.top_p < 1.0 for p in params):
        vals, order = logits.sort(dim=-1, descending=True)
        k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params]).unsqueeze(1)
        drop = torch.arange(vocab).unsqueeze(0) >= k
        probs = vals.masked_fill(drop, float("-inf")).softmax(dim=-1)
        drop |= probs.cumsum(dim=-1) - probs >= torch.tensor([p.top_p for p in params]).unsqueeze(1)
        logits = logits.scatter(1, order, vals.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    q = torch.empty_like(probs).exponential_(generator=generator)
    return (probs / q).argmax(dim=-1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from infertune import SamplingParams
    from infertune.runner.sampler import Sampler, SampleRequest

    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    b, v = args.batch, args.vocab
    ramp = -torch.log1p(torch.arange(v, dtype=torch.float32)) * 2  # Zipf-like
    kinds = {
        "peaked": torch.randn(b, v, generator=gen) * 4 + ramp[torch.randperm(v, generator=gen)],
        "flat": torch.randn(b, v, generator=gen) * 0.01,
    }
    settings = {
        "temperature 1.0": dict(temperature=1.0),
        "temperature 0.8, top_p 0.95": dict(temperature=0.8, top_p=0.95),
        "temperature 0.7, top_k 50": dict(temperature=0.7, top_k=50),
    }
    sampler = Sampler(seed=0)
    print(f"$ python benchmarks/bench_sampler.py --batch {b} --vocab {v} --iters {args.iters}")
    print(f"{args.threads} threads; median ms per call over {args.iters} calls, the two samplers alternating")
    print("| logits | sampling | sort + race (before) ms | infertune ms | speed-up |")
    print("|---|---|---:|---:|---:|")
    for kind, logits in kinds.items():
        for name, kw in settings.items():
            params = [SamplingParams(**kw) for _ in range(b)]
            rows = [SampleRequest(p, [0], []) for p in params]
            times = alternating_ms(
                {
                    "race": lambda logits=logits, params=params: race_sampler(logits, params, gen),
                    "infertune": lambda logits=logits, rows=rows: sampler(logits, rows),
                },
                args.iters,
            )
            a, n = statistics.median(times["race"]), statistics.median(times["infertune"])
            print(f"| {kind} | {name} | {a:.2f} | {n:.2f} | {a / n:.1f}x |")
    # Greedy: the torch formula (nan_to_num + argmax) against the backend kernels' greedy_tokens (csrc/sample.h)
    from infertune.kernels import x86

    ks = x86.kernels()
    if ks is None:
        print("\n(greedy: no CPU kernels here)")
        return 0
    print("\n| logits | greedy rows | torch (nan_to_num + argmax) ms | kernels ms | speed-up |")
    print("|---|---:|---:|---:|---:|")
    with_kernels = Sampler(seed=0, kernels=ks)
    for kind, logits in kinds.items():
        for rows_n in sorted({1, b}):
            part = logits[:rows_n]
            rows = [SampleRequest(SamplingParams(temperature=0.0), [0], []) for _ in range(rows_n)]
            times = alternating_ms(
                {
                    "torch": lambda part=part, rows=rows: sampler(part, rows),
                    "kernels": lambda part=part, rows=rows: with_kernels(part, rows),
                },
                args.iters,
            )
            a, n = statistics.median(times["torch"]), statistics.median(times["kernels"])
            print(f"| {kind} | {rows_n} | {a:.3f} | {n:.3f} | {a / n:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
