#!/usr/bin/env python3
"""The fused step's decode attention alone, two builds of the kernels' C source in one process, alternating.

A decode step of `--batch` sequences of `--context` keys over `--layers` layers' paged caches (the 386M model's
heads by default: 14 query heads, 2 KV heads, head_dim 64, blocks of 16 keys placed at random, as a long-running
server's free list leaves them): one it_decode_attention call a layer straight through ctypes (no tensor built
per call: bench_attention.py goes through cpu.decode_attention, whose Python side costs ~40 us a layer). The
caches are evicted (a 256 MB read) before each step unless --in-cache, which instead runs every layer on the first
layer's cache (L2 / L3: the instructions' cost alone). Prints each build's median ms a step, the K / V bytes it
read per second and B's speed-up, and checks that both builds give the same outputs bit for bit.

    git worktree add -f /tmp/base HEAD~1 --detach
    python benchmarks/bench_attention_builds.py --a /tmp/base/infertune/kernels/csrc/x86/avx512/avx512.c
    python benchmarks/bench_attention_builds.py --variant avx2 --a /tmp/base/infertune/kernels/csrc/x86/avx2/avx2.c

--prompt times a prompt step instead: each of the --batch sequences brings its --context tokens as rows (row i sees
keys 0 .. i, the causal prefill the fused step runs in blocks of 16 rows a KV head).
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import tempfile

from ab_common import alternating_ms, load_build


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--a", required=True, help="the baseline kernels source (a tree's csrc/x86/avx512/avx512.c)")
    ap.add_argument("--b", default=None, help="the changed source (default: this tree's, of --variant)")
    ap.add_argument("--variant", default="avx512", choices=["avx512", "avx2"], help="the library both build (flags)")
    ap.add_argument("--batch", type=int, default=16, help="sequences, one decode row each (default: 16)")
    ap.add_argument("--context", type=int, default=192, help="keys of each sequence (default: 192)")
    ap.add_argument("--layers", type=int, default=24, help="(default: 24)")
    ap.add_argument("--heads", default="14,2,64", help="query heads, KV heads, head_dim (default: 14,2,64)")
    ap.add_argument("--block-size", type=int, default=16, help="(default: 16)")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per build (default: 30)")
    ap.add_argument("--in-cache", action="store_true", help="every layer on one cache, nothing evicted")
    ap.add_argument("--prompt", action="store_true", help="a prompt step: --context rows a sequence, causal")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--no-amx", action="store_true", help="the AVX-512 path where the CPU has AMX (default: the tiles, as the step)"
    )
    args = ap.parse_args()

    import torch

    from infertune.kernels import cpu as kernels

    torch.set_num_threads(args.threads)
    if not kernels.available():
        print(f"kernels unavailable: {kernels.unavailable_reason()}")
        return 1
    hq, hkv, d = map(int, args.heads.split(","))
    b, ctx, bs = args.batch, args.context, args.block_size
    per = -(-ctx // bs)
    nb = b * per
    gen = torch.Generator().manual_seed(0)
    tables = torch.randperm(nb, generator=gen).view(b, per).contiguous()
    rows = b * ctx if args.prompt else b  # the step's rows (T)
    if args.prompt:  # row i of a sequence: its i + 1 first keys, the sequence's block table
        tables = tables.repeat_interleave(ctx, 0).contiguous()
        lens = torch.arange(1, ctx + 1, dtype=torch.int64).repeat(b)
    else:
        lens = torch.full((b,), ctx, dtype=torch.int64)
    caches = [torch.randn(2, nb, bs, hkv, d, generator=gen).to(torch.bfloat16) for _ in range(args.layers)]
    if args.in_cache:
        caches = [caches[0]] * args.layers
    qkv = torch.randn(rows, (hq + 2 * hkv) * d, generator=gen).to(torch.bfloat16)
    model = kernels.ItModel(
        hidden=hq * d, n_heads=hq, n_kv_heads=hkv, head_dim=d, inter=hq * d, num_blocks=nb, block_size=bs,
        scale=d**-0.5, nthreads=args.threads, n_layers=1, kv_int8=0,
    )  # fmt: skip
    args.b = args.b or str(kernels.VARIANTS[args.variant].source)
    steps, outs, keep = {}, {}, []
    use_amx = int(args.variant == "avx512" and kernels.amx() and not args.no_amx)
    print(f"{'prompt' if args.prompt else 'decode'} attention on {'AMX tiles' if use_amx else args.variant}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, src in (("A", args.a), ("B", args.b)):
            lib = load_build(src, tmp, name, args.variant)
            nbytes = lib.it_decode_workspace_bytes(ctypes.byref(model), rows, per * bs)
            work = torch.empty(nbytes + 64, dtype=torch.uint8)
            step = kernels.ItStep(
                T=rows, block_tables=tables.data_ptr(), context_lens=lens.data_ptr(), max_blocks=per,
                work=(work.data_ptr() + 63) // 64 * 64, work_bytes=nbytes,
            )  # fmt: skip
            outs[name] = [torch.empty(rows, hq, d, dtype=torch.bfloat16) for _ in caches]
            calls = [
                (ctypes.byref(model), ctypes.byref(step), qkv.data_ptr(), c.data_ptr(), o.data_ptr(), use_amx)
                for c, o in zip(caches, outs[name])
            ]
            keep += [work, step]

            def run(f=lib.it_decode_attention, calls=calls):
                for c in calls:
                    if f(*c) != 0:
                        raise RuntimeError("it_decode_attention refused the shapes")

            steps[name] = run
        flush = torch.ones(1 if args.in_cache else 64 << 20)
        times = alternating_ms(steps, args.steps, before=flush.sum)
    kv = args.layers * b * ctx * hkv * d * 2 * 2
    med = {name: statistics.median(t) for name, t in times.items()}
    where = "in cache" if args.in_cache else "caches evicted"
    rows_note = " (prompt rows)" if args.prompt else ""
    print(f"{b} x {ctx} keys{rows_note}, {args.layers} layers, heads {hq}/{hkv}x{d}, blocks of {bs}, {where}:")
    for name in med:
        print(f"  {name}: {med[name]:.3f} ms a step, K / V read at {kv / med[name] / 1e6:.1f} GB/s")
    same = all(torch.equal(x, y) for x, y in zip(outs["A"], outs["B"]))
    print(f"  B / A speed-up {med['A'] / med['B']:.3f}; outputs identical: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
