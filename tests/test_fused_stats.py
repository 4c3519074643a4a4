"""The fused step's counters belong to the engine that runs it (csrc/abi.h it_step_stats, pointed at by it_step.stats;
one per X86FusedDecoder): two engines in one process keep separate counts, and the library keeps none of its own.
The count it is checked against is taken independently, around the library's it_decode_layers call."""

from __future__ import annotations

import ctypes

import pytest
import torch

from infertune.kernels import cpu

pytestmark = pytest.mark.skipif(
    cpu.variant() not in ("avx512", "avx512-noamx", "avx2"), reason=f"no x86 fused step here: {cpu.describe()}"
)


class _CountingLib:
    """The decoder's library, with it_decode_layers counted (calls and the rows of each, read from the it_step it is
    handed) before it runs; every other entry point is the library's own."""

    def __init__(self, lib) -> None:
        self._lib, self.calls, self.rows = lib, 0, 0

    def __getattr__(self, name):
        return getattr(self._lib, name)

    def it_decode_layers(self, model, layers, step, x):
        self.calls += 1
        self.rows += ctypes.cast(step, ctypes.POINTER(cpu.ItStep)).contents.T
        return self._lib.it_decode_layers(model, layers, step, x)


def test_two_engines_in_one_process_count_apart(tmp_path):
    from conftest import make_checkpoint

    from infertune import LLM, SamplingParams

    model = make_checkpoint(
        tmp_path / "m", "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, dtype=torch.bfloat16
    )
    engines = [LLM(str(model), dtype="bfloat16", max_model_len=64, max_num_seqs=2) for _ in range(2)]
    fused = [llm.engine.executor.runner.fused for llm in engines]
    assert all(f is not None for f in fused), "the fused step did not build for the tiny bf16 Llama"
    assert fused[0].decoder.stats is not fused[1].decoder.stats
    counting = []
    for f in fused:
        counting.append(_CountingLib(f.decoder.lib))
        f.decoder.lib = counting[-1]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)

    engines[0].generate([{"prompt_token_ids": [5, 9, 17, 33]}, {"prompt_token_ids": [7, 8]}], params, use_tqdm=False)
    a, b = (f.step_timers() for f in fused)
    assert counting[0].calls >= 5 and counting[1].calls == 0
    assert (a["calls"], a["rows"]) == (counting[0].calls, counting[0].rows), (a, vars(counting[0]))
    assert all(a[k] >= 0 for k in cpu.FUSED_PARTS) and min(a["qkv"], a["attention"], a["down"]) > 0, a
    assert set(b) == set(cpu.FUSED_PARTS) | {"calls", "rows"} and not any(b.values()), b  # untouched

    engines[1].generate([{"prompt_token_ids": [11, 12, 13]}], params, use_tqdm=False)
    b = fused[1].step_timers(reset=True)
    assert (b["calls"], b["rows"]) == (counting[1].calls, counting[1].rows) and b["calls"] >= 5, b
    assert fused[0].step_timers() == a  # the first engine's counts did not move
    assert not any(fused[1].step_timers().values())  # reset zeroes that engine's only
    assert fused[0].step_timers(reset=True) == a and not any(fused[0].step_timers().values())


def test_a_step_without_stats_is_not_timed_and_writes_nothing():
    """it_step.stats = NULL (the default of a fresh ItStep): the step runs and no counter anywhere moves (there is no
    library-wide one to move); with stats, its calls and rows are the step's."""
    lib = cpu.library()
    hidden, heads, d, inter, bs, blocks = 64, 4, 16, 128, 4, 4
    g = torch.Generator().manual_seed(0)

    def w(*shape):
        return (torch.randn(*shape, generator=g) * 0.05).to(torch.bfloat16)

    norms = [torch.ones(hidden, dtype=torch.bfloat16) for _ in range(2)]
    weights = {"qkv": w(3 * hidden, hidden), "o": w(hidden, hidden), "gate_up": w(2 * inter, hidden)}
    weights["down"] = w(hidden, inter)
    cache = torch.zeros(2, blocks, bs, heads, d, dtype=torch.bfloat16)
    cos_sin = torch.cat([torch.ones(64, d // 2), torch.zeros(64, d // 2)], dim=1).contiguous()
    cmodel = cpu.ItModel(
        hidden=hidden,
        n_heads=heads,
        n_kv_heads=heads,
        head_dim=d,
        inter=inter,
        num_blocks=blocks,
        block_size=bs,
        cos_sin=cos_sin.data_ptr(),
        eps=1e-6,
        scale=d**-0.5,
        nthreads=1,
        n_layers=1,
    )
    layer = (cpu.ItLayer * 1)()
    layer[0].input_norm, layer[0].post_norm, layer[0].kv_cache = (
        norms[0].data_ptr(),
        norms[1].data_ptr(),
        cache.data_ptr(),
    )
    for name, t in weights.items():
        lin = getattr(layer[0], name)
        lin.kind, lin.w, (lin.N, lin.K) = int(cpu.WeightKind.BF16), t.data_ptr(), t.shape
    tables, lens = torch.tensor([[0]]), torch.tensor([1])
    positions, slots = torch.tensor([0]), torch.tensor([0])
    nbytes = lib.it_decode_workspace_bytes(ctypes.byref(cmodel), 1, blocks * bs)
    work = torch.empty(nbytes + 64, dtype=torch.uint8)
    step = cpu.ItStep(
        T=1,
        positions=positions.data_ptr(),
        slots=slots.data_ptr(),
        block_tables=tables.data_ptr(),
        context_lens=lens.data_ptr(),
        max_blocks=1,
        work=(work.data_ptr() + 63) // 64 * 64,
        work_bytes=nbytes,
    )
    outs, x0 = [], w(1, hidden)
    for stats in (None, cpu.ItStepStats()):
        step.stats = ctypes.addressof(stats) if stats is not None else None
        x = x0.clone()
        assert lib.it_decode_layers(ctypes.byref(cmodel), layer, ctypes.byref(step), x.data_ptr()) == 0
        outs.append(x)
        if stats is not None:
            got = cpu.fused_step_timers(stats)
            assert (got["calls"], got["rows"]) == (1, 1) and sum(stats.seconds) > 0, got
    assert not hasattr(lib, "it_fused_timers")  # (no process-wide counters left to read)
    assert torch.equal(outs[0], outs[1]) and not torch.equal(outs[0], x0)  # timing or not, the same step
