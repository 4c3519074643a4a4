#!/usr/bin/env python
"""What one tensor-parallel all-reduce costs between the ranks of this host: gloo (torch.distributed over TCP on
127.0.0.1) against the shared-memory path (infertune/layers/shm_allreduce.py), at the shapes a step of the 386M model
sums ([T, 896] after each attention and MLP block: 48 a step), each rank pinned to its own CPU as the engine pins it.

    python benchmarks/bench_allreduce.py --ranks 2 --hidden 896 --tokens 1,16,256 --iters 300

Prints the median microseconds a call of each path (bf16 activations summed in fp32, as the engine does) and what
48 of them add to a decode step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time


def rank_main(rank: int, args, port: int, out) -> None:
    import torch
    import torch.distributed as dist

    from infertune.backends.cpu import CPUBackend
    from infertune.layers.parallel import TensorParallel
    from infertune.layers.shm_allreduce import ShmAllReduce

    CPUBackend().bind_rank(rank, args.ranks)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=args.ranks)
    tokens = [int(t) for t in args.tokens.split(",")]
    shm = ShmAllReduce.connect(rank, args.ranks, max(tokens) * args.hidden, dist.barrier, f"bench{port}")
    paths = {"gloo": TensorParallel(rank, args.ranks), "shared memory": TensorParallel(rank, args.ranks, shm=shm)}
    rows = []
    for t in tokens:
        x = torch.randn(t, args.hidden, generator=torch.Generator().manual_seed(t)).bfloat16()  # (alike on every rank)
        for name, tp in paths.items():
            want = x.float() * args.ranks  # every rank holds the same x: the sum is exact in fp32
            for _ in range(20):
                y = tp.all_reduce(x.clone())
            assert torch.equal(y.float(), want.bfloat16().float()), name
            times = []
            for _ in range(args.iters):
                y = x.clone()
                dist.barrier() if args.barrier else None
                t0 = time.perf_counter()
                tp.all_reduce(y)
                times.append(time.perf_counter() - t0)
            rows.append((t, name, statistics.median(times) * 1e6))
    if rank == 0:
        out.put(rows)
    shm.close()
    dist.destroy_process_group()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=896, help="activation width (default: 896, the 386M model's)")
    ap.add_argument("--tokens", default="1,16,256", help="rows of each all-reduce (default: 1,16,256)")
    ap.add_argument("--iters", type=int, default=300)
    ap.add_argument("--barrier", action="store_true", help="line the ranks up before each timed call")
    args = ap.parse_args()
    print(
        f"$ python benchmarks/bench_allreduce.py --ranks {args.ranks} --hidden {args.hidden} --tokens {args.tokens} "
        f"--iters {args.iters}" + (" --barrier" if args.barrier else "")
    )
    import multiprocessing as mp

    from infertune.bench.offline import cpu_model
    from infertune.executor.worker import free_port

    print(f"CPU: {cpu_model()}, {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.2f}")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=rank_main, args=(r, args, port, out)) for r in range(args.ranks)]
    for p in procs:
        p.start()
    rows = out.get(timeout=600)
    for p in procs:
        p.join(60)
    print(f"\n{'tokens':>6} {'path':<14} {'us / call':>10} {'x 48 a step, ms':>16}")
    for t, name, us in rows:
        print(f"{t:>6} {name:<14} {us:>10.1f} {48 * us / 1000:>16.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
