"""Where KV compression starts to pay on this machine: `infertune tune --kv-compression JSON` times one request per
prompt length with full attention and with the press, the two engines stepped in turn (so they share the machine's
load alike), and puts the length below which the press does not pay into the policy it emits: full attention up to
that length, the press above (kv_compression.py).

"Pays" is about time, one request of the length plus --output-len tokens: the press costs its scoring at the end of
the prefill and saves KV reads at every decode step; memory it always saves. The threshold is the longest measured
length at which the press is not faster, below the shortest length from which it is faster at every longer length.
"""

from __future__ import annotations

import random
import statistics
import time


def _engine(model: str | None, options: dict, press, length: int, output_len: int, vocab: int, seed: int):
    from infertune import LLM, SamplingParams

    opts = {**options, "max_model_len": length + output_len, "max_num_seqs": 1, "kv_compression": press}
    engine = LLM(model, **opts).engine
    rng = random.Random(seed + length)
    prompt = [rng.randrange(1, max(2, vocab - 8)) for _ in range(length)]
    engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=output_len, ignore_eos=True))
    return engine


def measure(
    model: str | None, options: dict, press: dict, lengths: list[int], output_len: int, vocab: int, seed: int = 0
) -> list[dict]:
    """Per length: the request's wall time (its own steps), TTFT and median decode step, full vs press."""
    rows = []
    for length in lengths:
        engines = {
            name: _engine(model, options, p, length, output_len, vocab, seed)
            for name, p in (("full", None), ("press", press))
        }
        times = {name: [] for name in engines}
        while any(e.has_unfinished_requests() for e in engines.values()):
            for name, engine in engines.items():
                if engine.has_unfinished_requests():
                    t = time.perf_counter()
                    engine.step()
                    times[name].append(time.perf_counter() - t)
        row = {"length": length}
        for name, steps in times.items():
            prefill = len(steps) - (output_len - 1)  # the steps up to the first token
            row[f"{name}_s"] = sum(steps)
            row[f"{name}_ttft_s"] = sum(steps[:prefill])
            row[f"{name}_tpot_s"] = statistics.median(steps[prefill:]) if output_len > 1 else 0.0
        rows.append(row)
    return rows


def pick_threshold(rows: list[dict]) -> int | None:
    """The policy's max_length of full attention: the longest measured length where the press is not faster, below
    the lengths from which it is faster at every longer one; None where it is faster at every length."""
    rows = sorted(rows, key=lambda r: r["length"])
    threshold = None
    for r in rows:
        if r["press_s"] >= r["full_s"]:
            threshold = r["length"]
    return threshold


def policy(press: dict, threshold: int | None) -> dict:
    """The kv_compression option: full attention for prefills up to threshold, the press above. A policy given as
    the press keeps its rules after that first one (its window rules hold at every length, as a window rule does
    wherever it stands in a policy; its press rules above the threshold)."""
    if threshold is None:
        return dict(press)
    rules = press["policy"] if "policy" in press else [press]
    return {"policy": [{"max_length": threshold, "press": "none"}, *(dict(r) for r in rules)]}


def render(rows: list[dict], threshold: int | None) -> str:
    lines = [
        "| prompt tokens | full: request s (TTFT, TPOT ms) | press: request s (TTFT, TPOT ms) | press / full |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['length']} | {r['full_s']:.3f} ({r['full_ttft_s']:.3f}, {r['full_tpot_s'] * 1e3:.1f}) "
            f"| {r['press_s']:.3f} ({r['press_ttft_s']:.3f}, {r['press_tpot_s'] * 1e3:.1f}) "
            f"| {r['press_s'] / r['full_s']:.2f} |"
        )
    said = "compression pays at every measured length" if threshold is None else f"full up to {threshold} tokens"
    return "\n".join(lines) + f"\nKV compression threshold: {said}"
