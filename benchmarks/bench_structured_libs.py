"""xgrammar against llguidance: grammar compile time and per-token mask time, on two tokenizers.

    python benchmarks/bench_structured_libs.py [--vocab 150000] [--reps 3]

Needs both libraries: pip install xgrammar llguidance (infertune itself depends on llguidance only).
The tokenizers: the built-in model's (infertune/assets/demo-model, 4096 entries) and a byte-level BPE one of
--vocab entries built from it offline (every extra entry is the concatenation of two demo tokens, with the merge
that makes it), so that a Qwen / Llama-3 sized vocabulary is measured without a download. The grammars: a JSON
schema (nested object, enums, arrays, numbers), any JSON object, and a regex. For each, the compile time (first
compile; both libraries cache compiled grammars, so a second compile is a cache hit) and the mean time to fill
one row of the packed int32 bitmask while a matcher walks a valid output token by token (fill, then accept the
next token). One thread; the numbers are indicative on a shared machine.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

DEMO = Path(__file__).resolve().parents[1] / "infertune" / "assets" / "demo-model" / "tokenizer.json"

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "[0-9]{5}"}},
            "required": ["city", "zip"],
        },
        "score": {"type": "number"},
    },
    "required": ["name", "age", "role", "tags", "address", "score"],
    "additionalProperties": False,
}
INSTANCE = json.dumps(
    {
        "name": "Ada Lovelace",
        "age": 36,
        "role": "admin",
        "tags": ["math", "engines"],
        "address": {"city": "London", "zip": "12345"},
        "score": 9.5,
    }
)
REGEX = r"[A-Z][a-z]{2,8} [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,4})?"
REGEX_TEXT = "Alice 555-1234 ext. 42"
CASES = [
    ("json_schema", SCHEMA, INSTANCE),
    ("json_object", None, '{"a": [1, 2, {"b": null}], "c": "d"}'),
    ("regex", REGEX, REGEX_TEXT),
]


def big_tokenizer_json(target: int, seed: int = 0) -> str:
    """The demo tokenizer grown to `target` entries by merges of two of its own tokens."""
    d = json.loads(DEMO.read_text())
    vocab: dict[str, int] = d["model"]["vocab"]
    merges = list(d["model"]["merges"])
    added = {t["content"] for t in d["added_tokens"]}
    base = [t for t in vocab if t not in added]
    rng = random.Random(seed)
    nxt = max(vocab.values()) + 1
    while len(vocab) < target:
        a, b = rng.choice(base), rng.choice(base)
        if a + b in vocab:
            continue
        vocab[a + b] = nxt
        merges.append([a, b])
        nxt += 1
    d["model"]["vocab"] = vocab
    d["model"]["merges"] = merges
    # added tokens keep their ids (they are below the new ones)
    return json.dumps(d)


def vocab_list(tok_json: str) -> list[str]:
    d = json.loads(tok_json)
    ids = {**d["model"]["vocab"], **{t["content"]: t["id"] for t in d["added_tokens"]}}
    out = [""] * (max(ids.values()) + 1)
    for s, i in ids.items():
        out[i] = s
    return out


def bench_xgrammar(tok_json: str, reps: int) -> dict:
    import xgrammar as xgr
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(vocab_list(tok_json), vocab_type=xgr.VocabType.BYTE_LEVEL, stop_token_ids=[0])
    setup = time.perf_counter() - t0
    res = {"tokenizer setup s": setup}
    for kind, spec, text in CASES:
        compile_s, fill = [], []
        for _ in range(reps):
            compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            t0 = time.perf_counter()
            if kind == "json_schema":
                g = compiler.compile_json_schema(json.dumps(spec))
            elif kind == "json_object":
                g = compiler.compile_builtin_json_grammar()
            else:
                g = compiler.compile_regex(spec)
            compile_s.append(time.perf_counter() - t0)
            m = xgr.GrammarMatcher(g)
            mask = xgr.allocate_token_bitmask(1, info.vocab_size)
            for t in tok.encode(text, add_special_tokens=False).ids:
                t0 = time.perf_counter()
                m.fill_next_token_bitmask(mask, 0)
                fill.append(time.perf_counter() - t0)
                assert m.accept_token(t), (kind, t)
        res[kind] = (min(compile_s), sum(fill) / len(fill), max(fill))
    return res


def bench_llguidance(tok_json: str, reps: int) -> dict:
    import llguidance
    import llguidance.torch as llt
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tok_json)
    t0 = time.perf_counter()
    lltok = llguidance.LLTokenizer(tok_json, eos_token=0)
    setup = time.perf_counter() - t0
    res = {"tokenizer setup s": setup}
    for kind, spec, text in CASES:
        compile_s, fill = [], []
        for _ in range(reps):
            if kind == "json_schema":
                grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(spec))
            elif kind == "json_object":
                grammar = llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}')
            else:
                grammar = llguidance.LLMatcher.grammar_from_regex(spec)
            t0 = time.perf_counter()
            m = llguidance.LLMatcher(lltok, grammar)  # llguidance builds its parser lazily: no separate compile
            assert not m.is_error(), m.get_error()
            compile_s.append(time.perf_counter() - t0)
            mask = llt.allocate_token_bitmask(1, lltok.vocab_size)
            for t in tok.encode(text, add_special_tokens=False).ids:
                t0 = time.perf_counter()
                llt.fill_next_token_bitmask(m, mask, 0)
                fill.append(time.perf_counter() - t0)
                assert m.consume_token(t), (kind, t, m.get_error())
        res[kind] = (min(compile_s), sum(fill) / len(fill), max(fill))
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vocab", type=int, default=150_000)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    print("command:", " ".join(["python", *sys.argv]))
    torch.set_num_threads(1)
    toks = {"demo (4096)": DEMO.read_text()}
    t0 = time.perf_counter()
    toks[f"built ({args.vocab})"] = big_tokenizer_json(args.vocab)
    print(f"built the {args.vocab}-entry tokenizer in {time.perf_counter() - t0:.1f} s")
    print("| library | tokenizer | setup s | grammar | compile ms | mask mean ms | mask max ms |")
    print("|---|---|---|---|---|---|---|")
    for lib, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        for name, tj in toks.items():
            r = fn(tj, args.reps)
            for kind, _, _ in CASES:
                c, mean, mx = r[kind]
                print(
                    f"| {lib} | {name} | {r['tokenizer setup s']:.2f} | {kind} | {c * 1e3:.1f} | "
                    f"{mean * 1e3:.3f} | {mx * 1e3:.3f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
