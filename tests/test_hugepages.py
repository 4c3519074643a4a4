"""Packed weights and the KV cache on 2 MB pages (kernels/hugepages.py): the memory behaves as torch's, comes from
advised mappings that Linux backs with 2 MB pages (read back from /proc/self/smaps here, independently of the
module's own report), is unmapped with the last tensor over it, and INFERTUNE_HUGEPAGES=0 turns it all off."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from infertune.kernels import hugepages

PAGE = 2 << 20
needs_thp = pytest.mark.skipif(
    hugepages.mode() not in ("always", "madvise"),
    reason=f"transparent huge pages are {hugepages.mode()} here: empty() / zeros() are torch's",
)


def vma_of(address: int) -> dict[str, int]:
    """The /proc/self/smaps entry (start, end, AnonHugePages bytes, Rss bytes) of the mapping holding an address."""
    entry = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            entry = dict(start=lo, end=hi) if lo <= address < hi else None
        elif entry is not None and head in ("AnonHugePages:", "Rss:"):
            entry[head[:-1]] = int(line.split()[1]) * 1024
            if len(entry) == 4:
                return entry
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.fixture
def thp_off(monkeypatch):
    monkeypatch.setenv("INFERTUNE_HUGEPAGES", "0")
    hugepages.mode.cache_clear()
    yield
    monkeypatch.delenv("INFERTUNE_HUGEPAGES")
    hugepages.mode.cache_clear()


@needs_thp
def test_empty_gives_aligned_writable_tensors_packed_side_by_side_and_large_ones_2mb_aligned():
    a = hugepages.empty((1000, 7), torch.bfloat16)
    b = hugepages.empty(4096, torch.int32)
    big = hugepages.empty((3, 5 << 20), torch.uint8)  # (15 MiB: a mapping of its own)
    for t, shape, dtype in (
        (a, (1000, 7), torch.bfloat16),
        (b, (4096,), torch.int32),
        (big, (3, 5 << 20), torch.uint8),
    ):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous() and t.data_ptr() % 64 == 0
    # small ones from one chunk, one after the other (64-byte steps); a large one 2 MB-aligned
    assert b.data_ptr() == a.data_ptr() + (1000 * 7 * 2 + 63) // 64 * 64
    assert big.data_ptr() % PAGE == 0
    # they hold what is written, independently
    a.copy_(torch.arange(7000, dtype=torch.float32).view(1000, 7).to(torch.bfloat16))
    b.copy_(torch.arange(4096, dtype=torch.int32) * -3)
    big.fill_(7)
    assert torch.equal(a.float().view(-1)[:256], torch.arange(256, dtype=torch.float32))
    assert torch.equal(b, torch.arange(4096, dtype=torch.int32) * -3)
    assert int(big.sum()) == 7 * 15 * 2**20


def placed_at(address: int) -> bool:
    return any(p.lo <= address < p.hi for p in hugepages._allocator.placed())


@needs_thp
def test_the_memory_is_on_2mb_pages_and_goes_with_its_last_tensor():
    big = hugepages.empty(16 << 20, torch.uint8)
    big.fill_(1)  # (touched after the advice: Linux backs it with 2 MB pages)
    vma = vma_of(big.data_ptr())
    assert vma["AnonHugePages"] >= 8 * PAGE, vma  # (16 MiB: at least half on 2 MB pages, whatever fragmentation)
    kv = hugepages.zeros((4, 1 << 20), torch.bfloat16)
    assert int(kv.count_nonzero()) == 0 and kv.data_ptr() % PAGE == 0
    assert vma_of(kv.data_ptr())["Rss"] >= 8 << 20  # resident from the start (the KV cache: allocated up front)
    rep = hugepages.report()
    assert rep.placed_bytes >= (16 << 20) + (8 << 20)
    assert (16 << 20) <= rep.huge_bytes <= rep.placed_bytes
    big_at, kv_at = big.data_ptr(), kv.data_ptr()
    view = big[: 1 << 20]  # a view keeps the mapping alive
    del big, kv
    gc.collect()
    assert placed_at(big_at) and not placed_at(kv_at)
    with pytest.raises(AssertionError, match="no mapping holds"):
        vma_of(kv_at)  # (unmapped, not only forgotten)
    del view
    gc.collect()
    assert not placed_at(big_at)


@needs_thp
def test_a_chunk_is_unmapped_once_every_tensor_carved_from_it_is_gone():
    ts = [hugepages.empty(100_000, torch.uint8) for _ in range(5)]
    for i in range(5):
        ts[i].fill_(i)
    rec = hugepages._allocator._chunk
    assert rec is not None and rec.mapping() is not None and rec.used >= 5 * 100_000
    assert [int(t[17]) for t in ts] == list(range(5))
    del ts[:4]
    gc.collect()
    assert rec.mapping() is not None  # (one tensor is left)
    ts.clear()
    gc.collect()
    assert rec.mapping() is None
    fresh = hugepages.empty(64, torch.uint8)  # a new chunk, not the dead one
    assert hugepages._allocator._chunk is not rec and fresh.data_ptr() % 64 == 0


def test_off_gives_torch_memory_and_says_so(thp_off):
    assert hugepages.mode() == "off" and not hugepages.enabled()
    before = hugepages.report()
    t = hugepages.empty(16 << 20, torch.uint8)
    z = hugepages.zeros((2, 1 << 20), torch.float32)
    assert int(z.count_nonzero()) == 0 and t.numel() == 16 << 20
    assert hugepages.report().placed_bytes == before.placed_bytes == 0
    assert "INFERTUNE_HUGEPAGES=0" in before.summary()


@needs_thp
def test_packed_weights_are_placed_and_unchanged():
    from infertune.kernels import cpu

    if not cpu.available():
        pytest.skip(f"the CPU kernels are unavailable: {cpu.unavailable_reason()}")
    before = hugepages.report().placed_bytes
    w = (torch.randn(192, 256) * 0.02).to(torch.bfloat16)
    if cpu.bf16c_supported(192, 256):
        packed = cpu.pack_bf16c(w)
        codes = packed["codes"]
        assert hugepages.report().placed_bytes >= before + codes.numel()
        assert torch.equal(cpu.unpack_bf16c(cpu.bf16c_struct(packed), 192, 256), w)  # (still the same weight)
    q = torch.randint(-127, 128, (192, 256), dtype=torch.int8)
    p8 = cpu.pack_w8a8(q)
    assert placed_at(p8.data_ptr())
    assert torch.equal(cpu.unpack_w8a8(p8, 192, 256), q)
    q4 = torch.randint(0, 16, (192, 256), dtype=torch.uint8)
    p4 = cpu.pack_w4(q4)
    assert placed_at(p4.data_ptr())
    assert torch.equal(cpu.unpack_w4(p4), q4)


@needs_thp
def test_the_engines_kv_cache_is_placed_and_its_greedy_tokens_are_the_same_off(tiny_llama, monkeypatch):
    from infertune import LLM, SamplingParams

    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 9, 13, 2, 7]}, {"prompt_token_ids": list(range(3, 40))}]
    llm = LLM(model=str(tiny_llama), kv_cache_memory_bytes=64 << 20)
    storage = llm.engine.executor.runner._kv_storage
    assert placed_at(storage.data_ptr())
    assert vma_of(storage.data_ptr())["AnonHugePages"] >= 16 * PAGE  # (64 MiB of cache)
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    del llm, storage
    gc.collect()
    monkeypatch.setenv("INFERTUNE_HUGEPAGES", "0")
    hugepages.mode.cache_clear()
    try:
        llm = LLM(model=str(tiny_llama), kv_cache_memory_bytes=64 << 20)
        storage = llm.engine.executor.runner._kv_storage
        assert not placed_at(storage.data_ptr())
        off = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    finally:
        monkeypatch.delenv("INFERTUNE_HUGEPAGES")
        hugepages.mode.cache_clear()
    assert on == off


@needs_thp
def test_packs_made_inside_transient_are_torch_memory_and_pin_no_chunk():
    """A pack that is copied elsewhere and dropped (each expert's, before the [E, ...] stack) must not come from a
    shared chunk: a long-lived tensor carved beside it would keep its pages resident."""
    from infertune.kernels import cpu

    if not cpu.available():
        pytest.skip(f"the CPU kernels are unavailable: {cpu.unavailable_reason()}")
    q = torch.randint(-127, 128, (192, 256), dtype=torch.int8)
    with hugepages.transient():
        with hugepages.transient():  # (nested blocks)
            inner = cpu.pack_w8a8(q)
        tmp = cpu.pack_w8a8(q)
    after = cpu.pack_w8a8(q)
    assert not placed_at(inner.data_ptr()) and not placed_at(tmp.data_ptr())
    assert placed_at(after.data_ptr())  # (outside the block: a chunk again)
    assert torch.equal(inner, after) and torch.equal(tmp, after)


@needs_thp
def test_quantized_moe_experts_are_stacked_on_their_own_2mb_pages(tmp_path):
    """A MoE model's W8A16 experts, quantized at load one expert at a time, end in [E, ...] stacks that every step
    streams: each of 2 MB or more in a mapping of its own on 2 MB pages (read from /proc/self/smaps)."""
    from conftest import make_checkpoint

    from infertune import LLM

    path = make_checkpoint(
        tmp_path / "moe", "qwen3_moe", hidden_size=256, intermediate_size=256, moe_intermediate_size=256,
        num_experts=32, num_experts_per_tok=2, num_hidden_layers=1, head_dim=64, std=0.05,
    )  # fmt: skip
    llm = LLM(model=str(path), quantization="w8a16", dtype="bfloat16")
    experts = llm.engine.executor.runner.model.model.layers[0].mlp.experts
    big = [t for name, t in experts.named_buffers() if t.nbytes >= PAGE]
    assert big, [(n, t.shape, t.dtype) for n, t in experts.named_buffers()]
    for t in big:
        assert placed_at(t.data_ptr()) and t.data_ptr() % PAGE == 0
        assert vma_of(t.data_ptr())["AnonHugePages"] >= PAGE
