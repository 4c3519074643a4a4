#!/usr/bin/env python3
"""A mixture-of-experts layer's router and experts, torch's reference path against the kernels (csrc/moe.h), per call.

The layer has the MoE preset's shape (`infertune bench throughput --preset moe`: hidden 1024, 64 experts of 384,
top-8); --layers copies of it (1.2 GB of experts at 8) are cycled, and before each timed call a --evict-mb buffer
is read (untimed) so that the call streams its experts' weights from memory, as a decode step of a whole model does
(this CPU's L3 can hold 300 MB). Per token count T it times, in alternation (the first round untimed):

  router   torch: F.linear + route() + group_by_expert (Router.forward_native); F.linear + the fused top-k
           (moe_route); the router as the layer runs it with the kernels (Router.forward_kernels: their GEMV and
           the fused top-k up to ROUTER_KERNEL_ROWS tokens, route() on a boundary tie and past them)
  experts  torch: the loop over the experts picked (Experts.forward_native); the grouped GEMM as built (the experts
           side by side on the threads, csrc/moe.h IT_MOE_SIDE_BY_SIDE_ROWS), and from a second build that runs
           them one after the other with each one's features split over the threads (-DIT_MOE_SIDE_BY_SIDE_ROWS=1000000)

and prints the median ms of each, with what the experts' weights read comes to in GB/s. With --quant w4a16 the
experts are int4 (groups of 128, quant/experts.py; --quant w8a16: int8) and the second build is the library without
the one-row path of quantized experts (moe.c moe_one_row, -DMOE_ONE_ROW_OFF=1: each expert's linears on their own,
as before it); with
--quant 12bit they are kept in the lossless 12-bit layout (layers/moe.py CompressedExperts).

    python benchmarks/bench_moe_kernels.py --tokens 1,4,16,64,128 --threads 2
    python benchmarks/bench_moe_kernels.py --quant w4a16 --tokens 1,2 --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys

import torch
import torch.nn.functional as F
from ab_common import alternating_ms


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,4,16,64,128", help="token counts T (default: 1,4,16,64,128)")
    ap.add_argument("--layers", type=int, default=8, help="copies of the layer cycled through (default: 8)")
    ap.add_argument("--steps", type=int, default=40, help="timed calls of each path per T (default: 40)")
    ap.add_argument("--evict-mb", type=int, default=512, help="read before each call, untimed (default: 512)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--quant",
        choices=("none", "w8a16", "w4a16", "12bit"),
        default="none",
        help="the experts' weights (default: bf16)",
    )
    args = ap.parse_args()
    tokens = [int(t) for t in args.tokens.split(",")]
    print(
        f"$ python benchmarks/bench_moe_kernels.py --tokens {args.tokens} --layers {args.layers} "
        f"--steps {args.steps} --evict-mb {args.evict_mb} --threads {args.threads} --quant {args.quant}"
    )

    from infertune.bench.offline import PRESETS, cpu_model
    from infertune.config import MoeArch
    from infertune.kernels import cpu, x86
    from infertune.layers.moe import CompressedExperts, Experts, Router
    from infertune.quant.experts import QuantizedExperts
    from infertune.quant.int4 import W4A16Method
    from infertune.quant.int8 import W8A16Method

    torch.set_num_threads(args.threads)
    if cpu.variant() not in ("avx512", "avx512-noamx"):
        print(f"the AVX-512 kernels do not run here: {cpu.describe()}")
        return 1
    print(f"CPU: {cpu_model()}; kernels: {cpu.describe()}; torch {torch.__version__}, {args.threads} threads")
    kernels = x86.kernels()
    forced = {}  # the same kernels with the experts' threading forced one way
    builds = {"features split": "-DIT_MOE_SIDE_BY_SIDE_ROWS=1000000", "one-row path off": "-DMOE_ONE_ROW_OFF=1"}
    for name in ("one-row path off",) if args.quant in ("w8a16", "w4a16") else ("features split",):
        flag = builds[name]
        lib = ctypes.CDLL(str(cpu.build_library(cpu.VARIANTS["avx512"], cpu._compiler(), (flag,))))
        assert cpu.check_abi(lib) is None
        cpu.declare(lib)
        lib.it_amx_init(int(kernels.amx))
        forced[name] = x86.X86Kernels()
        forced[name].lib = lib

    shape = PRESETS["moe"]
    hidden, inter = shape["hidden_size"], shape["moe_intermediate_size"]
    moe = MoeArch(
        num_experts=shape["num_experts"],
        top_k=shape["num_experts_per_tok"],
        intermediate_size=inter,
        layers=(0,),
        norm_topk_prob=True,
    )
    g = torch.Generator().manual_seed(0)
    routers, experts = [], []
    for _ in range(args.layers):  # HF's init, as the preset's random model has it
        r = Router(hidden, moe, torch.bfloat16)
        r.weight.data = (0.02 * torch.randn(moe.num_experts, hidden, generator=g)).bfloat16()
        e = Experts(hidden, moe, torch.bfloat16)
        e.gate_up_proj.data = (0.02 * torch.randn(e.gate_up_proj.shape, generator=g)).bfloat16()
        e.down_proj.data = (0.02 * torch.randn(e.down_proj.shape, generator=g)).bfloat16()
        if args.quant in ("w8a16", "w4a16"):
            make = (
                (lambda: W4A16Method(group_size=128, kernels=kernels))
                if args.quant == "w4a16"
                else (lambda: W8A16Method(kernels=kernels))
            )
            e.quant_method = QuantizedExperts(make)
            e.quant_method.process_weights_after_loading(e)
        elif args.quant == "12bit":
            e.quant_method = CompressedExperts(kernels)
            e.quant_method.process_weights_after_loading(e)
        for m in (r, e):
            m.requires_grad_(False)
            m.use_kernels(kernels)
        routers.append(r)
        experts.append(e)
    described = [e._kernel_experts for e in experts]
    evict = torch.ones(args.evict_mb << 18)  # fp32: evict_mb MiB
    # (int4: + fp32 scale and zero per 128; 12-bit: ~0.76x bf16, the codes and their tables)
    expert_bytes = 3 * hidden * inter * {"none": 2, "w8a16": 1, "w4a16": 0.5 + 8 / 128, "12bit": 2 * 0.76}[args.quant]

    print(f"\n{'T':>4} {'path':<48} {'ms':>8} {'GB/s':>6}")
    for t in tokens:
        xs = [torch.randn(t, hidden, generator=g).bfloat16() for _ in range(args.layers)]
        routings = [r.forward_native(x) for r, x in zip(routers, xs)]
        touched = statistics.mean(int((rt.counts > 0).sum()) for rt in routings)
        calls = layer_calls(routers, experts, described, kernels, forced, moe, xs, routings)
        times = alternating_ms(cycled(calls, args.layers), args.steps * args.layers, before=evict.sum)
        for name, ms in times.items():
            med = statistics.median(ms)
            gbs = f"{touched * expert_bytes / med / 1e6:6.1f}" if name.startswith("experts") else ""
            print(f"{t:>4} {name:<48} {med:8.3f} {gbs:>6}")
        print(f"     ({touched:.1f} experts of {moe.num_experts} touched a call)")
    return 0


def layer_calls(routers, experts, described, kernels, forced, moe, xs, routings) -> dict:
    """The paths timed, each a function of the layer index."""
    calls = {
        "router: torch (F.linear, route, group_by_expert)": lambda j: routers[j].forward_native(xs[j]),
        "router: F.linear + fused top-k": lambda j: kernels.moe_route(F.linear(xs[j], routers[j].weight), moe),
        "router: as the layer runs it (forward_kernels)": lambda j: routers[j].forward_kernels(xs[j]),
        "experts: torch, a loop over the experts picked": lambda j: experts[j].forward_native(xs[j], routings[j]),
        "experts: grouped GEMM (as built)": lambda j: kernels.moe_experts(xs[j], described[j], routings[j]),
    }
    for name, k in forced.items():
        calls[f"experts: grouped GEMM, {name}"] = lambda j, k=k: k.moe_experts(xs[j], described[j], routings[j])
    return calls


def cycled(calls: dict, layers: int) -> dict:
    """Each call of `calls` (layer index -> None) as a callable that takes the next layer every time it runs."""
    out = {}
    for name, fn in calls.items():
        state = {"n": 0}

        def call(fn=fn, state=state):
            fn(state["n"] % layers)
            state["n"] += 1

        out[name] = call
    return out


if __name__ == "__main__":
    sys.exit(main())
