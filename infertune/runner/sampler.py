"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded per request, one host transfer.

Random sampling uses the exponential-race form of the Gumbel trick: argmax(p / q) with q ~ Exp(1)
draws from p. Seeded requests draw q from a generator seeded by (seed, output position), so their
tokens do not depend on what else is in the batch, nor on preemption.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from infertune.sampling_params import SamplingParams


@dataclass(slots=True)
class SampleRequest:
    """What the sampler needs to know about one row. The token lists are read only for penalties, so the
    runner leaves them empty otherwise and gives num_output_tokens (the seeded stream's position)."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    num_output_tokens: int | None = None

    @property
    def position(self) -> int:
        return len(self.output_token_ids) if self.num_output_tokens is None else self.num_output_tokens


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # Per row, when logprobs were asked for: (logprob of the sampled token, [(token, logprob)] top-k).
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu") -> None:
        # Unseeded requests share the engine's generator, so a whole run is reproducible from LLM(seed=...).
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRequest]) -> SamplerOutput:
        # logits [N, V] fp32
        params = [r.params for r in rows]
        want_logprobs = [p.logprobs for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want_logprobs) else None
        if any(p.uses_penalties for p in params):
            logits = apply_penalties(logits.clone(), rows)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = logits.argmax(dim=-1)
        else:
            tokens = self._sample(logits, params, rows, greedy)
        token_list = tokens.tolist()  # the step's one host sync
        logprobs: list = [None] * len(rows)
        if raw_logprobs is not None:
            chosen = raw_logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1).tolist()
            k_max = max(k or 0 for k in want_logprobs)
            top_vals, top_ids = raw_logprobs.topk(max(k_max, 1), dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for i, k in enumerate(want_logprobs):
                if k is not None:
                    logprobs[i] = (chosen[i], list(zip(top_ids[i][:k], top_vals[i][:k])))
        return SamplerOutput(token_list, logprobs)

    def _sample(self, logits, params: list[SamplingParams], rows, greedy: list[bool]) -> torch.Tensor:
        device = logits.device
        greedy_t = torch.tensor(greedy, device=device)
        argmax = logits.argmax(dim=-1)
        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device)
        logits = logits / temps.unsqueeze(1)
        logits = apply_top_k_top_p_min_p(logits, params)
        probs = logits.softmax(dim=-1)
        q = torch.empty_like(probs)
        q.exponential_(generator=self.generator)
        for i, (p, r) in enumerate(zip(params, rows)):
            if p.seed is not None and not greedy[i]:
                g = torch.Generator(device=device).manual_seed(_mix(p.seed, r.position))
                q[i].exponential_(generator=g)
        sampled = (probs / q).argmax(dim=-1)
        return torch.where(greedy_t, argmax, sampled)


def _mix(seed: int, position: int) -> int:
    return (seed * 0x9E3779B1 + position * 0x85EBCA77) & 0x7FFF_FFFF_FFFF_FFFF


def apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    need_k = any(0 < p.top_k < vocab for p in params)
    need_p = any(p.top_p < 1.0 for p in params)
    if need_k or need_p:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if need_k:
            k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device)
            drop |= torch.arange(vocab, device=logits.device).unsqueeze(0) >= k.unsqueeze(1)
        if need_p:
            top_p = torch.tensor([p.top_p for p in params], device=logits.device).unsqueeze(1)
            probs = sorted_logits.masked_fill(drop, float("-inf")).softmax(dim=-1)
            before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
            drop |= before >= top_p  # keeps the smallest prefix whose mass reaches top_p (never empty)
        logits = logits.scatter(1, order, sorted_logits.masked_fill(drop, float("-inf")))
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def apply_penalties(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    """OpenAI presence/frequency penalties over output tokens; CTRL repetition penalty over prompt + output."""
    n, vocab = logits.shape
    device = logits.device
    counts = torch.zeros(n, vocab, device=device)
    seen = torch.zeros(n, vocab, dtype=torch.bool, device=device)
    for i, r in enumerate(rows):
        if r.output_token_ids:
            out = torch.tensor(r.output_token_ids, device=device)
            counts[i].index_add_(0, out, torch.ones_like(out, dtype=counts.dtype))
        if r.params.repetition_penalty != 1.0:
            seen[i, torch.tensor(r.prompt_token_ids + r.output_token_ids, device=device)] = True
    rep = torch.tensor([r.params.repetition_penalty for r in rows], device=device).unsqueeze(1)
    pres = torch.tensor([r.params.presence_penalty for r in rows], device=device).unsqueeze(1)
    freq = torch.tensor([r.params.frequency_penalty for r in rows], device=device).unsqueeze(1)
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalised, logits)
    return logits - freq * counts - pres * (counts > 0)
