"""Pure functions over measured rows: SLO parsing, the online / offline recommendation, the throughput knee.

A row is a dict with at least: max_num_seqs, max_num_batched_tokens, status ("ok" | "oom" | "error"),
output_tok_s, and the latency figures in seconds: ttft_p50_s, ttft_p90_s, tpot_p50_s, tpot_p90_s.
Nothing here measures anything, so the tests can feed synthetic tables.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

SLO_METRICS = ("ttft_p50", "ttft_p90", "ttft_p99", "tpot_p50", "tpot_p90", "tpot_p99")
_UNITS = {"ms": 1e-3, "s": 1.0, "us": 1e-6}
KNEE_GAIN = 0.05  # throughput "stops rising" once doubling the batch gains less than 5 %


def parse_slo(text: str | None) -> dict[str, float]:
    """'ttft_p90=100ms,tpot_p90=50ms' -> {'ttft_p90': 0.1, 'tpot_p90': 0.05} (seconds). Bare numbers are ms."""
    if not text:
        return {}
    slo: dict[str, float] = {}
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"SLO term {part!r}: write METRIC=VALUE, e.g. ttft_p90=100ms")
        key, value = (x.strip() for x in part.split("=", 1))
        key = key.lower()
        if key not in SLO_METRICS:
            raise ValueError(f"SLO metric {key!r} is not one of {', '.join(SLO_METRICS)}")
        m = re.fullmatch(r"([0-9]*\.?[0-9]+)\s*(ms|s|us)?", value)
        if not m:
            raise ValueError(f"SLO value {value!r} for {key}: give a number with ms, s or us, e.g. 100ms")
        number = float(m.group(1)) * _UNITS[m.group(2) or "ms"]
        if number <= 0:
            raise ValueError(f"SLO value for {key} must be positive")
        slo[key] = number
    return slo


def format_slo(slo: dict[str, float]) -> str:
    return ", ".join(f"{k} <= {v * 1e3:g} ms" for k, v in slo.items()) or "none"


def is_usable(row: dict) -> bool:
    """A row that ran and has a positive, finite throughput (OOM and error rows never are)."""
    tok = row.get("output_tok_s")
    return row.get("status") == "ok" and tok is not None and math.isfinite(tok) and tok > 0


def slo_violations(row: dict, slo: dict[str, float]) -> list[str]:
    """The SLO terms this row breaks ('ttft_p90 150 ms > 100 ms'); a missing figure counts as a violation."""
    out = []
    for key, limit in slo.items():
        value = row.get(f"{key}_s")
        if value is None or not math.isfinite(value):
            out.append(f"{key} not measured")
        elif value > limit:
            out.append(f"{key} {value * 1e3:.1f} ms > {limit * 1e3:g} ms")
    return out


def _best(rows: list[dict]) -> dict | None:
    # Highest throughput; on a tie the smaller batch and token budget (less memory, lower latency).
    return max(
        rows,
        key=lambda r: (r["output_tok_s"], -r["max_num_seqs"], -(r.get("max_num_batched_tokens") or 0)),
        default=None,
    )


@dataclass
class Recommendation:
    offline: dict | None  # max tok/s among usable rows
    online: dict | None  # max tok/s among usable rows meeting the SLO (None when none does)
    slo: dict[str, float]
    messages: list[str] = field(default_factory=list)


def recommend(rows: list[dict], slo: dict[str, float] | None = None) -> Recommendation:
    slo = slo or {}
    usable = [r for r in rows if is_usable(r)]
    rec = Recommendation(offline=_best(usable), online=None, slo=slo)
    if not usable:
        rec.messages.append(
            "no setting ran: every row is OOM or failed; lower --max-batch or the lengths, or give "
            "a larger --kv-cache-memory-bytes"
        )
        return rec
    meeting = [r for r in usable if not slo_violations(r, slo)]
    rec.online = _best(meeting)
    if rec.online is None:
        closest = min(usable, key=lambda r: sum(r.get(f"{k}_s", math.inf) / v for k, v in slo.items()))
        rec.messages.append(
            f"no measured setting meets the SLO ({format_slo(slo)}); the closest is max_num_seqs="
            f"{closest['max_num_seqs']} ({'; '.join(slo_violations(closest, slo))}). Relax the SLO, shorten the "
            f"workload, use a smaller model or quantization, or faster hardware"
        )
    elif not slo:
        rec.messages.append("no SLO given: the online pick is the offline pick; pass --slo ttft_p90=...,tpot_p90=...")
    return rec


def series_key(row: dict):
    """Rows that differ only in max_num_seqs form one series: same token budget (and same variant, when the
    sweep also varies KV dtype, quantization or the dynamic-batch cap)."""
    variant = row.get("variant")
    return row.get("max_num_batched_tokens") if not variant else (variant, row.get("max_num_batched_tokens"))


def knee(rows: list[dict], gain: float = KNEE_GAIN) -> dict:
    """Per series (see series_key): the batch after which throughput stops rising (doubling the batch
    gains less than `gain`, or the next row is OOM); None when it keeps rising through the sweep."""
    out: dict = {}
    for key in dict.fromkeys(series_key(r) for r in rows):
        series = sorted((r for r in rows if series_key(r) == key), key=lambda r: r["max_num_seqs"])
        point = None
        for prev, cur in zip(series, series[1:]):
            if not is_usable(prev):
                break
            if not is_usable(cur) or cur["output_tok_s"] < prev["output_tok_s"] * (1 + gain):
                point = prev["max_num_seqs"]
                break
        out[key] = point
    return out
