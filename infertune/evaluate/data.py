"""Text for evaluation and calibration: the shipped held-out / calibration sets, JSONL or plain text, as token ids.

A .jsonl file holds one document per line, {"text": ...} (other keys are ignored; a bare JSON string is a
document too). Any other file is one document. Documents are tokenized without special tokens and joined
by the end-of-sequence token, the way the demo model was trained.
"""

from __future__ import annotations

import json
from pathlib import Path

_ASSETS = Path(__file__).resolve().parent.parent / "assets" / "calib"


def default_heldout_path() -> str:
    """The demo model's validation split (Python stdlib files it never saw; PSF-2.0), as JSONL."""
    return str(_ASSETS / "heldout.jsonl")


def default_calib_path() -> str:
    """576 function / class snippets from the demo model's training split (PSF-2.0), as JSONL."""
    return str(_ASSETS / "calib.jsonl")


def load_documents(path: str) -> list[str]:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"text file {path!r} does not exist; pass a .txt or .jsonl file")
    if p.suffix != ".jsonl":
        text = p.read_text(encoding="utf-8")
        if not text.strip():
            raise ValueError(f"{path} is empty; give it some text")
        return [text]
    docs = [text for _, text in read_jsonl_texts(path) if text.strip()]
    if not docs:
        raise ValueError(f'{path} holds no documents; each line must be {{"text": ...}}')
    return docs


def read_jsonl_texts(path: str) -> list[tuple[int, str]]:
    """(line number, text) of every non-blank line of a JSONL file of {"text": ...} (or bare strings)."""
    texts = []
    for lineno, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f'{path}:{lineno} is not valid JSON ({e}); each line must be {{"text": ...}}') from e
        text = record if isinstance(record, str) else record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f'{path}:{lineno} has no "text" string; each line must be {{"text": ...}}')
        texts.append((lineno, text))
    return texts


def encode_documents(tokenizer, docs: list[str]) -> list[list[int]]:
    # verbose=False: documents longer than the model's context are expected here (they are cut into windows).
    return [list(tokenizer.encode(d, add_special_tokens=False, verbose=False)) for d in docs]


def token_stream(tokenizer, docs: list[str], separator: int | None) -> list[int]:
    """All documents as one id stream, each followed by `separator` (the eos id) when there is one."""
    ids: list[int] = []
    for doc in encode_documents(tokenizer, docs):
        ids.extend(doc)
        if separator is not None:
            ids.append(separator)
    return ids
