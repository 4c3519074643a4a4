"""The model's generation_config.json as the sampling defaults of requests that leave them unset (vLLM's
generation_config="auto"), and the rest of vLLM's offline surface a ported script touches: its GPU-only engine options
(taken with a warning), get_default_sampling_params, chat(tools=), use_tqdm as a class, SamplingParams.clone /
extra_args, and named refusals for the pooling and beam-search entry points.

Oracles: a request with the fields unset against one with the same values written out (same seed: the same tokens),
the openai SDK as the client, the chat template's own rendering of the tools."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
from conftest import make_checkpoint
from server_utils import ENGINE, ServerThread

from infertune import LLM, SamplingParams
from infertune.cli import build_parser, engine_kwargs

GEN = {"temperature": 0.7, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1, "max_new_tokens": 7, "do_sample": True}
EXPLICIT = dict(temperature=0.7, top_p=0.9, top_k=20, repetition_penalty=1.1)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("gen-defaults"), "llama", seed=3)
    cfg = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps(cfg | GEN))
    return path


@pytest.fixture(scope="module")
def llm(ckpt):
    with LLM(str(ckpt), **ENGINE) as llm:
        yield llm


def test_the_models_generation_config_is_the_default(llm):
    d = llm.get_default_sampling_params()
    assert (d.temperature, d.top_p, d.top_k, d.repetition_penalty, d.max_tokens) == (0.7, 0.9, 20, 1.1, 7)
    assert llm.engine.sampling_defaults == EXPLICIT | {"max_tokens": 7}
    # generate() without params runs those defaults: seeded, the same tokens as the values written out
    d.seed, d.ignore_eos = 5, True
    got = llm.generate("cache lines", d)[0].outputs[0].token_ids
    want = llm.generate("cache lines", SamplingParams(**EXPLICIT, max_tokens=7, seed=5, ignore_eos=True))
    assert got == want[0].outputs[0].token_ids and len(got) == 7
    plain = llm.generate(["abc", "de"])  # no params at all: max_new_tokens caps both
    assert all(len(o.outputs[0].token_ids) <= 7 for o in plain)


def test_vllm_neutral_defaults_and_overrides(ckpt, tmp_path):
    from infertune.config import EngineConfig

    def defaults(**kw):
        return EngineConfig.create(str(ckpt), **kw).model.sampling_defaults()

    assert defaults(generation_config="vllm") == {}
    assert defaults(override_generation_config={"temperature": 0.2})["temperature"] == 0.2
    assert defaults(generation_config="vllm", override_generation_config={"top_k": 3}) == {"top_k": 3}
    with pytest.raises(ValueError, match=r"override_generation_config takes .*not \['temprature'\]"):
        defaults(override_generation_config={"temprature": 0.2})
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    assert defaults(generation_config=str(other)) == {"temperature": 0.3}
    with pytest.raises(ValueError, match="expected 'auto', 'vllm' or a folder holding a generation_config.json"):
        defaults(generation_config=str(tmp_path / "missing"))
    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    (bad / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    with pytest.raises(ValueError, match=r"generation_config.json: temperature=-1 is invalid"):
        EngineConfig.create(str(bad)).model.sampling_defaults()


def test_the_server_fills_only_what_a_request_leaves_unset(ckpt, llm):
    import openai

    with ServerThread(ckpt) as s:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "hello"}]
        seeded = dict(seed=11, extra_body={"ignore_eos": True})
        # chat, nothing set: the model's values, max_new_tokens as max_tokens
        r = client.chat.completions.create(model="tiny", messages=msgs, logprobs=True, **seeded)
        got = [t.token for t in r.choices[0].logprobs.content]
        want = llm.chat(msgs, SamplingParams(**EXPLICIT, max_tokens=7, seed=11, ignore_eos=True, logprobs=0))[0]
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 7
        assert "".join(got) == want.outputs[0].text
        # the request's own values win (temperature 0 is greedy whatever the model's default; max_tokens too), the
        # fields it leaves unset are still the model's (repetition_penalty 1.1 here)
        r = client.chat.completions.create(model="tiny", messages=msgs, temperature=0, max_tokens=9, **seeded)
        params = SamplingParams(temperature=0, repetition_penalty=1.1, max_tokens=9, ignore_eos=True)
        greedy = llm.chat(msgs, params)[0].outputs[0].text
        assert r.choices[0].message.content == greedy and r.usage.completion_tokens == 9
        # completions: max_tokens unset is OpenAI's 16, at most the model's 7 (vLLM's rule); set, it is the request's
        r = client.completions.create(model="tiny", prompt="abc", **seeded)
        assert r.usage.completion_tokens == 7
        want = llm.generate("abc", SamplingParams(**EXPLICIT, max_tokens=7, seed=11, ignore_eos=True))[0]
        assert r.choices[0].text == want.outputs[0].text
        r = client.completions.create(model="tiny", prompt="abc", max_tokens=12, **seeded)
        assert r.usage.completion_tokens == 12


def test_a_default_max_tokens_past_the_context_is_capped_not_refused(ckpt):
    """The model's max_new_tokens (or /v1/completions' default 16) larger than the room a prompt leaves: capped to the
    room, as vLLM does; the same value sent by the client is a 400 (OpenAI's rule, unchanged)."""
    with ServerThread(ckpt, override_generation_config={"max_new_tokens": 1000}) as s:
        import openai

        client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0)
        msgs = [{"role": "user", "content": "x" * 40}]
        r = client.chat.completions.create(model="tiny", messages=msgs, extra_body={"ignore_eos": True})
        prompt = r.usage.prompt_tokens
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == ENGINE["max_model_len"] - prompt
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.chat.completions.create(model="tiny", messages=msgs, max_tokens=1000)
        ids = list(range(100, 100 + ENGINE["max_model_len"] - 5))  # (5 tokens of room, less than the default 16)
        r = client.completions.create(model="tiny", prompt=ids, extra_body={"ignore_eos": True})
        assert r.usage.completion_tokens == 5 and r.choices[0].finish_reason == "length"
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model="tiny", prompt=ids, max_tokens=16)


def test_vllm_gpu_options_are_taken_with_a_warning(ckpt, caplog, capsys):
    with caplog.at_level(logging.WARNING, logger="infertune.config"):
        with LLM(str(ckpt), **ENGINE, gpu_memory_utilization=0.9, enforce_eager=True, trust_remote_code=True) as llm:
            assert llm.config.model.compile == "off"
            assert llm.generate("a", SamplingParams(max_tokens=2, temperature=0))[0].outputs[0].token_ids
    said = caplog.text
    assert "gpu_memory_utilization=0.9 is ignored: the KV cache's size is kv_cache_memory_bytes" in said
    assert "enforce_eager=True is ignored" in said and "trust_remote_code=True is ignored" in said
    with pytest.raises(ValueError, match="unknown engine option 'gpu_memory_utilisation'"):
        LLM(str(ckpt), gpu_memory_utilisation=0.9)  # (a misspelt one is still an error)
    # `vllm serve` flags: parsed (hidden from --help), handed on as the options above
    args = build_parser().parse_args(
        ["serve", "--model", str(ckpt), "--gpu-memory-utilization", "0.85", "--enforce-eager", "--trust-remote-code"]
    )
    kw = engine_kwargs(args)
    assert kw["gpu_memory_utilization"] == "0.85" and kw["enforce_eager"] is True and kw["trust_remote_code"]
    assert "disable_log_stats" not in kw

    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    assert "--gpu-memory-utilization" not in capsys.readouterr().out  # (taken, not advertised)


def test_chat_tools_reach_the_template(llm):
    template = (
        "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    params = SamplingParams(max_tokens=1, temperature=0)
    out = llm.chat([{"role": "user", "content": "hi"}], params, chat_template=template, tools=tools)[0]
    assert llm.get_tokenizer().decode(out.prompt_token_ids) == "[tool get_weather]hi"
    for bad, where in [({"type": "function"}, r"tools\[0\] must be"), ({"function": {"name": ""}}, "name must be")]:
        with pytest.raises(ValueError, match=where):
            llm.chat([{"role": "user", "content": "hi"}], params, tools=[bad])


def test_use_tqdm_takes_a_bar_class(llm):
    from tqdm import tqdm

    made = []

    class Bar(tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            made.append(self)

    outs = llm.generate(["a", "b", "c"], SamplingParams(max_tokens=2, temperature=0), use_tqdm=Bar)
    assert len(outs) == 3 and len(made) == 1 and made[0].n == 3 and made[0].total == 3


def test_sampling_params_clone_extra_args_and_refusals(llm):
    sp = SamplingParams(stop=["x"], extra_args={"tag": [1]}, max_tokens=3)
    twin = sp.clone()
    twin.extra_args["tag"].append(2)
    twin.stop.append("y")
    assert sp.extra_args == {"tag": [1]} and sp.stop == ["x"]
    out = llm.generate("a", SamplingParams(max_tokens=2, temperature=0, extra_args={"k": 1}))[0]
    assert len(out.outputs[0].token_ids) == 2
    with pytest.raises(ValueError, match="spaces_between_special_tokens=False is invalid: only true"):
        SamplingParams(spaces_between_special_tokens=False)
    with pytest.raises(ValueError, match="extra_args"):
        SamplingParams(extra_args=[1])
    with pytest.raises(NotImplementedError, match="lora_request: LoRA adapters are not supported"):
        llm.generate("a", lora_request=object())
    with pytest.raises(ValueError, match="priority: requests are served first come first served"):
        llm.generate(["a", "b"], priority=[0, 1])
    assert llm.generate(["a"], SamplingParams(max_tokens=1), priority=[0])[0].outputs[0].token_ids
    for name, why in [("embed", "no embedding models"), ("score", "prompt_logprobs=0"), ("beam_search", "n=")]:
        with pytest.raises(NotImplementedError, match=f"LLM.{name} is not supported: .*{why}"):
            getattr(llm, name)(["a"])


def test_tokenization_kwargs_reach_the_tokenizer(llm):
    """vLLM's tokenization_kwargs: the tokenizer's own truncation (its side, right here) and add_special_tokens."""
    tok = llm.get_tokenizer()
    text = "abcdefghij"
    params = SamplingParams(max_tokens=1, temperature=0)
    out = llm.generate(text, params, tokenization_kwargs={"truncation": True, "max_length": 4})[0]
    assert (
        out.prompt_token_ids == tok(text, truncation=True, max_length=4)["input_ids"] and len(out.prompt_token_ids) == 4
    )
    out = llm.generate({"prompt_token_ids": [5, 6]}, params, tokenization_kwargs={"max_length": 1})[0]
    assert out.prompt_token_ids == [5, 6]  # (token ids are not tokenized again)
    with pytest.raises(ValueError, match="tokenization_kwargs .* the tokenizer refuses them"):
        llm.generate(text, params, tokenization_kwargs={"truncation": "sideways"})


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(llm):
    """vLLM's SamplingParams.truncate_prompt_tokens: the last n of the tokenizer's ids run (and the greedy tokens
    are those of the kept ids given directly); -1 keeps max_model_len - 1; a bad value is refused by name."""
    tok = llm.get_tokenizer()
    text = "the quick brown fox jumps over the lazy dog"
    ids = tok(text)["input_ids"]
    assert len(ids) > 5
    out = llm.generate(text, SamplingParams(max_tokens=4, temperature=0, truncate_prompt_tokens=5))[0]
    direct = llm.generate({"prompt_token_ids": ids[-5:]}, SamplingParams(max_tokens=4, temperature=0))[0]
    assert out.prompt_token_ids == ids[-5:] and out.prompt is None
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids
    assert llm.llm_engine is llm.engine and llm.llm_engine.get_tokenizer() is tok  # (vLLM's names)
    room = llm.llm_engine.max_model_len - 1
    long = list(range(3, 3 + room + 7))
    kept = llm.generate({"prompt_token_ids": long}, SamplingParams(max_tokens=1, truncate_prompt_tokens=-1))[0]
    assert kept.prompt_token_ids == long[-room:]
    short = llm.generate(text, SamplingParams(max_tokens=1, truncate_prompt_tokens=1000))[0]
    assert short.prompt_token_ids == ids and short.prompt == text  # (shorter than n: unchanged)
    for bad in (0, -2, 2.5):
        with pytest.raises(ValueError, match="truncate_prompt_tokens"):
            SamplingParams(truncate_prompt_tokens=bad)
