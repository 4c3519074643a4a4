"""Accuracy of a candidate model (typically quantized) against a reference: the numbers `infertune eval` reports.

* perplexity: exp(mean next-token NLL) over held-out text, scored with sliding windows of the context so
  every token after the first is predicted exactly once, from at least `context - stride` tokens of
  history (the first window excepted);
* KL(P_ref || P_cand): per position, the KL divergence of the candidate's next-token distribution from
  the reference's (nats), averaged over the same positions (also its 99th percentile and max);
* top-1 agreement: share of positions where both models rank the same token first;
* greedy prefix: from a few prompts cut out of the same text, both engines decode greedily; the number of
  leading generated tokens that are identical.

Both models run through the engine itself (ModelRunner.prompt_logits for the scores, LLM.generate for the
greedy decode), so what is measured is what is served: the same kernels, the same KV cache.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from infertune.config import default_model_path
from infertune.evaluate.data import default_heldout_path, load_documents, token_stream
from infertune.llm import LLM
from infertune.sampling_params import SamplingParams

# Windows longer than this cost much memory on big vocabularies ([context, V] fp32 logits) for little gain.
DEFAULT_MAX_CONTEXT = 2048
# The built-in demo model allows 1024 positions but was trained on 256-token windows (its README): past 256
# it extrapolates and perplexity climbs from ~16 to ~70, so its windows (and its quantized copies') stop there.
DEMO_TRAINED_CONTEXT = 256
_ROW_CHUNK = 256  # rows of logits turned into log-probabilities at a time


# ---- metrics on logits (pure functions; the tests check them against hand computations) --------------------
def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """logits [n, V], targets [n] -> -log p(target) per position [n], in float64."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return -logp.gather(1, targets.long().unsqueeze(1)).squeeze(1)


def kl_divergence(ref_logits: torch.Tensor, cand_logits: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P_cand) per position [n], in nats: sum_v p_ref(v) * (log p_ref(v) - log p_cand(v))."""
    out = []
    for start in range(0, ref_logits.shape[0], _ROW_CHUNK):
        ref = torch.log_softmax(ref_logits[start : start + _ROW_CHUNK].float(), dim=-1)
        cand = torch.log_softmax(cand_logits[start : start + _ROW_CHUNK].float(), dim=-1)
        out.append((ref.exp() * (ref - cand)).sum(dim=-1))
    return torch.cat(out) if out else torch.zeros(0)


def top1_agreement(ref_logits: torch.Tensor, cand_logits: torch.Tensor) -> torch.Tensor:
    """Per position [n]: True where both rank the same token first."""
    return ref_logits.argmax(dim=-1) == cand_logits.argmax(dim=-1)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


@dataclass(frozen=True, slots=True)
class Window:
    """Tokens [begin, end) go through the model; targets [score_from, end) are scored."""

    begin: int
    end: int
    score_from: int


def sliding_windows(num_tokens: int, context: int, stride: int) -> list[Window]:
    """Windows of `context` tokens every `stride`; together they score targets 1 .. num_tokens-1 exactly once."""
    if context < 2:
        raise ValueError(f"context={context} must be at least 2 tokens")
    if not 0 < stride <= context:
        raise ValueError(f"stride={stride} must be in 1..context ({context})")
    windows, scored_to, begin = [], 1, 0
    while scored_to < num_tokens:
        begin = min(begin, scored_to - 1)  # target t is predicted from position t-1, which must be in the window
        end = min(begin + context, num_tokens)
        if end > scored_to:
            windows.append(Window(begin, end, scored_to))
            scored_to = end
        begin += stride
    return windows


def parse_gate(text: str) -> float:
    """'1%' (or '1') -> 0.01: the largest allowed relative perplexity increase."""
    try:
        value = float(str(text).strip().removesuffix("%"))
    except ValueError:
        raise ValueError(f"--gate {text!r}: give a percentage such as 1% or 0.5%") from None
    if value < 0 or math.isnan(value):
        raise ValueError(f"--gate {text!r} must be a non-negative percentage")
    return value / 100.0


# ---- the report ---------------------------------------------------------------------------------------------
@dataclass
class AccuracyReport:
    model: str
    quantization: str | None
    reference: str | None
    reference_quantization: str | None
    data: str
    num_tokens: int  # scored positions
    context: int
    stride: int
    nll: float  # mean next-token NLL of the candidate, nats
    perplexity: float
    ref_nll: float | None = None
    ref_perplexity: float | None = None
    kl_mean: float | None = None
    kl_p99: float | None = None
    kl_max: float | None = None
    top1_agreement: float | None = None
    greedy_prefix: list[int] = field(default_factory=list)  # per prompt: identical leading generated tokens
    greedy_tokens: int = 0  # tokens generated per prompt
    seconds: float = 0.0

    @property
    def perplexity_change(self) -> float | None:
        """Relative change of perplexity against the reference (0.01 = 1 % worse)."""
        return None if self.ref_perplexity is None else self.perplexity / self.ref_perplexity - 1.0

    @property
    def greedy_prefix_mean(self) -> float | None:
        return sum(self.greedy_prefix) / len(self.greedy_prefix) if self.greedy_prefix else None

    def passes_gate(self, gate: float) -> bool:
        if self.perplexity_change is None:
            raise ValueError("--gate needs a reference model: give --compare or --quantization")
        return self.perplexity_change <= gate

    def to_dict(self) -> dict:
        d = asdict(self)
        d["perplexity_change"] = self.perplexity_change
        d["greedy_prefix_mean"] = self.greedy_prefix_mean
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def format(self) -> str:
        cand = f"{self.model}" + (f" ({self.quantization})" if self.quantization else "")
        lines = [f"accuracy of {cand}"]
        if self.reference is not None:
            ref = f"{self.reference}" + (f" ({self.reference_quantization})" if self.reference_quantization else "")
            lines[0] += f"\n         vs {ref}"
        lines.append(
            f"text: {self.data}: {self.num_tokens:,} tokens scored, windows of {self.context} (stride {self.stride})"
        )
        if self.ref_perplexity is None:
            lines.append(f"perplexity {self.perplexity:.4f}   NLL {self.nll:.5f} nats/token")
        else:
            lines += [
                f"{'':18}{'candidate':>12}{'reference':>12}{'change':>12}",
                f"{'perplexity':18}{self.perplexity:12.4f}{self.ref_perplexity:12.4f}{100 * self.perplexity_change:+11.3f}%",
                f"{'NLL (nats/token)':18}{self.nll:12.5f}{self.ref_nll:12.5f}{self.nll - self.ref_nll:+12.5f}",
                f"KL(ref || cand)   mean {self.kl_mean:.6f}  p99 {self.kl_p99:.6f}  max {self.kl_max:.5f} nats/token",
                f"top-1 agreement   {100 * self.top1_agreement:.2f} %",
            ]
            if self.greedy_prefix:
                same = sum(p == self.greedy_tokens for p in self.greedy_prefix)
                lines.append(
                    f"greedy prefix     mean {self.greedy_prefix_mean:.1f} of {self.greedy_tokens} tokens; identical "
                    f"{same}/{len(self.greedy_prefix)} prompts [{' '.join(map(str, self.greedy_prefix))}]"
                )
        lines.append(f"({self.seconds:.1f} s)")
        return "\n".join(lines)


# ---- running the engines ------------------------------------------------------------------------------------
def _stored_source(model: str) -> str | None:
    """The unquantized model an `infertune quantize` checkpoint was made from, if it is still there."""
    try:
        cfg = json.loads((Path(model) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    source = ((cfg.get("quantization_config") or {}).get("infertune") or {}).get("source_model")
    return source if source and Path(source).is_dir() else None


def _stored_method(llm: LLM) -> str | None:
    if llm.config.quant.method:
        return llm.config.quant.method
    try:
        cfg = json.loads((Path(llm.config.model.model) / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return ((cfg.get("quantization_config") or {}).get("infertune") or {}).get("method")


def _trained_context(*llms: LLM | None) -> int:
    demo = Path(default_model_path()).resolve()
    for llm in llms:
        if llm is not None:
            path = llm.config.model.model
            if Path(path).resolve() == demo or (_stored_source(path) and Path(_stored_source(path)).resolve() == demo):
                return DEMO_TRAINED_CONTEXT
    return DEFAULT_MAX_CONTEXT


def _open(model, quantization: str | None, options: dict) -> LLM:
    if isinstance(model, LLM):
        if quantization is not None and quantization != model.config.quant.method:
            raise ValueError("pass either a loaded LLM or a quantization for it, not both")
        return model
    return LLM(model, quantization=quantization, **options)


def _window_logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    runner = llm.engine.executor.runner
    # Offline use only: no request holds KV blocks, so the first blocks of the pool are free to overwrite.
    table = list(range(-(-len(ids) // runner.block_size)))
    return runner.prompt_logits(ids, table)  # [n, V] fp32


def _greedy(llm: LLM, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def compare(
    model=None,
    reference=None,
    *,
    quantization: str | None = None,
    reference_quantization: str | None = None,
    data: str | None = None,
    max_tokens: int | None = None,
    context: int | None = None,
    stride: int | None = None,
    num_prompts: int = 8,
    prompt_tokens: int = 32,
    greedy_tokens: int = 64,
    engine_options: dict | None = None,
    candidate_options: dict | None = None,
    show_progress: bool = False,
) -> AccuracyReport:
    """Score `model` (a path, None for the demo model, or a loaded LLM) on held-out text against `reference`.

    With reference=None the reference is the same model unquantized when `quantization` is given, or the
    source model recorded in an `infertune quantize` checkpoint; otherwise only perplexity is reported.
    `engine_options` go to both engines (dtype, device, ...), `candidate_options` to the candidate only
    (quant_group_size, keep_fp). Windows default to the model's context (at most DEFAULT_MAX_CONTEXT)
    with a stride of half of it. An LLM passed in must have no requests in flight: its first KV blocks are
    overwritten and its prefix cache is reset.
    """
    t0 = time.perf_counter()
    if model is None:
        model = default_model_path()
    base = {"enable_prefix_caching": False, "max_num_seqs": max(num_prompts, 1), **(engine_options or {})}
    cand = _open(model, quantization, {**base, **(candidate_options or {})})
    if reference is None and not isinstance(model, LLM):
        if quantization is not None:
            reference = model
        elif model is not None:
            reference = _stored_source(model)
    ref = _open(reference, reference_quantization, base) if reference is not None else None

    data = data or default_heldout_path()
    eos = sorted(cand.engine.eos_token_ids)[0] if cand.engine.eos_token_ids else None
    ids = token_stream(cand.tokenizer, load_documents(data), eos)
    if ref is not None and ref.tokenizer.get_vocab() != cand.tokenizer.get_vocab():
        raise ValueError("the two models use different tokenizers; perplexity and KL are only comparable on one")
    if max_tokens is not None:
        if max_tokens < 2:
            raise ValueError(f"max_tokens={max_tokens} must be at least 2")
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise ValueError(f"{data} holds fewer than 2 tokens; give more text")
    limit = min(llm.engine.max_model_len for llm in (cand, ref) if llm is not None)
    context = context or min(limit, DEFAULT_MAX_CONTEXT, _trained_context(cand, ref))
    if context > limit:
        raise ValueError(f"context={context} exceeds max_model_len={limit}; lower it")
    stride = stride or max(context // 2, 1)
    windows = sliding_windows(len(ids), context, stride)

    nll_sum = ref_nll_sum = 0.0
    kls, agree = [], 0
    for w in tqdm(windows, desc="scoring", unit="window", disable=not show_progress):
        rows = slice(w.score_from - 1 - w.begin, w.end - 1 - w.begin)
        targets = torch.tensor(ids[w.score_from : w.end])
        cand_logits = _window_logits(cand, ids[w.begin : w.end])[rows].cpu()
        nll_sum += float(token_nll(cand_logits, targets).sum())
        if ref is not None:
            ref_logits = _window_logits(ref, ids[w.begin : w.end])[rows].cpu()
            ref_nll_sum += float(token_nll(ref_logits, targets).sum())
            kls.append(kl_divergence(ref_logits, cand_logits))
            agree += int(top1_agreement(ref_logits, cand_logits).sum())
    for llm in (cand, ref):
        if llm is not None:  # the scoring overwrote KV blocks the prefix cache may still point at
            llm.engine.block_manager.reset_prefix_cache()

    n = len(ids) - 1
    report = AccuracyReport(
        model=cand.config.model.model,
        quantization=_stored_method(cand),
        reference=ref.config.model.model if ref is not None else None,
        reference_quantization=_stored_method(ref) if ref is not None else None,
        data=data,
        num_tokens=n,
        context=context,
        stride=stride,
        nll=nll_sum / n,
        perplexity=math.exp(nll_sum / n),
    )
    if ref is not None:
        kl = torch.cat(kls).double()
        report.ref_nll, report.ref_perplexity = ref_nll_sum / n, math.exp(ref_nll_sum / n)
        report.kl_mean, report.kl_max = float(kl.mean()), float(kl.max())
        report.kl_p99 = float(torch.quantile(kl[: 2**24], 0.99))
        report.top1_agreement = agree / n
        span = min(prompt_tokens, len(ids) - 1)
        if num_prompts > 0 and span > 0 and span + greedy_tokens <= limit:
            starts = [i * (len(ids) - span) // num_prompts for i in range(num_prompts)]
            prompts = [ids[s : s + span] for s in starts]
            a, b = _greedy(cand, prompts, greedy_tokens), _greedy(ref, prompts, greedy_tokens)
            report.greedy_prefix = [common_prefix_length(x, y) for x, y in zip(a, b)]
            report.greedy_tokens = greedy_tokens
    report.seconds = time.perf_counter() - t0
    return report
