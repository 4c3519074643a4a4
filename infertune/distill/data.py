"""The data pipeline shared by ``infertune distill`` and ``infertune train``.

Input (``--data``): a text file (one document), a ``.jsonl`` file (one ``{"text": ...}`` document per line), or a
directory (every ``*.py`` and ``*.txt`` file below it, sorted by relative path, ``__pycache__`` skipped).

Split: a document is held out when ``sha256(document id)`` (read as a fraction of 2^64) is below ``val_fraction``;
the id is the file's path relative to ``--data`` (``name:line`` for a JSONL line). This depends on nothing but the
names, so the split is the same on every run and machine. When that leaves one side empty (a single file, or very
few files), the last ``val_fraction`` of the token stream is held out instead. With ``val_data`` (``--val-data``) the
held-out documents come from that file or directory instead, and every ``--data`` document is trained on.

Tokenization: with the teacher's tokenizer (``AutoTokenizer``), no special tokens added; documents are joined with
the tokenizer's EOS token as separator, and the stream is cut into windows of ``seq_len + 1`` tokens (input plus
the next-token targets). Training windows start at every multiple of ``seq_len``; batch ``k`` of a run with seed
``s`` is drawn with a generator seeded from ``(s, k)``, so a resumed run sees exactly the batches an uninterrupted
one would.
"""

from __future__ import annotations

import hashlib
import tokenize
from dataclasses import dataclass
from pathlib import Path

import torch

from infertune.evaluate.data import read_jsonl_texts

TEXT_SUFFIXES = (".py", ".txt")
SKIP_DIRS = {"__pycache__", ".git", ".hg", ".svn", ".tox", ".venv", "node_modules"}


def _read_text(path: Path) -> str:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        if path.suffix == ".py":
            with tokenize.open(path) as fh:  # honours PEP 263 coding cookies
                text = fh.read()
        else:
            text = raw.decode("utf-8", errors="replace")
    return text.replace("\r\n", "\n")


def collect_documents(data: str | Path, flag: str = "--data") -> list[tuple[str, str]]:
    """[(document id, text)] in a fixed order; empty documents dropped. `flag` names the option in errors."""
    root = Path(data)
    if not root.exists():
        raise ValueError(f"{flag} {data}: no such file or directory")
    docs: list[tuple[str, str]] = []
    if root.is_dir():
        files = sorted(
            (p.relative_to(root).as_posix(), p)
            for p in root.rglob("*")
            if p.is_file() and p.suffix in TEXT_SUFFIXES and not (set(p.relative_to(root).parts[:-1]) & SKIP_DIRS)
        )
        if not files:
            raise ValueError(f"{flag} {data}: no {' / '.join(TEXT_SUFFIXES)} files in that directory")
        docs = [(rel, _read_text(p)) for rel, p in files]
    elif root.suffix == ".jsonl":
        try:
            docs = [(f"{root.name}:{lineno}", text) for lineno, text in read_jsonl_texts(str(root))]
        except ValueError as e:
            raise ValueError(f"{flag} {data}: {e}") from None
    else:
        docs = [(root.name, _read_text(root))]
    docs = [(name, text) for name, text in docs if text.strip()]
    if not docs:
        raise ValueError(f"{flag} {data}: no non-empty text")
    return docs


def hash_fraction(doc_id: str) -> float:
    """sha256 of the id as a number in [0, 1)."""
    return int.from_bytes(hashlib.sha256(doc_id.encode("utf-8")).digest()[:8], "big") / 2.0**64


def split_documents(docs: list[tuple[str, str]], val_fraction: float):
    val = [d for d in docs if hash_fraction(d[0]) < val_fraction]
    train = [d for d in docs if hash_fraction(d[0]) >= val_fraction]
    return train, val


def encode_stream(tokenizer, texts: list[str], eos_id: int) -> torch.Tensor:
    ids: list[int] = []
    for text in texts:
        ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        ids.append(eos_id)
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class Corpus:
    train: torch.Tensor  # packed token stream (1-D, long)
    val: torch.Tensor
    seq_len: int
    n_train_docs: int
    n_val_docs: int
    split: str  # "by-file-hash", "explicit" (--val-data) or "stream-tail"

    @property
    def n_train_windows(self) -> int:
        return max(0, (self.train.numel() - 1) // self.seq_len)

    def batch(self, step: int, batch_size: int, seed: int) -> torch.Tensor:
        """Training batch number ``step``: [batch_size, seq_len + 1] windows, a pure function of (seed, step)."""
        n = self.n_train_windows
        gen = torch.Generator().manual_seed((seed * 1_000_003 + step) % (2**63))
        idx = torch.randint(0, n, (batch_size,), generator=gen)
        offsets = torch.arange(self.seq_len + 1)
        return self.train[idx[:, None] * self.seq_len + offsets]

    def val_windows(self, max_windows: int | None = None) -> torch.Tensor:
        """Non-overlapping held-out windows [n, seq_len + 1]."""
        n = (self.val.numel() - 1) // self.seq_len
        if max_windows is not None:
            n = min(n, max_windows)
        if n <= 0:
            return torch.empty(0, self.seq_len + 1, dtype=torch.long)
        return torch.stack([self.val[i * self.seq_len : i * self.seq_len + self.seq_len + 1] for i in range(n)])


def build_corpus(
    data: str | Path, tokenizer, seq_len: int, val_fraction: float = 0.05, val_data: str | Path | None = None
) -> Corpus:
    if seq_len < 2:
        raise ValueError(f"--seq-len must be >= 2, got {seq_len}")
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        raise ValueError("the tokenizer has no EOS token to separate documents")
    docs = collect_documents(data)
    if val_data is not None:
        train_docs, val_docs = docs, collect_documents(val_data, "--val-data")
        split = "explicit"
    else:
        train_docs, val_docs = split_documents(docs, val_fraction)
        split = "by-file-hash"
    if train_docs and val_docs:
        train = encode_stream(tokenizer, [t for _, t in train_docs], eos_id)
        val = encode_stream(tokenizer, [t for _, t in val_docs], eos_id)
    else:
        stream = encode_stream(tokenizer, [t for _, t in docs], eos_id)
        n_val = max(seq_len + 1, int(stream.numel() * val_fraction))
        train, val = stream[:-n_val], stream[-n_val:]
        train_docs, val_docs = docs, []
        split = "stream-tail"
    corpus = Corpus(train, val, seq_len, len(train_docs), len(val_docs), split)
    if corpus.n_train_windows < 1:
        raise ValueError(
            f"--data {data}: {train.numel()} training tokens, fewer than one window of --seq-len {seq_len} + 1"
        )
    if corpus.val_windows(1).size(0) < 1:  # (the held-out perplexity was nan, reported after the whole run)
        held_out = f"--val-data {val_data}" if val_data is not None else f"--data {data} held out by the split"
        raise ValueError(
            f"{held_out}: {val.numel()} held-out tokens, fewer than one window of --seq-len {seq_len} + 1; "
            "give more held-out text or a shorter --seq-len"
        )
    return corpus
