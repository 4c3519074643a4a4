"""What every worker of the offline benchmark shares, whichever system it runs (infertune, HF, llama.cpp).

The parent (offline.py) and the workers (offline_workers.py, peers.py) both build on this module and it on neither:
the result line's marker, the seeded prompts (identical for every system), the warm-up + timed-runs loop and the
RSS readings. (peer_vllm.py runs under vLLM's own interpreter without infertune, so it keeps a copy of the marker.)
"""

from __future__ import annotations

import resource
import time

from infertune.bench.offline_models import SPECIAL_TOKENS, VOCAB_SIZE, log

RESULT_MARKER = "@@BENCH_RESULT@@ "


def make_prompts(seed: int, batch: int, run: int, input_len: int, vocab: int) -> list[list[int]]:
    """Random token ids, identical for every system. run = -1 is the warm-up. Ids avoid the top of the
    vocabulary (the special tokens here). Each run gets fresh prompts so no prefix cache can hit."""
    import random

    rng = random.Random(f"{seed}/{batch}/{run}")
    high = max(2, min(vocab, VOCAB_SIZE) - len(SPECIAL_TOKENS))
    return [[rng.randrange(high) for _ in range(input_len)] for _ in range(batch)]


def peak_rss_mib() -> float:
    """Peak RSS of this process since its exec: VmHWM. (ru_maxrss is no good here: Linux carries it over
    fork + exec, so a worker would report its parent's peak when that is higher.)"""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux, a fallback


def current_rss_mib() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def warm_and_time(label: str, once, repeats: int) -> tuple[float, list[dict]]:
    """One untimed warm-up run (prompts of run -1), then `repeats` timed runs; returns (warm-up seconds, runs)."""
    log(f"{label}: warm-up run")
    t0 = time.perf_counter()
    once(-1)
    warmup_s = time.perf_counter() - t0
    runs = []
    for r in range(repeats):
        log(f"{label}: timed run {r + 1}/{repeats}")
        runs.append(once(r))
    return warmup_s, runs
