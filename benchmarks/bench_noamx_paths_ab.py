#!/usr/bin/env python3
"""The AVX-512 library's small-batch paths without AMX, each against the path before it, interleaved in one process.

--path bf16c-reg: 12-bit weights at 1-16 rows multiplied from the registers the tiles are decoded into
(csrc/x86/avx512/bf16c_noamx.c) against the slab GEMM at every row count (it_bf16c_reg_rows(0)); the default 12-bit
engine (compress_weights="auto").
--path q-dq: W8A16 / W4A16 from it_q_dq_rows rows (4 / 8) to 16, their weight rows rebuilt in bf16 a block at a time
for the bf16 GEMV (csrc/x86/avx512/gemv_quant.c linear_q_dq), against the int16-activation kernels at every row count
(it_q_dq_rows(kind, 17)); give --quantization.

Two parts, each taking turns round by round: the kernels (a decode step's linears of the 386M model at each --rows,
24 layers of qkv, o_proj, gate_up, down, every layer its own weights, so each step streams them from memory), then
one engine's whole greedy generates (--batches prompts x (input + output) tokens, fused decode step), with the path
switched on and off between turns. The switch is a process-wide setting of the loaded library, so both sides run the
same engine and weights. Prints the CPU, the kernels and per-round ratios (on / off).

    python benchmarks/bench_noamx_paths_ab.py --path bf16c-reg --rows 1,4,8,16 --batches 1,16
    python benchmarks/bench_noamx_paths_ab.py --path q-dq --quantization w8a16,w4a16 --rows 2,4,8,16 --batches 4,16
"""

from __future__ import annotations

import statistics

from ab_common import ab_parser, alternating_ms, bench_model, timed_generate

SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # (N, K) of qkv, o_proj, gate_up, down


def switch(lib, path: str, on: bool, defaults: dict) -> None:
    if path == "bf16c-reg":
        lib.it_bf16c_reg_rows(defaults["reg"] if on else 0)
    else:
        for kind in (1, 2):
            lib.it_q_dq_rows(kind, defaults[kind] if on else 17)


def step_calls(torch, kernels, path: str, quant: str, layers: int) -> list:
    """A decode step's linears of the 386M model as (call, K) pairs, each layer its own random weights."""
    from infertune.quant import int4 as q4
    from infertune.quant.int8 import quantize_int8_per_channel

    gen = torch.Generator().manual_seed(0)
    calls = []
    for _ in range(layers):
        for n, k in SHAPES:
            w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
            if path == "bf16c-reg":
                p = kernels.pack_bf16c(w)  # (the lambda keeps the packed tensors the struct points into alive)
                d = kernels.bf16c_struct(p)
                calls.append((lambda x, p=p, d=d, n=n: kernels.linear_bf16c(x, d, n), k))
            elif quant == "w8a16":
                q, s = quantize_int8_per_channel(w.float())
                calls.append((lambda x, q=q, s=s: kernels.linear_w8(x, q, s), k))
            else:
                q, s, z = q4.quantize_int4_groupwise(w, 128)
                p = kernels.pack_w4(q)
                calls.append((lambda x, p=p, s=s, z=z: kernels.linear_w4(x, p, s, z, 128), k))
    return calls


def main() -> int:
    ap = ab_parser(__doc__, batch=1, output_len=32, rounds=3, rounds_help="timed rounds of each part")
    ap.add_argument("--path", choices=("bf16c-reg", "q-dq"), required=True)
    ap.add_argument("--quantization", default="w8a16", help="q-dq: comma list of w8a16, w4a16 (default: w8a16)")
    ap.add_argument("--rows", default="1,16", help="kernel part: comma list of row counts (default: 1,16)")
    ap.add_argument("--layers", type=int, default=24, help="kernel part: layers a step (default: 24)")
    ap.add_argument("--batches", default="1", help="engine part: comma list of batch sizes (0: skip it)")
    args = ap.parse_args()

    import torch

    from infertune import LLM
    from infertune.bench.offline import cpu_model, read_model_config
    from infertune.kernels import cpu as kernels

    torch.set_num_threads(args.threads)
    lib = kernels.library() if kernels.available() else None
    if lib is None or kernels.amx() or not hasattr(lib, "it_q_dq_rows"):
        print(f"these paths are the AVX-512 library's without AMX; here: {kernels.describe()}")
        return 1
    defaults = {"reg": lib.it_bf16c_reg_rows(-1), 1: lib.it_q_dq_rows(1, 0), 2: lib.it_q_dq_rows(2, 0)}
    quants = ["none"] if args.path == "bf16c-reg" else args.quantization.split(",")
    print(
        f"$ python benchmarks/bench_noamx_paths_ab.py --path {args.path} --quantization {','.join(quants)} "
        f"--rows {args.rows} --batches {args.batches} --rounds {args.rounds}"
    )
    print(f"CPU: {cpu_model()}; kernels: {kernels.describe()}; {args.threads} threads; defaults {defaults}")
    try:
        print(
            "\n| weights | rows | off: ms a step's linears | on | speed-up (off ms / on ms) |\n|---|---:|---:|---:|---:|"
        )
        for quant in quants:
            calls = step_calls(torch, kernels, args.path, quant, args.layers)
            for m in (int(r) for r in args.rows.split(",")):
                xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (896, 4864)}

                def step(on: bool, xs=xs, calls=calls) -> None:
                    switch(lib, args.path, on, defaults)
                    for fn, k in calls:
                        fn(xs[k])

                t = alternating_ms({"off": lambda: step(False), "on": lambda: step(True)}, 4 * args.rounds)
                off, on = statistics.median(t["off"]), statistics.median(t["on"])
                print(f"| {quant} | {m} | {off:.1f} | {on:.1f} | {off / on:.2f}x |", flush=True)
            del calls
        batches = [int(b) for b in args.batches.split(",") if int(b) > 0]
        if batches:
            model = bench_model(args.model)
            vocab = read_model_config(model)["vocab_size"]
            print("\n| weights | batch | off: decode tok/s | on | on / off per round |\n|---|---:|---:|---:|---|")
            for quant in quants:
                for b in batches:
                    opts = {} if quant == "none" else {"quantization": quant}
                    llm = LLM(str(model), max_model_len=args.input_len + args.output_len + 16, max_num_seqs=b, **opts)

                    def gen(on: bool, run: int, llm=llm, b=b) -> dict:
                        switch(lib, args.path, on, defaults)
                        return timed_generate(llm, b, args.input_len, args.output_len, vocab, run)

                    gen(False, -1), gen(True, -1)  # (warm-up)
                    res = {"off": [], "on": []}
                    for r in range(args.rounds):  # (the order reversed on odd rounds, so drift hits both alike)
                        for side in ("off", "on") if r % 2 == 0 else ("on", "off"):
                            res[side].append(gen(side == "on", r))
                    off, on = (statistics.median(r["dec"] for r in res[s]) for s in ("off", "on"))
                    per = ", ".join(f"{a['dec'] / o['dec']:.2f}" for a, o in zip(res["on"], res["off"]))
                    print(f"| {quant} | {b} | {off:.1f} | {on:.1f} | {per} |", flush=True)
                    del llm
    finally:
        switch(lib, args.path, True, defaults)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
