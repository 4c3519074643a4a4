#!/usr/bin/env python3
"""Two builds of the CPU kernels' C source in one process: generate time with one or the other, alternating.

bench_builds_ab.py compares two checkouts in fresh processes, and this machine's phases (up to 2x) swamp a change
of 5-10% there. Here both sources are compiled (with the CFLAGS of infertune/kernels/cpu.py) and loaded side by
side; one engine runs, and before each generate its fused step is pointed at one build or the other (order A B,
B A, ...). Only the fused step's entry point (it_decode_layers) is switched, so the change must keep the C
structs (it_model, it_layer, it_step) as they are. Each generate is `--batch` prompts of `--input-len` random
tokens and `--output-len` new tokens, greedy; prompts of up to 128 tokens in all run through the fused step.

    git worktree add -f /tmp/base HEAD~1 --detach
    python benchmarks/bench_kernel_builds.py --a /tmp/base/infertune/kernels/csrc/x86/avx512/avx512.c

The AVX2 library: point --a and --b at avx2.c sources and run the engine on it (INFERTUNE_CPU_ISA=avx2, with
ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 for torch's part). Both builds get this process's prefetch settings.
"""

from __future__ import annotations

import random
import statistics
import tempfile
import time

from ab_common import ab_parser, bench_model, load_build


def main() -> int:
    ap = ab_parser(__doc__, batch=1, output_len=1, rounds=12, rounds_help="timed generates per build")
    ap.add_argument("--a", required=True, help="the baseline kernels source (a tree's csrc/x86/avx512/avx512.c)")
    ap.add_argument(
        "--b", default="infertune/kernels/csrc/x86/avx512/avx512.c", help="the changed source (avx512.c or avx2.c)"
    )
    ap.add_argument("--quantization", choices=["w8a16", "w4a16", "w8a8"], default=None, help="(default: none)")
    args = ap.parse_args()

    import torch

    from infertune import LLM, SamplingParams
    from infertune.kernels import cpu as kernels

    torch.set_num_threads(args.threads)
    if not kernels.available():
        print(f"kernels unavailable: {kernels.unavailable_reason()}")
        return 1
    builds = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, src in (("A", args.a), ("B", args.b)):
            builds.append(load_build(src, tmp, name, "avx2" if src.endswith("avx2.c") else "avx512"))
        model = str(bench_model(args.model))
        llm = LLM(
            model,
            dtype="bfloat16",
            enable_prefix_caching=False,
            max_num_seqs=max(args.batch, 1),
            quantization=args.quantization,
        )
        fused = llm.engine.executor.runner.fused  # (None where the engine has no fused step; .decoder: x86_fused)
        real = kernels._lib
        vocab = llm.engine.config.model.arch.vocab_size
        params = SamplingParams(max_tokens=args.output_len, temperature=0.0, ignore_eos=True)
        rng = random.Random(0)
        times: list[list[float]] = [[], []]
        parts: list[list[dict]] = [[], []]  # the fused step's own split per generate (kernels.FUSED_PARTS), if it ran
        print(
            f"$ python benchmarks/bench_kernel_builds.py --a {args.a} --b {args.b} --batch {args.batch} "
            f"--input-len {args.input_len} --output-len {args.output_len} --rounds {args.rounds}"
            + (f" --quantization {args.quantization}" if args.quantization else "")
        )
        try:
            for r in range(args.rounds + 1):  # round 0 warms both builds up, untimed
                for i in (0, 1) if r % 2 == 0 else (1, 0):
                    kernels._lib = builds[i]  # every kernel call from here on: linears, norms, the fused step
                    if fused is not None:
                        fused.decoder.lib = builds[i]
                    prompts = [
                        {"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.input_len)]}
                        for _ in range(args.batch)
                    ]
                    if fused is not None:  # (the engine's own counters, as each build of ABI 4+ writes them)
                        fused.step_timers(reset=True)
                    t = time.perf_counter()
                    llm.generate(prompts, params, use_tqdm=False)
                    if r:
                        times[i].append(time.perf_counter() - t)
                        split = fused.step_timers(reset=True) if fused is not None else {"calls": 0}
                        if split.pop("calls") > 0:
                            split.pop("rows")
                            parts[i].append(split)
        finally:
            kernels._lib = real
            if fused is not None:
                fused.lib = real
    a, b = (statistics.median(t) * 1e3 for t in times)
    print(f"| build | median ms per generate |\n|---|---:|\n| A {args.a} | {a:.1f} |\n| B {args.b} | {b:.1f} |")
    print("B / A per round: " + " ".join(f"{y / x:.2f}" for x, y in zip(*times)) + f"; medians {b / a:.2f}")
    if parts[0] and parts[1]:  # the fused step's parts, medians over the generates, ms
        print("| fused step part | A ms | B ms | B / A |\n|---|---:|---:|---:|")
        for name in kernels.FUSED_PARTS:
            pa, pb = (statistics.median(p[name] for p in ps) * 1e3 for ps in parts)
            print(f"| {name} | {pa:.2f} | {pb:.2f} | {pb / pa if pa else float('nan'):.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
