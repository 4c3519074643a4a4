"""vLLM offline scripts run against infertune unchanged: the engine keywords they spell out (vLLM's None = "not set",
the EngineArgs fields left at their defaults), and the LLM / LLMEngine / AsyncLLM methods they call.

Oracles: vLLM's documented semantics (EngineArgs: block_size, enable_prefix_caching, max_num_batched_tokens ... None
stand for the default; revision=None, enable_lora=False ... are the defaults of vLLM's LLM(...)); the prefix cache's
own count of cached prompt tokens; transformers' chat template rendering of the same conversation."""

from __future__ import annotations

import logging
import time

import pytest

from infertune import LLM, SamplingParams
from infertune.config import EngineConfig, OptionError

ENGINE = dict(dtype="float32", max_model_len=128, block_size=4, max_num_seqs=4)


def test_vllm_none_means_the_options_default_not_off(tiny_llama):
    """vLLM's EngineArgs hold None for "not set" (enable_prefix_caching, enable_chunked_prefill, block_size,
    max_num_batched_tokens, max_num_seqs, seed ...); a script that forwards them (LLM(**asdict(engine_args)), argparse
    defaults) got the prefix cache and chunked prefill silently off (None read as False), the others an error."""
    none = dict.fromkeys(
        [
            "enable_prefix_caching",
            "enable_chunked_prefill",
            "block_size",
            "max_num_batched_tokens",
            "max_num_seqs",
            "seed",
            "distributed_executor_backend",
        ]
    )
    config = EngineConfig.create(str(tiny_llama), **none)
    default = EngineConfig.create(str(tiny_llama))
    assert config == default
    with LLM(str(tiny_llama), dtype="float32", max_model_len=64, enable_prefix_caching=None) as llm:
        params = SamplingParams(temperature=0, max_tokens=1)
        prompt = {"prompt_token_ids": list(range(10, 50))}
        llm.generate(prompt, params)
        again = llm.generate(prompt, params)[0]
        assert again.num_cached_tokens >= 32  # (full blocks of 16 of the 40 prompt tokens came from the cache)


def test_a_bool_option_takes_only_a_bool(tiny_llama):
    with pytest.raises(ValueError, match="enable_prefix_caching='false' must be True or False"):
        EngineConfig.create(str(tiny_llama), enable_prefix_caching="false")
    assert EngineConfig.create(str(tiny_llama), enable_prefix_caching=0).cache.enable_prefix_caching is False


@pytest.mark.parametrize(
    "kw",
    [
        dict(revision=None),
        dict(tokenizer_revision=None),
        dict(download_dir=None),
        dict(load_format="auto"),
        dict(max_logprobs=20),
        dict(task="generate"),
        dict(runner="auto"),
        dict(hf_overrides=None),
        dict(enable_lora=False),
        dict(skip_tokenizer_init=False),
        dict(compilation_config=None),
        dict(hf_token=None),
        dict(model_impl="auto"),
        dict(disable_sliding_window=False),
    ],
)
def test_vllm_keywords_at_their_defaults_are_taken_silently(tiny_llama, kw, caplog):
    with caplog.at_level(logging.WARNING, logger="infertune.config"):
        assert EngineConfig.create(str(tiny_llama), **kw) == EngineConfig.create(str(tiny_llama))
    assert not caplog.text


@pytest.mark.parametrize(
    "kw, said",
    [
        (dict(revision="main"), "vLLM's revision='main' is ignored: the model is the local folder"),
        (dict(served_model_name="m"), "served_model_name='m' is ignored: it names the model in the server's"),
        (dict(max_logprobs=5), "max_logprobs=5 is ignored: a request may ask for up to 20"),
    ],
)
def test_vllm_keywords_without_effect_here_are_taken_with_a_warning(tiny_llama, kw, said, caplog):
    with caplog.at_level(logging.WARNING, logger="infertune.config"):
        EngineConfig.create(str(tiny_llama), **kw)
    assert said in caplog.text


@pytest.mark.parametrize(
    "kw, said",
    [
        (dict(enable_lora=True), "enable_lora=True is not supported: LoRA adapters"),
        (dict(task="embed"), "task='embed' is not supported: this engine serves generative models only"),
        (dict(hf_overrides={"num_hidden_layers": 1}), "hf_overrides="),
        (dict(load_format="dummy"), "load_format='dummy' is not supported"),
        (dict(skip_tokenizer_init=True), "skip_tokenizer_init=True is not supported"),
    ],
)
def test_vllm_keywords_that_would_change_the_answers_are_refused_by_name(tiny_llama, kw, said):
    with pytest.raises(OptionError, match=said.replace("(", r"\(").replace("[", r"\[")):
        EngineConfig.create(str(tiny_llama), **kw)


# ---- LLM.chat as vLLM's ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llm(tiny_llama):
    with LLM(str(tiny_llama), **ENGINE) as llm:
        yield llm


def _hf_ids(path, messages, **kw) -> list[int]:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path)
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kw)
    return hf.encode(text, add_special_tokens=False)


def test_chat_content_parts_and_tool_call_arguments_render_as_vllm_hands_them(llm, tiny_llama):
    """OpenAI messages as frameworks build them: content as text parts (vLLM joins them with newlines), an assistant
    turn with tool_calls and no content, its arguments a JSON string (vLLM parses it for the template). The parts were
    rendered as their Python repr ("[{'type': 'text', ...}]") and a message without content was refused."""
    template = (
        "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}"
        "{% for c in m.get('tool_calls', []) %}{{ c['function']['name'] }}({{ c['function']['arguments']['city'] }})"
        "{% endfor %}<|end|>\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
    )
    parts = [{"type": "text", "text": "Weather in"}, {"type": "text", "text": "Paris?"}]
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [
        {"role": "user", "content": parts},
        {"role": "assistant", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": parts},
    ]
    out = llm.chat(messages, SamplingParams(max_tokens=1), chat_template=template)[0]
    plain = [
        {"role": "user", "content": "Weather in\nParis?"},
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {**call["function"]}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "Weather in\nParis?"},
    ]
    plain[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    assert out.prompt_token_ids == _hf_ids(tiny_llama, plain, chat_template=template)
    assert "get_weather(Paris)" in out.prompt and "'type'" not in out.prompt
    with pytest.raises(ValueError, match="text-only"):
        llm.chat([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_chat_takes_vllms_keywords_and_the_llms_own_template(tiny_llama, tmp_path):
    """vLLM's LLM(chat_template=...) (a file or the text) is chat()'s template where a call gives none; chat() takes
    vLLM's chat_template_content_format, lora_request=None, priority, tokenization_kwargs (TypeError before)."""
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    (tmp_path / "t.jinja").write_text(template)
    messages = [{"role": "user", "content": "hi"}]
    for given in (template, str(tmp_path / "t.jinja")):
        with LLM(str(tiny_llama), **ENGINE, chat_template=given) as llm:
            out = llm.chat(
                messages,
                SamplingParams(max_tokens=1),
                use_tqdm=False,
                lora_request=None,
                priority=[0],
                chat_template_content_format="string",
                tokenization_kwargs={"truncation": True, "max_length": 60},
            )[0]
            assert out.prompt == "[user] hi\n[assistant] "
            assert out.prompt_token_ids == _hf_ids(tiny_llama, messages, chat_template=template)
            assert llm.chat(messages, SamplingParams(max_tokens=1), chat_template="{{ 'X' }}")[0].prompt == "X"
    with pytest.raises(ValueError, match="neither a file nor a Jinja template"):
        LLM(str(tiny_llama), **ENGINE, chat_template="no/such/file.jinja")


# ---- the other LLM / LLMEngine / AsyncLLM methods a vLLM script calls --------------------------------------------
def test_reset_prefix_cache_makes_the_next_prompt_compute_in_full(llm):
    """vLLM's llm.reset_prefix_cache() (benchmarks call it between runs) was an AttributeError. The oracle: the prefix
    cache's own count of the prompt tokens it served, and the tokens themselves (unchanged by where the KV came from)."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(30, 70))}
    first = llm.generate(prompt, params)[0]
    cached = llm.generate(prompt, params)[0]
    assert cached.num_cached_tokens >= 36 and cached.outputs[0].token_ids == first.outputs[0].token_ids
    assert llm.reset_prefix_cache() is True
    again = llm.generate(prompt, params)[0]
    assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids


def test_async_reset_prefix_cache_runs_on_the_engine_thread(tiny_llama):
    """vLLM's `await engine.reset_prefix_cache()` on AsyncLLM (an AttributeError): done between two steps on the
    engine thread; the oracle, as above, the prefix cache's own count of the prompt tokens it served."""
    import asyncio

    from infertune import AsyncLLM

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": list(range(30, 70))}

    async def run(engine, rid):
        last = None
        async for out in engine.generate(prompt, params, rid):
            last = out
        return last

    async def main():
        async with AsyncLLM(str(tiny_llama), **ENGINE) as engine:
            first = await run(engine, "a")
            cached = await run(engine, "b")
            assert cached.num_cached_tokens >= 36 and cached.outputs[0].token_ids == first.outputs[0].token_ids
            assert await engine.reset_prefix_cache() is True
            again = await run(engine, "c")
            assert again.num_cached_tokens == 0 and again.outputs[0].token_ids == first.outputs[0].token_ids

    asyncio.run(main())


def test_an_engine_call_queued_at_shutdown_is_answered_not_left_waiting(tiny_llama):
    """A reset_prefix_cache queued while a step runs and the engine shuts down: its caller gets EngineDeadError (the
    engine thread ends without draining its queue; the call would wait for ever)."""
    import asyncio
    import threading

    from infertune import AsyncLLM
    from infertune.engine.async_engine import EngineDeadError

    async def main():
        engine = AsyncLLM(str(tiny_llama), **ENGINE)
        core, step, stepping = engine.engine.engine, engine.engine.engine.step, threading.Event()
        core.step = lambda: (stepping.set(), time.sleep(0.3), step())[2]
        stream = engine.generate("abc", SamplingParams(max_tokens=50, ignore_eos=True), "r")
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.get_running_loop().run_in_executor(None, stepping.wait)
        call = asyncio.ensure_future(engine.reset_prefix_cache())
        await asyncio.sleep(0.05)  # (queued behind the sleeping step)
        engine.shutdown()
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(call, 5)
        with pytest.raises(EngineDeadError):  # (the running request's stream is told as well)
            await first

    asyncio.run(main())


@pytest.mark.parametrize("name", ["sleep", "wake_up", "start_profile", "stop_profile"])
def test_vllms_sleep_and_profiler_calls_are_named_errors(llm, name):
    with pytest.raises(NotImplementedError, match=f"LLM.{name} is not supported"):
        getattr(llm, name)()


def test_sampling_params_of_the_wrong_type_is_named(llm):
    with pytest.raises(ValueError, match="sampling_params must be a SamplingParams or a list of them"):
        llm.generate("a", {"max_tokens": 3})  # (was "'str' object has no attribute '__post_init__'")
    assert llm.generate("a", SamplingParams(max_tokens=1))[0].outputs[0].token_ids  # (still usable)


def test_engine_abort_request_takes_vllms_list_of_ids(llm):
    """vLLM's LLMEngine.abort_request(request_ids: list[str]): a list was looked up as one id (a TypeError, or
    nothing aborted when the engine was idle) and the requests ran on holding their KV blocks."""
    engine = llm.llm_engine
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    engine.add_request("a", "abc", params)
    engine.add_request("b", "abd", params)
    engine.add_request("c", "abe", params)
    engine.step()
    assert engine.abort_request(["a", "b", "zzz"]) is True
    assert engine.get_num_unfinished_requests() == 1
    assert engine.abort_request(("c",)) is True and not engine.has_unfinished_requests()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_async_abort_takes_a_list_of_ids(tiny_llama):
    import asyncio

    from infertune import AsyncLLM

    async def main():
        async with AsyncLLM(str(tiny_llama), **ENGINE) as engine:
            params = SamplingParams(max_tokens=100, ignore_eos=True)

            async def consume(rid):
                last = None
                async for out in engine.generate("abc", params, rid):
                    last = out
                    if len(out.outputs[0].token_ids) >= 2:
                        await engine.abort(["r1", "r2"])
                return last

            return await asyncio.wait_for(asyncio.gather(consume("r1"), consume("r2")), 60)

    for out in asyncio.run(main()):
        assert out.finished and out.outputs[0].finish_reason == "abort" and len(out.outputs[0].token_ids) < 100


# ---- vLLM's output_kind (RequestOutputKind) ----------------------------------------------------------------------
def _hf_greedy(path, ids: list[int], n: int) -> list[int]:
    import torch
    from conftest import hf_model

    out = hf_model(path).generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=None)
    return out[0, len(ids) :].tolist()


def test_async_output_kind_delta_and_final_only(tiny_llama):
    """vLLM's streaming scripts set SamplingParams(output_kind=RequestOutputKind.DELTA) and concatenate what comes
    (a TypeError here before: no such field). Oracle: the deltas add up to transformers' greedy tokens and to the
    cumulative stream's text; FINAL_ONLY yields the finished output alone."""
    import asyncio

    from infertune import AsyncLLM, RequestOutputKind

    ids = [5, 6, 7, 8]
    want = _hf_greedy(tiny_llama, ids, 12)

    async def main():
        async with AsyncLLM(str(tiny_llama), **ENGINE) as engine:
            base = dict(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1, prompt_logprobs=0)
            runs = {}
            for kind in RequestOutputKind:
                params = SamplingParams(**base, output_kind=kind)
                runs[kind] = [o async for o in engine.generate({"prompt_token_ids": ids}, params)]
            return runs

    runs = asyncio.run(main())
    whole = runs[RequestOutputKind.CUMULATIVE][-1].outputs[0]
    assert whole.token_ids == want
    deltas = runs[RequestOutputKind.DELTA]
    assert len(deltas) > 1 and [o.finished for o in deltas] == [False] * (len(deltas) - 1) + [True]
    assert sum((o.outputs[0].token_ids for o in deltas), []) == want
    assert "".join(o.outputs[0].text for o in deltas) == whole.text
    assert sum((o.outputs[0].logprobs for o in deltas), []) == whole.logprobs
    running = [
        sum(lp.logprob for lp in whole.logprobs[: len(sum((d.outputs[0].token_ids for d in deltas[: i + 1]), []))])
        for i in range(len(deltas))
    ]
    assert [o.outputs[0].cumulative_logprob for o in deltas] == pytest.approx(running)  # (vLLM's: the running total)
    assert deltas[0].prompt_logprobs is not None and all(o.prompt_logprobs is None for o in deltas[1:])
    (final,) = runs[RequestOutputKind.FINAL_ONLY]
    assert final.finished and final.outputs[0].token_ids == want and final.outputs[0].text == whole.text


def test_engine_step_honours_output_kind_and_generate_returns_whole_outputs(llm, tiny_llama):
    from infertune import RequestOutputKind

    ids = [9, 10, 11]
    want = _hf_greedy(tiny_llama, ids, 6)
    engine = llm.llm_engine
    for kind in (RequestOutputKind.DELTA, RequestOutputKind.FINAL_ONLY):
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, n=2, output_kind=kind)
        engine.add_request("k", {"prompt_token_ids": ids}, params)
        got: dict[int, list[int]] = {0: [], 1: []}
        seen = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                seen += 1
                for c in out.outputs:
                    got[c.index] += c.token_ids
        assert got == {0: want, 1: want}
        assert seen == 1 if kind == RequestOutputKind.FINAL_ONLY else seen > 1
        (out,) = llm.generate({"prompt_token_ids": ids}, params)
        assert [c.token_ids for c in out.outputs] == [want, want]
    with pytest.raises(ValueError, match="output_kind"):
        SamplingParams(output_kind=7)


# ---- vLLM's EngineArgs / LLMEngine.from_engine_args / AsyncLLMEngine ----------------------------------------------
def test_vllms_llm_engine_example_runs_as_it_is(tiny_llama):
    """vLLM's examples/offline_inference/llm_engine_example.py shape: EngineArgs.add_cli_args(parser),
    EngineArgs.from_cli_args(args), LLMEngine.from_engine_args(...), then add_request / step /
    has_unfinished_requests (none of these names existed). Oracle: transformers' greedy tokens."""
    import argparse

    from infertune import EngineArgs, LLMEngine

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--model", str(tiny_llama), "--dtype", "float32", "--max-model-len", "64"])
    engine_args = EngineArgs.from_cli_args(args)
    engine = LLMEngine.from_engine_args(engine_args)
    try:
        assert engine.config.model.max_model_len == 64 and engine.config.model.dtype == "float32"
        prompts = [([5, 6, 7], 5), ([8, 9], 3)]
        for i, (ids, n) in enumerate(prompts):
            engine.add_request(str(i), {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=n))
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        assert done == {str(i): _hf_greedy(tiny_llama, ids, n) for i, (ids, n) in enumerate(prompts)}
    finally:
        engine.shutdown()
    with LLM(**vars(EngineArgs(model=str(tiny_llama), dtype="float32", max_model_len=64, revision=None))) as llm:
        assert llm.config.model.max_model_len == 64
    with pytest.raises(ValueError, match="did you mean 'max_num_seqs'"):
        EngineArgs(model=str(tiny_llama), max_num_sequences=4)


def test_async_llm_engine_from_engine_args_and_its_tokenizer(tiny_llama):
    import asyncio

    from transformers import AutoTokenizer

    from infertune import AsyncEngineArgs, AsyncLLMEngine

    async def main():
        engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(model=str(tiny_llama), **ENGINE))
        try:
            tok = engine.get_tokenizer()
            ids = tok.encode("héllo ✓")
            last = None
            async for out in engine.generate(
                {"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=4), "a"
            ):
                last = out
            return ids, tok.decode(ids), last
        finally:
            engine.shutdown()

    ids, text, last = asyncio.run(main())
    hf = AutoTokenizer.from_pretrained(tiny_llama)
    assert ids == hf.encode("héllo ✓") and text == "héllo ✓"
    assert last.finished and last.outputs[0].token_ids == _hf_greedy(tiny_llama, ids, 4)


# ---- token ids and numbers as numpy / torch hand them ---------------------------------------------------------------
def test_numpy_and_torch_token_ids_and_integers_are_taken(llm, tiny_llama):
    """A TokensPrompt built from a tokenizer's numpy / torch output, or a max_tokens drawn with numpy: the ids were
    refused as "must be integers" (np.int64 is not an int) or failed on an array's truth value; a bool passed as a
    token id was taken as 1. Oracle: transformers' greedy tokens for the same ids."""
    import numpy as np
    import torch

    ids = [5, 6, 7]
    want = _hf_greedy(tiny_llama, ids, 3)
    params = SamplingParams(temperature=0, max_tokens=np.int64(3), ignore_eos=True, seed=np.int32(1))
    assert params.max_tokens == 3 and type(params.max_tokens) is int and type(params.seed) is int
    for given in (np.array(ids), torch.tensor(ids), list(np.array(ids)), torch.tensor(ids).tolist()):
        assert llm.generate({"prompt_token_ids": given}, params)[0].outputs[0].token_ids == want
    stop = SamplingParams(stop_token_ids=np.array([want[1]]), temperature=0, ignore_eos=True)
    assert llm.generate({"prompt_token_ids": ids}, stop)[0].outputs[0].token_ids == want[:2]
    with pytest.raises(ValueError, match=r"must be integers in \[0, \d+\) for this model; position 1 is True"):
        llm.generate({"prompt_token_ids": [5, True]}, params)
    with pytest.raises(ValueError, match="position 0 is 1.5"):
        llm.generate({"prompt_token_ids": [1.5]}, params)


# ---- vLLM's request keywords on LLMEngine.add_request / AsyncLLM.generate -------------------------------------------
def test_engine_add_request_takes_vllms_arguments_in_its_order(llm, tiny_llama):
    """vLLM's LLMEngine.add_request(request_id, prompt, params, arrival_time, lora_request, tokenization_kwargs,
    trace_headers, priority): the 4th positional argument landed in cap_max_tokens and the keywords were a TypeError.
    Oracle: transformers' tokenizer with the same kwargs; arrival_time (time.time()) moves the metrics' clock."""
    import time

    from transformers import AutoTokenizer

    engine = llm.llm_engine
    kwargs = {"truncation": True, "max_length": 5}
    params = SamplingParams(temperature=0, max_tokens=2)
    engine.add_request("t", "abcdefghij", params, time.time() - 2.0, None, kwargs, None, 0)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
    (out,) = outs
    assert out.prompt_token_ids == AutoTokenizer.from_pretrained(tiny_llama)("abcdefghij", **kwargs)["input_ids"]
    assert 2.0 <= out.metrics.ttft < 60  # (it arrived two seconds before it was added)
    with pytest.raises(NotImplementedError, match="lora_request"):
        engine.add_request("u", "a", params, lora_request=object())
    with pytest.raises(ValueError, match="priority"):
        engine.add_request("u", "a", params, priority=1)
    assert not engine.has_unfinished_requests()


def test_async_generate_takes_vllms_keywords(tiny_llama):
    import asyncio

    from infertune import AsyncLLM

    async def main():
        async with AsyncLLM(str(tiny_llama), **ENGINE) as engine:
            params = SamplingParams(temperature=0, max_tokens=2)
            kw = dict(lora_request=None, trace_headers=None, priority=0, data_parallel_rank=None)
            outs = [o async for o in engine.generate({"prompt_token_ids": [5, 6]}, params, "a", prompt_text="xy", **kw)]
            texts = [
                o
                async for o in engine.generate(
                    "abcdefgh", params, "b", tokenization_kwargs={"max_length": 3, "truncation": True}
                )
            ]
            with pytest.raises(ValueError, match="priority"):
                async for _ in engine.generate("a", params, "c", priority=2):
                    pass
            return outs[-1], texts[-1]

    tokens, text = asyncio.run(main())
    assert tokens.prompt == "xy" and tokens.prompt_token_ids == [5, 6] and tokens.finished
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(tiny_llama)
    assert text.prompt_token_ids == hf("abcdefgh", max_length=3, truncation=True)["input_ids"]
    assert len(text.prompt_token_ids) == 3


def test_request_metrics_answer_to_vllms_names(llm):
    """vLLM's RequestMetrics fields a ported script reads (time_in_queue, first_scheduled_time, last_token_time,
    first_token_latency) were AttributeErrors. They are the engine's own figures under vLLM's names, on one clock."""
    out = llm.generate("abc", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    m = out.metrics
    assert m.time_in_queue == m.queue_time and m.first_scheduled_time == m.scheduled_time
    assert m.first_token_latency == m.ttft
    assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.last_token_time <= m.finished_time
    assert m.last_token_time > m.first_token_time  # (three tokens: the last came steps after the first)


def test_vllms_prompt_types_are_exported(llm, tiny_llama):
    """`from vllm import TextPrompt, TokensPrompt` ported as `from infertune import ...` (an ImportError before)."""
    from infertune import TextPrompt, TokensPrompt

    want = _hf_greedy(tiny_llama, [5, 6, 7], 3)
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7]), TextPrompt(prompt="abc")], params)
    assert outs[0].outputs[0].token_ids == want and outs[1].prompt == "abc"
    assert TokensPrompt.__required_keys__ == {"prompt_token_ids"} and TextPrompt.__required_keys__ == {"prompt"}


# ---- options that do nothing with the others given say so -----------------------------------------------------------
@pytest.mark.parametrize(
    "kw, said",
    [
        (
            dict(quant_group_size=64),
            "quant_group_size=64 has no effect here: it sets w4a16's groups (quantization is None)",
        ),
        (dict(quant_group_size=64, quantization="w8a16"), "quant_group_size=64 has no effect here"),
        (dict(quant_symmetric=True), "quant_symmetric=True has no effect here"),
        (dict(keep_fp=("model.layers.0.*",)), "keep_fp=('model.layers.0.*',) has no effect here: no quantization"),
        (dict(kv_connector="p2p"), "kv_connector='p2p' has no effect here: it is read only with kv_role"),
        (dict(kv_load_failure_policy="fail"), "kv_load_failure_policy='fail' has no effect here"),
        (dict(enable_expert_parallel=True), "enable_expert_parallel=True has no effect here: the model has no experts"),
        (dict(mla_cache="decompressed"), "mla_cache='decompressed' has no effect here: the model is not a DeepSeek"),
    ],
)
def test_an_option_without_effect_is_named_once(tiny_llama, kw, said, caplog, monkeypatch):
    """These were taken without a word (a script tuning quant_group_size without a quantization believed it did
    something). Once a process: the engines a tool builds again for the same options do not repeat it."""
    import infertune.config as config

    monkeypatch.setattr(config, "_WARNED", set())
    with caplog.at_level(logging.WARNING, logger="infertune.config"):
        EngineConfig.create(str(tiny_llama), **kw)
        EngineConfig.create(str(tiny_llama), **kw)
    assert caplog.text.count(said) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="infertune.config"):
        EngineConfig.create(str(tiny_llama), quantization="w4a16", quant_group_size=32, quant_symmetric=True)
        EngineConfig.create(str(tiny_llama), quantization="w8a16", keep_fp=("lm_head", "model.layers.0.*"))
    assert "has no effect" not in caplog.text  # (where they do something: quiet)


def test_decode_kernels_linear_at_float32_says_it_does_nothing(tiny_llama, caplog):
    with caplog.at_level(logging.WARNING, logger="infertune.runner.model_runner"):
        with LLM(str(tiny_llama), **ENGINE, decode_kernels="linear"):
            pass
    assert "decode_kernels='linear' has no effect here (dtype float32): they are bf16 kernels" in caplog.text


@pytest.mark.parametrize(
    "kw, said",
    [
        (dict(max_tokens=5), "max_tokens is a per-request setting: pass SamplingParams(max_tokens=...) to generate()"),
        (dict(temperature=0.0), "temperature is a per-request setting"),
        (dict(gpu_memory_utilisation=0.5), "did you mean 'gpu_memory_utilization'?"),
        (dict(max_seq_len=100), "did you mean 'max_model_len'?"),
        (dict(n_ctx=100), "did you mean 'max_model_len'?"),
        (dict(max_num_sequences=4), "did you mean 'max_num_seqs'?"),
    ],
)
def test_an_unknown_option_names_what_was_meant(tiny_llama, kw, said):
    """LLM(max_tokens=...) suggested 'max_stop_len', max_seq_len (other engines' name) too; a misspelt vLLM option
    had no suggestion at all."""
    (name,) = kw
    with pytest.raises(
        TypeError,
        match=f"unknown engine option '{name}'; " + said.replace("(", r"\(").replace(")", r"\)").replace(".", r"\."),
    ):
        LLM(str(tiny_llama), **kw)


def test_completion_finished_reads_as_vllms_method_and_as_a_bool(llm):
    """vLLM's CompletionOutput.finished() is a method: a ported `if c.finished():` was "'bool' object is not
    callable"; infertune's own `c.finished` reads as before."""
    out = llm.generate("abc", SamplingParams(max_tokens=2))[0]
    c = out.outputs[0]
    assert c.finished() is True and c.finished and c.finished == True  # noqa: E712
    running = c.__class__(0, "", [], None)
    assert running.finished() is False and not running.finished and repr(running.finished) == "False"


def test_async_llm_health_calls_as_vllms(tiny_llama):
    """vLLM's AsyncLLM.check_health / is_running / errored / get_num_unfinished_requests (AttributeErrors before)."""
    import asyncio

    from infertune import AsyncLLM
    from infertune.engine.async_engine import EngineDeadError

    async def main():
        engine = AsyncLLM(str(tiny_llama), **ENGINE)
        await engine.check_health()
        assert engine.is_running and not engine.errored and not engine.is_stopped
        core, step = engine.engine.engine, engine.engine.engine.step
        core.step = lambda: (time.sleep(0.05), step())[1]  # (steps slower than this loop: the request still runs)
        stream = engine.generate("abc", SamplingParams(max_tokens=50, ignore_eos=True), "r")
        await stream.__anext__()
        assert engine.get_num_unfinished_requests() == 1
        await stream.aclose()
        engine.shutdown()
        assert not engine.is_running and engine.is_stopped
        with pytest.raises(EngineDeadError, match="shut down"):
            await engine.check_health()

    asyncio.run(main())


def test_generate_takes_vllms_keywords_at_their_defaults(llm):
    """vLLM's generate(..., lora_request=[None, None], priority=0, mm_processor_kwargs=None): the list of Nones was
    refused as a LoRA request and mm_processor_kwargs was a TypeError."""
    params = SamplingParams(temperature=0, max_tokens=2)
    outs = llm.generate(
        ["a", "b"], params, use_tqdm=False, lora_request=[None, None], priority=0, mm_processor_kwargs=None
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [2, 2]
    with pytest.raises(ValueError, match="mm_processor_kwargs: this engine serves text-only models"):
        llm.generate("a", params, mm_processor_kwargs={"num_crops": 4})
