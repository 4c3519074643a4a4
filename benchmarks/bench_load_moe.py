"""Load time and peak memory of the MoE preset against a dense model of about the same bytes (the MoE issue's targets:
load time <= 2x the dense model's; peak RSS <= weights + KV cache + 300 MB).

Each load runs in a fresh process, the two models alternating, after their files are read once into the page cache
(so the disk is out of it: what is timed is infertune's own work, from `LLM(...)` to a ready engine). The "weights"
are what the loaded model keeps (its parameters and buffers, each tensor's bytes once: 12-bit experts, packed
layouts; a pack carved from a shared chunk counts its own bytes, not the chunk's),
the KV cache is the engine's one allocation; peak RSS is the process's high-water mark (/proc/self/status VmHWM),
read after `import infertune` too (what the import costs is printed apart).

    python benchmarks/bench_load_moe.py --rounds 3
    python benchmarks/bench_load_moe.py --rounds 3 --dense llama-1b --moe moe --compress-weights off
    python benchmarks/bench_load_moe.py --rounds 3 --quantization w4a16   # both models quantized as they load
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from infertune.config import parse_size

CHILD = r"""
import json, sys, time
import psutil
import torch
from infertune import LLM
from infertune.bench.step_bytes import engine_tensors
from infertune.bench.worker_protocol import peak_rss_mib  # (VmHWM: ru_maxrss carries a parent's over fork + exec)
hwm = lambda: peak_rss_mib() * 2**20
rss_import = hwm()
model, kv_bytes, compress, quant = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
if len(sys.argv) > 5:  # --trim-every: the loader's heap-trim step (infertune.models.loader.TRIM_EVERY_BYTES)
    import infertune.models.loader
    infertune.models.loader.TRIM_EVERY_BYTES = int(sys.argv[5])
t0 = time.perf_counter()
llm = LLM(model, dtype="bfloat16", max_model_len=1024, max_num_seqs=16, kv_cache_memory_bytes=kv_bytes,
          compress_weights=compress, quantization=None if quant == "none" else quant)
load_s = time.perf_counter() - t0
runner = llm.engine.executor.runner
# each tensor's own bytes once (a packed weight carved from a shared 2 MB-page chunk counts its part, not the chunk)
weights = sum(n for _, n in engine_tensors(runner.model))
kv = runner._kv_storage.numel() * runner._kv_storage.element_size()
peak = hwm()
print(json.dumps(dict(load_s=load_s, weights=weights, kv=kv, peak_rss=peak, import_rss=rss_import,
                      rss_now=psutil.Process().memory_info().rss)))
"""


def read_into_page_cache(folder: Path) -> int:
    total = 0
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                total += len(chunk)
    return total


def one_load(model: Path, kv_bytes: int, compress: str, quant: str, trim: int | None = None) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(kv_bytes), compress, quant, *([str(trim)] if trim else [])],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--moe", default="moe", help="the MoE preset (infertune/bench/offline_models.py PRESETS)")
    p.add_argument("--dense", default="llama-1b", help="a dense preset of about the MoE preset's bytes")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kv-bytes", type=int, default=256 << 20, help="the KV cache each engine takes (default 256 MiB)")
    p.add_argument("--compress-weights", default="auto", help="compress_weights for both (auto: 12-bit where it pays)")
    p.add_argument("--quantization", default="none", help="quantization for both: none, w8a16, w4a16, w8a8")
    p.add_argument("--cache-dir", default="/tmp/infertune-bench")
    p.add_argument(
        "--trim-every",
        type=parse_size,
        default=None,
        help="the loader's heap-trim step, e.g. 64Mi (default: the loader's own, TRIM_EVERY_BYTES)",
    )
    args = p.parse_args()

    from infertune.bench.offline_models import ensure_model

    models = {name: ensure_model(name, Path(args.cache_dir)) for name in (args.moe, args.dense)}
    files = {name: sum(f.stat().st_size for f in m.glob("*.safetensors")) for name, m in models.items()}
    runs: dict[str, list[dict]] = {name: [] for name in models}
    for r in range(args.rounds):
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            read_into_page_cache(models[name])
            got = one_load(models[name], args.kv_bytes, args.compress_weights, args.quantization, args.trim_every)
            runs[name].append(got)
            print(
                f"round {r + 1} {name}: load {got['load_s']:.2f} s, peak RSS {got['peak_rss'] / 2**20:.0f} MiB, "
                f"RSS after the load {got['rss_now'] / 2**20:.0f} MiB",
                flush=True,
            )
    print()
    print(
        "| model | checkpoint MiB | weights kept MiB | KV MiB | load s (median; each) | peak RSS MiB | "
        "weights + KV + 300 MB | peak - (weights + KV) MiB | RSS after the load MiB (max) | import RSS MiB |"
    )
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    med = {}
    for name, rs in runs.items():
        load = statistics.median(x["load_s"] for x in rs)
        peak = max(x["peak_rss"] for x in rs)
        w, kv = rs[0]["weights"], rs[0]["kv"]
        med[name] = load
        budget = w + kv + 300 * 10**6
        each = ", ".join(f"{x['load_s']:.2f}" for x in rs)
        print(
            f"| {name} | {files[name] / 2**20:.0f} | {w / 2**20:.0f} | {kv / 2**20:.0f} | {load:.2f} "
            f"({each}) | {peak / 2**20:.0f} | {budget / 2**20:.0f} "
            f"({'within' if peak <= budget else 'OVER'}) | {(peak - w - kv) / 2**20:.0f} | "
            f"{max(x['rss_now'] for x in rs) / 2**20:.0f} | {rs[0]['import_rss'] / 2**20:.0f} |"
        )
    ratio = med[args.moe] / med[args.dense]
    size = files[args.moe] / files[args.dense]
    print(f"\nload time {args.moe} / {args.dense}: {ratio:.2f}x (checkpoint bytes {size:.2f}x); target <= 2x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
