"""AsyncLLM, the async Python API. Oracle: the offline LLM on the same checkpoint (greedy), the engine's stats."""

from __future__ import annotations

import asyncio
import time

import pytest
from server_utils import ENGINE

from infertune import LLM, AsyncLLM, SamplingParams

PROMPTS = ["The cache", "Hello", [5, 6, 7, 8], {"prompt_token_ids": [40, 41, 42]}]


def test_exported_and_documented():
    import infertune
    import infertune.async_llm

    assert "AsyncLLM" in infertune.__all__ and infertune.AsyncLLM is AsyncLLM
    assert "async for" in infertune.async_llm.__doc__ and AsyncLLM.generate.__doc__ and AsyncLLM.abort.__doc__


def test_greedy_tokens_equal_llm_and_streams_are_cumulative(tiny_llama):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    ref = LLM(str(tiny_llama), **ENGINE).generate(PROMPTS, params)

    async def run():
        async with AsyncLLM(str(tiny_llama), **ENGINE) as engine:

            async def one(i, prompt):
                seen = []
                async for out in engine.generate(prompt, params, f"r{i}"):
                    seen.append(list(out.outputs[0].token_ids))
                assert out.finished and out.outputs[0].finish_reason == "length"
                assert all(a == b[: len(a)] for a, b in zip(seen, seen[1:]))  # each output extends the last
                return out

            return await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS)))

    outs = asyncio.run(run())
    for got, want in zip(outs, ref):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
        assert got.prompt_token_ids == want.prompt_token_ids


def test_abort_from_another_task_ends_the_stream_and_frees_the_request(tiny_llama):
    async def run():
        engine = AsyncLLM(str(tiny_llama), **{**ENGINE, "max_model_len": 256})
        try:
            params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            outs = []

            async def consume():
                async for out in engine.generate("abort me", params, "victim"):
                    outs.append(out)

            task = asyncio.create_task(consume())
            while len(outs) < 2:
                await asyncio.sleep(0.005)
            await engine.abort("victim")
            await asyncio.wait_for(task, 10)  # the iteration ends; nothing raised
            last = outs[-1]
            assert last.finished and last.outputs[0].finish_reason == "abort"
            assert len(last.outputs[0].token_ids) < 200
            deadline = time.time() + 10
            while time.time() < deadline and (
                engine.num_unfinished_requests
                or engine.engine.stats["kv_blocks_free"] != engine.engine.stats["kv_blocks_total"]
            ):
                await asyncio.sleep(0.02)
            stats = engine.engine.stats
            assert stats["num_running"] == 0 and stats["num_waiting"] == 0
            assert stats["kv_blocks_free"] == stats["kv_blocks_total"] or engine.config.cache.enable_prefix_caching
            await engine.abort("victim")  # unknown / finished ids are ignored
            # The engine still serves after an abort.
            outs = [o async for o in engine.generate("again", SamplingParams(max_tokens=3, ignore_eos=True))]
            out = outs[-1]
            assert out.finished and len(out.outputs[0].token_ids) == 3
        finally:
            engine.shutdown()

    asyncio.run(run())


def test_leaving_the_loop_early_aborts(tiny_llama):
    async def run():
        async with AsyncLLM(str(tiny_llama), **{**ENGINE, "max_model_len": 256}) as engine:
            gen = engine.generate("x", SamplingParams(max_tokens=200, ignore_eos=True), "early")
            async for _ in gen:
                break
            await gen.aclose()
            deadline = time.time() + 10
            while time.time() < deadline and engine.num_unfinished_requests:
                await asyncio.sleep(0.02)
            assert engine.num_unfinished_requests == 0

    asyncio.run(run())


def test_bad_requests_raise_value_errors(tiny_llama):
    async def run():
        async with AsyncLLM(str(tiny_llama), **ENGINE) as engine:
            with pytest.raises(ValueError, match="empty"):
                async for _ in engine.generate("", SamplingParams()):
                    pass
            with pytest.raises(ValueError, match="max_model_len"):
                async for _ in engine.generate([1] * 100, SamplingParams()):
                    pass

    asyncio.run(run())


def test_a_request_that_finished_before_its_consumer_left_counts_as_finished_not_aborted(tiny_llama):
    """The server's request counters come from the engine: a request the engine finished while its consumer (an HTTP
    client that just hung up) never read the end is counted once, as finished, and not as aborted."""

    async def run():
        async with AsyncLLM(str(tiny_llama), **{**ENGINE, "max_model_len": 256}) as engine:
            core = engine.engine
            gen = engine.generate("x", SamplingParams(max_tokens=5, ignore_eos=True), "left")
            async for _ in gen:  # the first output; the engine goes on and finishes the request unread
                deadline = time.time() + 10
                while time.time() < deadline and core.num_finished.get("length", 0) == 0:
                    await asyncio.sleep(0.02)
                break
            await gen.aclose()  # leaving the loop asks for an abort, which finds the request done
            deadline = time.time() + 10
            while time.time() < deadline and engine.num_unfinished_requests:
                await asyncio.sleep(0.02)
            await asyncio.sleep(0.1)  # (the abort is processed on the engine thread's next turn)
            assert core.num_finished == {"length": 1} and core.num_aborted == 0

    asyncio.run(run())


def test_a_memory_limit_below_the_loaded_process_refuses_to_start(tiny_llama):
    from infertune.config import EngineConfig
    from infertune.engine.async_engine import AsyncLLMEngine
    from infertune.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.create(str(tiny_llama), dtype="float32", max_model_len=32, memory_limit="10Mi"))
    with pytest.raises(ValueError, match="memory_limit=10 MiB is at or below what this process holds"):
        AsyncLLMEngine(engine)


def test_two_generates_with_one_request_id_at_once_refuse_the_second_and_the_engine_goes_on(tiny_llama):
    """Both calls passed the id check before either was admitted, and the admission's assert then stopped the engine
    loop for good (every later generate: EngineDeadError). Now the second is a ValueError; the first runs to its end
    with the offline engine's tokens, and the engine serves the next request."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    want = LLM(str(tiny_llama), **ENGINE).generate("dup", params)[0].outputs[0].token_ids

    async def main():
        async with AsyncLLM(str(tiny_llama), **ENGINE) as engine:

            async def run():
                last = None
                async for out in engine.generate("dup", params, "same"):
                    last = out
                return last.outputs[0].token_ids

            results = await asyncio.wait_for(asyncio.gather(run(), run(), return_exceptions=True), 30)
            errors = [r for r in results if isinstance(r, BaseException)]
            done = [r for r in results if not isinstance(r, BaseException)]
            assert len(errors) == 1 and isinstance(errors[0], ValueError), results
            assert "request id 'same' is already in use" in str(errors[0]) and done == [want]
            again = [out async for out in engine.generate("dup", params, "same")][-1]  # (the id is free again)
            assert again.outputs[0].token_ids == want and engine.engine.error is None

    asyncio.run(main())
