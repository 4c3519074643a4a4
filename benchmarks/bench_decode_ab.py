#!/usr/bin/env python3
"""What each decode fast path gains, interleaved in one process so machine drift cancels out.

Engines on the same checkpoint with decode_kernels="off" (torch's matmuls, oneDNN-prepacked bf16 weights),
"linear" (infertune's GEMV / AMX kernels under the per-op PyTorch forward) and "auto" (the kernels plus the fused
decode step: every layer in one call, workspace allocated once, attention read straight from the paged blocks)
take turns, each a full generate of B prompts x (input + output) tokens, greedy, EOS ignored. Reports the median
TTFT, decode tok/s and output tok/s of each, and per-round ratios against "off". On this 2-core machine separate
processes minutes apart differ by more than some of these effects, which is why this script exists beside
`infertune bench throughput`.

    python benchmarks/bench_decode_ab.py --batch 1 --quantization none,w8a16,w4a16
    python benchmarks/bench_decode_ab.py --batch 16
    python benchmarks/bench_decode_ab.py --batch 16 --output-len 128 --modes auto-bf16,auto
    python benchmarks/bench_decode_ab.py --batch 1 --quantization w8a16,w4a16 --modes auto,auto-q8head
"""

from __future__ import annotations

import statistics

from ab_common import ab_parser, bench_model, interleave

# engine name -> its options: decode_kernels, and for "auto-bf16" the plain bf16 weights (compress_weights="off")
# instead of the default lossless 12-bit layout
MODES = {
    "off": dict(decode_kernels="off"),
    "linear": dict(decode_kernels="linear"),
    "auto": dict(decode_kernels="auto"),
    "auto-bf16": dict(decode_kernels="auto", compress_weights="off"),
    "auto-q8head": dict(decode_kernels="auto", quantize_lm_head=True),  # (with --quantization w8a16 / w4a16)
}


def main() -> int:
    ap = ab_parser(__doc__, batch=1, output_len=64, rounds=3, rounds_help="timed rounds over every engine")
    ap.add_argument("--quantization", default="none", help="comma list of none, w8a16, w4a16 (default: none)")
    ap.add_argument(
        "--modes",
        default="off,linear,auto",
        help=f"comma list of engines among {', '.join(MODES)}; ratios are against the first (default: off,linear,auto)",
    )
    args = ap.parse_args()
    modes = args.modes.split(",")
    if not modes or any(m not in MODES for m in modes):
        ap.error(f"--modes {args.modes}: each must be one of {', '.join(MODES)}")
    if "auto-q8head" in modes and "none" in args.quantization.split(","):
        ap.error("--modes auto-q8head quantizes the LM head of a quantized model: give --quantization w8a16 / w4a16")

    import torch

    from infertune import LLM
    from infertune.bench.offline import read_model_config

    torch.set_num_threads(args.threads)
    model = bench_model(args.model)
    vocab = read_model_config(model)["vocab_size"]
    print(
        f"$ python benchmarks/bench_decode_ab.py --batch {args.batch} --input-len {args.input_len} "
        f"--output-len {args.output_len} --rounds {args.rounds} --quantization {args.quantization} --modes {args.modes}"
    )
    print(f"model {model}, bf16, {args.threads} threads, batch {args.batch}")
    print(f"| weights | engine | TTFT s | decode tok/s | output tok/s | decode vs {modes[0]} (per round) |")
    print("|---|---|---:|---:|---:|---|")
    for quant in args.quantization.split(","):
        q = None if quant == "none" else quant
        opts = dict(
            dtype="bfloat16",
            max_model_len=args.input_len + args.output_len,
            max_num_seqs=args.batch,
            kv_cache_memory_bytes=256 << 20,
            enable_prefix_caching=False,
            quantization=q,
        )
        engines = {mode: LLM(str(model), **MODES[mode], **opts) for mode in modes}
        res = interleave(engines, args.batch, args.input_len, args.output_len, vocab, args.rounds)
        for name, rows in res.items():
            ratio = ", ".join(f"{a['dec'] / b['dec']:.2f}" for a, b in zip(rows, res[modes[0]]))
            print(
                f"| {quant} | {name} | {statistics.median(r['ttft'] for r in rows):.3f} | "
                f"{statistics.median(r['dec'] for r in rows):.1f} | {statistics.median(r['out'] for r in rows):.1f} "
                f"| {ratio} |",
                flush=True,
            )
        del engines
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
