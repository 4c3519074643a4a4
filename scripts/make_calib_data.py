#!/usr/bin/env python3
"""Build infertune's default evaluation and calibration text, deterministically, from the local Python stdlib.

Writes two JSONL files (one {"source": ..., "text": ...} record per line) to infertune/assets/calib/:

* heldout.jsonl: every file of the demo model's validation split (the same ~2 % of stdlib files, chosen
  by sha256 of the path, that scripts/make_demo_model.py held out), whole and in sorted path order.
  Neither the demo model nor its tokenizer saw them, so perplexity on them is a held-out measurement.
* calib.jsonl: CALIB_RECORDS snippets (one top-level function or class each, cut at a line boundary to at
  most SNIPPET_BYTES) from the demo model's *training* split, taken round-robin over the files in
  sha256(path) order, so they spread over the whole library and never overlap the held-out text.
  Calibration data may come from the training distribution (it only sets activation ranges); it must
  not come from the evaluation text, or the accuracy report would flatter the calibrated model.

The Python standard library is under the Python Software Foundation License Version 2 (PSF-2.0).

Usage (from the repository root):  python scripts/make_calib_data.py
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "scripts"))

import make_demo_model as demo  # noqa: E402  (same split, same file reading)

OUT = REPO_ROOT / "infertune" / "assets" / "calib"
CALIB_RECORDS = 576  # >= 512 calibration samples with some to spare
SNIPPET_BYTES = 520
MIN_SNIPPET_BYTES = 160


def _snippets(text: str) -> list[str]:
    """Top-level def / class sources of a module, each cut to at most SNIPPET_BYTES at a line boundary."""
    try:
        tree = ast.parse(text)
    except SyntaxError:  # lib2to3 fixtures and the like
        return []
    out = []
    lines = text.splitlines(keepends=True)
    for node in tree.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        kept, size = [], 0
        for line in lines[node.lineno - 1 : node.end_lineno]:
            if size + len(line.encode("utf-8")) > SNIPPET_BYTES:
                break
            kept.append(line)
            size += len(line.encode("utf-8"))
        snippet = "".join(kept).rstrip() + "\n"
        if len(snippet.encode("utf-8")) >= MIN_SNIPPET_BYTES:
            out.append(snippet)
    return out


def main() -> None:
    _, train, val = demo.collect_corpus()
    OUT.mkdir(parents=True, exist_ok=True)
    with open(OUT / "heldout.jsonl", "w", encoding="utf-8") as f:
        for rel, text in val:
            f.write(json.dumps({"source": f"Lib/{rel}", "text": text}) + "\n")
    per_file = [(rel, _snippets(text)) for rel, text in sorted(train, key=lambda d: demo._path_hash(d[0]))]
    records, depth = [], 0
    while len(records) < CALIB_RECORDS and any(len(s) > depth for _, s in per_file):
        for rel, snippets in per_file:
            if depth < len(snippets) and len(records) < CALIB_RECORDS:
                records.append({"source": f"Lib/{rel}", "text": snippets[depth]})
        depth += 1
    with open(OUT / "calib.jsonl", "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    print(f"heldout.jsonl: {len(val)} files, {sum(len(t.encode()) for _, t in val):,} bytes")
    print(f"calib.jsonl: {len(records)} snippets, {sum(len(r['text'].encode()) for r in records):,} bytes")


if __name__ == "__main__":
    main()
