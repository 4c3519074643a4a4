"""What the A/B scripts share: their options, the benchmark model, a timed generate, and alternating timers."""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def ab_parser(doc: str, batch: int, output_len: int, rounds: int, rounds_help: str) -> argparse.ArgumentParser:
    """The options every A/B script shares (--model, --batch, --input-len, --output-len, --rounds, --threads)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the 386m preset of bench throughput)")
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=output_len)
    ap.add_argument("--rounds", type=int, default=rounds, help=f"{rounds_help} (default: {rounds})")
    ap.add_argument("--threads", type=int, default=2)
    return ap


def bench_model(model: str | None) -> Path:
    """--model, or the 386m preset of `infertune bench throughput` (built once, cached in /tmp/infertune-bench)."""
    from infertune.bench.offline import ensure_model

    return Path(model) if model else ensure_model("386m", Path("/tmp/infertune-bench"))


def timed_generate(llm, batch: int, input_len: int, output_len: int, vocab: int, run: int) -> dict:
    """One greedy generate of `batch` random prompts (seeded by `run`): total s, TTFT s, output and decode tok/s."""
    from infertune import SamplingParams
    from infertune.bench.offline import make_prompts

    prompts = [{"prompt_token_ids": p} for p in make_prompts(0, batch, run, input_len, vocab)]
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    total = time.perf_counter() - t
    ttft = max(o.metrics.first_token_time for o in outs) - t
    return dict(total=total, ttft=ttft, out=batch * output_len / total, dec=batch * (output_len - 1) / (total - ttft))


def interleave(engines: dict, batch: int, input_len: int, output_len: int, vocab: int, rounds: int) -> dict:
    """One untimed warm-up per engine, then `rounds` rounds over every engine, the order reversed on odd rounds
    so that drift hits all alike. Returns {name: [timed_generate results]}."""
    names = list(engines)
    for name in names:  # warm-up
        timed_generate(engines[name], batch, input_len, output_len, vocab, -1)
    res = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            res[name].append(timed_generate(engines[name], batch, input_len, output_len, vocab, r))
    return res


def alternating_ms(paths: dict, steps: int, before=None) -> dict:
    """Each callable of `paths` once a step, in turn, for 1 + `steps` steps (the first untimed); `before()` runs
    ahead of each call, untimed (e.g. to evict the caches). Returns {name: [ms of each timed call]}."""
    times = {name: [] for name in paths}
    for step in range(steps + 1):
        for name, fn in paths.items():
            if before is not None:
                before()
            t = time.perf_counter()
            fn()
            if step:
                times[name].append((time.perf_counter() - t) * 1e3)
    return times


def load_build(src: str, out_dir: str, name: str, variant: str = "avx512"):
    """One kernels source (a tree's csrc/x86/avx512/avx512.c, or avx2.c with variant="avx2") compiled with the
    variant's flags and that tree's own headers ahead of this one's, loaded, declared and (AVX-512) AMX-initialised:
    a second build beside the process's, for A/B scripts."""
    import ctypes
    import subprocess

    from infertune.kernels import cpu

    so = Path(out_dir) / f"lib{name}.so"
    own = f"-I{Path(src).resolve().parents[2]}"  # that tree's csrc/ headers before this one's
    subprocess.run([cpu._compiler(), own, *cpu.VARIANTS[variant].cflags, src, "-o", str(so), "-lm"], check=True)
    lib = ctypes.CDLL(str(so))
    cpu.declare(lib)
    cpu.apply_prefetch_settings(lib)  # (a library left at its compiled-in defaults would prefetch near)
    if variant == "avx512":
        lib.it_amx_init(int(cpu.amx()))  # (amx() loads the process's library first: _amx is False until then)
    return lib
