#!/usr/bin/env python3
"""The GEMVs' weight prefetch, near against far, interleaved in one process so machine drift cancels out.

near: each weight row asks for its own bytes 1 KiB ahead, into L1 (what the kernels were tuned with on Intel Xeons).
far: each row asks for the same columns of the row whole blocks ahead (at least --far bytes), into L2 (csrc/bf16.h
pf_weights; the default on AMD CPUs). The 12-bit codec's stream asks 4 tiles ahead either way, into L1 (near) or L2
(far). "far, bf16 near": far for the int8 / int4 GEMVs, near for bf16 weights (plain and 12-bit): auto on AMD Zen 5
(kernels/cpu.py prefetch_bf16_bytes). The kernel section times a decode step's linears of the 386M model (24 layers
of qkv, o_proj, gate_up, down, each layer its own weights, so every step streams them from memory) in bf16, 12-bit
bf16 (where the library has it), W8A16 and W4A16 at one row; the engine section times whole batch-1 generates (fused
decode step) with each setting in turn. Prints which kernel variant ran, the CPU and a bandwidth probe, so rows from
different CPUs are not mixed up.

    python benchmarks/bench_prefetch.py
    python benchmarks/bench_prefetch.py --far 4096,16384 --quantization none,w8a16,w4a16 --rounds 3
"""

from __future__ import annotations

import statistics

from ab_common import ab_parser, alternating_ms, bench_model, timed_generate

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # (N, K) of qkv, o_proj, gate_up, down


def probe_gbps(torch) -> float:
    """Median read bandwidth of a 1 GiB fp32 sum (the benchmarks' probe)."""
    import time

    y = torch.ones(256 << 20)
    ts = []
    for _ in range(5):
        t = time.perf_counter()
        y.sum()
        ts.append(time.perf_counter() - t)
    return (1 << 30) / statistics.median(ts) / 1e9


def kernel_steps(torch, kernels, settings: dict, layers: int, steps: int) -> None:
    """Each weight kind's decode-step linears at one row, the settings alternating step by step."""
    from infertune.quant import int4 as q4

    gen = torch.Generator().manual_seed(0)
    x = {k: torch.randn(1, k, generator=gen).to(torch.bfloat16) for _, k in SHAPES}
    print(f"| weights | MB a step | {' | '.join(f'{s} ms (GB/s)' for s in settings)} | far / near (speed) |")
    print(f"|---|---:|{'---:|' * len(settings)}---:|")
    kinds = ["bf16"] + (["12-bit"] if kernels.bf16c_supported(896, 896) else []) + ["w8a16", "w4a16"]
    for kind in kinds:
        calls, nbytes = [], 0
        for _ in range(layers):
            for n, k in SHAPES:
                w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
                if kind == "bf16":
                    calls.append((lambda xx, w=w: kernels.linear_bf16(xx, w), k))
                    nbytes += w.numel() * 2
                elif kind == "12-bit":
                    p = kernels.pack_bf16c(w)  # (the lambda keeps the tensors the struct points into alive)
                    d = kernels.bf16c_struct(p)
                    calls.append((lambda xx, p=p, d=d, n=n: kernels.linear_bf16c(xx, d, n), k))
                    nbytes += sum(t.numel() * t.element_size() for t in p.values())
                elif kind == "w8a16":
                    s = w.float().abs().amax(1) / 127
                    q = torch.round(w.float() / s[:, None]).to(torch.int8)
                    calls.append((lambda xx, q=q, s=s: kernels.linear_w8(xx, q, s), k))
                    nbytes += q.numel() + s.numel() * 4
                else:
                    q, scale, zero = q4.quantize_int4_groupwise(w, 128)
                    packed = kernels.pack_w4(q)
                    calls.append((lambda xx, p=packed, sc=scale, z=zero: kernels.linear_w4(xx, p, sc, z, 128), k))
                    nbytes += packed.numel() + scale.numel() * 8

        def step(setting, calls=calls):
            kernels.set_prefetch(setting[0], bf16_far_bytes=setting[1])
            for fn, k in calls:
                fn(x[k])

        times = alternating_ms({name: (lambda v=v: step(v)) for name, v in settings.items()}, steps)
        meds = {name: statistics.median(t) for name, t in times.items()}
        names = list(settings)
        cells = " | ".join(f"{meds[n]:.1f} ({nbytes / meds[n] / 1e6:.1f})" for n in names)
        print(f"| {kind} | {nbytes / 1e6:.0f} | {cells} | {meds[names[0]] / meds[names[1]]:.2f}x |", flush=True)
        del calls


def main() -> int:
    ap = ab_parser(__doc__, batch=1, output_len=64, rounds=3, rounds_help="timed rounds over every setting")
    ap.add_argument("--far", default="4096", help="comma list of far distances in bytes (default: 4096)")
    ap.add_argument(
        "--quantization", default="none,w8a16,w4a16", help="engine section: comma list of none, w8a16, w4a16"
    )
    ap.add_argument("--layers", type=int, default=24, help="kernel section: layers of weights (default: 24)")
    ap.add_argument("--steps", type=int, default=8, help="kernel section: timed steps (default: 8)")
    ap.add_argument("--skip-engine", action="store_true", help="only the kernel section")
    args = ap.parse_args()
    try:
        fars = [int(v) for v in args.far.split(",")]
    except ValueError:
        ap.error(f"--far {args.far}: give distances in bytes, e.g. 4096,16384")
    if any(v <= 0 for v in fars):
        ap.error("--far: each distance must be > 0 (near is always run)")

    import torch

    from infertune import LLM
    from infertune.bench.offline import cpu_model, read_model_config
    from infertune.kernels import cpu as kernels

    if not kernels.available():
        print(f"the CPU kernels do not run here: {kernels.unavailable_reason()}")
        return 1
    torch.set_num_threads(args.threads)
    settings = {"near": (0, 0), **{f"far {v}": (v, v) for v in fars}, f"far {fars[0]}, bf16 near": (fars[0], 0)}
    print(
        f"$ python benchmarks/bench_prefetch.py --far {args.far} --quantization {args.quantization} "
        f"--rounds {args.rounds} --output-len {args.output_len} --threads {args.threads}"
    )
    print(
        f"CPU: {cpu_model()}; kernels: {kernels.describe()}; {args.threads} threads; probe {probe_gbps(torch):.1f} GB/s"
    )
    print("\nKernels: one decode step's linears at one row (median ms of alternating steps)\n")
    kernel_steps(torch, kernels, settings, args.layers, args.steps)
    if args.skip_engine:
        return 0
    model = bench_model(args.model)
    vocab = read_model_config(model)["vocab_size"]
    print(f"\nEngine: {model.name}, batch {args.batch}, {args.input_len} + {args.output_len}, fused decode step\n")
    print("| weights | setting | TTFT s | decode tok/s | decode vs near (per round) |")
    print("|---|---|---:|---:|---|")
    for quant in args.quantization.split(","):
        llm = LLM(
            str(model),
            dtype="bfloat16",
            max_model_len=args.input_len + args.output_len,
            max_num_seqs=args.batch,
            kv_cache_memory_bytes=256 << 20,
            enable_prefix_caching=False,
            quantization=None if quant == "none" else quant,
        )
        res = {name: [] for name in settings}
        timed_generate(llm, args.batch, args.input_len, args.output_len, vocab, -1)  # warm-up
        for r in range(args.rounds):
            order = list(settings) if r % 2 == 0 else list(settings)[::-1]
            for name in order:
                kernels.set_prefetch(settings[name][0], bf16_far_bytes=settings[name][1])
                res[name].append(timed_generate(llm, args.batch, args.input_len, args.output_len, vocab, r))
        for name, rows in res.items():
            ratio = ", ".join(f"{a['dec'] / b['dec']:.2f}" for a, b in zip(rows, res["near"]))
            print(
                f"| {quant} | {name} | {statistics.median(r['ttft'] for r in rows):.3f} | "
                f"{statistics.median(r['dec'] for r in rows):.1f} | {ratio} |",
                flush=True,
            )
        del llm
    kernels.set_prefetch(kernels.prefetch_bytes(), bf16_far_bytes=kernels.prefetch_bf16_bytes())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
