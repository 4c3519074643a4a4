"""Measurements shared by `tune` and `ledger`: one engine configuration (or HF transformers generate) on a
fixed list of token-id prompts, in this process.

Per run: output tok/s (generated tokens / wall time of the whole generate call), per-request TTFT (first
token - arrival) and TPOT ((finished - first token) / (tokens - 1)) with p50 / p90 / p99, the KV-cache bytes
the engine allocated, and the growth of this process's resident set across load + generate (an in-process
figure: memory freed by an earlier measurement and reused is not counted again).
"""

from __future__ import annotations

import gc
import math
import time

OOM_MARKERS = ("KV-cache budget", "out of memory", "OutOfMemoryError")


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile, q in [0, 100]; None for an empty list."""
    vals = sorted(v for v in values if v is not None and math.isfinite(v))
    if not vals:
        return None
    pos = (len(vals) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return vals[lo] + (vals[hi] - vals[lo]) * (pos - lo)


def rss_mib() -> float:
    try:
        import psutil

        return psutil.Process().memory_info().rss / 2**20
    except ImportError:  # pragma: no cover
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def latency_summary(ttfts: list[float], tpots: list[float]) -> dict:
    out = {}
    for name, vals in (("ttft", ttfts), ("tpot", tpots)):
        for q in (50, 90, 99):
            out[f"{name}_p{q}_s"] = percentile(vals, q)
    return out


def is_oom(exc: BaseException) -> bool:
    text = f"{type(exc).__name__}: {exc}"
    return any(m in text for m in OOM_MARKERS)


def measure_infertune(
    model: str | None,
    options: dict,
    prompts: list[list[int]],
    output_lens: list[int],
    warmup_prompts: list[list[int]] | None = None,
    repeats: int = 1,
) -> dict:
    """Build LLM(model, **options), warm it up, time `repeats` generate calls (the fastest is kept)."""
    import infertune.executor.uniproc  # noqa: F401  engine modules load lazily: import them before the RSS baseline
    from infertune import LLM, SamplingParams

    engine_options = {k: v for k, v in options.items() if k != "moe_kernels"}
    gc.collect()
    rss0 = rss_mib()
    t0 = time.perf_counter()
    try:
        llm = LLM(model, **engine_options)
    except Exception as e:  # noqa: BLE001  a row, not a crash: OOM or an unsupported option
        return dict(status="oom" if is_oom(e) else "error", error=f"{type(e).__name__}: {e}", options=options)
    load_s = time.perf_counter() - t0
    runner = llm.engine.executor.runner
    kernels = runner.decode_kernels.name if runner.decode_kernels is not None else None
    try:
        if "moe_kernels" in options:
            limit_moe_kernels(runner, options["moe_kernels"])
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in output_lens]
        if warmup_prompts:
            llm.generate(
                [{"prompt_token_ids": p} for p in warmup_prompts],
                SamplingParams(temperature=0.0, max_tokens=min(4, max(output_lens)), ignore_eos=True),
                use_tqdm=False,
            )
        best = None
        for _ in range(max(repeats, 1)):
            t_start = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
            total = time.perf_counter() - t_start
            errors = [o.error for o in outs if getattr(o, "error", None)]
            if errors:
                raise RuntimeError(f"the engine rejected a prompt: {errors[0]}")
            n_tok = sum(len(o.outputs[0].token_ids) for o in outs)
            ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
            tpots = [
                (o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
                for o in outs
                if len(o.outputs[0].token_ids) > 1
            ]
            run = dict(total_s=total, output_tokens=n_tok, output_tok_s=n_tok / total, **latency_summary(ttfts, tpots))
            if best is None or run["output_tok_s"] > best["output_tok_s"]:
                best = run
        kv_bytes = llm.engine.executor.kv_cache_info.total_bytes
        row = dict(
            status="ok",
            load_s=load_s,
            kv_cache_bytes=int(kv_bytes),
            decode_kernels=kernels,
            rss_growth_mib=rss_mib() - rss0,
            options=options,
            **best,
        )
    except Exception as e:  # noqa: BLE001
        row = dict(status="oom" if is_oom(e) else "error", error=f"{type(e).__name__}: {e}", options=options)
    finally:
        del llm
        gc.collect()
    return row


# The ledger's MoE steps: which of a MoE layer's stages keep the decode kernels (the rest run their PyTorch
# reference: route() then a per-expert matmul loop, layers/moe.py). A measurement switch, not an engine option.
# The MoE kernels a ledger step keeps: the fused gating top-k, the grouped experts, and the fused decode step, which
# runs both inside its one C call a step (so it goes whenever either is off)
MOE_KERNEL_STAGES = {
    "none": (),
    "router": ("router",),
    "experts": ("router", "experts"),
    "all": ("router", "experts", "fused"),
}


def limit_moe_kernels(runner, stages: str) -> int:
    """Take the decode kernels off the MoE routers and / or experts not in MOE_KERNEL_STAGES[stages], and the fused
    decode step off a MoE model unless it is kept; returns how many modules (and fused steps) went back to PyTorch."""
    from infertune.layers.moe import Experts, Router

    keep = MOE_KERNEL_STAGES[stages]
    n = 0
    moe = False
    for m in runner.model.modules():
        moe = moe or isinstance(m, Router)
        if (isinstance(m, Router) and "router" not in keep) or (isinstance(m, Experts) and "experts" not in keep):
            if m.kernels is not None:
                m.use_kernels(None)
                n += 1
    if moe and "fused" not in keep and getattr(runner, "fused", None) is not None:
        runner.fused = None
        n += 1
    return n


def measure_hf(
    model_dir: str,
    dtype: str,
    prompts: list[list[int]],
    output_len: int,
    batch: int,
    warmup: bool = True,
    attn: str = "sdpa",
) -> dict:
    """HF transformers generate ("PyTorch native"): the prompts in static batches of `batch`, greedy, exactly
    `output_len` new tokens each. TTFT of a request = the wall time before its batch started + a separate
    generate(max_new_tokens=1) of that batch (as in `bench throughput`); TPOT = (batch time - TTFT) / (N - 1)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    gc.collect()
    rss0 = rss_mib()
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype), attn_implementation=attn
    ).eval()
    load_s = time.perf_counter() - t0
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id
        pad = pad[0] if isinstance(pad, list) else (pad if pad is not None else 0)

    def gen(ids: torch.Tensor, n: int) -> torch.Tensor:
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=pad,
        )
        return out[:, ids.shape[1] :]

    chunks = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    try:
        with torch.inference_mode():
            if warmup:
                gen(torch.tensor(chunks[0], dtype=torch.long), min(4, output_len))
            elapsed, ttfts, tpots, n_tok = 0.0, [], [], 0
            for chunk in chunks:  # a chunk's prompts have one length (the workload is uniform)
                ids = torch.tensor(chunk, dtype=torch.long)
                t = time.perf_counter()
                gen(ids, 1)
                ttft = time.perf_counter() - t
                t = time.perf_counter()
                out = gen(ids, output_len)
                total = time.perf_counter() - t
                n_tok += out.numel()
                ttfts += [elapsed + ttft] * len(chunk)
                if output_len > 1:
                    tpots += [max(total - ttft, 0.0) / (output_len - 1)] * len(chunk)
                elapsed += total
        return dict(
            status="ok",
            load_s=load_s,
            total_s=elapsed,
            output_tokens=n_tok,
            output_tok_s=n_tok / elapsed,
            rss_growth_mib=rss_mib() - rss0,
            kv_cache_bytes=None,
            **latency_summary(ttfts, tpots),
        )
    except Exception as e:  # noqa: BLE001
        return dict(status="oom" if is_oom(e) else "error", error=f"{type(e).__name__}: {e}")
    finally:
        model = None  # drop the weights before the next measurement (gen's closure reads the same name)
        gc.collect()


RESULT_MARKER = "@@TUNE_RESULT@@ "


def run_isolated(fn_name: str, threads: int | None = None, timeout: float | None = None, **kwargs) -> dict:
    """Run measure_infertune / measure_hf in a fresh Python process (`python -m infertune.tune.measure`, the
    arguments as JSON on stdin), so the peak RSS it reports belongs to that measurement alone."""
    import json
    import os
    import subprocess
    import sys

    import torch

    threads = threads or torch.get_num_threads()
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    payload = json.dumps(dict(fn=fn_name, threads=threads, kwargs=kwargs))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "infertune.tune.measure"],
            input=payload,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired:
        return dict(status="error", error=f"the measuring process timed out after {timeout} s")
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_MARKER)]
    if proc.returncode != 0 or not lines:
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        oom = proc.returncode in (-9, 137)  # killed, most likely by the kernel's OOM killer
        return dict(
            status="oom" if oom else "error",
            error=f"the measuring process exited with {proc.returncode}: {tail[0][:300]}",
        )
    return json.loads(lines[-1][len(RESULT_MARKER) :])


def _child_main() -> int:
    import json
    import sys

    import torch

    from infertune.bench.offline import peak_rss_mib

    req = json.loads(sys.stdin.read())
    torch.set_num_threads(req["threads"])
    fn = {"measure_infertune": measure_infertune, "measure_hf": measure_hf}[req["fn"]]
    row = fn(**req["kwargs"])
    row["peak_rss_mib"] = peak_rss_mib()  # VmHWM of this fresh process: imports + weights + KV + transients
    sys.stdout.write(RESULT_MARKER + json.dumps(row, default=str) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(_child_main())
