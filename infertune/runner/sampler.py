"""Batched sampling: penalties, temperature, top-k / top-p / min-p, seeded per request, one host transfer.

Random sampling inverts each row's CDF at one uniform draw: the first token whose cumulative probability
exceeds u * total. One random number a row, where an exponential race (argmax p / q, q ~ Exp(1) per
vocabulary entry) took one per token: at 16 rows x 32k tokens the race's draws alone cost ~11 ms a step on
2 CPU cores, the CDF ~0.5 ms. Seeded requests draw u from a generator seeded by (seed, output position), so
their tokens do not depend on what else is in the batch, nor on preemption.

Speculative decoding adds a row for each draft token (`verify_drafts`): a sequence's row t is sampled as its output
position num_output_tokens + t would be without drafts (the same uniform when seeded, penalties over the drafts
before it), and a draft is accepted while it equals what its row drew.

Top-k / top-p look at the best `CANDIDATES` tokens of each row (torch.topk, ~1-3 ms) instead of sorting the
vocabulary (~19 ms at 16 x 32k): exact whenever every top-p row's best candidates already hold its mass, as
on a trained model's peaked distributions; otherwise (a flat distribution) the step falls back to the full
sort.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from infertune.sampling_params import SamplingParams

if TYPE_CHECKING:
    from infertune.kernels.interface import DecodeKernels
    from infertune.runner.structured_output import StepMask


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
    # Per row, when logprobs were asked for: (logprob of the sampled token, [(token, logprob)] top-k, the sampled
    # token's rank: 1 + the tokens more likely).
    logprobs: list[tuple[float, list[tuple[int, float]]] | None]
    # Per row, where prompt_logprobs were asked for and the step computed prompt tokens: (index of the first prompt
    # token scored, [(its logprob, top-k)] for it and the ones after it).
    prompt_logprobs: list[tuple[int, list[tuple[float, list[tuple[int, float]]]]] | None] | None = None
    # Speculative decoding, where the step had drafts: per row, how many of its drafts were accepted; the row's
    # tokens are those drafts, then token_ids[row].
    num_accepted: list[int] | None = None
    # A draft model: per row, the drafts it proposed for the row's next step (None where it proposed none).
    draft_token_ids: list[list[int] | None] | None = None
    # A KV connector's loads the workers could not do this step (their prompts were computed instead).
    kv_load_failed: list[str] | None = None
    # A KV connector's workers' get_finished after the step: (req ids whose sending finished, whose receiving did)
    kv_finished: tuple[set[str], set[str]] | None = None


def argmax_only(rows: list[SampleRequest], mask: StepMask | None = None) -> bool:
    """Whether a step's rows need nothing but each row's argmax (greedy, no logprobs, penalties or grammar mask):
    then the runner may hand the sampler the logits in the LM head's dtype (bf16), which the argmax reads exactly as
    the fp32 they widen to, without the [N, V] fp32 copy."""
    return mask is None and all(
        r.params.greedy and r.params.logprobs is None and not r.params.uses_penalties and not r.params.adjusts_logits
        for r in rows
    )


class Sampler:
    def __init__(self, seed: int = 0, device: torch.device | str = "cpu", kernels: DecodeKernels | None = None) -> None:
        # Unseeded requests share the engine's generator, so a whole run is reproducible from LLM(seed=...).
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # The backend's kernels, for greedy_tokens (one pass per row, no copies); None: torch's ops throughout.
        self.kernels = kernels

    def best(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's most likely token, NaNs counted as -inf (argmax alone takes NaN as the largest), so a token a
        grammar masked out (-inf) is never chosen over a NaN. bf16 logits are read as the fp32 they widen to."""
        if self.kernels is not None:
            got = self.kernels.greedy_tokens(logits)
            if got is not None:
                return got
        return logits.float().nan_to_num(nan=float("-inf")).argmax(dim=-1)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRequest], mask: StepMask | None = None) -> SamplerOutput:
        # logits [N, V] fp32; or in the LM head's dtype where argmax_only(rows, mask)
        if logits.dtype is not torch.float32 and not argmax_only(rows, mask):
            logits = logits.float()
        if mask is not None:  # structured output: the grammar's disallowed tokens at -inf (runner/structured_output.py)
            logits = mask.apply(logits)
        params = [r.params for r in rows]
        want_logprobs = [p.logprobs for p in params]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(k is not None for k in want_logprobs) else None
        # The logits processors, then the penalties, both after the raw logprobs: vLLM's order and transformers'
        # (logit_bias before repetition_penalty, as sequence_bias before it; the masks commute with the penalties).
        if any(p.adjusts_logits for p in params):
            allowed = logits  # (the grammar's mask applied)
            logits = apply_logits_processors(logits.clone(), rows)  # (in place: a copy)
            if mask is not None:
                logits = _grammar_wins(logits, allowed, mask.rows)
        if any(p.uses_penalties for p in params):
            logits = apply_penalties(logits, rows)  # (not in place)
        greedy = [p.greedy for p in params]
        if all(greedy):
            tokens = self.best(logits)
        else:
            tokens = self._sample(logits, params, rows, greedy)
        token_list = tokens.tolist()  # the step's one host sync
        logprobs: list = [None] * len(rows)
        if raw_logprobs is not None:
            chosen_t = raw_logprobs.gather(1, tokens.unsqueeze(1))
            ranks = ((raw_logprobs > chosen_t).sum(1) + 1).tolist()  # (1 + the tokens more likely: vLLM's rank)
            chosen = chosen_t.squeeze(1).tolist()
            k_max = max(k or 0 for k in want_logprobs)
            top_vals, top_ids = raw_logprobs.topk(max(k_max, 1), dim=-1)
            top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
            for i, k in enumerate(want_logprobs):
                if k is not None:
                    logprobs[i] = (chosen[i], list(zip(top_ids[i][:k], top_vals[i][:k])), ranks[i])
        return SamplerOutput(token_list, logprobs)

    def _sample(self, logits, params: list[SamplingParams], rows, greedy: list[bool]) -> torch.Tensor:
        device = logits.device
        temps = torch.tensor([1.0 if g else p.temperature for p, g in zip(params, greedy)], device=device)
        probs = apply_top_k_top_p_min_p(logits / temps.unsqueeze(1), params).softmax(dim=-1)
        u = torch.rand(len(params), 1, generator=self.generator, device=device, dtype=torch.float64)
        for i, (p, r) in enumerate(zip(params, rows)):
            if p.seed is not None and not greedy[i]:
                g = torch.Generator(device=device).manual_seed(_mix(p.seed, r.position))
                u[i] = torch.rand(1, generator=g, device=device, dtype=torch.float64)
        sampled = inverse_cdf(probs, u)
        # A row whose scaled logits overflow (a huge logit over a tiny temperature, or a NaN from the model) has no
        # distribution to draw from: it takes its best token instead, NaNs counted as -inf so that a token a
        # grammar masked out (-inf) is never chosen. No host sync: a where over the batch.
        best = self.best(logits)
        sampled = torch.where(probs.isnan().any(dim=-1), best, sampled)
        if not any(greedy):
            return sampled
        return torch.where(torch.tensor(greedy, device=device), best, sampled)


def verify_drafts(row_tokens: list[int], drafts: list[int]) -> tuple[int, int]:
    """Speculative decoding's verification of one sequence: row_tokens are the tokens its 1 + d rows drew (row t
    after the drafts before t), drafts its d draft tokens. Returns (drafts accepted, the token that follows them).

    A draft is accepted while it equals its row's token; the row of the first mismatch (or the row after the last
    draft: the bonus token) gives the token after them. Greedy rows accept while the draft is the argmax. A random
    row's token is an inverse-CDF draw from the same p as sampling without drafts, so the draft x is accepted with
    probability p(x), and on rejection the token is distributed as p with x taken out, renormalised: the rejection
    sampling of a proposal that puts all its mass on x, with one uniform a position. The output distribution is
    exactly that of sampling without drafts; a seeded request even gives the same tokens."""
    accepted = 0
    while accepted < len(drafts) and row_tokens[accepted] == drafts[accepted]:
        accepted += 1
    return accepted, row_tokens[accepted]


def _mix(seed: int, position: int) -> int:
    return (seed * 0x9E3779B1 + position * 0x85EBCA77) & 0x7FFF_FFFF_FFFF_FFFF


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds u * (the row's total): a draw from probs
    for u ~ U[0, 1) [N, 1] (float64). Zero-probability tokens are never chosen: their CDF step is empty."""
    cdf = probs.double().cumsum(dim=-1)
    idx = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).clamp_(max=probs.shape[-1] - 1)
    empty = probs.gather(1, idx) == 0
    if bool(empty.any()):  # u * total rounded up to the total: past the last token with mass, so take that one
        last = probs.shape[-1] - 1 - (probs > 0).flip(-1).int().argmax(dim=-1, keepdim=True)
        idx = torch.where(empty, last, idx)
    return idx.squeeze(1)


CANDIDATES = 256  # tokens per row that top-k / top-p look at before falling back to a full sort


def apply_top_k_top_p_min_p(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    vocab = logits.shape[-1]
    need_k = any(0 < p.top_k < vocab for p in params)
    need_p = any(p.top_p < 1.0 for p in params)
    if need_k or need_p:
        cap = max([CANDIDATES if need_p else 0] + [p.top_k for p in params if 0 < p.top_k < vocab])
        filtered = _top_k_top_p(logits, params, min(cap, vocab)) if cap < vocab else None
        logits = filtered if filtered is not None else _top_k_top_p(logits, params, vocab)
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=logits.device).unsqueeze(1)
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    return logits


def _top_k_top_p(logits: torch.Tensor, params: list[SamplingParams], cap: int) -> torch.Tensor | None:
    """Top-k, then top-p on the renormalized mass, over each row's `cap` best tokens (cap = vocab: all of them,
    sorted). None where a top-p row's best `cap` tokens hold less than its top_p (the kept prefix might reach
    past them). Rows that ask for neither are returned as they are."""
    n, vocab = logits.shape
    device = logits.device
    if cap >= vocab:
        vals, order = logits.sort(dim=-1, descending=True)
    else:
        vals, order = logits.topk(cap, dim=-1)  # sorted, best first
    drop = torch.zeros_like(vals, dtype=torch.bool)
    k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device).unsqueeze(1)
    drop |= torch.arange(vals.shape[-1], device=device).unsqueeze(0) >= k
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], device=device).unsqueeze(1)
        if cap >= vocab:
            probs = vals.masked_fill(drop, float("-inf")).softmax(dim=-1)
        else:
            # the mass of each candidate over what top-k leaves: the k best where top-k is set (all among the
            # candidates), the whole row otherwise
            cut = torch.tensor([0 < p.top_k < vocab for p in params], device=device).unsqueeze(1)
            norm = torch.where(
                cut,
                vals.masked_fill(drop, float("-inf")).logsumexp(dim=-1, keepdim=True),
                logits.logsumexp(dim=-1, keepdim=True),
            )
            probs = (vals - norm).exp().masked_fill(drop, 0.0)
            held = probs.sum(dim=-1, keepdim=True)
            if bool(((top_p < 1.0) & ~cut & (held < top_p)).any()):
                return None
        before = probs.cumsum(dim=-1) - probs  # mass strictly above each token
        # keeps the smallest prefix whose mass reaches top_p (never empty); a row that asks for no top-p keeps all
        # (its fp32 cumsum reaches 1.0 before the tail: the tail would go, with another row's top_p in the batch)
        drop |= (before >= top_p) & (top_p < 1.0)
    if cap >= vocab:
        return logits.scatter(1, order, vals.masked_fill(drop, float("-inf")))
    out = torch.full_like(logits, float("-inf")).scatter_(1, order, vals.masked_fill(drop, float("-inf")))
    filtered = torch.tensor([0 < p.top_k < vocab or p.top_p < 1.0 for p in params], device=device).unsqueeze(1)
    return torch.where(filtered, out, logits)


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


def _grammar_wins(logits: torch.Tensor, allowed: torch.Tensor, grammar_rows: list[int]) -> torch.Tensor:
    """A grammar row the logits processors left without any token (allowed_token_ids without the EOS a finished
    grammar needs, a bad word the grammar requires) keeps the grammar's own choices, so its output stays valid; with
    no token at all, the draw fell back to the argmax of -infs, token 0, which the grammar refuses."""
    rows = torch.tensor(grammar_rows, device=logits.device)
    empty = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
    picked = logits[rows]
    empty[rows] = (torch.isneginf(picked) | torch.isnan(picked)).all(dim=-1)
    return torch.where(empty.unsqueeze(1), allowed, logits) if bool(empty.any()) else logits


def apply_logits_processors(logits: torch.Tensor, rows: list[SampleRequest]) -> torch.Tensor:
    """In place, per row: logit_bias added; every token but allowed_token_ids, the end-of-sequence and stop tokens
    while the output is shorter than min_tokens, and each bad word's last token where the output ends in the tokens
    before it, set to -inf (SamplingParams' logits processors)."""
    vocab = logits.shape[-1]
    device = logits.device
    for i, r in enumerate(rows):
        p = r.params
        if not p.adjusts_logits:
            continue
        row = logits[i]
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=device)
            row.index_add_(0, ids, torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=device))
        if p.allowed_token_ids:
            banned = torch.ones(vocab, dtype=torch.bool, device=device)
            banned[torch.tensor(p.allowed_token_ids, device=device)] = False
            row.masked_fill_(banned, float("-inf"))
        if p.min_tokens and r.position < p.min_tokens and p.min_tokens_stop_ids:
            row[torch.tensor(p.min_tokens_stop_ids, device=device)] = float("-inf")
        if p.bad_words_token_ids:
            out = r.output_token_ids
            ban = [
                w[-1]
                for w in p.bad_words_token_ids
                if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1 :] == w[:-1])
            ]
            if ban:
                row[torch.tensor(ban, device=device)] = float("-inf")
    return logits
