#!/usr/bin/env python3
"""The fused decode step's attention alone: AMX tiles against the AVX-512 path and torch's paged SDPA.

A batch of B sequences of L cached tokens each, the 386M model's heads (14 query heads, 2 KV heads, head_dim 64),
one cache per layer for `--layers` layers with scattered blocks (as a running server's are), as one decode step
would meet them. Between steps a 256 MiB buffer is read, as the weights' stream evicts the cache in a real step.
The three paths alternate step by step; prints the median milliseconds per step (all layers) of each.

    python benchmarks/bench_attention.py --batch 16 --context 192
"""

from __future__ import annotations

import argparse
import statistics
from types import SimpleNamespace

from ab_common import alternating_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=192, help="cached tokens per sequence (default: 192)")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--heads", default="14,2,64", help="query heads, KV heads, head_dim (default: 14,2,64)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch

    from infertune.kernels import cpu as kernels
    from infertune.layers.attention.paged import TorchPagedAttention

    if not kernels.available():
        print(f"the CPU kernels are unavailable: {kernels.unavailable_reason()}")
        return 1
    torch.set_num_threads(args.threads)
    hq, hkv, d = (int(x) for x in args.heads.split(","))
    b, ctx, bs = args.batch, args.context, args.block_size
    per_seq = -(-ctx // bs)
    num_blocks = b * per_seq
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(num_blocks, generator=gen).view(b, per_seq)
    lens = torch.full((b,), ctx, dtype=torch.int64)
    caches = [torch.randn(2, num_blocks, bs, hkv, d, generator=gen).to(torch.bfloat16) for _ in range(args.layers)]
    q = torch.randn(b, hq, d, generator=gen).to(torch.bfloat16)
    scale = d**-0.5
    torch_attn = TorchPagedAttention()
    flush = torch.ones(64 << 20)  # 256 MiB

    def kernel(amx):
        return lambda cache: kernels.decode_attention(q, cache, tables, lens, hkv, scale, use_amx=amx)

    def torch_paged(cache):
        meta = SimpleNamespace(decode_block_tables=tables, decode_context_lens=lens, step_cache={})
        return torch_attn._decode(q, cache, meta, scale, None, None)

    paths = {"kernel, AMX": kernel(True), "kernel, AVX-512": kernel(False), "torch paged SDPA": torch_paged}
    if not kernels._amx:
        del paths["kernel, AMX"]
    steps = {name: (lambda fn=fn: [fn(cache) for cache in caches]) for name, fn in paths.items()}
    times = alternating_ms(steps, args.steps, before=flush.sum)
    print(
        f"$ python benchmarks/bench_attention.py --batch {b} --context {ctx} --layers {args.layers} "
        f"--heads {args.heads} --block-size {bs} --steps {args.steps}"
    )
    print(f"{args.threads} threads; medians over {args.steps} steps, the paths alternating")
    print("| path | ms per step | vs torch |")
    print("|---|---:|---:|")
    base = statistics.median(times["torch paged SDPA"])
    for name, ts in times.items():
        print(f"| {name} | {statistics.median(ts):.2f} | {base / statistics.median(ts):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
