"""The engine's tokenizer.json path (FastTokenizer) against transformers' AutoTokenizer on the same folder."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_checkpoint

from infertune.engine.detokenizer import IncrementalDetokenizer
from infertune.engine.tokenizer import FastTokenizer, load_tokenizer

TEXTS = [
    "",
    "the hello",
    "  two leading spaces",
    "tabs\tand\nnew lines\n\n",
    "héllo wörld, 日本語 🤖",
    "<|user|>hi<|end|>",
    "</s>",
    "a</s>b<s>c",
    "the<|user|> the <|end|>",
    "Ünïcödé ǅ ﬁ №",
]


def _save(tok, path: Path, model_type: str = "llama", **config_overrides) -> Path:
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": ["<|user|>", "<|end|>"]})
    fast.save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    if config_overrides:
        cfg = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**cfg, **config_overrides}))
    return path


def byte_level_bpe(path: Path, **kw) -> Path:
    """GPT-2 / Llama-3 style: byte-level BPE with a few merges, BOS added by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("l", "l"), ("he", "ll")]
    for a, b in merges:
        vocab[a + b] = len(vocab)
    for special in ("<unk>", "<s>", "</s>"):
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return _save(tok, path, **kw)


def sentencepiece_unigram(path: Path, **kw) -> Path:
    """Llama-2 style: a normalizer, Metaspace, a unigram model with byte fallback and a decoder that strips the
    leading space, BOS added by the post-processor."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    pieces += ["▁", "▁the", "▁hello", "▁wor", "he", "llo", "t", "h", "e", "l", "o", "a", "b", "c", "w", "r", "d"]
    vocab = [(p, 0.0 if i < 259 else -float(len(pieces) - i) / 10) for i, p in enumerate(pieces)]
    tok = Tokenizer(models.Unigram(vocab, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", 1)])
    return _save(tok, path, **kw)


def older_transformers_bpe(path: Path) -> Path:
    """The byte-level BPE folder as transformers 4.x wrote it: PreTrainedTokenizerFast, added_tokens_decoder, and
    clean_up_tokenization_spaces on (which transformers ignores for BPE)."""
    byte_level_bpe(path)
    added = json.loads((path / "tokenizer.json").read_text())["added_tokens"]
    decoder = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    cfg = json.loads((path / "tokenizer_config.json").read_text())
    cfg.update(
        tokenizer_class="PreTrainedTokenizerFast", added_tokens_decoder=decoder, clean_up_tokenization_spaces=True
    )
    (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return path


BUILDERS = {
    "byte_level_bpe": byte_level_bpe,
    # the model types whose folders AutoTokenizer builds with the generic class they state (transformers 5)
    "qwen3_bpe": lambda path: byte_level_bpe(path, model_type="qwen3"),
    "qwen2_moe_bpe": lambda path: byte_level_bpe(path, model_type="qwen2_moe"),
    "qwen3_moe_bpe": lambda path: byte_level_bpe(path, model_type="qwen3_moe"),
    "sentencepiece_unigram": sentencepiece_unigram,
    "older_transformers_bpe": older_transformers_bpe,
}


@pytest.fixture(scope="module", params=sorted(BUILDERS))
def pair(request, tmp_path_factory):
    """(FastTokenizer, transformers AutoTokenizer) of one plain folder."""
    from transformers import AutoTokenizer

    path = BUILDERS[request.param](tmp_path_factory.mktemp(request.param))
    ours = load_tokenizer(str(path))
    assert isinstance(ours, FastTokenizer), "a plain folder must take the tokenizer.json path"
    return ours, AutoTokenizer.from_pretrained(path)


def test_encode_matches_transformers(pair):
    ours, hf = pair
    for text in TEXTS:
        for add in (True, False):
            assert ours.encode(text, add_special_tokens=add) == hf.encode(text, add_special_tokens=add), (text, add)
        assert ours.encode(text) == hf.encode(text)
        assert ours.encode(text, add_special_tokens=False, verbose=False) == hf.encode(text, add_special_tokens=False)


def test_decode_matches_transformers(pair):
    ours, hf = pair
    special_ids = [hf.convert_tokens_to_ids(t) for t in ("<s>", "</s>", "<|user|>", "<|end|>", "<unk>")]
    sequences = [hf.encode(text) for text in TEXTS] + [[], special_ids, list(range(len(hf))), [special_ids[1]]]
    # Single bytes of a multi-byte character: incomplete UTF-8 must decode the same way.
    multibyte = hf.encode("日本語 🤖", add_special_tokens=False)
    sequences += [multibyte[:n] for n in range(1, len(multibyte))]
    for ids in sequences:
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(ids, skip_special_tokens=skip), (ids, skip)
    for token_id in special_ids + [5, 70]:
        assert ours.decode(token_id) == hf.decode(token_id)


def test_streamed_text_matches_transformers(pair):
    """The engine's incremental detokenizer gives the same text through either tokenizer."""
    ours, hf = pair
    prompt = hf.encode("the hello")
    output = hf.encode("héllo <|user|>wörld 日本語 🤖</s>", add_special_tokens=False)
    for skip in (True, False):
        streams = []
        for tok in (ours, hf):
            detok = IncrementalDetokenizer(tok, prompt, skip)
            streams.append([detok.add(t) for t in output] + [detok.flush()])
        assert streams[0] == streams[1]
        assert "wörld 日本語 🤖" in "".join(streams[0])


def test_vocab_and_special_ids_match_transformers(pair):
    ours, hf = pair
    assert ours.eos_token_id == hf.eos_token_id is not None
    assert ours.get_vocab() == hf.get_vocab()
    assert len(ours) == len(hf)
    assert ours.chat_template is None and hf.chat_template is None


def test_the_rest_of_the_api_comes_from_transformers(pair):
    ours, hf = pair
    ids = hf.encode("the <|user|>hello")
    assert ours.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
    assert ours("the hello")["input_ids"] == hf("the hello")["input_ids"]
    assert ours.all_special_ids == hf.all_special_ids
    assert ours.decode([ids, ids]) == hf.decode([ids, ids])  # batched: handed to transformers


@pytest.mark.parametrize(
    "change, expected",
    [
        ("chat_template_file", "chat_template.jinja"),
        ("chat_template_key", "chat_template"),
        ("qwen2", "model_type 'qwen2'"),
        ("add_bos_token", "add_bos_token"),
        ("slow_class", "tokenizer_class 'LlamaTokenizer'"),
        ("special_not_in_json", "<|system|>"),
        ("special_stripped", "<|user|>"),
    ],
)
def test_other_folders_get_transformers(tmp_path, caplog, change, expected):
    """A folder transformers would build or wrap differently gets AutoTokenizer itself."""
    import logging

    from transformers import AutoTokenizer

    overrides = {
        "chat_template_key": {"chat_template": "{{ messages[0]['content'] }}"},
        "add_bos_token": {"add_bos_token": False},
        "slow_class": {"tokenizer_class": "LlamaTokenizer"},
        "special_not_in_json": {"extra_special_tokens": ["<|user|>", "<|end|>", "<|system|>"]},
    }.get(change, {})
    path = byte_level_bpe(tmp_path, model_type="qwen2" if change == "qwen2" else "llama", **overrides)
    if change == "chat_template_file":
        (path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    if change == "special_stripped":
        data = json.loads((path / "tokenizer.json").read_text())
        for t in data["added_tokens"]:
            t["lstrip"] = t["lstrip"] or t["content"] == "<|user|>"
        (path / "tokenizer.json").write_text(json.dumps(data))
    with caplog.at_level(logging.DEBUG, logger="infertune.engine.tokenizer"):
        tok = load_tokenizer(str(path))
    assert not isinstance(tok, FastTokenizer)
    assert expected in caplog.text
    hf = AutoTokenizer.from_pretrained(path)
    assert type(tok) is type(hf)
    for text in TEXTS:
        assert tok.encode(text) == hf.encode(text)


def test_engine_on_a_plain_folder_never_imports_transformers(tmp_path):
    """The point of the tokenizer.json path: serving a plain folder loads neither transformers nor (through the
    model build) sympy, and its prompt ids and text are what AutoTokenizer gives."""
    path = make_checkpoint(tmp_path / "plain", "llama")
    (path / "chat_template.jinja").unlink()  # the fixture's tokenizer has a chat template; this folder is plain
    script = f"""
import json, sys
import torch
before = set(sys.modules)
from infertune import LLM, SamplingParams
llm = LLM({str(path)!r}, dtype="float32", max_model_len=64, compile="off")
params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, skip_special_tokens=False)
out = llm.generate("héllo <|user|>the", params)[0]
new = set(sys.modules) - before
heavy = sorted(m for m in new if m.split(".")[0] in ("transformers", "sympy"))
print(json.dumps(dict(kind=type(llm.tokenizer).__name__, prompt_ids=out.prompt_token_ids, ids=out.outputs[0].token_ids,
                      text=out.outputs[0].text, imported=heavy)))
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["kind"] == "FastTokenizer"
    assert got["imported"] == []
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)
    assert got["prompt_ids"] == hf.encode("héllo <|user|>the")
    assert got["text"] == hf.decode(got["ids"], skip_special_tokens=False)


@pytest.mark.parametrize(
    ("prompt", "output"),
    [
        ("你好", "世界和平。ok 世界"),  # the prompt's last 4 tokens start inside 你
        ("hello 👍🏽", "👍🏽 hello 😀 ok"),  # 8-byte emoji: its byte tokens outnumber the 4 tokens of context
        ("ok", "中文字符 hello 。"),
    ],
)
def test_streamed_text_with_byte_fallback_tokens_matches_transformers(prompt, output):
    """Llama 2 / Mistral's byte fallback: a run of byte tokens decodes only as a whole, so a few tokens of context
    that start inside a character turn the character after them into U+FFFD (平 came out as three). Streamed
    deltas add up to transformers' decode of prompt + output past the prompt's text, and none holds a U+FFFD."""
    from conftest import make_byte_fallback_tokenizer

    hf = make_byte_fallback_tokenizer()
    prompt_ids = hf.encode(prompt)
    output_ids = hf.encode(output, add_special_tokens=False)
    assert "<0xE4>" in hf.convert_ids_to_tokens(prompt_ids + output_ids) or "<0xF0>" in hf.convert_ids_to_tokens(
        prompt_ids + output_ids
    )
    for skip in (True, False):
        detok = IncrementalDetokenizer(hf, prompt_ids, skip)
        deltas = [detok.add(t) for t in output_ids] + [detok.flush()]
        whole = hf.decode(prompt_ids + output_ids, skip_special_tokens=skip)
        head = hf.decode(prompt_ids, skip_special_tokens=skip)
        assert whole.startswith(head)
        assert "".join(deltas) == whole[len(head) :] == " " + output
        assert not any("\ufffd" in d for d in deltas), deltas


@pytest.mark.parametrize("text", ["hello world", "你好 hello。", "ok 👍🏽 hello", "hello  hello"])
def test_token_bytes_add_up_to_the_text(text):
    """OpenAI's logprobs `bytes`: each token's own bytes, joined, are the text's UTF-8 (Python's encode). A byte
    token decodes alone as U+FFFD and a SentencePiece word-start token ("▁hello") without its space; the tokens'
    bytes were those of their lone decodes (U+FFFD's three bytes, no space)."""
    from conftest import make_byte_fallback_tokenizer, make_tokenizer

    from infertune.engine.tokenizer import token_bytes

    sp = make_byte_fallback_tokenizer()  # (SentencePiece puts a space in front of the text)
    ids = sp.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(sp, i, sp.decode([i])) for i in ids) == (" " + text).encode("utf-8")
    bl = make_tokenizer()  # byte-level: every UTF-8 byte one token
    ids = bl.encode(text, add_special_tokens=False)
    assert b"".join(token_bytes(bl, i, bl.decode([i])) for i in ids) == text.encode("utf-8")
