"""Per-request results of a serving run and their statistics: percentiles, summaries, goodput, the report table."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile must be within [0, 100], got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summarize(values: Sequence[float], percentiles: Sequence[float] = PERCENTILES) -> dict:
    """count, mean, std (population), min, max and p<q> for each q; the statistics are None for no values."""
    n = len(values)
    out: dict = {"count": n}
    if n == 0:
        out.update(mean=None, std=None, min=None, max=None)
        out.update({f"p{q:g}": None for q in percentiles})
        return out
    mean = math.fsum(values) / n
    out.update(
        mean=mean, std=math.sqrt(math.fsum((v - mean) ** 2 for v in values) / n), min=min(values), max=max(values)
    )
    out.update({f"p{q:g}": percentile(values, q) for q in percentiles})
    return out


@dataclass
class RequestResult:
    index: int
    prompt_len: int = 0  # estimated from the dataset
    expected_output_len: int = 0
    success: bool = False
    error: str | None = None
    status: int | None = None
    start: float = 0.0  # seconds after the benchmark start when the request was sent
    ttft: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    latency: float | None = None  # seconds, end to end
    output_tokens: int = 0
    prompt_tokens: int | None = None  # from the server's usage, when given
    chunks: int = 0  # content chunks received
    usage_reported: bool = False

    @property
    def tpot(self) -> float | None:
        if not self.success or self.ttft is None or self.latency is None or self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)

    def record(self) -> dict:
        """JSON-ready per-request record, times in milliseconds."""
        ms = lambda s: None if s is None else s * 1000.0  # noqa: E731
        d = asdict(self)
        d.update(
            start_ms=ms(self.start),
            ttft_ms=ms(self.ttft),
            tpot_ms=ms(self.tpot),
            e2el_ms=ms(self.latency),
            itl_ms=[x * 1000.0 for x in self.itl],
        )
        for k in ("start", "ttft", "itl", "latency"):
            del d[k]
        return d


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Whether a request succeeded within the given SLOs (a 1-token output has no TPOT and meets it)."""
    if not r.success:
        return False
    if slo_ttft_ms is not None and (r.ttft is None or r.ttft * 1000 > slo_ttft_ms):
        return False
    if slo_tpot_ms is not None:
        tpot = r.tpot
        if tpot is None and r.output_tokens >= 2:
            return False
        if tpot is not None and tpot * 1000 > slo_tpot_ms:
            return False
    return True


def summarize_results(
    results: Sequence[RequestResult],
    duration: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    """All run-level numbers: counts, token totals, throughputs, latency statistics (ms), goodput, errors."""
    ok = [r for r in results if r.success]
    ms = lambda xs: [x * 1000.0 for x in xs]  # noqa: E731
    input_tokens = sum(r.prompt_tokens if r.prompt_tokens is not None else r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: None)
    summary = {
        "duration_s": duration,
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "input_tokens_from_server": all(r.prompt_tokens is not None for r in ok) if ok else None,
        "output_tokens_from_usage": all(r.usage_reported for r in ok) if ok else None,
        "request_throughput": per_s(len(ok)),
        "input_throughput": per_s(input_tokens),
        "output_throughput": per_s(output_tokens),
        "total_token_throughput": per_s(input_tokens + output_tokens),
        "ttft_ms": summarize(ms([r.ttft for r in ok if r.ttft is not None])),
        "tpot_ms": summarize(ms([r.tpot for r in ok if r.tpot is not None])),
        "itl_ms": summarize(ms([x for r in ok for x in r.itl])),
        "e2el_ms": summarize(ms([r.latency for r in ok if r.latency is not None])),
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "goodput": None,
        "good_requests": None,
        "short_outputs": sum(r.output_tokens < r.expected_output_len for r in ok),
        "errors": dict(Counter(r.error for r in results if not r.success).most_common()),
    }
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results)
        summary.update(good_requests=good, goodput=per_s(good))
    return summary


def format_report(summary: dict, title: str = "Serving benchmark") -> str:
    """A one-screen plain-text table of a summary."""
    width = 62

    def num(x, fmt="{:.2f}"):
        return "-" if x is None else fmt.format(x)

    lines = [f" {title} ".center(width, "=")]

    def row(label, value):
        lines.append(f"{label:<40}{value:>{width - 40}}")

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Duration (s):", num(summary["duration_s"]))
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total output tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", num(summary["request_throughput"]))
    row("Input token throughput (tok/s):", num(summary["input_throughput"]))
    row("Output token throughput (tok/s):", num(summary["output_throughput"]))
    row("Total token throughput (tok/s):", num(summary["total_token_throughput"]))
    if summary.get("good_requests") is not None:
        slos = [
            f"TTFT<={summary['slo_ttft_ms']:g}ms" if summary["slo_ttft_ms"] is not None else "",
            f"TPOT<={summary['slo_tpot_ms']:g}ms" if summary["slo_tpot_ms"] is not None else "",
        ]
        row(f"Goodput (req/s) {' '.join(s for s in slos if s)}:", num(summary["goodput"]))
        row("Requests meeting the SLOs:", f"{summary['good_requests']}/{summary['num_requests']}")
    lines.append("-" * width)
    lines.append(f"{'Latency (ms)':<14}" + "".join(f"{h:>12}" for h in ("mean", "p50", "p90", "p99")))
    for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2el_ms")):
        s = summary[key]
        lines.append(f"{name:<14}" + "".join(f"{num(s[k]):>12}" for k in ("mean", "p50", "p90", "p99")))
    lines.append("=" * width)
    if summary.get("short_outputs"):
        lines.append(
            f"Note: {summary['short_outputs']} completed requests got fewer output tokens than asked "
            "(EOS, stop, or a server cap)"
        )
    if summary["errors"]:
        # Messages that differ only in numbers (token counts, ids) are one kind here; --json keeps them all.
        kinds: Counter = Counter()
        example: dict[str, str] = {}
        for msg, count in summary["errors"].items():
            msg = " ".join(str(msg).split())
            key = re.sub(r"\d+", "N", msg)
            kinds[key] += count
            example.setdefault(key, msg)
        lines.append("Errors (count: first message of the kind):")
        for i, (key, count) in enumerate(kinds.most_common()):
            if i == 3:
                lines.append(f"  ... and {len(kinds) - 3} more kinds (see --json)")
                break
            lines.append(f"  {count}: {example[key][: width * 2]}")
    return "\n".join(lines)
