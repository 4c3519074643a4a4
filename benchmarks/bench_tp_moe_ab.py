#!/usr/bin/env python3
"""TP=2 on the MoE preset, one side of an A/B: `python benchmarks/bench_tp_moe_ab.py TREE BATCH [MODEL]`.

TREE is an infertune checkout (a git worktree of the base commit, or `.`); run the sides alternately. The workload
is the throughput bench's: BATCH prompts of 128 tokens, 128 new ones each, greedy, EOS ignored, on the MoE preset
(`infertune bench throughput --preset moe` builds it under /tmp/infertune-bench), tensor parallel over 2 worker
processes. Prints `RESULT TREE BATCH tok/s`: the median output tok/s of 3 timed generates after a warm-up. MODEL:
another model folder (default: the MoE preset's). With INFERTUNE_TP_SHM=0 in the environment the ranks have no
shared-memory segment, as ranks on two hosts.
"""

import sys
import time
from pathlib import Path

MODEL = "/tmp/infertune-bench/qwen3_moe-moe-random-bf16-v1"


def main() -> None:
    tree, batch = str(Path(sys.argv[1]).resolve()), int(sys.argv[2])
    model = sys.argv[3] if len(sys.argv) > 3 else MODEL
    import infertune
    from infertune import LLM, SamplingParams

    assert infertune.__file__.startswith(tree), f"{infertune.__file__} is not under {tree}"
    llm = LLM(model, dtype="bfloat16", tensor_parallel_size=2, max_model_len=512, max_num_seqs=16)

    def prompts(salt: int) -> list[dict]:
        return [
            {"prompt_token_ids": [(salt * 7919 + i * 131 + j * 17) % 30000 + 5 for j in range(128)]}
            for i in range(batch)
        ]

    params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=0)
    llm.generate(prompts(0), params, use_tqdm=False)
    rates = []
    for r in range(3):
        t = time.perf_counter()
        llm.generate(prompts(r + 1), params, use_tqdm=False)
        rates.append(batch * 128 / (time.perf_counter() - t))
    print("RESULT", tree, batch, sorted(rates)[1])
    llm.engine.shutdown()


# (the worker processes are spawned: they import this file again, with the tree first on their path too)
sys.path.insert(0, str(Path(sys.argv[1]).resolve()))

if __name__ == "__main__":
    main()
