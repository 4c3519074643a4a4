"""Token healing (SamplingParams.token_healing): the prompt's last token is taken off and the output must start with
its text. The oracle is HF transformers on the built-in model: the first healed token is HF's best among the tokens
that can start the removed text, and the text returned continues the prompt exactly."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from server_utils import ServerThread
from transformers import AutoModelForCausalLM, AutoTokenizer

from infertune import LLM, SamplingParams, StructuredOutputsParams
from infertune.sampling_params import ParamError

DEMO = str(Path(__file__).resolve().parents[1] / "infertune" / "assets" / "demo-model")
PROMPTS = ["def ", "The capital of Fra", "x = 1\nprint(x", "import num"]


@pytest.fixture(scope="module")
def llm():
    return LLM(model=DEMO, dtype="float32", seed=0)


@pytest.fixture(scope="module")
def hf():
    return AutoModelForCausalLM.from_pretrained(DEMO, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(DEMO)


def _greedy(max_tokens: int = 8, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw)


@pytest.mark.parametrize("prompt", PROMPTS)
def test_first_healed_token_is_hfs_best_among_those_that_start_the_removed_text(llm, hf, prompt):
    model, tok = hf
    ids = tok.encode(prompt)
    head_ids = ids[:-1]
    context = head_ids[-4:]
    head = tok.decode(context)
    removed = tok.decode(context + ids[-1:])[len(head) :]
    with torch.no_grad():
        logits = model(torch.tensor([head_ids])).logits[0, -1].double()
    # the tokens a healed output may begin with: their text starts with the removed text, or is a start of it
    texts = [tok.decode(context + [t])[len(head) :] for t in range(logits.shape[0])]
    ok = [bool(x) and (x.startswith(removed) or removed.startswith(x)) for x in texts]
    allowed = torch.tensor(ok)
    expected = int(torch.where(allowed, logits, torch.tensor(float("-inf"), dtype=torch.float64)).argmax())

    out = llm.generate([prompt], _greedy(token_healing=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == head_ids  # the healed prompt is one token short
    first = out.outputs[0].token_ids[0]
    assert first == expected, (texts[first], texts[expected])
    # the returned text continues the prompt as given: prompt + text is what the healed ids spell
    assert prompt + out.outputs[0].text == tok.decode(head_ids + out.outputs[0].token_ids)


def test_healing_changes_the_demo_models_loop_on_a_trailing_space(llm):
    """The issue's example: "def " makes the built-in model start mid-word (it never saw a lone " " token before a
    name); healed, its first token carries the space itself."""
    plain = llm.generate(["def "], _greedy(), use_tqdm=False)[0].outputs[0]
    healed = llm.generate(["def "], _greedy(token_healing=True), use_tqdm=False)[0].outputs[0]
    assert not plain.text.startswith(" ") and plain.text.startswith("ut")
    assert healed.token_ids[0] != plain.token_ids[0]
    assert llm.get_tokenizer().decode([healed.token_ids[0]]).startswith(" ")


def test_nothing_to_heal_leaves_the_request_as_it_was(llm):
    """A one-token prompt has no boundary to heal: the output equals the unhealed one."""
    tok = llm.get_tokenizer()
    one = tok.encode("def")
    assert len(one) == 1
    a = llm.generate([{"prompt_token_ids": one}], _greedy(token_healing=True), use_tqdm=False)[0]
    b = llm.generate([{"prompt_token_ids": one}], _greedy(), use_tqdm=False)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and a.prompt_token_ids == one


def test_healing_with_sampling_and_n(llm):
    """Seeded sampling with n=3: every sample starts with the removed text (the mask holds for each)."""
    tok = llm.get_tokenizer()
    outs = llm.generate(
        ["The capital of Fra"],
        SamplingParams(n=3, max_tokens=6, temperature=1.0, seed=5, token_healing=True),
        use_tqdm=False,
    )[0].outputs
    head = tok.encode("The capital of Fra")[:-1]
    for o in outs:
        assert tok.decode(head + o.token_ids).startswith("The capital of Fra")
        assert "The capital of Fra" + o.text == tok.decode(head + o.token_ids)


def test_healing_refuses_what_it_cannot_combine_with():
    with pytest.raises(ParamError, match="token_healing"):
        SamplingParams(token_healing=True, structured_outputs=StructuredOutputsParams(regex="a+"))
    with pytest.raises(ParamError, match="token_healing"):
        SamplingParams(token_healing=True, prompt_logprobs=1, max_tokens=0)


def test_server_completion_with_token_healing_streamed_and_whole():
    body = {"prompt": "The capital of Fra", "max_tokens": 6, "temperature": 0, "token_healing": True}
    with ServerThread(DEMO, max_model_len=256) as s:
        whole = httpx.post(s.url + "/v1/completions", json=body, timeout=60).json()
        plain = httpx.post(s.url + "/v1/completions", json={**body, "token_healing": False}, timeout=60).json()
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            chunks = [line[6:] for line in r.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        bad = httpx.post(  # healing and a scored prompt do not mix: a 400 that names token_healing
            s.url + "/v1/completions", json={**body, "echo": True, "logprobs": 1, "max_tokens": 0}, timeout=60
        )
    streamed = "".join(json.loads(c)["choices"][0]["text"] for c in chunks if json.loads(c)["choices"])
    text = whole["choices"][0]["text"]
    assert streamed == text
    assert whole["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"] - 1
    assert bad.status_code == 400 and "token_healing" in bad.text


def test_heals_after_a_character_in_byte_fallback_tokens(tmp_path):
    """Llama 2 / Mistral: a prompt whose last tokens follow a character spelled in byte tokens ("你好 ok") was left
    unhealed, its few tokens of context starting inside 好 (decoded as U+FFFD). Oracle: transformers' decode of the
    prompt, which the healed prompt plus the output must continue."""
    from conftest import make_byte_fallback_tokenizer, make_checkpoint

    tok = make_byte_fallback_tokenizer()
    path = make_checkpoint(tmp_path, "llama", vocab_size=len(tok), eos_token_id=2, bos_token_id=1)
    for name in ("chat_template.jinja", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json"):
        (path / name).unlink(missing_ok=True)
    tok.save_pretrained(path)
    llm = LLM(str(path), dtype="float32", max_model_len=64)
    prompt = "你好 ok"
    ids = tok.encode(prompt)
    assert tok.convert_ids_to_tokens(ids)[-5:] == ["<0xA5>", "<0xBD>", "▁", "o", "k"]
    out = llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0, token_healing=True, ignore_eos=True))[0]
    assert list(out.prompt_token_ids) == ids[:-1]  # healed: "k" taken off
    whole = tok.decode(list(out.prompt_token_ids) + list(out.outputs[0].token_ids), skip_special_tokens=True)
    assert whole.startswith(tok.decode(ids, skip_special_tokens=True))
    assert whole == prompt + out.outputs[0].text


def test_heals_where_the_context_starts_inside_an_emoji(llm):
    """Byte-level BPE (Llama 3, Qwen): "x 😀 a b"'s last 5 tokens start inside 😀, so the context decoded with a
    U+FFFD in front, and healing was skipped for that alone. Oracle: the tokenizer's decode of the healed ids."""
    tok = llm.get_tokenizer()
    prompt = "x 😀 a b"
    ids = tok.encode(prompt)
    assert "\ufffd" in tok.decode(ids[-5:])
    out = llm.generate([prompt], _greedy(token_healing=True), use_tqdm=False)[0]
    assert out.prompt_token_ids == ids[:-1]  # healed: " b" taken off
    assert tok.decode(out.outputs[0].token_ids).startswith(" b")
    assert prompt + out.outputs[0].text == tok.decode(ids[:-1] + out.outputs[0].token_ids)
