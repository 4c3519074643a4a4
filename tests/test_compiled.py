"""The compiled forward (torch.compile of each layer's dense stages) against the eager one and HF transformers.

Oracles: HF's logits at every prompt position; the eager engine's greedy tokens for a batch that mixes decodes
of different sizes with prefill chunks; Dynamo's own graph counter (the warm-up compiles every variant, serving
compiles nothing).
"""

from __future__ import annotations

import pytest
import torch
from conftest import hf_model, make_checkpoint

from infertune import LLM, SamplingParams
from infertune.backends.cpu import CPUBackend
from infertune.runner.compiled import AUTO_MIN_PARAMETERS, should_compile

BLOCK = 4


def _runner(llm):
    return llm.engine.executor.runner


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("compiled"), "llama", tie_word_embeddings=True)
    return path, hf_model(path)


@pytest.fixture(scope="module")
def compiled(ckpt):
    return LLM(
        str(ckpt[0]), dtype="float32", block_size=BLOCK, max_model_len=96, compile="on", max_num_batched_tokens=16
    )


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (1, 5, 2 * BLOCK, 23, 40)]


def test_compiled_prompt_logits_match_hf(ckpt, compiled):
    path, hf = ckpt
    assert _runner(compiled).compiled is not None and _runner(compiled).compile_seconds > 0
    ids = _prompts(hf.config.vocab_size)[3]
    ours = _runner(compiled).prompt_logits(ids, list(range(-(-len(ids) // BLOCK))))  # blocks unused by the engine
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_compiled_greedy_matches_eager_and_serving_never_compiles(ckpt, compiled):
    import torch._dynamo.utils as dyn

    path, hf = ckpt
    prompts = [{"prompt_token_ids": p} for p in _prompts(hf.config.vocab_size)]
    # Different lengths: the batch shrinks as sequences finish (decode batches of 5, 4, ... 1) and the first steps
    # mix decodes with prefill chunks (max_num_batched_tokens 16 splits the longer prompts).
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 9, 14, 20, 6)]
    graphs_before = dyn.counters["stats"]["unique_graphs"]
    out_c = compiled.generate(prompts, params, use_tqdm=False)
    assert dyn.counters["stats"]["unique_graphs"] == graphs_before, "a request triggered a compile"
    eager = LLM(
        str(path), dtype="float32", block_size=BLOCK, max_model_len=96, compile="off", max_num_batched_tokens=16
    )
    assert _runner(eager).compiled is None
    out_e = eager.generate(prompts, params, use_tqdm=False)
    for c, e, n in zip(out_c, out_e, (3, 9, 14, 20, 6)):
        assert len(c.outputs[0].token_ids) == n
        assert c.outputs[0].token_ids == e.outputs[0].token_ids


def test_compiled_bf16_and_w8a16_are_as_accurate_as_eager(tmp_path):
    """bf16 with prepacked (oneDNN) weights, W8A16 and W8A8 int8 weights (the packed kernels as opaque custom ops
    where the weights are packed), inside the compiled graphs.

    Fused kernels round bf16 intermediates differently from eager, so neither is bit-exact; the oracle is HF in
    fp32: the compiled logits must be as close to it as the eager engine's (mean abs error within 1.25x), for a
    2-token and a 23-token step (both the dynamic graph variant).
    """
    path = make_checkpoint(tmp_path / "m", "llama", hidden_size=128, intermediate_size=256)
    hf = hf_model(path)
    prompts = _prompts(hf.config.vocab_size)
    for quant in (None, "w8a16", "w8a8"):
        kw = dict(dtype="bfloat16", block_size=BLOCK, max_model_len=64, quantization=quant)
        got, want = LLM(str(path), compile="on", **kw), LLM(str(path), compile="off", **kw)
        for ids in (prompts[3][:2], prompts[3]):
            with torch.no_grad():
                ref = hf(torch.tensor([ids])).logits[0].double()
            table = list(range(-(-len(ids) // BLOCK)))
            err_c = (_runner(got).prompt_logits(ids, table).double() - ref).abs().mean().item()
            err_e = (_runner(want).prompt_logits(ids, table).double() - ref).abs().mean().item()
            assert 0 < err_c <= 1.25 * err_e, (quant, len(ids), err_c, err_e)


class _NoCompile:
    name = "npu"
    supports_compile = False


class _CompileByDefault:
    name = "fast"
    supports_compile = True
    compile_by_default = True


def test_should_compile_policy():
    cpu = CPUBackend()
    assert should_compile("auto", cpu, 10**12) is False  # measured slower on CPU: auto leaves it off there
    assert should_compile("auto", _CompileByDefault(), AUTO_MIN_PARAMETERS) is True
    assert should_compile("auto", _CompileByDefault(), AUTO_MIN_PARAMETERS - 1) is False
    assert should_compile("off", cpu, 10**12) is False
    assert should_compile("on", cpu, 1) is True
    assert should_compile("auto", _NoCompile(), 10**12) is False
    with pytest.raises(ValueError, match="not supported on the npu backend"):
        should_compile("on", _NoCompile(), 1)
    with pytest.raises(ValueError, match="compile="):
        should_compile("yes", cpu, 1)


def test_compile_option_is_validated(tiny_llama):
    with pytest.raises(ValueError, match="compile='always'"):
        LLM(str(tiny_llama), compile="always")


def test_a_failing_compile_falls_back_under_auto_and_raises_under_on(tiny_llama, monkeypatch):
    """No C++ compiler or an Inductor failure must not stop an `auto` engine; `on` must say what failed."""
    import infertune.runner.compiled as compiled_mod

    def broken_warm_up(self, run_step):
        raise OSError("no C++ compiler found")

    monkeypatch.setattr(compiled_mod.CompiledForward, "warm_up", broken_warm_up)
    monkeypatch.setattr(compiled_mod, "AUTO_MIN_PARAMETERS", 0)  # make the tiny model qualify for auto
    monkeypatch.setattr(CPUBackend, "compile_by_default", True)
    llm = LLM(str(tiny_llama), dtype="float32", compile="auto")
    assert _runner(llm).compiled is None and _runner(llm).compile_seconds is None
    out = llm.generate("hi", SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
    with pytest.raises(RuntimeError, match="compile='on': torch.compile failed .*no C\\+\\+ compiler"):
        LLM(str(tiny_llama), dtype="float32", compile="on")


def test_one_token_steps_run_eager_and_larger_ones_compiled(compiled, monkeypatch):
    """Batch-1 decode measured faster eager (see CompiledForward.min_tokens); everything of 2+ tokens is compiled."""
    runner = _runner(compiled)
    sizes = []
    real = type(runner.compiled).__call__

    def spy(self, input_ids, *a):
        sizes.append(input_ids.shape[0])
        return real(self, input_ids, *a)

    monkeypatch.setattr(type(runner.compiled), "__call__", spy)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    compiled.generate([{"prompt_token_ids": [3, 4, 5, 6]}], sp, use_tqdm=False)  # prefill 4, then 1-token decodes
    assert sizes == [4]
    compiled.generate([{"prompt_token_ids": [3, 4]}, {"prompt_token_ids": [7, 8, 9]}], sp, use_tqdm=False)
    assert sizes[1:] == [5, 2, 2]  # both prefills in one step, then decodes of 2 tokens


def test_compile_on_with_tensor_parallel_is_refused_before_any_rank_starts():
    """Said by the config, in the caller's process (it was raised inside each spawned rank, after an ERROR line)."""
    from infertune.config import EngineConfig

    with pytest.raises(ValueError, match="compile='on' does not run with tensor parallel yet"):
        EngineConfig.create(None, compile="on", tensor_parallel_size=2)
    assert EngineConfig.create(None, compile="auto", tensor_parallel_size=2).parallel.tensor_parallel_size == 2
