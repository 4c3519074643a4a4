"""Unit tests of BlockManager: all-or-nothing allocation, ref counting, and the chained-hash prefix cache."""

from __future__ import annotations

import pytest

from infertune.engine import block_manager as bm_module
from infertune.engine.block_manager import BlockManager
from infertune.engine.sequence import Sequence

BS = 4


def seq_of(tokens, max_tokens=4):
    return Sequence(list(tokens), max_tokens)


def compute(bm: BlockManager, seq: Sequence, num_tokens: int | None = None, hits=()) -> None:
    """Allocate for and 'compute' the first num_tokens tokens of seq (default: all), then cache full blocks."""
    num_tokens = len(seq) if num_tokens is None else num_tokens
    assert bm.allocate_slots(seq, num_tokens, list(hits))
    seq.num_computed_tokens = num_tokens
    bm.cache_full_blocks(seq)


def ref_counts(bm: BlockManager) -> list[int]:
    return [b.ref_count for b in bm.blocks]


def free_ids(bm: BlockManager) -> list[int]:
    return list(bm._free)


# ---- arithmetic and allocation ---------------------------------------------------------------------
@pytest.mark.parametrize(
    "num_tokens,expected", [(0, 0), (1, 1), (3, 1), (4, 1), (5, 2), (8, 2), (9, 3), (16, 4), (17, 5)]
)
def test_blocks_needed(num_tokens, expected):
    assert BlockManager(8, BS).blocks_needed(num_tokens) == expected


def test_blocks_needed_block_size_one_and_sixteen():
    assert BlockManager(4, 1).blocks_needed(7) == 7
    assert BlockManager(4, 16).blocks_needed(16) == 1
    assert BlockManager(4, 16).blocks_needed(17) == 2


def test_fresh_pool_is_all_free():
    bm = BlockManager(5, BS)
    assert bm.num_free_blocks == 5
    assert bm.usage == 0.0
    assert ref_counts(bm) == [0] * 5
    assert free_ids(bm) == [0, 1, 2, 3, 4]


def test_allocate_takes_lowest_free_blocks_in_order_and_grows():
    bm = BlockManager(6, BS)
    seq = seq_of(range(10))
    assert bm.allocate_slots(seq, 10)
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 3
    assert bm.usage == pytest.approx(0.5)
    # Growing within the last block allocates nothing; crossing a boundary takes the next free block.
    assert bm.allocate_slots(seq, 12)
    assert seq.block_table == [0, 1, 2]
    assert bm.allocate_slots(seq, 13)
    assert seq.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 2
    assert ref_counts(bm) == [1, 1, 1, 1, 0, 0]
    # Asking for fewer tokens than already held is a no-op success.
    assert bm.allocate_slots(seq, 1)
    assert seq.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 2


def test_failed_allocation_of_new_sequence_changes_nothing():
    bm = BlockManager(4, BS)
    a = seq_of(range(12))
    assert bm.allocate_slots(a, 12)
    assert a.block_table == [0, 1, 2]
    b = seq_of(range(8))
    assert not bm.allocate_slots(b, 8)  # needs 2, 1 free
    assert b.block_table == []
    assert bm.num_free_blocks == 1
    assert free_ids(bm) == [3]
    assert ref_counts(bm) == [1, 1, 1, 0]
    assert bm.allocate_slots(b, 4)  # exactly what is left
    assert b.block_table == [3]
    assert bm.num_free_blocks == 0


def test_failed_growth_changes_nothing():
    bm = BlockManager(4, BS)
    seq = seq_of(range(10))
    assert bm.allocate_slots(seq, 10)
    assert not bm.allocate_slots(seq, 17)  # needs 5 blocks in all: 2 more, 1 free
    assert seq.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 1
    assert ref_counts(bm) == [1, 1, 1, 0]
    assert bm.allocate_slots(seq, 16)
    assert seq.block_table == [0, 1, 2, 3]
    assert not bm.allocate_slots(seq, 17)
    assert seq.block_table == [0, 1, 2, 3]
    assert bm.num_free_blocks == 0


def test_failed_allocation_with_cached_hits_adopts_nothing():
    bm = BlockManager(4, BS)
    a = seq_of(list(range(8)) + [99])
    compute(bm, a)
    bm.free(a)
    b = seq_of(list(range(8)) + list(range(100, 110)))  # 18 tokens -> 5 blocks, 2 of them hits
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]
    assert not bm.allocate_slots(b, len(b), hits)  # 3 fresh needed, only 2 free besides the hits
    assert b.block_table == []
    assert bm.num_free_blocks == 4
    assert ref_counts(bm) == [0, 0, 0, 0]
    # The cached blocks are still there for a request that fits.
    c = seq_of(list(range(8)) + [5])
    assert bm.get_computed_blocks(c) == [0, 1]


def test_free_returns_every_block():
    bm = BlockManager(8, BS)
    a, b = seq_of(range(9)), seq_of(range(50, 55))
    assert bm.allocate_slots(a, 9)
    assert bm.allocate_slots(b, 5)
    assert bm.num_free_blocks == 3
    bm.free(a)
    assert a.block_table == []
    assert a.num_hashed_blocks == 0
    assert bm.num_free_blocks == 6
    assert ref_counts(bm) == [0, 0, 0, 1, 1, 0, 0, 0]
    bm.free(b)
    assert bm.num_free_blocks == 8
    assert ref_counts(bm) == [0] * 8
    assert sorted(free_ids(bm)) == list(range(8))
    assert bm.usage == 0.0


def test_double_free_of_a_block_is_caught():
    bm = BlockManager(4, BS)
    a = seq_of(range(5))
    assert bm.allocate_slots(a, 5)
    table = list(a.block_table)
    bm.free(a)
    a.block_table = table
    with pytest.raises(AssertionError):
        bm.free(a)


# ---- sharing -----------------------------------------------------------------------------------------
def test_ref_counting_of_shared_prefix_blocks():
    bm = BlockManager(8, BS)
    a = seq_of(list(range(8)) + [100])
    compute(bm, a)
    assert a.block_table == [0, 1, 2]
    b = seq_of(list(range(8)) + [200, 201])
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]
    assert bm.allocate_slots(b, len(b), hits)
    assert b.block_table == [0, 1, 3]
    assert ref_counts(bm)[:4] == [2, 2, 1, 1]
    assert bm.num_free_blocks == 4
    bm.free(a)
    assert ref_counts(bm)[:4] == [1, 1, 0, 1]
    assert bm.num_free_blocks == 5
    assert 0 not in bm._free and 1 not in bm._free
    bm.free(b)
    assert ref_counts(bm) == [0] * 8
    assert bm.num_free_blocks == 8


# ---- prefix cache ------------------------------------------------------------------------------------
def test_prefix_hit_returns_the_first_sequences_blocks():
    bm = BlockManager(8, BS)
    a = seq_of(list(range(12)) + [7])  # 3 full blocks + 1 token
    assert bm.get_computed_blocks(a) == []
    compute(bm, a)
    assert a.block_table == [0, 1, 2, 3]
    assert a.num_hashed_blocks == 3
    assert [bm.blocks[i].hash is not None for i in range(4)] == [True, True, True, False]
    assert bm.blocks[1].token_ids == (4, 5, 6, 7)
    # Same first 2 full blocks, different third block.
    b = seq_of(list(range(8)) + [40, 41, 42, 43, 44])
    assert bm.get_computed_blocks(b) == [0, 1]
    # Same 3 full blocks.
    c = seq_of(list(range(12)) + [8, 9])
    assert bm.get_computed_blocks(c) == [0, 1, 2]
    # get_computed_blocks changes nothing.
    assert ref_counts(bm)[:4] == [1, 1, 1, 1]
    assert bm.num_free_blocks == 4


def test_only_computed_full_blocks_are_cached():
    bm = BlockManager(8, BS)
    a = seq_of(list(range(12)) + [7])
    assert bm.allocate_slots(a, len(a))
    a.num_computed_tokens = 6  # chunked prefill: 1.5 blocks done
    bm.cache_full_blocks(a)
    assert a.num_hashed_blocks == 1
    b = seq_of(list(range(12)) + [8])
    assert bm.get_computed_blocks(b) == [0]
    a.num_computed_tokens = 12
    bm.cache_full_blocks(a)
    assert a.num_hashed_blocks == 3
    assert bm.get_computed_blocks(b) == [0, 1, 2]


def test_hit_never_covers_the_last_token():
    bm = BlockManager(8, BS)
    a = seq_of(list(range(8)) + [100])
    compute(bm, a)
    exact = seq_of(range(8))  # exactly 2 full blocks, both cached
    assert bm.get_computed_blocks(exact) == [0]
    one_more = seq_of(list(range(8)) + [3])
    assert bm.get_computed_blocks(one_more) == [0, 1]
    exact_one_block = seq_of(range(4))
    assert bm.get_computed_blocks(exact_one_block) == []


def test_hit_survives_free_until_evicted_tail_first():
    bm = BlockManager(4, BS)
    a = seq_of(list(range(8)) + [100])
    compute(bm, a)
    assert a.block_table == [0, 1, 2]
    bm.free(a)
    # The uncached tail block goes first, then the cached blocks, tail first (evicted first).
    assert free_ids(bm) == [2, 3, 1, 0]
    probe = seq_of(list(range(8)) + [5])
    assert bm.get_computed_blocks(probe) == [0, 1]

    # Fresh allocations use uncached blocks first: the cache survives.
    c = seq_of(range(200, 208))
    assert bm.allocate_slots(c, 8)
    assert c.block_table == [2, 3]
    assert bm.get_computed_blocks(probe) == [0, 1]

    # The next fresh block evicts block 1 (the cached tail), so only block 0 still hits.
    d = seq_of(range(300, 302))
    assert bm.allocate_slots(d, 2)
    assert d.block_table == [1]
    assert bm.blocks[1].hash is None
    assert bm.get_computed_blocks(probe) == [0]

    e = seq_of(range(400, 402))
    assert bm.allocate_slots(e, 2)
    assert e.block_table == [0]
    assert bm.get_computed_blocks(probe) == []
    assert bm._hash_to_block == {}


def test_hit_on_freed_cached_blocks_reuses_them():
    bm = BlockManager(4, BS)
    a = seq_of(list(range(8)) + [100])
    compute(bm, a)
    bm.free(a)
    assert bm.num_free_blocks == 4
    b = seq_of(list(range(8)) + [1, 2, 3])
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]
    assert bm.allocate_slots(b, len(b), hits)
    assert b.block_table == [0, 1, 2]  # 2 hits + the uncached block 2 (front of the free list)
    assert ref_counts(bm) == [1, 1, 1, 0]
    assert free_ids(bm) == [3]
    # The hit blocks keep their hashes (they are not evicted when adopted).
    assert bm.blocks[0].hash is not None and bm.blocks[1].hash is not None


def test_allocation_with_hits_counts_hits_in_free_list():
    bm = BlockManager(3, BS)
    a = seq_of(list(range(8)) + [100])
    compute(bm, a)
    bm.free(a)
    # 3 blocks needed: 2 hits (both in the free list) + 1 fresh: fits in 3.
    b = seq_of(list(range(8)) + [7, 7, 7, 7])
    hits = bm.get_computed_blocks(b)
    assert hits == [0, 1]
    assert bm.allocate_slots(b, len(b), hits)
    assert b.block_table == [0, 1, 2]
    assert bm.num_free_blocks == 0


def test_hash_chain_same_block_after_different_prefix_is_not_a_hit():
    bm = BlockManager(8, BS)
    a = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a)
    assert bm.get_computed_blocks(seq_of([0, 0, 0, 0, 5, 6, 7, 8, 9])) == []
    assert bm.get_computed_blocks(seq_of([1, 2, 3, 4, 0, 0, 0, 0, 9])) == [0]
    # The second block's tokens in first position are not a hit either.
    assert bm.get_computed_blocks(seq_of([5, 6, 7, 8, 9])) == []


def test_hash_collision_is_verified_against_stored_tokens(monkeypatch):
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: 12345)
    bm = BlockManager(8, BS)
    a = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a)
    # Every block hashes to the same value: only the first one is registered, the second stays private.
    assert bm._hash_to_block == {12345: 0}
    assert bm.blocks[0].hash == 12345
    assert bm.blocks[1].hash is None
    # A different prefix colliding with the cached block is not a hit.
    assert bm.get_computed_blocks(seq_of([9, 9, 9, 9, 5, 6, 7, 8, 9])) == []
    assert bm.get_computed_blocks(seq_of([1, 2, 3, 5, 9])) == []
    # The true prefix still hits its (verified) first block; the colliding second block is rejected
    # because its parent hash differs from the cached block's (None for a first block).
    assert bm.get_computed_blocks(seq_of([1, 2, 3, 4, 1, 2, 3, 4, 9])) == [0]
    assert bm.get_computed_blocks(seq_of([1, 2, 3, 4, 5, 6, 7, 8, 0])) == [0]


def test_hash_collision_ignoring_parent_is_caught_by_parent_check(monkeypatch):
    # A hash that ignores the chain: block (5,6,7,8) hashes the same in first and second position.
    monkeypatch.setattr(bm_module, "chain_hash", lambda parent, tokens: hash(("x", tokens)))
    bm = BlockManager(8, BS)
    a = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(bm, a)
    assert len(bm._hash_to_block) == 2
    assert bm.get_computed_blocks(seq_of([5, 6, 7, 8, 9])) == []
    assert bm.get_computed_blocks(seq_of([0, 0, 0, 0, 5, 6, 7, 8, 9])) == []
    assert bm.get_computed_blocks(seq_of([1, 2, 3, 4, 5, 6, 7, 8, 0])) == [0, 1]


def test_concurrent_compute_of_same_prefix_keeps_first_block_and_second_private():
    bm = BlockManager(8, BS)
    a = seq_of(list(range(8)) + [1])
    b = seq_of(list(range(8)) + [2])
    assert bm.allocate_slots(a, len(a))
    assert bm.allocate_slots(b, len(b))
    assert a.block_table == [0, 1, 2] and b.block_table == [3, 4, 5]
    a.num_computed_tokens = b.num_computed_tokens = 9
    bm.cache_full_blocks(a)
    bm.cache_full_blocks(b)
    assert bm.blocks[3].hash is None and bm.blocks[4].hash is None
    assert bm.get_computed_blocks(seq_of(list(range(8)) + [3])) == [0, 1]
    bm.free(a)
    bm.free(b)
    assert bm.num_free_blocks == 8
    # Private (uncached) blocks are reused first.
    assert free_ids(bm) == [3, 4, 5, 2, 6, 7, 1, 0]


def test_prefix_hit_rate_accounting():
    bm = BlockManager(8, BS)
    assert bm.prefix_hit_rate == 0.0
    bm.record_prefix_lookup(10, 4)
    assert (bm.prefix_queries, bm.prefix_hits) == (10, 4)
    assert bm.prefix_hit_rate == pytest.approx(0.4)
    bm.record_prefix_lookup(10, 0)
    assert (bm.prefix_queries, bm.prefix_hits) == (20, 4)
    assert bm.prefix_hit_rate == pytest.approx(0.2)
    bm.record_prefix_lookup(20, 16)
    assert bm.prefix_hit_rate == pytest.approx(0.5)


def test_prefix_caching_disabled_gives_no_hits():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    a = seq_of(list(range(12)) + [1])
    compute(bm, a)
    assert a.num_hashed_blocks == 0
    assert all(b.hash is None for b in bm.blocks)
    assert bm._hash_to_block == {}
    assert bm.get_computed_blocks(seq_of(list(range(12)) + [1])) == []
    bm.free(a)
    assert bm.get_computed_blocks(seq_of(list(range(12)) + [1])) == []
    assert bm.num_free_blocks == 8


def test_reset_prefix_cache_drops_only_free_cached_blocks():
    bm = BlockManager(8, BS)
    a = seq_of(list(range(8)) + [1])
    compute(bm, a)
    b = seq_of(list(range(100, 108)) + [1])
    compute(bm, b)
    bm.free(b)
    bm.reset_prefix_cache()
    assert bm.get_computed_blocks(seq_of(list(range(100, 108)) + [2])) == []
    assert bm.get_computed_blocks(seq_of(list(range(8)) + [2])) == [0, 1]


def test_hash_collision_in_parent_does_not_make_a_child_block_hit(monkeypatch):
    real = bm_module.chain_hash

    def colliding(parent, tokens):  # only the first blocks (1,2,3,4) and (9,9,9,9) collide
        if parent is None and tokens in ((1, 2, 3, 4), (9, 9, 9, 9)):
            return 777
        return real(parent, tokens)

    monkeypatch.setattr(bm_module, "chain_hash", colliding)
    bm = BlockManager(8, BS)
    s1 = seq_of([1, 2, 3, 4, 0])
    compute(bm, s1)
    assert s1.block_table == [0, 1] and bm.blocks[0].hash == 777
    s2 = seq_of([9, 9, 9, 9, 5, 6, 7, 8, 0])
    assert bm.get_computed_blocks(s2) == []  # the collision itself is caught
    compute(bm, s2)
    assert s2.block_table == [2, 3, 4]
    assert bm.blocks[2].hash is None  # the colliding first block stays private
    # Block 3 holds KV of (5,6,7,8) computed after (9,9,9,9): it must not serve a (1,2,3,4) prefix.
    s3 = seq_of([1, 2, 3, 4, 5, 6, 7, 8, 0])
    assert bm.get_computed_blocks(s3) == [0]


def test_private_duplicate_keeps_growing_without_registering_children():
    """Two sequences compute the same first block at once: the second's copy stays private, and as it keeps
    growing over several steps, none of its later blocks is registered (their chain has no cached parent)."""
    bm = BlockManager(16, 4)
    a, b = seq_of([1, 2, 3, 4, 5]), seq_of([1, 2, 3, 4, 6])
    assert bm.allocate_slots(a, 5) and bm.allocate_slots(b, 5)
    for s in (a, b):
        s.num_computed_tokens = 5
        bm.cache_full_blocks(s)
    assert bm.get_computed_blocks(seq_of([1, 2, 3, 4, 9])) == [a.block_table[0]]
    for step in range(10):  # b decodes token by token, crossing two more block boundaries
        b.append_token(10 + step)
        assert bm.allocate_slots(b, len(b))
        b.num_computed_tokens = len(b)
        bm.cache_full_blocks(b)
    assert all(bm.blocks[i].hash is None for i in b.block_table)
    assert bm.get_computed_blocks(seq_of(b.token_ids + [0])) == [a.block_table[0]]
