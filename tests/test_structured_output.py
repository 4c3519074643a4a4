"""Structured output (docs/structured-output.md): JSON schema, regex, choice, grammar and json_object constraints,
offline and through the server. The models are tiny and random (or the built-in one), so their text is garbage:
only the grammar's masks can make it valid, which is what these tests check."""

from __future__ import annotations

import json
import random
import re
import zlib
from pathlib import Path

import httpx
import jsonschema
import pytest
import torch
from server_utils import ServerThread

from infertune import LLM, SamplingParams, StructuredOutputsParams
from infertune.runner.grammar import GrammarCompiler, grammar_key, ll_tokenizer
from infertune.runner.sampler import Sampler, SampleRequest
from infertune.runner.structured_output import StructuredOutputs, apply_token_bitmask, unpack_bitmask
from infertune.scheduler_output import NewRequest, SchedulerOutput

DEMO = str(Path(__file__).resolve().parents[1] / "infertune" / "assets" / "demo-model")


# ---- a random JSON-schema generator: every schema it makes has only finite instances (bounded strings, integers and
# arrays), so a constrained output always ends within max_tokens ----------------------------------------------------
def random_schema(rng: random.Random, depth: int = 0) -> dict:
    kinds = ["string", "integer", "boolean", "enum", "null", "array"] + (["object"] * 2 if depth < 2 else [])
    kind = rng.choice(kinds)
    if kind == "string":
        lo = rng.randint(0, 2)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 5)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "null":
        return {"type": "null"}
    if kind == "enum":
        pool = ["red", "green", "blue", "a b", 'q"uote', 0, 7, -3, True, None, "é"]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if kind == "array":
        lo = rng.randint(0, 2)
        item = random_schema(rng, depth + 1) if depth < 2 else {"type": "boolean"}
        return {"type": "array", "items": item, "minItems": lo, "maxItems": lo + rng.randint(0, 2)}
    return random_object(rng, depth + 1)


def random_object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["id", "name", "tags", "point", "ok", "kind", "size", "meta", "x y"], rng.randint(1, 4))
    props = {n: random_schema(rng, depth) for n in names}
    required = [n for n in names if rng.random() < 0.7]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def _so(**kw) -> StructuredOutputsParams:
    return StructuredOutputsParams(**kw)


@pytest.fixture(scope="module")
def demo() -> LLM:
    return LLM(DEMO, dtype="float32", max_model_len=1024)


@pytest.fixture(scope="module")
def tiny(tiny_llama) -> LLM:
    return LLM(str(tiny_llama), dtype="float32", max_model_len=256)


class CountingSampler:
    """Wraps the runner's sampler: per call, the rows sampled and which of them a grammar constrained."""

    def __init__(self, inner: Sampler) -> None:
        self.inner, self.calls = inner, []

    def __call__(self, logits, rows, mask=None):
        constrained = [] if mask is None else [rows[i].params.structured_outputs for i in mask.rows]
        self.calls.append((len(rows), constrained))
        return self.inner(logits, rows, mask)


# ---- offline -----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["demo", "tiny"])
def test_every_output_under_a_random_schema_validates(model, request):
    llm = request.getfixturevalue(model)
    rng = random.Random(zlib.crc32(model.encode()))  # (not hash(): it changes from one process to the next)
    schemas = [random_object(rng) for _ in range(30)]
    # Every byte is a token on the tiny model: the default whitespace (up to 16 between tokens) would crowd out the
    # structure within its 256-token context, so its flexible rows take a narrower whitespace pattern.
    ws = r"[ \n]{0,2}" if model == "tiny" else None
    params = [
        SamplingParams(
            max_tokens=700 if model == "demo" else 240,
            temperature=[0.0, 0.7, 1.2][i % 3],
            seed=i,
            structured_outputs=_so(json=s, disable_any_whitespace=i % 2 == 0, whitespace_pattern=ws),
        )
        for i, s in enumerate(schemas)
    ]
    outs = llm.generate([f"record {i}:" for i in range(len(schemas))], params, use_tqdm=False)
    stopped = 0
    for schema, out, p in zip(schemas, outs, params):
        c = out.outputs[0]
        if c.finish_reason == "length":  # a bounded schema can still outgrow max_tokens (escapes, nesting, spaces)
            assert len(c.token_ids) == p.max_tokens, (schema, c.text)
            continue
        assert c.finish_reason == "stop", (schema, c.text)
        jsonschema.validate(json.loads(c.text), schema)
        stopped += 1
    assert stopped >= 27, stopped


def test_schema_given_as_text_and_pydantic_like_nesting(tiny):
    schema = {
        "type": "object",
        "properties": {
            "p": {"$ref": "#/$defs/point"},
            "ps": {"type": "array", "items": {"$ref": "#/$defs/point"}, "maxItems": 2},
        },
        "required": ["p", "ps"],
        "additionalProperties": False,
        "$defs": {
            "point": {
                "type": "object",
                "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "y": {"enum": ["u", "v"]}},
                "required": ["x", "y"],
                "additionalProperties": False,
            }
        },
    }
    so = _so(json=json.dumps(schema), whitespace_pattern=" ?")
    sp = SamplingParams(max_tokens=200, temperature=0, structured_outputs=so)
    c = tiny.generate("point:", sp, use_tqdm=False)[0].outputs[0]
    assert c.finish_reason == "stop"
    jsonschema.validate(json.loads(c.text), schema)


@pytest.mark.parametrize(
    "regex", [r"[a-z]{3}-\d{2,4}", r"(yes|no)!", r"\d{1,6}\.\d\d", r"[A-Z][a-z]{0,6}( [A-Z][a-z]{0,6}){1,2}"]
)
def test_regex_outputs_fullmatch(tiny, demo, regex):
    for llm in (tiny, demo):
        params = [
            SamplingParams(max_tokens=40, temperature=t, seed=s, structured_outputs=_so(regex=regex))
            for t, s in ((0, None), (1.0, 1), (1.5, 2))
        ]
        for out in llm.generate(["a", "b", "c"], params, use_tqdm=False):
            c = out.outputs[0]
            assert c.finish_reason == "stop" and re.fullmatch(regex, c.text), (regex, c.text)


def test_choice_outputs_are_one_of_the_choices(tiny, demo):
    choices = ["positive", "negative", "neutral", "pos"]
    for llm in (tiny, demo):
        params = [
            SamplingParams(max_tokens=20, temperature=1.0, seed=s, structured_outputs=_so(choice=choices))
            for s in range(8)
        ]
        texts = [o.outputs[0].text for o in llm.generate(["x"] * 8, params, use_tqdm=False)]
        assert all(t in choices for t in texts), texts


def test_json_object_outputs_parse_as_objects(tiny, demo):
    for llm in (tiny, demo):
        params = [
            SamplingParams(max_tokens=300, temperature=0.9, seed=s, structured_outputs=_so(json_object=True))
            for s in range(4)
        ]
        for out in llm.generate(["{"] * 4, params, use_tqdm=False):
            c = out.outputs[0]
            if c.finish_reason == "stop":
                assert isinstance(json.loads(c.text), dict), c.text
            else:  # a free-form object can run past max_tokens: then it is an unfinished object
                assert c.finish_reason == "length" and c.text.lstrip().startswith("{")


@pytest.mark.parametrize(
    "grammar",
    [
        'root ::= "(" digit+ ("+" digit+)* ")"\ndigit ::= [0-9]',  # GBNF (llama.cpp)
        'start: "(" DIGITS ("+" DIGITS)* ")"\nDIGITS: /[0-9]{1,3}/',  # Lark
    ],
)
def test_grammar_outputs_match(tiny, grammar):
    params = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_outputs=_so(grammar=grammar))
        for s in range(4)
    ]
    for out in tiny.generate(["expr:"] * 4, params, use_tqdm=False):
        c = out.outputs[0]
        if c.finish_reason == "stop":
            assert re.fullmatch(r"\(\d+(\+\d+)*\)", c.text), c.text
        else:
            assert re.fullmatch(r"\(\d*(\+\d*)*", c.text), c.text


def test_max_tokens_mid_structure_is_length(tiny):
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "minLength": 20, "maxLength": 30}},
        "required": ["name"],
    }
    c = tiny.generate("x", SamplingParams(max_tokens=5, structured_outputs=_so(json=schema)), use_tqdm=False)[0]
    assert c.outputs[0].finish_reason == "length" and len(c.outputs[0].token_ids) == 5
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.outputs[0].text)


def test_grammar_ends_the_output_even_with_ignore_eos(tiny):
    sp = SamplingParams(max_tokens=50, ignore_eos=True, structured_outputs=_so(regex="abc"))
    c = tiny.generate("x", sp, use_tqdm=False)[0].outputs[0]
    assert c.text == "abc" and c.finish_reason == "stop"


def test_logits_processors_that_leave_a_grammar_no_token_keep_the_output_valid(tiny, tiny_llama):
    """allowed_token_ids of digits under a digits regex: once the regex is complete it allows EOS alone, which
    allowed_token_ids bans, and with no token left the draw took token 0 ('!'), which the grammar refuses, until
    max_tokens ("12345!!!!!", finish "length"). Now the grammar's choices win where the processors leave none: the
    output is whole (Python's re and llguidance's own matcher accept it) and ends on EOS. A bad word the grammar
    requires is written rather than the output broken off inside the choice."""
    import llguidance

    tok = tiny.get_tokenizer()
    digits = [tok.convert_tokens_to_ids(d) for d in "0123456789"]
    regex = "[0-9]{5}"
    for temperature in (0, 1.0):
        sp = SamplingParams(
            max_tokens=10,
            temperature=temperature,
            seed=3,
            allowed_token_ids=digits,
            structured_outputs=_so(regex=regex),
        )
        c = tiny.generate("x", sp, use_tqdm=False)[0].outputs[0]
        assert re.fullmatch(regex, c.text) and c.finish_reason == "stop", c.text
        matcher = llguidance.LLMatcher(
            ll_tokenizer(str(tiny_llama), tok.vocab_size + 3, (tok.eos_token_id,)),
            llguidance.LLMatcher.grammar_from_regex(regex),
        )
        assert matcher.consume_tokens(c.token_ids[:-1]) and matcher.is_accepting()
        assert c.token_ids[-1] == tok.eos_token_id
    sp = SamplingParams(
        max_tokens=10, temperature=0, bad_words=["yes", "no"], structured_outputs=_so(choice=["yes", "no"])
    )
    c = tiny.generate("x", sp, use_tqdm=False)[0].outputs[0]
    assert c.text in ("yes", "no") and c.finish_reason == "stop", c.text


@pytest.mark.parametrize(
    "so, says",
    [
        (dict(json={"type": "strin"}), "Invalid type"),
        (dict(json={"type": "string", "pattern": "(("}), "unclosed group"),
        (dict(json='{"type": '), "not valid JSON"),
        (dict(json={"type": "object", "properties": {"a": {"$ref": "#/nope"}}}), "/nope"),
        (dict(regex="(("), "unclosed group"),
        (dict(grammar="start: (("), "grammar"),
    ],
)
def test_a_schema_the_library_cannot_compile_is_a_value_error(tiny, so, says):
    with pytest.raises(ValueError, match=re.escape(says)):
        tiny.generate("x", SamplingParams(structured_outputs=_so(**so)), use_tqdm=False)
    assert not tiny.engine.has_unfinished_requests()


def test_structured_outputs_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="structural_tag"):
        StructuredOutputsParams(structural_tag="{}")
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    assert SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs.regex == "a+"


def test_grammars_are_compiled_once_per_schema():
    compiler = GrammarCompiler([0])
    schema = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}
    reordered = {"properties": {"a": {"type": "string"}, "b": {"type": "integer"}}, "type": "object"}
    first = compiler.spec(SamplingParams(structured_outputs=_so(json=schema)))
    again = compiler.spec(SamplingParams(structured_outputs=_so(json=json.dumps(reordered))))
    assert again is first and compiler.cache.misses == 1 and compiler.cache.hits == 1
    other = compiler.spec(SamplingParams(structured_outputs=_so(json=schema, disable_any_whitespace=True)))
    assert other is not first
    assert grammar_key(_so(regex="a")) != grammar_key(_so(grammar="a"))


# ---- the masks ------------------------------------------------------------------------------------------------
def test_unpack_bitmask_matches_the_bits():
    g = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 3), dtype=torch.int32, generator=g)
    allowed = unpack_bitmask(bitmask, vocab)
    expect = [[bool((int(bitmask[r, t // 32]) >> (t % 32)) & 1) for t in range(vocab)] for r in range(3)]
    assert allowed.tolist() == expect
    logits = torch.randn(5, vocab, generator=g)
    out = apply_token_bitmask(logits, bitmask, [4, 0, 2])
    for k, r in enumerate([4, 0, 2]):
        assert torch.equal(out[r], torch.where(allowed[k], logits[r], float("-inf")))
    assert torch.equal(out[1], logits[1]) and torch.equal(out[3], logits[3])


def _new(req_id: str, params: SamplingParams, spec) -> NewRequest:
    return NewRequest(req_id, [1, 2], 2, params, [], 0, spec)


def test_bitmask_path_samples_what_a_python_built_boolean_mask_samples():
    """The oracle: each row's allowed tokens as a boolean vector from the library's matcher (one byte per token),
    logits masked with torch.where, sampled by a second sampler with the same seeds; the batched bitmask path must
    sample the same tokens, step after step."""
    import llguidance

    vocab = 4096
    compiler = GrammarCompiler([0])
    constraints = [
        _so(
            json={
                "type": "object",
                "properties": {"k": {"type": "integer", "minimum": 0, "maximum": 999}},
                "required": ["k"],
                "additionalProperties": False,
            }
        ),
        _so(regex=r"[a-z]{2,5}( [a-z]{2,5})*"),
        None,  # an unconstrained row in the same batch
        _so(json_object=True),
        _so(choice=["alpha", "beta", "gamma"]),
    ]
    params = [
        SamplingParams(temperature=[0.0, 1.0, 1.0, 0.8, 1.3][i], seed=100 + i, structured_outputs=c)
        for i, c in enumerate(constraints)
    ]
    specs = [compiler.spec(p) for p in params]
    ids = [f"r{i}" for i in range(len(params))]
    manager = StructuredOutputs(DEMO, vocab)
    tok = ll_tokenizer(DEMO, vocab, (0,))
    refs = [None if s is None else llguidance.LLMatcher(tok, s.grammar) for s in specs]
    fast, slow = Sampler(seed=5), Sampler(seed=5)
    g = torch.Generator().manual_seed(1)
    out = SchedulerOutput([_new(i, p, s) for i, p, s in zip(ids, params, specs)], req_ids=ids)
    for step in range(12):
        mask = manager.begin_step(out, ids)
        assert mask.rows == [0, 1, 3, 4]
        logits = torch.randn(len(ids), vocab, generator=g) * 3
        rows = [SampleRequest(p, [], [], step) for p in params]
        got = fast(logits, rows, mask).token_ids
        allowed = torch.ones(len(ids), vocab, dtype=torch.bool)
        for i, m in enumerate(refs):
            if m is not None:
                allowed[i] = torch.frombuffer(bytearray(m.compute_logit_bias()), dtype=torch.uint8)[:vocab] > 0
        want = slow(torch.where(allowed, logits, float("-inf")), rows).token_ids
        assert got == want, step
        assert all(allowed[i, t] for i, t in enumerate(got))
        manager.accept(ids, got)
        for m, t in zip(refs, got):
            if m is not None:
                assert m.consume_token(t)
        out = SchedulerOutput(req_ids=ids, num_scheduled_tokens=[1] * len(ids))


def test_masks_of_different_schemas_are_batched_in_one_step(tiny):
    runner = tiny.engine.executor.runner
    counting = CountingSampler(runner.sampler)
    runner.sampler = counting
    try:
        schema = {
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"],
            "additionalProperties": False,
        }
        params = [
            SamplingParams(max_tokens=30, structured_outputs=_so(json=schema, disable_any_whitespace=True)),
            SamplingParams(max_tokens=30, structured_outputs=_so(regex="[xyz]{4,8}")),
            SamplingParams(max_tokens=30, structured_outputs=_so(choice=["one", "three"])),
            SamplingParams(max_tokens=10, ignore_eos=True),  # unconstrained, in the same batch
        ]
        outs = tiny.generate(["p1", "p2", "p3", "p4"], params, use_tqdm=False)
    finally:
        runner.sampler = counting.inner
    assert json.loads(outs[0].outputs[0].text)["n"] in range(10)
    assert re.fullmatch("[xyz]{4,8}", outs[1].outputs[0].text)
    assert outs[2].outputs[0].text in ("one", "three")
    kinds = [{so.kind for so in c} for n, c in counting.calls if n == 4]
    assert {"json", "regex", "choice"} in kinds, counting.calls  # three grammars and a free row: one sampler call


def test_overlap_and_no_overlap_give_the_same_tokens(tiny):
    runner = tiny.engine.executor.runner
    sp = [
        SamplingParams(max_tokens=60, temperature=1.0, seed=s, structured_outputs=_so(json_object=True))
        for s in range(3)
    ]
    results = []
    for overlap in (True, False):
        runner.structured.overlap = overlap
        results.append([o.outputs[0].token_ids for o in tiny.generate(["a", "b", "c"], sp, use_tqdm=False)])
    runner.structured.overlap = True
    assert results[0] == results[1]


# ---- preemption and a worker process ---------------------------------------------------------------------------
PREEMPTING = dict(
    dtype="float32",
    max_model_len=64,
    block_size=4,
    max_num_seqs=6,
    max_num_batched_tokens=16,
    kv_cache_memory_bytes=20 * 2048,  # 20 blocks of 4 tokens for 6 sequences of up to ~45 tokens
)
SMALL = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": 0, "maximum": 99},
        "b": {"enum": ["x", "yy"]},
        "c": {"type": "boolean"},
    },
    "required": ["a", "b", "c"],
    "additionalProperties": False,
}


def _preempting_run(path, backend: str):
    params = [
        SamplingParams(max_tokens=40, temperature=t, seed=s, structured_outputs=c)
        for t, s, c in (
            (0, None, _so(json=SMALL, disable_any_whitespace=True)),
            (1.0, 3, _so(json=SMALL, disable_any_whitespace=True)),
            (1.0, 4, _so(regex=r"[a-f]{10,20}")),
            (0.9, 5, _so(json=SMALL, whitespace_pattern=r"\n?")),
            (0, None, _so(choice=["abcdefghijklmnop", "qrstuvwxyz0123456789"])),
            (1.0, 6, None),
        )
    ]
    llm = LLM(str(path), distributed_executor_backend=backend, **PREEMPTING)
    try:
        outs = llm.generate([f"prompt number {i}" for i in range(6)], params, use_tqdm=False)
        return [o.outputs[0] for o in outs], llm.engine.stats()["num_preemptions"]
    finally:
        llm.engine.shutdown()


def _check_preempting_outputs(outs):
    for c in (outs[0], outs[1], outs[3]):
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), SMALL)
    assert re.fullmatch("[a-f]{10,20}", outs[2].text)
    assert outs[4].text in ("abcdefghijklmnop", "qrstuvwxyz0123456789")


def test_outputs_validate_after_preemption_and_match_an_unpreempted_run(tiny_llama):
    outs, preemptions = _preempting_run(tiny_llama, "uni")
    assert preemptions > 0
    _check_preempting_outputs(outs)
    roomy = LLM(str(tiny_llama), dtype="float32", max_model_len=64)
    params = [
        SamplingParams(max_tokens=40, temperature=0, structured_outputs=_so(json=SMALL, disable_any_whitespace=True)),
        SamplingParams(
            max_tokens=40, temperature=0, structured_outputs=_so(choice=["abcdefghijklmnop", "qrstuvwxyz0123456789"])
        ),
    ]
    alone = roomy.generate(["prompt number 0", "prompt number 4"], params, use_tqdm=False)
    assert roomy.engine.stats()["num_preemptions"] == 0
    assert [o.outputs[0].token_ids for o in alone] == [outs[0].token_ids, outs[4].token_ids]


def test_worker_process_gives_the_same_structured_outputs(tiny_llama):
    uni, _ = _preempting_run(tiny_llama, "uni")
    mp, preemptions = _preempting_run(tiny_llama, "mp")
    assert preemptions > 0
    _check_preempting_outputs(mp)
    assert [c.token_ids for c in mp] == [c.token_ids for c in uni]


# ---- the server ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tiny_llama):
    with ServerThread(tiny_llama, max_model_len=256) as s:
        yield s


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 8},
        "temp": {"type": "integer", "minimum": -40, "maximum": 50},
        "sky": {"enum": ["clear", "rain", "snow"]},
        "hours": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 23}, "maxItems": 3},
    },
    "required": ["city", "temp", "sky", "hours"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "weather?"}]


# Every byte is a token on the tiny model: JSON's default whitespace (up to 16 between tokens) would not fit its
# context, so the JSON requests narrow it with vLLM's guided_whitespace_pattern.
WS = {"guided_whitespace_pattern": "[ ]?"}


def _chat(server, **body):
    body = {"messages": MESSAGES, "max_tokens": 150, **WS, **body}
    return httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)


def _complete(server, **body):
    return httpx.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 150, **WS, **body}, timeout=60)


def test_server_response_format_json_schema_and_json_object(server):
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    for seed in range(3):
        for r in (
            _chat(server, response_format=rf, temperature=1.0, seed=seed),
            _complete(server, response_format=rf, temperature=1.0, seed=seed),
        ):
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            text = choice["message"]["content"] if "message" in choice else choice["text"]
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(text), SCHEMA)
    r = _chat(server, response_format={"type": "json_object"}, max_tokens=200, seed=1, temperature=0.7)
    assert r.status_code == 200
    if r.json()["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(r.json()["choices"][0]["message"]["content"]), dict)
    r = _chat(server, response_format={"type": "text"}, max_tokens=5)
    assert r.status_code == 200


def test_server_guided_fields(server):
    r = _complete(server, guided_regex=r"\d{3}-[A-Z]{2}", temperature=1.0, seed=3)
    assert r.status_code == 200 and re.fullmatch(r"\d{3}-[A-Z]{2}", r.json()["choices"][0]["text"])
    r = _chat(server, guided_choice=["left", "right"], temperature=1.0, seed=3)
    assert r.json()["choices"][0]["message"]["content"] in ("left", "right")
    r = _complete(server, guided_json=SCHEMA, n=2, temperature=1.0, seed=4)
    for c in r.json()["choices"]:
        jsonschema.validate(json.loads(c["text"]), SCHEMA)
    r = _complete(server, guided_grammar='root ::= "a" [0-9] "b"', temperature=1.0)
    assert re.fullmatch(r"a[0-9]b", r.json()["choices"][0]["text"])
    r = _complete(server, structured_outputs={"regex": "z{3}"})
    assert r.json()["choices"][0]["text"] == "zzz"


def test_server_streamed_json_schema(server):
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA}}
    text = ""
    with httpx.stream(
        "POST",
        server.url + "/v1/chat/completions",
        timeout=60,
        json={"messages": MESSAGES, "max_tokens": 150, "stream": True, "response_format": rf, **WS},
    ) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                delta = json.loads(line[6:])["choices"][0]["delta"]
                text += delta.get("content") or ""
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize(
    "body, status, says",
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            400,
            "Invalid type: strin",
        ),
        ({"guided_json": {"type": "string", "format": "bogus"}}, 400, "Unknown format: bogus"),
        ({"guided_regex": "(("}, 400, "unclosed group"),
        ({"response_format": {"type": "yaml"}}, 400, "response_format.type"),
        ({"response_format": {"type": "json_schema"}}, 400, "json_schema.schema"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, 400, "one output constraint"),
        ({"structured_outputs": {"regex": "a", "bogus": 1}}, 400, "structured_outputs takes ["),
        ({"guided_choice": []}, 400, "choice"),
        # matches no string: a regex of an empty class, a grammar whose first step allows nothing
        ({"guided_regex": "[a&&b]"}, 400, "matches no output"),
        ({"guided_grammar": "start: /[a&&b]/"}, 400, "the grammar matches no output"),
    ],
)
def test_server_refuses_what_cannot_be_compiled(server, body, status, says):
    for r in (_chat(server, **body), _complete(server, **body)):
        assert r.status_code == status, r.text
        assert says in r.json()["error"]["message"], r.json()
        assert r.json()["error"]["param"].split(".")[0] in body, r.json()  # (a field the client sent)
    assert httpx.get(server.url + "/health").status_code == 200


def test_openai_sdk_response_format(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x")
    rf = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
    r = client.chat.completions.create(
        model="tiny", messages=MESSAGES, response_format=rf, max_tokens=150, extra_body=WS
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)
    r = client.completions.create(model="tiny", prompt="x", max_tokens=150, extra_body={"guided_choice": ["a", "b"]})
    assert r.choices[0].text in ("a", "b")
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "bad", "schema": {"type": "object", "minProperties": 3, "maxProperties": 1}},
    }
    with pytest.raises(openai.BadRequestError, match="minProperties"):
        client.chat.completions.create(model="tiny", messages=MESSAGES, response_format=bad, max_tokens=10)


def test_an_unsatisfiable_constraint_is_refused_offline(tiny):
    """A regex that matches no string gave a 200 with EOS alone reported as "stop"; now a ValueError (400)."""
    with pytest.raises(ValueError, match="matches no output"):
        tiny.generate("x", SamplingParams(structured_outputs=_so(regex="[a&&b]")), use_tqdm=False)
    assert not tiny.engine.has_unfinished_requests()


def test_strict_json_schema_allows_only_the_declared_keys(server):
    """OpenAI's strict mode: an object schema without additionalProperties still gets only its declared keys
    (vLLM's disable_additional_properties); without strict the model may add keys, as JSON Schema allows.
    Oracle: jsonschema with additionalProperties false on every object."""
    open_schema = {"type": "object", "properties": {"a": {"type": "integer", "maximum": 99}}, "required": ["a"]}
    closed = {**open_schema, "additionalProperties": False}
    for seed in range(4):
        rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": open_schema, "strict": True}}
        r = _chat(server, response_format=rf, temperature=1.0, seed=seed, max_tokens=60)
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), closed)
    extra = 0
    for seed in range(4):  # (without strict: the random model writes other keys too, most of the time)
        rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": open_schema}}
        r = _chat(server, response_format=rf, temperature=1.0, seed=seed, max_tokens=60)
        content = r.json()["choices"][0]["message"]["content"]
        extra += not content.startswith('{"a"') or not content.rstrip().endswith("}") or content.count(":") > 1
    assert extra > 0


def test_strict_mode_closes_object_schemas_and_leaves_data_alone(server):
    """strict closes every object schema, not a const or enum value that happens to be an object (it became
    {"type": "object", "additionalProperties": false}: the output then broke the client's own schema), nor a
    property named "properties". Oracle: jsonschema with the client's schema."""
    schema = {
        "type": "object",
        "properties": {
            "cfg": {"const": {"type": "object"}},
            "kind": {"enum": [{"properties": {}}]},
            "properties": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}, "required": ["n"]},
        },
        "required": ["cfg", "kind", "properties"],
    }
    rf = {"type": "json_schema", "json_schema": {"name": "s", "schema": schema, "strict": True}}
    r = _chat(server, response_format=rf, temperature=0, max_tokens=200, guided_whitespace_pattern="")
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop", choice
    out = json.loads(choice["message"]["content"])
    jsonschema.validate(out, schema)
    assert set(out) == {"cfg", "kind", "properties"} and set(out["properties"]) == {"n"}  # (closed objects)


def test_tool_choice_that_constrains_and_a_second_constraint_is_a_400(server):
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}
    for choice in ("required", {"type": "function", "function": {"name": "f"}}):
        for extra in ({"guided_regex": "ZZZ"}, {"response_format": {"type": "json_object"}}):
            r = _chat(server, tools=[tool], tool_choice=choice, **extra)
            assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
            assert "one constraint a request" in r.json()["error"]["message"]
    r = _chat(server, tools=[tool], tool_choice="none", guided_regex="ZZZ")  # (none: the guided field applies)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "ZZZ"
    # a malformed tool_choice says each shape it can take, and names the field
    r = _chat(server, tools=[tool], tool_choice={"type": "function"})
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "tool_choice", err
    assert "'none', 'auto' or 'required'" in err["message"] and "tool_choice.function: Field required" in err["message"]
    r = _chat(server, response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text


def test_a_stream_ends_with_the_stop_reason_of_the_whole_response(server):
    """The stop string (or token) that ended a choice is the last streamed chunk's stop_reason, as the non-streamed
    response's (vLLM's stream choices; null before the finish)."""
    body = {"prompt": "ab", "max_tokens": 30, "temperature": 0, "stop": ["a", "b", "c", "d", "e"]}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    for path, extra in (("/v1/completions", {}), ("/v1/chat/completions", {"messages": MESSAGES})):
        req = {**body, **extra, "stream": True}
        if extra:
            req.pop("prompt")
        with httpx.stream("POST", server.url + path, json=req, timeout=60) as r:
            chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ") and x != "data: [DONE]"]
        choices = [c["choices"][0] for c in chunks if c["choices"]]
        assert all(c["stop_reason"] is None for c in choices[:-1])
        final = choices[-1]
        if not extra:
            assert (final["finish_reason"], final["stop_reason"]) == (whole["finish_reason"], whole["stop_reason"])
        plain = httpx.post(server.url + path, json={**req, "stream": False}, timeout=60).json()["choices"][0]
        assert final["stop_reason"] == plain["stop_reason"] and final["finish_reason"] == plain["finish_reason"]
