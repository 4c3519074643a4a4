"""Cost model: dollars per million tokens, tokens per joule, and the prefill / decode card split.

Energy assumes every card draws its TDP the whole time, so tokens per joule is a lower bound. Dollars use the
catalog's per-card hourly price (or --price-per-hour) and count only card-hours, not host, storage or network.

Prefill / decode split (disaggregation, the seeds' "2 cards prefill + 6 cards decode"). Prefill is compute-bound:
a prefill instance finishes Rp requests/s (prompts packed into ~2048-token steps). Decode is bandwidth-bound:
a decode instance finishes Rd requests/s at its batch. With N instances, n on prefill and N - n on decode serve
min(n Rp, (N - n) Rd) requests/s; the best n balances the two, i.e. prefill gets the share
(1 / Rp) / (1 / Rp + 1 / Rd) of the cards: the share of a request's card-time spent in prefill. So 2 + 6 is what
comes out when decoding a request costs about three times the card-time of prefilling it. Qwen2.5-7B on the
seeds' 910B with 1024-token prompts, 512-token outputs and the seeds' batch 32: a card prefills 11.8 requests/s
and decodes 3.7 requests/s, a 24% prefill share, so 2 prefill + 6 decode of 8 cards
(`infertune plan --model qwen2.5-7b-instruct --device 910b --input-len 1024 --output-len 512 --batch 32`).
A roofline cannot show the gain the seeds measured (+19%): at the ideal ratio, colocated cards that alternate
prefill and decode reach the same N / (1 / Rp + 1 / Rd). The gain of disaggregation comes from what a roofline
leaves out (prefill chunks stalling decode steps, decode batches limited by memory shared with prefill), so the
split is reported next to the colocated figure, not as a speed-up.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


def usd_per_million_tokens(usd_per_hour_per_card: float | None, cards: int, tokens_per_s: float) -> float | None:
    if usd_per_hour_per_card is None or tokens_per_s <= 0:
        return None
    return usd_per_hour_per_card * cards / 3600.0 / tokens_per_s * 1e6


def tokens_per_joule(tokens_per_s: float, watts_per_card: float | None, cards: int) -> float | None:
    if watts_per_card is None:
        return None
    return tokens_per_s / (watts_per_card * cards)


@dataclass(frozen=True)
class PDSplit:
    instances: int  # prefill + decode instances (each instance is --tp cards)
    prefill_instances: int
    decode_instances: int
    prefill_requests_per_s_per_instance: float
    decode_requests_per_s_per_instance: float
    requests_per_s: float  # of the split: min(prefill side, decode side)
    colocated_requests_per_s: float  # every instance does both: N / (1/Rp + 1/Rd)
    ideal_prefill_share: float  # (1/Rp) / (1/Rp + 1/Rd)
    bottleneck: str  # "prefill", "decode" or "balanced"
    rate: float | None = None
    prefill_instances_for_rate: int | None = None
    decode_instances_for_rate: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def pd_split(instances: int, prefill_rps: float, decode_rps: float, rate: float | None = None) -> PDSplit:
    """Best split of `instances` into prefill and decode, given each kind's requests/s per instance.

    Ties go to more decode instances (decode holds the KV cache and sets TPOT). With `rate` (requests/s), also
    the fewest instances of each kind that sustain it.
    """
    if instances < 2:
        raise ValueError(f"a prefill / decode split needs at least 2 instances (got {instances})")
    if prefill_rps <= 0 or decode_rps <= 0:
        raise ValueError("requests/s per instance must be positive")
    best_n, best = 1, -1.0
    for n in range(1, instances):
        served = min(n * prefill_rps, (instances - n) * decode_rps)
        if served > best * (1 + 1e-12):
            best_n, best = n, served
    p_side, d_side = best_n * prefill_rps, (instances - best_n) * decode_rps
    bottleneck = (
        "balanced" if math.isclose(p_side, d_side, rel_tol=1e-9) else ("prefill" if p_side < d_side else "decode")
    )
    share = (1 / prefill_rps) / (1 / prefill_rps + 1 / decode_rps)
    need_p = need_d = None
    if rate is not None:
        if rate <= 0:
            raise ValueError(f"--rate must be positive (got {rate})")
        need_p, need_d = math.ceil(rate / prefill_rps - 1e-9), math.ceil(rate / decode_rps - 1e-9)
    return PDSplit(
        instances,
        best_n,
        instances - best_n,
        prefill_rps,
        decode_rps,
        best,
        instances / (1 / prefill_rps + 1 / decode_rps),
        share,
        bottleneck,
        rate,
        need_p,
        need_d,
    )
