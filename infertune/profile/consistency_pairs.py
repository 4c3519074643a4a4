"""The pure half of `infertune doctor --consistency`: the paths that must agree, the built-in prompt set, the judging
of a divergence (noise at a near-tie, or a failure), the accuracy gate, the long-run checks and the printed table.

No torch and no engine here, so the judging is tested exactly on crafted numbers (tests/test_consistency.py); the
engine side (running the paths, localising a divergence) is infertune/profile/consistency.py.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# Machine epsilon (the spacing of values just above 1.0) of each dtype the logits' inputs may be computed in.
EPS = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}
# How many ulps of the logit scale two paths may differ by before a flipped greedy pick counts as a bug. A 16-bit
# path rounds every activation to 8 (bf16) or 11 (fp16) bits, so a few ulps of the logits' magnitude is its noise;
# fp32 rounds 2^16 times finer, but the error accumulates over every layer's reductions taken in another order
# (another batch shape, another kernel), so it gets more ulps: still ~4 orders of magnitude tighter than bf16.
ULPS = {"float32": 256, "bfloat16": 4, "float16": 4}
# Localisation: a module whose output differs between the two paths by more than this share of its scale
# (debug-layers' relative max error) is where the paths part.
LOCATE_THRESHOLD = {"float32": 1e-3, "bfloat16": 0.05, "float16": 0.02}
# The accuracy gate of the pairs that are not expected to be identical (teacher-forced on the reference's tokens).
GATES = {"kv-int8": {"top1": 0.95, "mean_abs_logprob": 0.10}, "quant": {"top1": 0.90, "mean_abs_logprob": 0.30}}


def tolerance(dtype: str, logit_scale: float) -> float:
    """The logit margin below which a flipped greedy pick is numerical noise: ULPS ulps of the logit scale."""
    return ULPS.get(dtype, ULPS["float32"]) * EPS.get(dtype, EPS["float32"]) * max(float(logit_scale), 1.0)


@dataclass(slots=True, frozen=True)
class Pair:
    key: str  # what --pair takes
    name: str  # what the table prints
    ref: dict  # engine options of the reference path, over the base
    test: dict  # engine options of the path under test, over the base
    gate: str = "identity"  # "identity" (identical, or diverging only at near-ties) or "accuracy"
    ref_label: str = ""
    test_label: str = ""


PAIR_KEYS = ("batch", "prefix", "chunked", "preempt", "kernels", "kv-int8", "quant")


def make_pairs(user: dict, batch: int, chunk_tokens: int) -> list[Pair]:
    """The pairs for the user's options (their decode_kernels / kv_cache_dtype / quantization decide the last three).

    Every path runs the user's options with the prefix cache off (only its own pair turns it on) and a token budget
    that takes a whole prompt at once (only the chunked pair shrinks it), so each pair changes one thing."""
    fast = user.get("decode_kernels", "auto")
    fast = "auto" if fast == "off" else fast
    pairs = [
        Pair("batch", "batch 1 vs N", {"max_num_seqs": 1}, {}, ref_label="batch 1", test_label=f"batch {batch}"),
        Pair(
            "prefix",
            "prefix cache off vs on",
            {"max_num_seqs": 1},
            {"max_num_seqs": 1, "enable_prefix_caching": True},
            ref_label="prefix cache off",
            test_label="prefix cache on",
        ),
        Pair(
            "chunked",
            "whole vs chunked prefill",
            {},
            {"max_num_batched_tokens": chunk_tokens},
            ref_label="whole prefill",
            test_label=f"chunks of {chunk_tokens} tokens",
        ),
        Pair(
            "preempt", "preemption forced vs not", {}, {"__tiny_kv__": True}, ref_label="ample KV", test_label="tiny KV"
        ),
        Pair(
            "kernels",
            "kernels vs torch",
            {"decode_kernels": "off"},
            {"decode_kernels": fast},
            ref_label="decode_kernels=off",
            test_label=f"decode_kernels={fast}",
        ),
    ]
    if user.get("kv_cache_dtype", "auto") == "int8":
        tier = user.get("kv_int4_after")  # (the int4 tier rides on the int8 cache: off with it on the reference side)
        test = "int8 KV" if tier is None else f"int8 KV, int4 after {tier}"
        pairs.append(
            Pair(
                "kv-int8",
                f"bf16 KV vs {test}",
                {"kv_cache_dtype": "auto", "kv_int4_after": None},
                {},
                "accuracy",
                "model-dtype KV",
                test,
            )
        )
    if user.get("quantization"):
        q = user["quantization"]
        pairs.append(
            Pair("quant", "unquantized vs quantized", {"quantization": None}, {}, "accuracy", "unquantized", q)
        )
    return pairs


# ---- the built-in prompt set -----------------------------------------------------------------------------------


def default_prompts(seed_ids: list[int], block_size: int, chunk_tokens: int, max_prompt: int) -> list[list[int]]:
    """Token-id prompts whose lengths sit around block and chunk boundaries, plus a group sharing a prefix of two full
    blocks (so that the prefix cache really hits). seed_ids: the tokenized seed text, repeated to any length."""
    ids = list(seed_ids) or [1, 2, 3]

    def take(n: int, offset: int = 0) -> list[int]:
        return [ids[(offset + i) % len(ids)] for i in range(n)]

    bs, c = block_size, chunk_tokens
    lengths = [1, 3, bs - 1, bs, bs + 1, 2 * bs + 1, c - 1, c + 1, 2 * c + 1, 3 * bs - 1]
    lengths = sorted({n for n in lengths if 1 <= n <= max_prompt})
    prompts = [take(n, offset=7 * i) for i, n in enumerate(lengths)]
    prefix = take(min(2 * bs, max_prompt - 5), offset=3)
    for j, extra in enumerate((1, 4, bs + 3)):  # same two full blocks, different tails
        tail = take(extra, offset=101 + 13 * j)
        if len(prefix) + len(tail) <= max_prompt:
            prompts.append(prefix + tail)
    return prompts


def max_tokens_for(i: int, base: int) -> int:
    """Per-prompt output length: varied, so requests finish at different steps and prefills mix with decodes."""
    return max(1, base - 3 + (5 * i) % 7)


SEED_TEXT = (
    "The quick brown fox jumps over the lazy dog. In 1905 Einstein published four papers; the third, on "
    "special relativity, begins with the electrodynamics of moving bodies. def fib(n): return n if n < 2 else "
    "fib(n - 1) + fib(n - 2)  # memoise this. Numbers: 3.14159, 2.71828, 1.41421. Ein Satz auf Deutsch. "
)


# ---- judging --------------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Divergence:
    request: int  # index in the prompt set
    step: int  # index of the generated token (0: the token the prefill produced)
    ref_token: int
    test_token: int
    margin: float  # the larger of the two paths' logit gaps between the two candidates
    ref_margin: float
    test_margin: float
    lower_bound: bool = False  # a candidate fell outside the top-k: the margin is at least this
    verdict: str = ""  # "noise" or "FAIL"
    ref_bound: bool = False  # ref_margin is a lower bound (the test's token outside the reference's top-k)
    test_bound: bool = False  # likewise test_margin


def gap(chosen: int, other: int, top: list[tuple[int, float]]) -> tuple[float, bool]:
    """Logit gap (= logprob gap) between chosen and other in one step's top-k; (gap, True) where other is not in the
    top-k: then the gap is at least chosen - the k-th."""
    lp = dict(top)
    if chosen not in lp:
        return float("inf"), True
    if other in lp:
        return lp[chosen] - lp[other], False
    return lp[chosen] - min(lp.values()), True


def judge_divergence(
    request: int, step: int, ref_token: int, test_token: int, ref_top: list, test_top: list, tol: float
) -> Divergence:
    """A flipped greedy pick is noise where both paths see the two candidates within tol of each other (a near-tie),
    and a failure where either path prefers its own pick by more than tol."""
    rm, rb = gap(ref_token, test_token, ref_top)
    tm, tb = gap(test_token, ref_token, test_top)
    margin = max(rm, tm)
    d = Divergence(request, step, ref_token, test_token, margin, rm, tm, rb or tb, ref_bound=rb, test_bound=tb)
    d.verdict = "noise" if margin <= tol else "FAIL"
    return d


def first_divergence(ref: list[int], test: list[int]) -> int | None:
    """The first step where two greedy sequences differ (a length difference counts at the shorter's end)."""
    for i, (a, b) in enumerate(zip(ref, test)):
        if a != b:
            return i
    return None if len(ref) == len(test) else min(len(ref), len(test))


def accuracy_verdict(top1: float, mean_abs_logprob: float, gate: dict) -> str:
    ok = top1 >= gate["top1"] and mean_abs_logprob <= gate["mean_abs_logprob"]
    return "pass (gate)" if ok else "FAIL (gate)"


@dataclass(slots=True)
class PairResult:
    key: str
    name: str
    ref_label: str
    test_label: str
    compared: int = 0
    identical: int = 0
    divergences: list[Divergence] = field(default_factory=list)
    tolerance: float = 0.0
    logit_scale: float = 0.0
    dtype: str = ""
    verdict: str = ""  # pass / noise / FAIL / n/a / pass (gate) / FAIL (gate)
    skipped: str = ""  # why n/a
    notes: list[str] = field(default_factory=list)
    accuracy: dict | None = None  # accuracy pairs: top1, mean_abs_logprob, gate
    location: dict | None = None  # the first module whose activations differ, for a failure
    reproduce: str = ""
    ref_margins: list[list[float]] = field(default_factory=list)  # per request, the reference's top1 - top2 per step
    # MoE: the divergences a router near-tie explains (consistency.explain_by_route_flip's findings, one a divergence)
    route_flips: list[dict] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.verdict.startswith("FAIL")

    def headline(self) -> Divergence | None:
        """The divergence the table shows: the first failure (by step), else the first near-tie."""
        fails = [d for d in self.divergences if d.verdict == "FAIL"]
        pool = fails or self.divergences
        return min(pool, key=lambda d: (d.step, d.request)) if pool else None

    def decide(self) -> None:
        if self.skipped:
            self.verdict = "n/a"
        elif self.accuracy is not None:
            self.verdict = accuracy_verdict(
                self.accuracy["top1"], self.accuracy["mean_abs_logprob"], self.accuracy["gate"]
            )
        elif any(d.verdict == "FAIL" for d in self.divergences):
            self.verdict = "FAIL"
        elif self.divergences:
            self.verdict = "noise"
        else:
            self.verdict = "pass"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["headline"] = asdict(self.headline()) if self.headline() else None
        for x in [*d["divergences"], d["headline"]]:
            if x:
                for k in ("margin", "ref_margin", "test_margin"):
                    if x[k] == float("inf"):
                        x[k] = "inf"
        return d


def _fmt_margin(d: Divergence) -> str:
    if d.margin == float("inf"):
        return "inf"
    return ("≥" if d.lower_bound else "") + f"{d.margin:.3g}"


def format_table(results: list[PairResult]) -> str:
    header = f"{'pair':<26} {'seqs':>5} {'identical':>9}  {'first divergence':<18} {'margin':>9} {'tol':>8}  verdict"
    lines = [header, "-" * len(header)]
    for r in results:
        if r.skipped:
            lines.append(f"{r.name:<26} {'-':>5} {'-':>9}  {'-':<18} {'-':>9} {'-':>8}  n/a: {r.skipped}")
            continue
        h = r.headline()
        where = f"req {h.request}, step {h.step}" if h else "-"
        margin = _fmt_margin(h) if h else "-"
        verdict = r.verdict
        if r.accuracy is not None:
            a = r.accuracy
            verdict += f": top-1 {a['top1']:.1%} (>= {a['gate']['top1']:.0%}), mean |dlogprob| "
            verdict += f"{a['mean_abs_logprob']:.3g} (<= {a['gate']['mean_abs_logprob']})"
        lines.append(
            f"{r.name:<26} {r.compared:>5} {r.identical:>9}  {where:<18} {margin:>9} {r.tolerance:>8.2g}  {verdict}"
        )
    return "\n".join(lines)


def format_failures(results: list[PairResult]) -> str:
    lines = []
    for r in results:
        for n in r.notes:
            lines.append(f"note ({r.name}): {n}")
    for r in results:
        if not r.failed:
            continue
        lines.append("")
        h = r.headline()
        lines.append(f"FAIL {r.name} ({r.ref_label} vs {r.test_label}):")
        if h is not None and r.accuracy is None:
            lines.append(
                f"  request {h.request}, step {h.step}: {r.ref_label} picks token {h.ref_token}, {r.test_label} picks "
                f"{h.test_token}; margin {_fmt_margin(h)} (reference {h.ref_margin:.3g}, under test "
                f"{h.test_margin:.3g}) > tolerance {r.tolerance:.2g}: not a near-tie"
            )
        if r.accuracy is not None:
            a, g = r.accuracy, r.accuracy["gate"]
            lines.append(
                f"  accuracy gate (teacher-forced on the reference's tokens, {a['positions']} positions): top-1 "
                f"agreement {a['top1']:.1%} (gate >= {g['top1']:.0%}), mean |logprob diff| "
                f"{a['mean_abs_logprob']:.3g} (gate <= {g['mean_abs_logprob']})"
            )
        loc = r.location
        if loc:
            if loc.get("module"):
                lines.append(
                    f"  first module whose activations differ: {loc['module']} (#{loc['index']}, rel-max "
                    f"{loc['rel_max']:.3g} > {loc['threshold']:g}){' — ' + loc['note'] if loc.get('note') else ''}"
                )
            else:
                lines.append(f"  location: {loc.get('note', 'no module differs')}")
        if r.reproduce:
            lines.append(f"  reproduce: {r.reproduce}")
    return "\n".join(lines)


# ---- the long run --------------------------------------------------------------------------------------------


def memory_interval(n: int) -> int:
    """Tokens between memory readings: every 1,000, or every n/10 for a shorter run."""
    return max(1, min(1000, n // 10))


def memory_verdict(readings: list[tuple[int, int]], min_growth: int = 24 * 2**20, share: float = 0.03) -> dict:
    """readings: (tokens, RSS bytes). The first reading is the warm-up (allocator pools, kernels' buffers fill); the
    curve is flat when RSS grows by less than max(min_growth, share of RSS) from there to the end."""
    if len(readings) < 3:
        return {"verdict": "too few readings", "growth_bytes": 0, "slope_bytes_per_1k": 0.0}
    base = readings[1][1]
    growth = readings[-1][1] - base
    xs = [t for t, _ in readings[1:]]
    ys = [b for _, b in readings[1:]]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs) or 1.0
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / var * 1000
    limit = max(min_growth, share * base)
    verdict = "GROWING" if growth > limit and slope > 0 else "flat"
    return {"verdict": verdict, "growth_bytes": int(growth), "slope_bytes_per_1k": slope, "limit_bytes": int(limit)}


def repetition(tokens: list[int], max_period: int = 32) -> dict:
    """Repetition collapse: the tail's shortest period p (<= max_period) repeated over the last quarter (at least 4
    times), and the share of distinct tokens there."""
    n = len(tokens)
    window = tokens[-max(8, n // 4) :]
    distinct = len(set(window)) / max(len(window), 1)
    for p in range(1, max_period + 1):
        if len(window) >= 4 * p and all(window[i] == window[i - p] for i in range(p, len(window))):
            return {"collapsed": True, "period": p, "distinct_share": distinct}
    return {"collapsed": False, "period": None, "distinct_share": distinct}


def drift(scales: list[float]) -> dict:
    """Logit-scale drift: the median max |logit| over the last tenth against the first tenth."""
    if len(scales) < 10:
        return {"ratio": 1.0, "drifting": False}
    k = max(1, len(scales) // 10)
    first, last = sorted(scales[:k])[k // 2], sorted(scales[-k:])[k // 2]
    ratio = last / first if first > 0 else float("inf")
    return {"ratio": ratio, "drifting": not 0.5 <= ratio <= 2.0, "first": first, "last": last}


def format_long(report: dict) -> str:
    mem = report["memory"]
    lines = [
        f"long run: {report['tokens']} tokens generated from a {report['prompt_tokens']}-token prompt "
        f"({report['seconds']:.1f} s)",
        "  RSS every {} tokens: {}".format(
            report["interval"], ", ".join(f"{t}:{b / 2**20:.0f}M" for t, b in report["rss"])
        ),
        f"  memory: {mem['verdict']} (growth {mem['growth_bytes'] / 2**20:+.1f} MiB after the warm-up reading, "
        f"{mem['slope_bytes_per_1k'] / 2**20:+.2f} MiB per 1000 tokens; limit {mem.get('limit_bytes', 0) / 2**20:.0f} MiB)",
        f"  non-finite logits: {report['nonfinite_steps']} steps"
        + (f" (first at step {report['first_nonfinite']})" if report["first_nonfinite"] is not None else ""),
        f"  logit scale: max |logit| {report['drift'].get('first', 0):.3g} -> {report['drift'].get('last', 0):.3g} "
        f"(ratio {report['drift']['ratio']:.2f}{', DRIFTING' if report['drift']['drifting'] else ''})",
        "  repetition: "
        + (
            f"COLLAPSED into a loop of period {report['repetition']['period']}"
            if report["repetition"]["collapsed"]
            else "no loop"
        )
        + f" ({report['repetition']['distinct_share']:.0%} distinct tokens in the tail)",
        f"  verdict: {report['verdict']}",
    ]
    return "\n".join(lines)


def long_verdict(report: dict) -> str:
    bad = []
    if report["nonfinite_steps"]:
        bad.append("NON-FINITE")
    if report["memory"]["verdict"] == "GROWING":
        bad.append("MEMORY GROWING")
    warn = []
    if report["drift"]["drifting"]:
        warn.append("logit-scale drift")
    if report["repetition"]["collapsed"]:
        warn.append("repetition collapse")
    if bad:
        return "FAIL: " + ", ".join(bad) + (f" (and {', '.join(warn)})" if warn else "")
    return "pass" + (f" (warnings: {', '.join(warn)})" if warn else "")
