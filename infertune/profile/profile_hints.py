"""What to try next, derived from a profile summary. Pure: every hint names the measured figure and the threshold
that fired it, so it can be checked (and tested) against the numbers.

The summary is the JSON one `infertune profile --json` writes (see profile_cmd.build_summary): phases.<phase>.share
(category -> fraction of the phase's step wall time), launch, instrumentation, context.
"""

from __future__ import annotations

# Thresholds: a share of the phase's wall time (or a ratio) at which a hint is worth reading.
ATTENTION_DECODE = 0.25
ATTENTION_PREFILL = 0.30
KV_DECODE = 0.15
MATMUL_DECODE = 0.50
SMALL_BATCH = 8  # decode sequences per step up to which a matmul-heavy decode is memory-bound
MATMUL_PREFILL = 0.60
LAUNCH_DECODE = 0.15
HOST_DECODE = 0.30
SAMPLING_DECODE = 0.10
ELEMENTWISE_DECODE = 0.20
MOE_ROUTER = 0.15
COMMUNICATION = 0.10
OTHER = 0.20
JITTER = 1.5  # decode step p90 / median
PROFILER_INFLATION = 1.5  # profiled / unprofiled decode step
PAGE_FAULTS = 2000  # minor page faults per step (8 MiB of fresh 4 KiB pages): the allocator hands memory back

HOST_ADVICE = {
    "python_in_forward": "Python between the model's ops (compiled decode removes it)",
    "python_in_sampler": "Python in the sampler (per-row loops over sampling parameters)",
    "python_in_runner": "Python in the runner around the forward",
    "prepare_inputs": "building the step's input tensors from Python lists (persistent buffers filled in place help)",
    "schedule": "scheduling",
    "update": "advancing sequences after the step",
    "detokenize": "detokenization and stop-string checks",
    "engine_step_other": "the engine's step loop",
}


def _pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def _hint(rule: str, phase: str | None, figure: float, threshold: float, text: str) -> dict:
    return {"rule": rule, "phase": phase, "figure": round(figure, 4), "threshold": threshold, "text": text}


def derive_hints(summary: dict) -> list[dict]:
    """Hints for a profile summary, most specific first; an empty list when nothing crosses a threshold."""
    hints: list[dict] = []
    phases = summary.get("phases", {})
    ctx = summary.get("context", {})
    dec = phases.get("decode")
    pre = phases.get("prefill")
    if dec:
        hints += _decode_hints(dec, summary, ctx)
    if pre:
        hints += _prefill_hints(pre, ctx)
    for name, ph in phases.items():
        faults = ph.get("page_faults_per_step") or 0
        if faults >= PAGE_FAULTS:
            hints.append(
                _hint(
                    "page_faults",
                    name,
                    faults,
                    PAGE_FAULTS,
                    (
                        f"each {name} step faults in {faults:,.0f} fresh pages (~{faults * 4 / 1024:,.0f} MiB, zeroed by the "
                        "kernel): the host allocator hands freed activations back to the OS and maps them again. The CPU "
                        "backend keeps them (glibc mallopt) unless INFERTUNE_KEEP_HOST_MEMORY=0; with another allocator, "
                        "preload tcmalloc or jemalloc (LD_PRELOAD)"
                    ),
                )
            )
        share = ph["share"]
        if share.get("moe_router", 0) >= MOE_ROUTER:
            hints.append(
                _hint(
                    "moe_router",
                    name,
                    share["moe_router"],
                    MOE_ROUTER,
                    (
                        f"the MoE router and the dispatch around the experts are {_pct(share['moe_router'])} of {name}: "
                        "compute scores, top-k and the grouping by expert in one fused gating top-k, and run the experts "
                        "as one grouped GEMM instead of a loop of small matmuls with gathers and scatters around them"
                    ),
                )
            )
        if share.get("communication", 0) >= COMMUNICATION:
            hints.append(
                _hint(
                    "communication",
                    name,
                    share["communication"],
                    COMMUNICATION,
                    (
                        f"communication is {_pct(share['communication'])} of {name}: overlap collectives with compute, or use "
                        "fewer tensor-parallel ranks for a model this size"
                    ),
                )
            )
    return hints


def _decode_hints(dec: dict, summary: dict, ctx: dict) -> list[dict]:
    out = []
    share = dec["share"]
    ms = dec.get("ms_per_step_by_category", {})
    seqs = dec.get("seqs_per_step") or ctx.get("batch") or 0
    if share.get("attention", 0) >= ATTENTION_DECODE:
        out.append(
            _hint(
                "attention_decode",
                "decode",
                share["attention"],
                ATTENTION_DECODE,
                (
                    f"attention is {_pct(share['attention'])} of decode ({ms.get('attention', 0):.2f} ms/step): each decode "
                    "step attends over the whole context of every sequence; a fused paged-attention (flash-decoding) kernel "
                    "avoids the padded gather, and a shorter max_model_len or a sliding window cuts the work"
                ),
            )
        )
    if share.get("kv_cache", 0) >= KV_DECODE:
        kv = dec.get("kv_detail_share", {})
        out.append(
            _hint(
                "kv_cache",
                "decode",
                share["kv_cache"],
                KV_DECODE,
                (
                    f"KV-cache access is {_pct(share['kv_cache'])} of decode (reads {_pct(kv.get('read', 0))}, writes "
                    f"{_pct(kv.get('write', 0))}): an int8 KV cache halves the bytes moved (kv_cache_dtype=int8; infertune "
                    "accepts only 'auto' today), and an attention kernel that reads blocks in place avoids the gather copy"
                ),
            )
        )
    if share.get("matmul", 0) >= MATMUL_DECODE and 0 < seqs <= SMALL_BATCH:
        quantized = ctx.get("quantization")
        todo = (
            "raise the batch (--batch / max_num_seqs) so each weight read serves more tokens"
            if quantized
            else "try quantization=w8a16 (int8 weights halve the bytes) or w4a16 (a quarter), or a larger batch"
        )
        out.append(
            _hint(
                "matmul_memory_bound",
                "decode",
                share["matmul"],
                MATMUL_DECODE,
                (
                    f"matmul is {_pct(share['matmul'])} of decode at {seqs:g} sequences per step: every step streams all the "
                    f"weights for only {seqs:g} tokens, so it is memory-bound; {todo}"
                ),
            )
        )
    launch = summary.get("launch", {})
    if launch.get("share_of_decode_step", 0) >= LAUNCH_DECODE:
        out.append(
            _hint(
                "launch_overhead",
                "decode",
                launch["share_of_decode_step"],
                LAUNCH_DECODE,
                (
                    f"{launch['launches_per_decode_step']:g} {launch.get('counted', 'ops')} per decode step at "
                    f"{launch['per_launch_us']:.1f} us each = {launch['overhead_us_per_decode_step'] / 1000:.2f} ms of "
                    f"dispatch/launch overhead ({_pct(launch['share_of_decode_step'])} of the decode step): enable compiled "
                    "decode (torch.compile or graph capture of the decode step) to fuse the small ops and replay launches"
                ),
            )
        )
    inst = summary.get("instrumentation", {}).get("share_of_decode_step", 0.0)
    host = share.get("host", 0) - inst  # the profiler's own ranges are not the engine's overhead
    if host >= HOST_DECODE:
        detail = {k: v for k, v in dec.get("host_detail_share", {}).items()}
        if "python_in_forward" in detail:
            detail["python_in_forward"] = max(detail["python_in_forward"] - inst, 0.0)
        top = max(detail, key=detail.get) if detail else "engine_step_other"
        out.append(
            _hint(
                "host_overhead",
                "decode",
                host,
                HOST_DECODE,
                (
                    f"host overhead and idle gaps are {_pct(host)} of decode (instrumentation excluded); the largest part is "
                    f"{HOST_ADVICE.get(top, top)} at {_pct(detail.get(top, 0))}: a larger batch (--batch / max_num_seqs) "
                    "amortises the per-step host work over more tokens"
                ),
            )
        )
    if share.get("sampling", 0) >= SAMPLING_DECODE:
        sort = sum(r["share"] for r in dec.get("top_ops", []) if r["category"] == "sampling" and "sort" in r["op"])
        why = (
            f"the vocabulary sort behind top-p alone is {_pct(sort)}: the sampler sorts only when a row's 256 best "
            "tokens hold less than its top_p (a flat distribution, as a random-weight model's); a lower top_p, or "
            "top-k, keeps it on the candidates"
            if sort >= 0.02
            else "batch the per-row work and keep it on the device until the single host sync"
        )
        out.append(
            _hint(
                "sampling",
                "decode",
                share["sampling"],
                SAMPLING_DECODE,
                f"sampling is {_pct(share['sampling'])} of decode: {why}",
            )
        )
    elementwise = share.get("norm", 0) + share.get("activation", 0) + share.get("rotary", 0)
    if elementwise >= ELEMENTWISE_DECODE:
        out.append(
            _hint(
                "elementwise",
                "decode",
                elementwise,
                ELEMENTWISE_DECODE,
                (
                    f"norm + activation + rotary are {_pct(elementwise)} of decode: many small elementwise ops; fused "
                    "RMSNorm / SiLU-and-mul / rotary kernels, or torch.compile, merge them into a few"
                ),
            )
        )
    if share.get("other", 0) >= OTHER:
        out.append(
            _hint(
                "unclassified",
                "decode",
                share["other"],
                OTHER,
                (
                    f"{_pct(share['other'])} of decode is 'other': see the top ops, and teach profile_categories.py "
                    "their category"
                ),
            )
        )
    p50, p90 = dec.get("step_ms_p50"), dec.get("step_ms_p90")
    if p50 and p90 and p90 / p50 >= JITTER:
        out.append(
            _hint(
                "step_jitter",
                "decode",
                p90 / p50,
                JITTER,
                (
                    f"decode steps vary: p90 {p90:.2f} ms vs median {p50:.2f} ms (x{p90 / p50:.1f}); the CPU is shared or "
                    f"oversubscribed ({ctx.get('torch_threads', '?')} torch threads): run `infertune doctor`, give torch "
                    "only the free cores, and re-profile on a quiet machine"
                ),
            )
        )
    base = dec.get("unprofiled_ms_per_step")
    if base and dec.get("ms_per_step") and dec["ms_per_step"] / base >= PROFILER_INFLATION:
        r = dec["ms_per_step"] / base
        out.append(
            _hint(
                "profiler_inflation",
                "decode",
                r,
                PROFILER_INFLATION,
                (
                    f"profiling made decode steps x{r:.1f} slower ({dec['ms_per_step']:.2f} vs {base:.2f} ms unprofiled): the "
                    "shares of small, fast ops are overstated; trust the large categories and the op counts most"
                ),
            )
        )
    return out


def _prefill_hints(pre: dict, ctx: dict) -> list[dict]:
    out = []
    share = pre["share"]
    if share.get("attention", 0) >= ATTENTION_PREFILL:
        out.append(
            _hint(
                "attention_prefill",
                "prefill",
                share["attention"],
                ATTENTION_PREFILL,
                (
                    f"attention is {_pct(share['attention'])} of prefill at input_len {ctx.get('input_len', '?')}: it grows "
                    "with the square of the prompt; use a flash attention kernel (SDPA picks it in fp16/bf16 on a GPU), and "
                    "bound the work per step with chunked prefill (max_num_batched_tokens)"
                ),
            )
        )
    if share.get("matmul", 0) >= MATMUL_PREFILL:
        out.append(
            _hint(
                "matmul_prefill",
                "prefill",
                share["matmul"],
                MATMUL_PREFILL,
                (
                    f"matmul is {_pct(share['matmul'])} of prefill: compute-bound GEMMs; quantization=w8a8 runs int8 GEMMs "
                    "(VNNI / AMX on CPU, int8 tensor cores on GPU), and bf16 beats fp32 where the hardware has it"
                ),
            )
        )
    return out
