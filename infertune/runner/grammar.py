"""Structured-output grammars through llguidance, with no torch: what the engine compiles and validates (a schema
it cannot compile is a ParamError that says why, so a 400), and the worker's compiled-matcher cache.

`GrammarCompiler.spec(params)` turns a request's StructuredOutputsParams into a `GrammarSpec` (plain data, sent to
the workers in the NewRequest), cached in an LRU keyed by the schema's text. `MatcherCache.matcher(spec)` gives a
worker a fresh llguidance matcher for a spec: the first one for a key is built (llguidance builds its lexer and
parser lazily, so this costs about a millisecond even on a 150k-entry vocabulary), later ones are copies of it.
Why llguidance and not xgrammar: docs/structured-output.md (measured by benchmarks/bench_structured_libs.py).
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict
from pathlib import Path

from infertune.sampling_params import ParamError, SamplingParams, StructuredOutputsParams
from infertune.scheduler_output import GrammarSpec

log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept, least recently used dropped first
# JSON's whitespace between tokens, bounded: unbounded, a model that likes whitespace (the built-in one does) fills
# max_tokens with it. disable_any_whitespace: none; whitespace_pattern: the client's own.
DEFAULT_WHITESPACE = r"[\x20\x0A\x0D\x09]{0,16}"


class _LRU:
    def __init__(self, size: int) -> None:
        self.size, self.items, self.lock = size, OrderedDict(), threading.Lock()
        self.hits = self.misses = 0

    def get(self, key):
        with self.lock:
            value = self.items.get(key)
            if value is not None:
                self.items.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
            return value

    def put(self, key, value) -> None:
        with self.lock:
            self.items[key] = value
            self.items.move_to_end(key)
            while len(self.items) > self.size:
                self.items.popitem(last=False)


def _bad(message: str) -> ParamError:
    return ParamError("structured_outputs", message)


def grammar_key(so: StructuredOutputsParams) -> str:
    """The cache key: the kind, the JSON options, and the schema / regex / choices / grammar text."""
    kind = so.kind
    value = getattr(so, kind)
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise _bad(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(value, (dict, bool)):
            raise _bad("the JSON schema must be a JSON object")
        text = json.dumps(value, sort_keys=True, separators=(",", ":"))
    elif kind == "choice":
        text = json.dumps(value)
    else:
        text = value if isinstance(value, str) else json.dumps(value)
    options = ""
    if kind in ("json", "json_object"):
        options = json.dumps([so.disable_any_whitespace, so.disable_additional_properties, so.whitespace_pattern])
    return f"{kind}|{options}|{text}"


def compile_grammar(so: StructuredOutputsParams) -> str:
    """llguidance's grammar for so, validated; ParamError with the library's reason where it cannot be built."""
    import llguidance
    from llguidance import LLMatcher

    kind = so.kind
    try:
        if kind in ("json", "json_object"):
            schema = {"type": "object"} if kind == "json_object" else so.json
            if isinstance(schema, str):
                schema = json.loads(schema)
            if so.disable_additional_properties and isinstance(schema, dict):
                schema = no_additional_properties(schema)
            options: dict = {"whitespace_flexible": not so.disable_any_whitespace}
            if so.whitespace_pattern is not None:
                options["whitespace_pattern"] = so.whitespace_pattern
            elif not so.disable_any_whitespace:
                options["whitespace_pattern"] = DEFAULT_WHITESPACE
            grammar = LLMatcher.grammar_from_json_schema(schema, defaults=options)
        elif kind == "regex":
            grammar = LLMatcher.grammar_from_regex(so.regex)
        elif kind == "choice":
            grammar = llguidance.grammar_from("choice", json.dumps(so.choice))
        else:  # Lark, or GBNF / EBNF (llguidance converts it)
            grammar = llguidance.grammar_from("grammar", so.grammar)
    except (ValueError, TypeError) as e:
        raise _bad(f"cannot compile the {kind} constraint: {e}") from None
    is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, None)
    if is_error:
        raise _bad(f"cannot compile the {_NAMES[kind]}: {messages[0] if messages else 'invalid'}")
    return grammar


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object grammar",
    "regex": "regex",
    "choice": "choice",
    "grammar": "grammar",
}


# keywords whose value is data (left as it is), and those whose value maps names to schemas (each walked, the map
# itself not a schema): a property named "properties", or a const object, is not an object schema to close
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
_SCHEMA_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def no_additional_properties(schema: dict) -> dict:
    """A copy of schema where every object schema without "additionalProperties" gets false (vLLM's option)."""

    def walk(node):
        if isinstance(node, list):
            return [walk(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {}
        for key, value in node.items():
            if key in _DATA_KEYWORDS:
                out[key] = value
            elif key in _SCHEMA_MAPS and isinstance(value, dict):
                out[key] = {name: walk(sub) for name, sub in value.items()}
            else:
                out[key] = walk(value)
        if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
            out["additionalProperties"] = False
        return out

    return walk(schema)


class GrammarCompiler:
    """The engine's side: StructuredOutputsParams -> GrammarSpec, compiled once per schema (LRU, thread-safe: the
    server compiles off the event loop, the engine thread then finds it cached)."""

    def __init__(
        self, eos_token_ids, size: int = CACHE_SIZE, tokenizer_path: str | None = None, vocab_size: int = 0
    ) -> None:
        """tokenizer_path (a folder with tokenizer.json) and vocab_size: each new grammar's first step is tried
        against the tokenizer, so one that allows no token at all (a regex of an empty class, a grammar that
        contradicts itself) is a ParamError at compile time; without them, only the grammar's own validation."""
        self.eos_token_ids = tuple(sorted(int(t) for t in eos_token_ids))
        self.cache = _LRU(size)
        self.tokenizer_path, self.vocab_size = tokenizer_path, vocab_size

    def spec(self, params: SamplingParams) -> GrammarSpec | None:
        return None if params.structured_outputs is None else self.compile(params.structured_outputs)

    def compile(self, so: StructuredOutputsParams) -> GrammarSpec:
        key = grammar_key(so)
        spec = self.cache.get(key)
        if spec is None:
            spec = GrammarSpec(key, compile_grammar(so), self.eos_token_ids)
            self._check_first_step(spec, so.kind)
            self.cache.put(key, spec)
        return spec

    def _check_first_step(self, spec: GrammarSpec, kind: str) -> None:
        """A grammar whose matcher errs or allows no token (EOS included) before the first token matches no
        string: the request is refused (else the output would be EOS alone, or nothing valid, as a normal stop)."""
        if self.tokenizer_path is None or not (Path(self.tokenizer_path) / "tokenizer.json").is_file():
            return
        from llguidance import LLMatcher

        matcher = LLMatcher(
            ll_tokenizer(self.tokenizer_path, self.vocab_size, spec.eos_token_ids), spec.grammar, log_level=0
        )
        allowed = 0 if matcher.is_error() else sum(bin(b).count("1") for b in matcher.compute_bitmask())
        if matcher.is_error() or allowed == 0:
            reason = matcher.get_error().splitlines()[0] if matcher.is_error() else "no token can start it"
            raise _bad(f"the {_NAMES[kind]} matches no output ({reason}): it can never be satisfied")


# ---- the worker's side ----------------------------------------------------------------------------------------------
_TOKENIZERS: dict = {}
_TOKENIZERS_LOCK = threading.Lock()


def ll_tokenizer(tokenizer_path: str, vocab_size: int, eos_token_ids: tuple[int, ...]):
    """llguidance's view of the tokenizer (its tokenizer.json), built once per process (about 1 s at 150k entries)."""
    import llguidance

    key = (tokenizer_path, vocab_size, eos_token_ids)
    with _TOKENIZERS_LOCK:
        tok = _TOKENIZERS.get(key)
        if tok is None:
            path = Path(tokenizer_path) / "tokenizer.json"
            if not path.is_file():
                raise ValueError(
                    f"structured output needs the tokenizer's tokenizer.json (a fast tokenizer); {path} is missing"
                )
            text = path.read_text()
            data = json.loads(text)
            ids = list(data["model"]["vocab"].values()) + [t["id"] for t in data.get("added_tokens", [])]
            size = max(ids, default=-1) + 1
            tok = llguidance.LLTokenizer(
                text, n_vocab=max(vocab_size, size) if vocab_size else None, eos_token=list(eos_token_ids) or None
            )
            _TOKENIZERS[key] = tok
        return tok


class MatcherCache:
    """Per worker: key -> a matcher in its initial state, built once; each request gets a copy of it."""

    def __init__(self, tokenizer_path: str, vocab_size: int, size: int = CACHE_SIZE) -> None:
        self.tokenizer_path, self.vocab_size = tokenizer_path, vocab_size
        self.cache = _LRU(size)

    def tokenizer(self, spec: GrammarSpec):
        return ll_tokenizer(self.tokenizer_path, self.vocab_size, spec.eos_token_ids)

    def matcher(self, spec: GrammarSpec):
        """A fresh matcher for spec; one in llguidance's error state (is_error()) where it could not be built."""
        from llguidance import LLMatcher

        template = self.cache.get(spec.key)
        if template is None:
            template = LLMatcher(self.tokenizer(spec), spec.grammar, log_level=0)
            if template.is_error():
                log.error("structured output: the grammar failed in the worker: %s", template.get_error())
                return template
            self.cache.put(spec.key, template)
        return template.deep_copy()
