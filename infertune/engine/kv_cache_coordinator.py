"""KV cache coordinator: one block pool, one block table per layer group and sequence (vLLM's hybrid KV cache). Pure
Python.

The layers are grouped by the window they attend within (scheduler_output.KVCacheGroup: full attention, or a sliding
window W). A block id is one page of every group's cache at once (the runner gives the groups' layers the same
tensors, layer i of each group the i-th), so the pool and its free list are shared, and each group's table holds
its own ids. A full group keeps every block, as BlockManager does. A windowed group frees the blocks that fall
wholly out of its window as the sequence advances: a query at position p sees keys p - W + 1 .. p, so before a step
whose first new token sits at p = num_computed_tokens, the blocks below (p - W + 1) // block_size are never read
again; they go back to the pool (kept as a cached prefix where hashed) and their entries become NULL_BLOCK. A
sequence then holds at most ceil((W - 1 + chunk) / block) + 1 blocks of the group, W / block + 1 when it decodes.

Prefix caching: each group caches its own blocks under (group, chained hash). A hit of h blocks needs, in a full
group, the chain of all h; in a windowed group only the blocks the next query's window reaches,
(h * block - W + 1) // block .. h - 1, so a prefix whose early blocks were evicted still hits. The hit is the longest
h every group has.

KV compression (kv_compression.py): `plan(n)` says, per group, how many tokens of a prefill of n it keeps under the
engine's kv_compression; a sequence with its own (`Sequence.kv_compression`, a request's) is planned by that one over
the same groups, so each sequence frees blocks by its own press, and one whose press is "none" (or that its policy
leaves whole) caches and hits prefixes as without compression. A sequence its plan compresses is admitted without
prefix-cache hits and never registers a block (its KV is rewritten in place when the prefill ends, so it no longer
matches the token hashes); once the step that completes its prefill is done, `compress` gives back each group's
blocks past ceil(kept / block), and from then on the group holds num_computed_tokens - num_evicted[g] tokens' KV
(positions go on counting; slots are fewer).

The int4 tier (`int4_after`, an int8 cache; scheduler_output's INT4_LO / INT4_HI): before a step, `pack_int4` turns
each pair of a full group's oldest int8 entries whose tokens all lie int4_after or more behind the sequence's
computed ones into one int4 block: in place (the first block) where that block is private and unhashed, else into
a fresh block (the two stay valid for whoever else holds or caches them); the table keeps two entries for it, and
only the INT4_LO one holds the reference. A sequence's int4 entries are always a prefix of its table, so nothing
written or trimmed ever touches them. A sequence whose prefill a press is still to compress is not packed, nor one
still in its prefill (or a recompute's): the prompt's later chunks attend to int8 KV, whatever the chunk size.

Invariants (beside BlockManager's): a NULL_BLOCK entry only ever precedes a windowed group's first live block; a
hashed block is never written (a hit never covers the last token); every live entry holds one reference.
"""

from __future__ import annotations

from collections.abc import Sequence as Seq

from infertune.engine.block_manager import BlockManager
from infertune.engine.sequence import Sequence
from infertune.scheduler_output import (
    NULL_BLOCK,
    KVCacheGroup,
    entry_block,
    entry_kind,
    int4_entries_due,
    int4_entry,
)


class KVCacheCoordinator(BlockManager):
    """BlockManager's API over several layer groups; `windows[g]` is group g's window (None: full attention).

    get_computed_blocks answers one list per group (NULL_BLOCK before a windowed group's window), which
    allocate_slots adopts; chunk is the longest prefill chunk (the scheduler's max_num_batched_tokens)."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        windows: Seq[int | None],
        enable_prefix_caching: bool = True,
        chunk: int | None = None,
        plan=None,
        groups: tuple[KVCacheGroup, ...] | None = None,
        int4_after: int | None = None,
    ) -> None:
        """plan: the engine's KV compression plan (prefill length -> tokens kept per group, or None), or None
        without one; groups: the KV cache groups a sequence's own kv_compression is planned over; int4_after: the
        int4 tier's age (CacheConfig.kv_int4_after), None: off."""
        super().__init__(num_blocks, block_size, enable_prefix_caching)
        assert windows and all(w is None or w > 0 for w in windows)
        self.windows = tuple(windows)
        self.chunk = chunk
        self.plan = plan  # KV compression: prefill length -> tokens kept per group (None: whole), or no press
        self.groups = groups
        self._blocks_used = [0] * len(self.windows)  # per group, the blocks some sequence holds (for /metrics)
        self.int4_after = int4_after
        self.num_int4_packs = 0  # pairs of int8 blocks re-stored as int4 so far
        self._int4_used = [0] * len(self.windows)  # per group, the int4 blocks some sequence holds

    @property
    def blocks_used_by_group(self) -> list[int]:
        return list(self._blocks_used)

    @property
    def int4_blocks_by_group(self) -> list[int]:
        """Per group, the int4 blocks sequences hold (each holds two blocks' tokens)."""
        return list(self._int4_used)

    # ---- queries -------------------------------------------------------------------------------
    def max_blocks_per_seq(self, num_tokens: int, prompt_tokens: int | None = None) -> int:
        """The most blocks a sequence of num_tokens (prompt_tokens of them its prompt; None: all) holds at once, over
        the groups. With the int4 tier a full group's peak is the larger of its prompt at int8 (a prefill is never
        packed: pack_int4) and its last decode step's blocks, each pair of blocks wholly int4_after behind the end
        packed into one (the count only grows with the tokens, a block every other block past the age)."""
        chunk = self.chunk or num_tokens
        total = 0
        for w in self.windows:
            need = KVCacheGroup(w, ()).max_blocks(num_tokens, self.block_size, chunk)
            if w is None and self.int4_after is not None:
                need = min(need, self._int4_peak(num_tokens, num_tokens if prompt_tokens is None else prompt_tokens))
            total += need
        return total

    def _int4_peak(self, num_tokens: int, prompt_tokens: int) -> int:
        bs = self.block_size
        pairs = (max(0, num_tokens - self.int4_after) // bs) // 2
        end = -(-num_tokens // bs) - pairs + 1  # (+1: a pair can wait a step for the fresh block it is packed into)
        return max(-(-min(prompt_tokens + 1, num_tokens) // bs), end)

    def num_hit_tokens(self, computed_blocks: list[list[int]]) -> int:
        return len(computed_blocks[0]) * self.block_size

    def first_live_block(self, group: int, num_computed: int) -> int:
        """The first block of `group` that a query at position num_computed (or later) reads."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    def blocks_in_use(self, seq: Sequence) -> list[int]:
        """Per group, the blocks seq holds."""
        return [sum(b != NULL_BLOCK and entry_kind(b) != 2 for b in t) for t in self._tables(seq)]

    def _tables(self, seq: Sequence) -> list[list[int]]:
        while len(seq.block_tables) < len(self.windows):
            seq.block_tables.append([])
        return seq.block_tables

    def get_computed_blocks(self, seq: Sequence) -> list[list[int]]:
        """Per group, the cached blocks of seq's longest prefix hit that every group has (full blocks only, never the
        last token); a windowed group's list is NULL_BLOCK up to the hit's window. Changes nothing."""
        num_groups = len(self.windows)
        if not self.enable_prefix_caching or self._plan(seq) is not None:
            return [[] for _ in range(num_groups)]  # (a sequence to compress computes and owns all its KV)
        limit = (len(seq) - 1) // self.block_size
        chains: dict[int, list[int]] = {}
        for g, window in enumerate(self.windows):
            if window is None:  # the chain of every block from the first, as BlockManager follows it
                chain: list[int] = []
                for i in range(limit):
                    block_id = self._cached(g, seq, i)
                    if block_id is None or self.blocks[block_id].parent_block_id != (chain[-1] if chain else None):
                        break
                    chain.append(block_id)
                chains[g] = chain
                limit = len(chain)
        # Windowed groups: per block, its cached block (or None) and the run of linked cached blocks ending there.
        cached: dict[int, list[int | None]] = {}
        runs: dict[int, list[int]] = {}
        for g, window in enumerate(self.windows):
            if window is not None:
                cached[g], runs[g] = [], []
                for i in range(limit):
                    block_id = self._cached(g, seq, i)
                    linked = block_id is not None and i and cached[g][i - 1] is not None
                    if linked and self.blocks[block_id].parent_block_id not in (None, cached[g][i - 1]):
                        linked = False  # registered after another copy of the previous block: not this chain
                    cached[g].append(block_id)
                    runs[g].append(0 if block_id is None else (runs[g][i - 1] + 1 if linked else 1))
        hit = limit
        while hit > 0 and not all(
            hit - self.first_live_block(g, hit * self.block_size) <= runs[g][hit - 1] for g in runs
        ):
            hit -= 1
        out = []
        for g in range(num_groups):
            if g in chains:
                out.append(chains[g][:hit])
            else:
                first = self.first_live_block(g, hit * self.block_size)
                out.append([NULL_BLOCK] * first + cached[g][first:hit])
        return out

    def _plan(self, seq: Sequence) -> list[int] | None:
        """Per group, the tokens seq keeps once its prefill (all of its tokens now) is computed; None: all of them."""
        if seq.kv_compression is not None:  # its own press (a request's), over the engine's groups
            assert self.groups is not None, "a sequence's own kv_compression needs the coordinator's groups"
            return seq.kv_compression.plan(self.groups, len(seq))
        return self.plan(len(seq)) if self.plan is not None else None

    def _cached(self, group: int, seq: Sequence, i: int) -> int | None:
        """The block group caches for seq's i-th full block (its chained hash, double-checked on its tokens)."""
        block_id = self._hash_to_block.get((group, self._block_hash(seq, i)))
        if block_id is None or self.blocks[block_id].token_ids != self._block_tokens(seq, i):
            return None
        return block_id

    # ---- allocation ----------------------------------------------------------------------------
    def allocate_slots(self, seq: Sequence, num_tokens: int, computed_blocks: list[list[int]] = ()) -> bool:
        """Free each windowed group's blocks below its window, then grow every group's table (after adopting
        computed_blocks) to hold num_tokens. All or nothing, but for the freeing: those blocks are dead either way."""
        tables = self._tables(seq)
        computed = list(computed_blocks) or [[] for _ in self.windows]
        if seq.num_computed_tokens == 0 and not any(tables):  # admitted (again): its plan for this prefill
            seq.kv_kept, seq.num_evicted = self._plan(seq), None
        for g, window in enumerate(self.windows):
            if window is not None:
                self._free_below(g, tables[g], self.first_live_block(g, seq.num_computed_tokens))
        hits_in_free = sum(1 for hits in computed for b in hits if b != NULL_BLOCK and self.blocks[b].ref_count == 0)
        evicted = seq.num_evicted or [0] * len(self.windows)
        needed = [
            max(self.blocks_needed(num_tokens - e) - len(t) - len(c), 0) for t, c, e in zip(tables, computed, evicted)
        ]
        if sum(needed) > len(self._free) - hits_in_free:
            return False
        for g, (table, hits) in enumerate(zip(tables, computed)):  # every group's hits first: none is taken fresh
            for block_id in hits:
                if block_id != NULL_BLOCK:
                    block = self.blocks[block_id]
                    if block.ref_count == 0:
                        del self._free[block_id]
                        self._blocks_used[g] += 1
                    block.ref_count += 1
                table.append(block_id)
        for g, (table, n) in enumerate(zip(tables, needed)):
            for _ in range(n):
                table.append(self._take_free(g))
        return True

    def _take_free(self, group: int) -> int:
        """The next free block (uncached ones first), forgotten by the prefix cache and held once by `group`."""
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        self._forget(block)
        block.ref_count = 1
        self._blocks_used[group] += 1
        return block_id

    def _free_below(self, group: int, table: list[int], first: int) -> None:
        """Release table's blocks before index first (out of the window), in order: the oldest is evicted first."""
        for i in range(min(first, len(table))):
            if table[i] != NULL_BLOCK:
                self._release(group, table[i])
                table[i] = NULL_BLOCK

    def _release(self, group: int, block_id: int) -> None:
        block = self.blocks[block_id]
        assert block.ref_count > 0, f"double free of block {block_id}"
        block.ref_count -= 1
        if block.ref_count == 0:
            self._blocks_used[group] -= 1
            self._free[block_id] = None
            if block.hash is None:  # nothing worth keeping: reuse before cached blocks
                self._free.move_to_end(block_id, last=False)

    def free(self, seq: Sequence) -> None:
        for g, table in enumerate(self._tables(seq)):
            for entry in reversed(table):
                if entry != NULL_BLOCK and entry_kind(entry) != 2:  # (an int4 block's INT4_LO entry holds it)
                    self._release(g, entry_block(entry))
                    self._int4_used[g] -= entry_kind(entry) == 1
        seq.block_tables = [[] for _ in self.windows]
        seq.num_hashed_blocks = 0
        seq.kv_kept = seq.num_evicted = seq.num_int4_entries = None

    def pack_int4(self, seq: Sequence) -> list[tuple[int, int, int, int, int]]:
        """The int4 tier, before a step: re-store each pair of seq's oldest int8 blocks (of a full group) whose tokens
        lie int4_after or more behind its computed ones as one int4 block. Returns (group, table index, first,
        second, dst) per pair, in order; seq's tables name dst already. A fresh dst comes from the free blocks, and
        where there is none the pair waits."""
        if self.int4_after is None or seq.num_computed_tokens < max(len(seq) - 1, 1):
            return []  # (only decoding: a prefill's, or a recompute's, later chunks attend to int8 KV alone, so the
            # first token does not depend on the chunk size or on prefix-cache hits; packs wait for the decode)
        if seq.kv_kept is not None and seq.num_evicted is None:  # a press still reads this prefill's KV
            return []
        tables = self._tables(seq)
        if seq.num_int4_entries is None:
            seq.num_int4_entries = [0] * len(tables)
        evicted = seq.num_evicted or [0] * len(tables)
        packs = []
        for g, table in enumerate(tables):
            if self.windows[g] is not None:
                continue  # (a window frees its old blocks instead)
            due = int4_entries_due(seq.num_computed_tokens - evicted[g], self.int4_after, self.block_size)
            i = seq.num_int4_entries[g]
            while i + 2 <= min(due, len(table)):
                first, second = table[i], table[i + 1]
                block = self.blocks[first]
                if block.ref_count == 1 and block.hash is None:
                    dst = first  # (private and unhashed: overwritten in place)
                    self._release(g, second)
                else:  # shared or cached: a fresh block, the two stay as they are for the others
                    if not self._free:
                        break
                    dst = self._take_free(g)
                    self._release(g, first)
                    self._release(g, second)
                table[i], table[i + 1] = int4_entry(dst, False), int4_entry(dst, True)
                self._int4_used[g] += 1
                packs.append((g, i, first, second, dst))
                i += 2
            seq.num_int4_entries[g] = i
        self.num_int4_packs += len(packs)
        return packs

    def compress(self, seq: Sequence) -> bool:
        """After the step that computed seq's prefill: the press kept seq.kv_kept[g] tokens of each group, so give
        back the blocks past those; True where a table got shorter (the workers cut theirs to it)."""
        if seq.kv_kept is None or seq.num_evicted is not None:
            return False
        n = seq.num_computed_tokens
        seq.num_evicted = [n - k for k in seq.kv_kept]
        shrunk = False
        for g, (table, kept) in enumerate(zip(self._tables(seq), seq.kv_kept)):
            keep = self.blocks_needed(kept)
            while len(table) > keep:
                block_id = table.pop()
                assert entry_kind(block_id) == 0, "a sequence is packed to int4 only once its press ran"
                assert self.blocks[block_id].hash is None, "a compressed sequence never registers a block"
                self._release(g, block_id)
                shrunk = True
        return shrunk

    def trim(self, seq: Sequence, num_tokens: int) -> int:
        keep = self.blocks_needed(num_tokens)
        freed = 0
        for g, table in enumerate(self._tables(seq)):
            while len(table) > keep:
                entry = table.pop()
                assert entry_kind(entry) == 0, "int4 entries hold computed tokens only, never trimmed"
                block = self.blocks[entry]
                assert block.ref_count == 1 and block.hash is None, "a trimmed block must be private and unhashed"
                self._release(g, block.block_id)
                freed += 1
        return freed

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register each group's blocks that became full of computed KV. A full group extends its cached chain only;
        a windowed group registers a block whose previous one it no longer holds too (a hit needs only the window)."""
        if not self.enable_prefix_caching or seq.kv_kept is not None:
            return
        end = seq.num_computed_tokens // self.block_size
        for g, table in enumerate(self._tables(seq)):
            for i in range(seq.num_hashed_blocks, end):
                if entry_kind(table[i]) or (i and entry_kind(table[i - 1])):
                    break  # (int4 blocks hold no token chain a prefix could hit, so nothing after them is cached)
                block = self.blocks[table[i]] if table[i] != NULL_BLOCK else None
                parent = table[i - 1] if i and table[i - 1] != NULL_BLOCK else None
                if parent is not None and self._hash_to_block.get((g, self._block_hash(seq, i - 1))) != parent:
                    if self.windows[g] is None:
                        break  # the previous block stayed private, so this prefix has no cached chain to extend
                    parent = None
                key = (g, self._block_hash(seq, i))
                if block is not None and block.hash is None and key not in self._hash_to_block:
                    block.hash, block.token_ids, block.parent_block_id = key, self._block_tokens(seq, i), parent
                    self._hash_to_block[key] = block.block_id
        seq.num_hashed_blocks = max(seq.num_hashed_blocks, end)


def kv_cache_manager(
    info, enable_prefix_caching: bool, chunk: int, kv_compression=None, int4_after: int | None = None
) -> BlockManager:
    """The engine's block manager for the runner's KV cache (runner.KVCacheInfo): BlockManager where every layer
    attends in full (one group, exactly as without windows) and there is neither KV compression nor the int4 tier,
    else a coordinator over the groups. With kv_compression (kv_compression.KVCompressionConfig, even one that
    compresses nothing, such as {"press": "none"}) requests may bring their own press, so the coordinator plans each
    sequence."""
    groups = info.groups or (KVCacheGroup(None, ()),)
    if len(groups) == 1 and groups[0].window is None and kv_compression is None and int4_after is None:
        return BlockManager(info.num_blocks, info.block_size, enable_prefix_caching)
    windows = [g.window for g in groups]
    compressed = kv_compression is not None and any(g.compressed for g in groups)
    plan = (lambda n: kv_compression.plan(groups, n)) if compressed else None
    own = tuple(groups) if kv_compression is not None else None
    return KVCacheCoordinator(
        info.num_blocks, info.block_size, windows, enable_prefix_caching, chunk, plan, own, int4_after
    )


def group_label(group: KVCacheGroup) -> str:
    """A KV cache group's name in /metrics and stats: full, window_W, or compressed_L (its first layer)."""
    if group.window is not None:
        return f"window_{group.window}"
    return f"compressed_{group.layers[0]}" if group.compressed else "full"


def describe_groups(info, max_model_len: int, chunk: int) -> list[str]:
    """Per kind of KV cache group (full attention, each window): its layers, and the most blocks, tokens and bytes
    of KV one sequence of max_model_len holds in it (prefill chunks of at most `chunk`): a windowed group's stay
    near window / block + 1 blocks however long the sequence. A kind cut into n equal groups (kv_cache_groups) holds
    its blocks in each, n times the blocks for its tokens."""
    pages = max(len(g.layers) for g in info.groups)
    kinds: dict[tuple, list] = {}
    for g in info.groups:
        kinds.setdefault((g.window, g.compressed, g.compressed and g.layers[0]), []).append(g)
    lines = []
    for (window, compressed, _), members in kinds.items():
        g = members[0]
        tokens = g.max_blocks(max_model_len, info.block_size, chunk) * info.block_size
        blocks = tokens // info.block_size * len(members)
        kind = "full attention" if window is None else f"sliding window {window}"
        if compressed:  # (its most: a prefill holds every token until the press runs)
            kind = "full attention, compressed after the prefill"
        layers = sorted(i for m in members for i in m.layers)
        nbytes = blocks * info.block_size * info.bytes_per_token
        split = f" in {len(members)} groups" if len(members) > 1 else ""
        lines.append(
            f"{kind} (layers {','.join(map(str, layers))}{split}): {blocks} blocks = {tokens} tokens a sequence "
            f"({nbytes / 2**10:.1f} KiB, {pages} layers' pages a block)"
        )
    return lines
