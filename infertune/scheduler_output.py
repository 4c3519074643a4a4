"""The plain-data contract between the engine and its workers: what one step schedules (vLLM v1's SchedulerOutput).

A request (one sequence) is sent whole once, the first step it is scheduled (`NewRequest`: its tokens, sampling
params, blocks); after that each step sends only what changed (`CachedRequest`: new block ids, computed count).
A worker keeps its own per-request state (runner/request_state.py), appends the tokens it samples itself, and
forgets the requests in `finished_req_ids` (finished, aborted or preempted; a preempted one comes back later as
a NewRequest with the tokens it had). Everything here is picklable plain data, so a worker can live in another
process. It sits at the bottom of the layering because the engine, the executors and the runner all read it.

KV cache groups (`KVCacheGroup`, vLLM's hybrid KV cache): the layers are grouped by the window they attend within
(full attention, or each sliding window), and each group has its own block table per request; the first group's
travels as `block_ids`, the others' as `group_block_ids`. A windowed group frees the blocks that fall wholly out of
its window (engine/kv_cache_coordinator.py); a worker is not told, as no query reads them again, so its copy keeps
their old ids, and an entry a new request never had is NULL_BLOCK (-1).

The int4 tier for old tokens (CacheConfig.kv_int4_after, an int8 cache): two full int8 blocks of a sequence's
oldest tokens are re-stored as one int4 block (`SchedulerOutput.kv_packs`), which takes the same bytes: each page
row's D bytes hold two tokens' nibbles, the first block's in the low nibbles, the second's in the high, and its 4
scale bytes their two fp16 scales. A table still has one entry per block_size tokens; an int4 block's two entries
are its id with INT4_LO and INT4_HI set (`int4_entry`), so a token's entry, and its slot (entry * block_size +
offset), say where and how it is stored. Only the INT4_LO entry holds the block's reference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infertune.sampling_params import SamplingParams

# A windowed group's block-table entry with no block (out of the window since before the worker was told of the
# request): a worker's tensors may hold any valid id there, as no query reads it.
NULL_BLOCK = -1

# An int4 block's two table entries: its id with one of these set (the bits above any block id).
INT4_SHIFT = 40
INT4_LO = 1 << INT4_SHIFT  # its tokens 0 .. block_size - 1: the pages' low nibbles
INT4_HI = 2 << INT4_SHIFT  # its tokens block_size .. 2 block_size - 1: the high nibbles
BLOCK_ID_MASK = INT4_LO - 1


def int4_entry(block_id: int, high: bool) -> int:
    """The table entry of one half of int4 block block_id."""
    return block_id | (INT4_HI if high else INT4_LO)


def int4_entries_due(held: int, age: int, block_size: int) -> int:
    """The leading table entries that should be int4 once `held` tokens are computed: whole pairs of blocks whose
    tokens all lie `age` or more behind the newest (the scheduler packs them before a step)."""
    return max(0, held - age) // block_size // 2 * 2


def entry_block(entry: int) -> int:
    """The block id a table entry reads (NULL_BLOCK stays itself)."""
    return entry if entry < 0 else entry & BLOCK_ID_MASK


def entry_kind(entry: int) -> int:
    """0: an int8 (or model dtype) block; 1: an int4 block's low half; 2: its high half."""
    return 0 if entry < 0 else entry >> INT4_SHIFT


@dataclass(slots=True, frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request: those attending within the same window (None: in full)."""

    window: int | None
    layers: tuple[int, ...]
    # KV compression (kv_compression.py) may drop tokens of these layers once a prefill is done; every layer of the
    # group keeps the same count (a group per budget).
    compressed: bool = False

    def max_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks a sequence of num_tokens holds at once in this group, with prefill chunks of at most
        `chunk` tokens: all of them in full attention; in a window W, those the positions from its chunk's first
        query's window on (W - 1 before the chunk) to the chunk's end can touch (W / block + 1 for a decode)."""
        need = -(-num_tokens // block_size)
        if self.window is None:
            return need
        return min(need, -(-(self.window - 2 + min(chunk, num_tokens)) // block_size) + 1)


# The most KV cache groups kv_cache_groups makes by splitting (the fused step reads this many: csrc/abi.h
# IT_MAX_KV_GROUPS, kernels/cpu.py MAX_KV_GROUPS); more kinds of layers than this are left as they are.
MAX_KV_CACHE_GROUPS = 8


def kv_cache_groups(
    layer_windows: tuple[int | None, ...] | None,
    num_layers: int,
    max_model_len: int,
    layer_keys: tuple | None = None,
    max_groups: int = MAX_KV_CACHE_GROUPS,
) -> tuple[KVCacheGroup, ...]:
    """The layers grouped by window, the full-attention group first, then each window in order of first use. A
    window of max_model_len or more never drops a token, so its layers join the full group. layer_keys (KV
    compression: KVCompressionConfig.layer_key per layer, None where never compressed) split the full layers further,
    one group per key, after the uncompressed ones.

    A block id is a page of every group's cache at once, so a block costs as many layers' pages as the largest
    group has layers. Where the kinds have unequal layer counts (Gemma 3: 5 windowed layers to 1 full), each kind's
    layers are then cut into groups of `equal_group_size` layers (vLLM's hybrid allocator does the same): Gemma 3
    1B's 22 windowed and 4 full layers become 6 windowed groups and 1 full one of 4 layers' pages a block, and a
    full-attention token costs 4 layers' pages instead of 22."""
    windows = [None if w is None or w >= max_model_len else w for w in (layer_windows or (None,) * num_layers)]
    keys = [None if w is not None or layer_keys is None else layer_keys[i] for i, w in enumerate(windows)]
    kinds = list(zip(windows, keys))
    order = sorted(set(kinds), key=lambda k: (k[0] is not None, k[1] is not None, kinds.index(k)))
    groups = [
        KVCacheGroup(w, tuple(i for i, x in enumerate(kinds) if x == (w, key)), key is not None) for w, key in order
    ]
    size = equal_group_size(groups, max_model_len, max_groups)
    return tuple(
        KVCacheGroup(g.window, g.layers[i : i + size], g.compressed)
        for g in groups
        for i in range(0, len(g.layers), size)
    )


def equal_group_size(groups, max_model_len: int, max_groups: int = MAX_KV_CACHE_GROUPS) -> int:
    """The layers a KV cache group holds once the kinds (windows, compression keys) are cut into equal groups: the
    size s whose groups hold the fewest layer pages for one sequence of max_model_len (each kind's ceil(n / s)
    groups of s pages a block, a full kind max_model_len tokens, a windowed one at most its window), with at most
    max_groups groups in all; of equal sizes the one with the fewest groups. One kind, or counts all equal: no cut."""
    sizes = [len(g.layers) for g in groups]
    if len(set(sizes)) <= 1:
        return max(sizes, default=1)
    tokens = [max_model_len if g.window is None else min(g.window, max_model_len) for g in groups]

    def cost(s: int) -> tuple[int, int]:
        parts = [-(-n // s) for n in sizes]
        return sum(p * s * t for p, t in zip(parts, tokens)), sum(parts)

    allowed = [s for s in range(1, max(sizes) + 1) if cost(s)[1] <= max(max_groups, len(groups))]
    return min(allowed, key=cost)


class TokenView:
    """Prompt / output views of `token_ids` (prompt first), for the engine's Sequence and a worker's RequestState."""

    __slots__ = ()
    token_ids: list[int]
    num_prompt_tokens: int

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


@dataclass(slots=True)
class NewRequest:
    req_id: str
    token_ids: list[int]  # prompt + the outputs it already has (non-empty after a preemption: recomputed)
    num_prompt_tokens: int
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hits)
    # The grammar its output must match (structured output), None if unconstrained. The worker builds a matcher
    # from it and advances it by the outputs already in token_ids (after a preemption) and by each token sampled.
    structured_output: GrammarSpec | None = None
    # The block tables of the KV cache groups after the first (block_ids), NULL_BLOCK where out of their window.
    group_block_ids: list[list[int]] = field(default_factory=list)
    # KV compression: per KV cache group, the tokens of KV it keeps once the prefill of token_ids is computed (the
    # worker evicts the others at the end of that step and the engine takes their blocks back); None: no press.
    kv_kept: list[int] | None = None
    # The press behind kv_kept where the request brought its own (its kv_compression.KVCompressionConfig, frozen plain
    # data); None: the engine's kv_compression.
    kv_compression: object = None


@dataclass(slots=True, frozen=True)
class GrammarSpec:
    """A compiled, validated structured-output grammar as plain data (docs/structured-output.md)."""

    key: str  # what it was compiled from (kind, options, schema text): the workers' cache key
    grammar: str  # the library's grammar (llguidance's serialized form), already validated by the engine
    eos_token_ids: tuple[int, ...]  # the tokens that end the output once the grammar accepts


@dataclass(slots=True)
class CachedRequest:
    req_id: str
    new_block_ids: list[int]  # appended to the worker's block table, after it is cut to num_kept_blocks
    num_computed_tokens: int
    # How many of the blocks sent before the request still holds: all of them, but where speculative decoding gave
    # back the blocks that only rejected drafts used.
    num_kept_blocks: int
    # The same two for each KV cache group after the first (new_block_ids and num_kept_blocks are the first's).
    group_new_block_ids: list[list[int]] = field(default_factory=list)
    group_num_kept_blocks: list[int] = field(default_factory=list)


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    # The step's requests in batch order with their new tokens; a worker answers one sampled token (or None) each.
    req_ids: list[str] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # forget these before running the step
    # Speculative decoding: req_id -> the draft tokens that follow its last token in this step (its scheduled tokens
    # are that token plus them); the worker answers the drafts it accepted and one token after them.
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    # A draft model (speculative method "draft_model"): req_id -> how many drafts its worker proposes, after this
    # step, for the next one (runner/draft_model.py); they come back in SamplerOutput.draft_token_ids.
    num_drafts_to_propose: dict[str, int] = field(default_factory=dict)
    # A KV connector's instructions to the workers this step (kv_transfer.base.KVConnectorMetadata, plain data; None:
    # nothing): the prompt KV each rank loads from a producer before the forward.
    kv_connector_metadata: object = None
    # The int4 tier (CacheConfig.kv_int4_after): (group, first, second, dst) per pair of int8 blocks of a KV cache
    # group re-stored as one int4 block dst (dst may be first), done before the step's forward; the requests' tables
    # already name dst (int4_entry) where they held first and second.
    kv_packs: list[tuple[int, int, int, int]] = field(default_factory=list)
