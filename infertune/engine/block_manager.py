"""Ref-counted pool of KV-cache blocks with a chained-hash prefix cache over full blocks. Pure Python.

Invariants:
- a block is in `_free` iff its ref_count is 0; a free block may still hold a cached prefix (hash set),
  and is reused on a hit until a fresh allocation evicts it (least recently freed first);
- a block with a hash is never written again: only full blocks are hashed, and a hit never covers a
  sequence's last token, so the block that receives new KV is always private to its sequence.
"""

from __future__ import annotations

from collections import OrderedDict

from infertune.engine.sequence import Sequence


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "parent_block_id", "token_ids")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.parent_block_id: int | None = None  # the cached block holding the previous block of the prefix
        self.token_ids: tuple[int, ...] = ()


def chain_hash(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((parent_hash, token_ids))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        # Prefix-cache statistics, in tokens, over admissions.
        self.prefix_queries = 0
        self.prefix_hits = 0

    # ---- queries -------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    @property
    def blocks_used_by_group(self) -> list[int]:
        """Per KV cache group, the blocks some sequence holds: one group here."""
        return [self.num_blocks - len(self._free)]

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def max_blocks_per_seq(self, num_tokens: int, prompt_tokens: int | None = None) -> int:
        """The most blocks a sequence of num_tokens holds at once (the KV cache coordinator's differ by group and
        with the int4 tier, which reads prompt_tokens)."""
        return self.blocks_needed(num_tokens)

    def num_hit_tokens(self, computed_blocks: list[int]) -> int:
        """Tokens of KV that get_computed_blocks' answer covers."""
        return len(computed_blocks) * self.block_size

    def get_computed_blocks(self, seq: Sequence) -> list[int]:
        """Cached blocks holding a prefix of seq (full blocks only, never the last token). Changes nothing."""
        if not self.enable_prefix_caching:
            return []
        hits: list[int] = []
        for i in range((len(seq) - 1) // self.block_size):
            h = self._block_hash(seq, i)
            block_id = self._hash_to_block.get(h)
            if block_id is None:
                break
            block = self.blocks[block_id]
            parent = hits[-1] if hits else None
            if block.token_ids != self._block_tokens(seq, i) or block.parent_block_id != parent:
                break  # a hash collision: the cached block holds other tokens, or follows another prefix
            hits.append(block_id)
        return hits

    def _block_tokens(self, seq: Sequence, i: int) -> tuple[int, ...]:
        return tuple(seq.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def _block_hash(self, seq: Sequence, i: int) -> int:
        """Chained hash of seq's i-th full block; memoised on the sequence since full blocks never change."""
        while len(seq.block_hashes) <= i:
            j = len(seq.block_hashes)
            parent = seq.block_hashes[j - 1] if j else None
            seq.block_hashes.append(chain_hash(parent, self._block_tokens(seq, j)))
        return seq.block_hashes[i]

    # ---- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_tokens: int, computed_blocks: list[int] = ()) -> bool:
        """Grow seq.block_table (after adopting computed_blocks) to hold num_tokens. All or nothing."""
        hits_in_free = sum(1 for b in computed_blocks if self.blocks[b].ref_count == 0)
        needed = self.blocks_needed(num_tokens) - len(seq.block_table) - len(computed_blocks)
        if needed > len(self._free) - hits_in_free:
            return False
        for block_id in computed_blocks:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        for _ in range(max(needed, 0)):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            self._forget(block)
            block.ref_count = 1
            seq.block_table.append(block_id)
        return True

    def free(self, seq: Sequence) -> None:
        """Release seq's blocks. Tail blocks go first into the free list so they are evicted first."""
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            assert block.ref_count > 0, f"double free of block {block_id}"
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
                if block.hash is None:  # nothing worth keeping: reuse before cached blocks
                    self._free.move_to_end(block_id, last=False)
        seq.block_table = []
        seq.num_hashed_blocks = 0

    @property
    def int4_blocks_by_group(self) -> list[int]:
        """The int4 tier's blocks held (engine/kv_cache_coordinator.py); never any here."""
        return [0]

    num_int4_packs = 0

    def pack_int4(self, seq: Sequence) -> list[tuple[int, int, int, int, int]]:
        """The int4 tier's packing before a step (engine/kv_cache_coordinator.py); never here."""
        return []

    def compress(self, seq: Sequence) -> bool:
        """KV compression's block give-back after a prefill (engine/kv_cache_coordinator.py); never here."""
        return False

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        """Give back seq's blocks past those num_tokens need (speculative decoding: the blocks only rejected drafts
        used); returns how many. They hold no computed token of seq, so they are private and unhashed."""
        keep = self.blocks_needed(num_tokens)
        freed = 0
        while len(seq.block_table) > keep:
            block = self.blocks[seq.block_table.pop()]
            assert block.ref_count == 1 and block.hash is None, "a trimmed block must be private and unhashed"
            block.ref_count = 0
            self._free[block.block_id] = None
            self._free.move_to_end(block.block_id, last=False)  # nothing worth keeping: reuse it first
            freed += 1
        return freed

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that became full of computed KV, so later requests can share them."""
        if not self.enable_prefix_caching:
            return
        end = seq.num_computed_tokens // self.block_size
        for i in range(seq.num_hashed_blocks, end):
            block = self.blocks[seq.block_table[i]]
            parent = seq.block_table[i - 1] if i else None
            if parent is not None and self._hash_to_block.get(self._block_hash(seq, i - 1)) != parent:
                break  # the previous block stayed private, so this prefix has no cached chain to extend
            h = self._block_hash(seq, i)
            # A block already hashed came from a hit; a hash already mapped means another sequence
            # computed the same prefix concurrently (or collided): keep that one and leave this block private.
            if block.hash is None and h not in self._hash_to_block:
                block.hash, block.token_ids, block.parent_block_id = h, self._block_tokens(seq, i), parent
                self._hash_to_block[h] = block.block_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, end)

    def record_prefix_lookup(self, num_prompt_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_queries += num_prompt_tokens
        self.prefix_hits += num_hit_tokens

    @property
    def prefix_hit_rate(self) -> float:
        return self.prefix_hits / self.prefix_queries if self.prefix_queries else 0.0

    def reset_prefix_cache(self) -> None:
        """Drop every cached prefix that no running sequence holds."""
        for block_id in self._free:
            self._forget(self.blocks[block_id])

    def _forget(self, block: Block) -> None:
        if block.hash is not None and self._hash_to_block.get(block.hash) == block.block_id:
            del self._hash_to_block[block.hash]
        block.hash, block.parent_block_id, block.token_ids = None, None, ()
