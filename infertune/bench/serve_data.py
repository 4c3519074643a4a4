"""Serving-benchmark workloads: random-word prompts and JSONL/ShareGPT datasets turned into PromptSpecs."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Common English words that are one token (with their leading space) in the GPT-2, Llama, Mistral and
# Qwen tokenizers, so a prompt of N random words is close to N tokens on most servers.
WORDS = (
    "the of and to in is that for it as was with be by on not he this are or his from at which but have an "
    "they you were her she there been one all we their has would when if so no will more other its can what "
    "into about them some time could these two may first then do any like my now over such our man me even "
    "most made after also did many before must through back years where much your way well down should "
    "because each just those people how too little state good very make world still own see men work long "
    "get here between both life being under never day same another know while last might us great old year "
    "off come since against go came right used take three"
).split()


@dataclass
class PromptSpec:
    prompt: str
    prompt_len: int  # estimated (or counted with --tokenizer); the server's usage count is reported when given
    output_len: int


def approx_token_count(text: str) -> int:
    """Rough BPE token count when no tokenizer is given: about 4 characters per token."""
    return max(1, round(len(text) / 4)) if text else 0


def random_prompts(
    n: int, input_len: int, output_len: int, seed: int = 0, count_tokens: Callable[[str], int] | None = None
) -> list[PromptSpec]:
    """n prompts of input_len random common words (~input_len tokens on most tokenizers).

    With count_tokens (a real tokenizer), words are added or dropped until the count is input_len or
    within a word of it.
    """
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    rng = random.Random(seed)
    specs = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(input_len)]
        length = input_len
        if count_tokens is not None:
            words, length = _fit_words(words, input_len, count_tokens, rng)
        specs.append(PromptSpec(" ".join(words), length, output_len))
    return specs


def _fit_words(
    words: list[str], target: int, count_tokens: Callable[[str], int], rng: random.Random
) -> tuple[list[str], int]:
    """Resize words so that count_tokens(' '.join(words)) is target, or the nearest count a word boundary allows."""

    def resize(n: int) -> None:
        if n < len(words):
            del words[n:]
        else:
            words.extend(rng.choice(WORDS) for _ in range(n - len(words)))

    length = count_tokens(" ".join(words))
    for _ in range(6):  # proportional steps first
        want = max(1, round(len(words) * target / max(length, 1)))
        if length == target or want == len(words):
            break
        resize(want)
        length = count_tokens(" ".join(words))
    for _ in range(64):  # then a word at a time, stopping at the count nearest the target
        if length == target:
            break
        step = -1 if length > target else 1
        if len(words) + step < 1:
            break
        saved = list(words)
        resize(len(words) + step)
        new = count_tokens(" ".join(words))
        if (new > target) != (length > target):  # crossed the target: keep the closer side
            if abs(new - target) > abs(length - target):
                words[:] = saved
                new = length
            length = new
            break
        length = new
    return words, length


HUMAN_ROLES = {"human", "user"}
ASSISTANT_ROLES = {"gpt", "assistant", "chatgpt", "bard", "bing", "model"}


def parse_record(rec: dict, default_output_len: int, count_tokens: Callable[[str], int]) -> PromptSpec | None:
    """One dataset record -> PromptSpec, or None if it has no usable prompt.

    {"prompt": str, "output_len": N (optional, default --output-len)}, or ShareGPT-like
    {"conversations" (or "messages"): [{"from"|"role": ..., "value"|"content": ...}, ...]}: the first human
    turn is the prompt and the first assistant turn after it sets the output length (its token count).
    """
    if not isinstance(rec, dict):
        return None
    if isinstance(rec.get("prompt"), str):
        prompt = rec["prompt"]
        out = rec.get("output_len", default_output_len)
        if not prompt or not isinstance(out, int) or isinstance(out, bool):
            return None
        return PromptSpec(prompt, count_tokens(prompt), max(1, out))
    turns = rec.get("conversations", rec.get("messages"))
    if not isinstance(turns, list):
        return None
    prompt, answer = None, None
    for turn in turns:
        if not isinstance(turn, dict):
            continue
        role = str(turn.get("from", turn.get("role", ""))).lower()
        text = turn.get("value", turn.get("content"))
        if not isinstance(text, str):
            continue
        if prompt is None:
            if role in HUMAN_ROLES and text:
                prompt = text
        elif role in ASSISTANT_ROLES:
            answer = text
            break
    if prompt is None:
        return None
    out = max(1, count_tokens(answer)) if answer else default_output_len
    return PromptSpec(prompt, count_tokens(prompt), out)


def read_records(path: str | Path) -> list[dict]:
    """Records of a JSONL file (one JSON object a line; blank lines skipped) or of a JSON array file."""
    text = Path(path).read_text(encoding="utf-8")
    if text.lstrip().startswith("["):
        data = json.loads(text)
        return list(data)
    records = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from None
    return records


def load_dataset(
    dataset: str,
    num_prompts: int,
    input_len: int,
    output_len: int,
    seed: int = 0,
    count_tokens: Callable[[str], int] | None = None,
) -> list[PromptSpec]:
    """num_prompts PromptSpecs: `random`, or from a JSONL/JSON file (seeded shuffle; cycled if too short)."""
    if num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if dataset == "random":
        return random_prompts(num_prompts, input_len, output_len, seed, count_tokens)
    path = Path(dataset)
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {dataset} (use 'random' or a .jsonl path)")
    count = count_tokens or approx_token_count
    specs = [s for s in (parse_record(r, output_len, count) for r in read_records(path)) if s is not None]
    if not specs:
        raise ValueError(f"{dataset}: no usable records (need 'prompt' or 'conversations' with a human turn)")
    random.Random(seed).shuffle(specs)
    return [specs[i % len(specs)] for i in range(num_prompts)]
