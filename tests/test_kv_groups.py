"""KV cache groups (engine/kv_cache_coordinator.py): a windowed group frees exactly the blocks wholly out of its
window, prefix hits on it need only the hit's last window, nothing leaks under any add / abort / finish / preempt
sequence (a hypothesis state machine), a one-group coordinator is BlockManager block for block, and end to end a
windowed model serves sequences many times its KV pool's full-attention length with HF transformers' tokens."""

from __future__ import annotations

import pickle

import pytest
import torch
from conftest import hf_model, make_checkpoint
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from parity_utils import assert_teacher_forced
from test_scheduler import SHARED, STOP, fake_token

from infertune import LLM, SamplingParams
from infertune.config import SchedulerConfig
from infertune.engine.block_manager import BlockManager
from infertune.engine.kv_cache_coordinator import KVCacheCoordinator
from infertune.engine.scheduler import ScheduledBatch, Scheduler
from infertune.engine.sequence import Sequence, SequenceStatus
from infertune.runner.request_state import RequestStates
from infertune.scheduler_output import NULL_BLOCK, KVCacheGroup, entry_block, entry_kind, kv_cache_groups

BS = 4


def computed(bm, seq: Sequence, num_tokens: int, hits=()) -> None:
    """Allocate for and 'compute' seq up to num_tokens, then offer its full blocks to the prefix cache."""
    assert bm.allocate_slots(seq, num_tokens, list(hits))
    seq.num_computed_tokens = num_tokens
    bm.cache_full_blocks(seq)


# ---------------------------------------------------------------------------------------------------- unit tests
def test_groups_follow_the_layers_windows():
    assert kv_cache_groups(None, 3, 64) == (KVCacheGroup(None, (0, 1, 2)),)
    assert kv_cache_groups((6, None, 6, None), 4, 64) == (KVCacheGroup(None, (1, 3)), KVCacheGroup(6, (0, 2)))
    # a window as long as the context never drops a token: those layers attend in full
    # (then 2 full layers to 1 windowed: cut into groups of one layer each, so a block is one layer's page)
    full = (KVCacheGroup(None, (0,)), KVCacheGroup(None, (2,)))
    assert kv_cache_groups((64, 8, None), 3, 64) == (*full, KVCacheGroup(8, (1,)))
    assert kv_cache_groups((64, 8, None), 3, 64, max_groups=2) == (KVCacheGroup(None, (0, 2)), KVCacheGroup(8, (1,)))


def _pages_a_sequence(groups, max_model_len):
    """Layer pages one sequence of max_model_len holds: each group's tokens (a window's at most its window) in
    blocks of the largest group's pages."""
    pages = max(len(g.layers) for g in groups)
    return sum(pages * (max_model_len if g.window is None else min(g.window, max_model_len)) for g in groups)


@pytest.mark.parametrize(
    "layers, every, window, max_len, sizes",
    [
        (26, 6, 512, 32768, [4, 4, 4, 4, 4, 4, 2]),  # Gemma 3 1B: layers 5, 11, 17, 23 full, 22 windowed
        (34, 6, 1024, 131072, [5, 5, 5, 5, 5, 5, 4]),  # Gemma 3 4B
        (62, 6, 1024, 131072, [10, 10, 10, 10, 10, 10, 2]),  # Gemma 3 27B: 7 groups, the fused step reads 8
        (8, 2, 4096, 8192, [4, 4]),  # Gemma 2: 1 : 1, no cut
    ],
)
def test_unequal_kinds_are_cut_into_equal_groups(layers, every, window, max_len, sizes):
    """Oracle: every partition of the kinds into equal groups of s layers (s = 1 .. the largest kind, at most 8
    groups), priced by brute force as the layer pages one sequence of max_model_len holds; the engine's grouping is
    the cheapest, covers every layer once, and keeps each group to one kind."""
    windows = tuple(None if i % every == every - 1 else window for i in range(layers))
    groups = kv_cache_groups(windows, layers, max_len)
    assert [len(g.layers) for g in groups] == sizes
    assert sorted(i for g in groups for i in g.layers) == list(range(layers))
    assert all(windows[i] == g.window for g in groups for i in g.layers)
    kinds = [[i for i in range(layers) if windows[i] is None], [i for i in range(layers) if windows[i] is not None]]
    prices = []
    for s in range(1, max(len(k) for k in kinds) + 1):
        cut = [KVCacheGroup(w, tuple(k[j : j + s])) for k, w in zip(kinds, (None, window)) for j in range(0, len(k), s)]
        if len(cut) <= 8:
            prices.append(_pages_a_sequence(cut, max_len))
    assert _pages_a_sequence(groups, max_len) == min(prices)
    # Gemma 3 1B: a full-attention token cost 22 layers' pages with one group a kind, now 4
    uncut = kv_cache_groups(windows, layers, max_len, max_groups=1)
    assert len(uncut) == 2 and _pages_a_sequence(groups, max_len) <= _pages_a_sequence(uncut, max_len)


@pytest.mark.parametrize("window", [1, 3, 4, 6, 8, 9])
def test_decoding_frees_exactly_the_blocks_out_of_the_window(window):
    """Token by token to 60: before each step the blocks below (p - W + 1) // 4 are NULL and back in the pool, the
    rest live; a decode holds the ceil((W - 1) / 4) + 1 blocks its W positions can touch (W / 4 + 1 when 4 divides
    W), and KVCacheGroup.max_blocks says so."""
    bm = KVCacheCoordinator(32, BS, [window])
    seq = Sequence(list(range(5)), 60)
    computed(bm, seq, 5)
    held = []
    for p in range(5, 60):
        seq.append_token(p)
        assert bm.allocate_slots(seq, p + 1)
        (table,) = seq.block_tables
        first = max(0, p - window + 1) // BS  # the block of the oldest key position p sees
        assert table[:first] == [NULL_BLOCK] * first
        assert NULL_BLOCK not in table[first:] and len(table) == -(-(p + 1) // BS)
        assert bm.num_free_blocks == 32 - (len(table) - first)
        held.append(len(table) - first)
        seq.num_computed_tokens = p + 1
        bm.cache_full_blocks(seq)
    assert max(held) == -(-(window - 1) // BS) + 1 == KVCacheGroup(window, ()).max_blocks(60, BS, 1)
    if window % BS == 0:
        assert max(held) == window // BS + 1
    bm.free(seq)
    assert bm.num_free_blocks == 32 and all(b.ref_count == 0 for b in bm.blocks)


def test_full_group_keeps_every_block_beside_a_windowed_one():
    bm = KVCacheCoordinator(40, BS, [None, 6])
    seq = Sequence(list(range(30)), 8)
    computed(bm, seq, 10)
    assert bm.allocate_slots(seq, 30)  # a chunk of 20 after 10: frees the windowed blocks below (10 - 5) // 4 = 1
    full, win = seq.block_tables
    assert len(full) == 8 and NULL_BLOCK not in full
    assert win[:1] == [NULL_BLOCK] and NULL_BLOCK not in win[1:] and len(win) == 8
    assert bm.blocks_in_use(seq) == [8, 7]
    assert set(full).isdisjoint(b for b in win if b != NULL_BLOCK)


def test_prefix_hit_on_a_windowed_group_needs_only_its_last_window():
    """A 20-token prefix cached by a windowed group (W = 6), its early blocks freed as it advanced: a 21-token prompt
    with it hits 5 blocks and adopts only blocks 3 and 4 (the window of position 20 starts at 15), so the hit holds
    with every other block evicted; a full group beside the window needs its whole chain."""
    bm = KVCacheCoordinator(7, BS, [6])
    a = Sequence(list(range(20)), 4)
    for n in range(4, 21, 4):  # chunks of 4: a's early blocks leave the window (and the table) as it advances
        computed(bm, a, n)
    cached = list(a.block_tables[0])
    assert cached[:2] == [NULL_BLOCK] * 2 and NULL_BLOCK not in cached[2:]  # the window of 16 starts at 11
    bm.free(a)
    for block in bm.blocks:
        if block.block_id not in cached[3:]:
            bm._forget(block)  # evicted
    b = Sequence(list(range(20)) + [99], 4)
    hits = bm.get_computed_blocks(b)
    assert hits == [[NULL_BLOCK] * 3 + cached[3:]]
    assert bm.num_hit_tokens(hits) == 20
    computed(bm, b, 21, hits)
    assert b.block_tables[0][:5] == hits[0] and bm.blocks_in_use(b) == [3]
    bm._forget(bm.blocks[cached[3]])
    assert bm.get_computed_blocks(Sequence(list(range(20)) + [99], 4)) == [[]]  # 4 blocks' window needs block 2

    # Full + window: the full group's chain binds the hit; evicting the window's blocks shortens it.
    bm = KVCacheCoordinator(20, BS, [None, 6])
    a = Sequence(list(range(17)), 4)
    computed(bm, a, 17)
    full_a, win_a = (list(t) for t in a.block_tables)
    bm.free(a)
    hits = bm.get_computed_blocks(Sequence(list(range(17)), 4))
    assert hits == [full_a[:4], [NULL_BLOCK, NULL_BLOCK, win_a[2], win_a[3]]]
    bm._forget(bm.blocks[win_a[3]])  # evicted: the windowed group only has the 3-block prefix's window now
    hits = bm.get_computed_blocks(Sequence(list(range(17)), 4))
    assert hits == [full_a[:3], [NULL_BLOCK, win_a[1], win_a[2]]]


def test_prefix_caching_off_and_trim():
    bm = KVCacheCoordinator(16, BS, [None, 6], enable_prefix_caching=False)
    seq = Sequence(list(range(9)), 8)
    computed(bm, seq, 9)
    bm.free(seq)
    assert bm.get_computed_blocks(Sequence(list(range(9)), 4)) == [[], []]
    seq = Sequence(list(range(9)), 8)
    computed(bm, seq, 9)
    assert bm.allocate_slots(seq, 17)  # room for drafts
    assert bm.trim(seq, 10) == 2 * 2  # both groups give back the drafts' two blocks
    assert [len(t) for t in seq.block_tables] == [3, 3]
    assert bm.num_free_blocks == 16 - 3 - 2  # the windowed group holds blocks 1 and 2 only


def test_one_sequence_fits_the_most_blocks_it_can_hold():
    bm = KVCacheCoordinator(16, BS, [None, 6], chunk=8)
    # full: ceil(64 / 4) = 16; window 6 with chunks of 8: the 5 + 8 positions touch at most ceil(12 / 4) + 1 = 4
    assert bm.max_blocks_per_seq(64) == 20
    assert BlockManager(16, BS).max_blocks_per_seq(64) == 16


# ------------------------------------------------------------------------------------------------ state machine
class CoordinatorMachine(RuleBasedStateMachine):
    """Random adds, steps (speculative drafts included), aborts mid-step and preemptions over a coordinator: the
    groups' tables, ref counts and free list agree, windowed groups free exactly what leaves the window, every
    computed in-window position holds its own prefix's KV, a worker fed the pickled SchedulerOutputs reads the same
    live blocks, and after draining nothing is held. With one full group a twin scheduler over BlockManager makes
    the very same tables. With the int4 tier (int4_after) the packs the workers are told to do are simulated on the
    KV (all read, then all written), and every position, int4 halves included, still holds its own prefix's KV; a
    sequence's int4 entries are a leading run of pairs, all int4_after or more behind its computed tokens."""

    @initialize(
        windows=st.sampled_from([(None,), (6,), (None, 6), (None, 3), (4, None, 9)]),
        num_blocks=st.integers(12, 32),
        max_num_seqs=st.integers(1, 5),
        budget=st.integers(1, 24),
        prefix=st.booleans(),
        spec=st.booleans(),
        int4_after=st.sampled_from([None, None, 0, 3, 8]),
    )
    def setup(self, windows, num_blocks, max_num_seqs, budget, prefix, spec, int4_after):
        self.windows = windows
        self.int4_after = int4_after
        speculative = {"method": "ngram", "num_speculative_tokens": 3} if spec else None
        cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, speculative_config=speculative)
        self.bm = KVCacheCoordinator(num_blocks, BS, windows, prefix, chunk=budget, int4_after=int4_after)
        self.sched = Scheduler(cfg, self.bm)
        # BlockManager's twin, run on the same requests: the one-group coordinator must match it exactly
        self.twin = None
        if windows == (None,) and int4_after is None:
            self.twin = Scheduler(cfg, BlockManager(num_blocks, BS, prefix))
        self.seqs: list[tuple[Sequence, Sequence | None]] = []
        self.kv: dict[int, dict[int, tuple[int, ...]]] = {}  # block -> slot -> the prefix whose KV is there
        self.worker = RequestStates()

    @rule(data=st.data())
    def add(self, data):
        max_tokens = data.draw(st.integers(1, 12), label="max_tokens")
        n = data.draw(st.integers(1, 40), label="prompt_len")
        if self.bm.max_blocks_per_seq(n + max_tokens - 1) > self.bm.num_blocks:
            return  # the engine refuses what the pool cannot hold
        prompt = (SHARED[: n - 2] + [n % 3, 4])[:n] if data.draw(st.booleans(), label="shared") else [n % 5] * n
        pair = []
        for sched in (self.sched, self.twin):
            if sched is not None:
                seq = Sequence(prompt, max_tokens)
                seq.stop_token_ids = frozenset({STOP})
                seq.spec_decode = True
                sched.add(seq)
            pair.append(seq if sched is not None else None)
        self.seqs.append(tuple(pair))

    def _step(self, abort=None):
        batch = self.sched.schedule()
        twin = self.twin.schedule() if self.twin is not None else None
        if twin is not None:
            assert [s.token_ids for s in twin.seqs] == [s.token_ids for s in batch.seqs]
            assert [s.block_table for s in twin.seqs] == [s.block_table for s in batch.seqs]
            assert list(self.twin.block_manager._free) == list(self.bm._free)
        out = pickle.loads(pickle.dumps(self.sched.scheduler_output(batch)))
        assert not out.kv_packs or self.int4_after is not None
        packed = {  # the workers' packs, before the step's KV is written: every pair read before any is written
            dst: {(half, off): self.kv[src][off] for half, src in ((1, first), (2, second)) for off in range(BS)}
            for _, first, second, dst in out.kv_packs
        }
        self.kv.update(packed)
        for seq, n, drafts in zip(batch.seqs, batch.num_scheduled_tokens, batch.draft_token_ids):
            tokens = seq.token_ids + drafts  # a draft's KV is written as if it were accepted
            for g, table in enumerate(seq.block_tables):
                first = self.bm.first_live_block(g, seq.num_computed_tokens)
                assert table[:first] == [NULL_BLOCK] * first, "a block out of the window is still held"
                assert NULL_BLOCK not in table[first:], "a block in the window was freed"
                assert len(table) * BS >= seq.num_computed_tokens + n
                for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):  # write the step's KV
                    assert entry_kind(table[pos // BS]) == 0, "a write into an int4 block"
                    block = self.bm.blocks[table[pos // BS]]
                    assert block.ref_count == 1 and block.hash is None, "a write into a shared or cached block"
                    self.kv.setdefault(block.block_id, {})[pos % BS] = tuple(tokens[: pos + 1])
        step = self.worker.begin_step(out)
        for (state, _, _), seq in zip(step, batch.seqs):
            for mine, theirs in zip(seq.block_tables, state.block_tables, strict=True):
                assert len(mine) == len(theirs)
                assert all(b == t for b, t in zip(mine, theirs) if b != NULL_BLOCK)
        if abort is not None and batch.seqs:
            victim = batch.seqs[abort % len(batch.seqs)]
            self.sched.finish(victim, SequenceStatus.FINISHED_ABORTED)
            if twin is not None:
                self.twin.finish(twin.seqs[abort % len(batch.seqs)], SequenceStatus.FINISHED_ABORTED)
        sampled = [fake_token(s) if f else None for s, f in zip(batch.seqs, batch.sample)]
        accepted = [len(d) // 2 for d in batch.draft_token_ids] if any(batch.draft_token_ids) else None
        self.worker.end_step(step, sampled, batch.draft_token_ids, accepted)
        self.sched.update(batch, sampled, accepted)
        if twin is not None:
            self.twin.update(twin, sampled, accepted)

    @rule()
    def step(self):
        self._step()

    @rule(i=st.integers(0, 100))
    def step_with_abort_mid_step(self, i):
        self._step(abort=i)

    @precondition(lambda self: any(not s.is_finished for s, _ in self.seqs))
    @rule(i=st.integers(0, 1000))
    def abort(self, i):
        live = [p for p in self.seqs if not p[0].is_finished]
        for sched, seq in zip((self.sched, self.twin), live[i % len(live)]):
            if sched is not None:
                sched.finish(seq, SequenceStatus.FINISHED_ABORTED)

    @precondition(lambda self: any(s.status is SequenceStatus.RUNNING for s, _ in self.seqs))
    @rule(i=st.integers(0, 1000))
    def preempt(self, i):
        for sched in (self.sched, self.twin):
            if sched is not None:
                sched.running.remove(victim := sched.running[i % len(sched.running)])
                sched._preempt(victim)

    @invariant()
    def blocks_consistent(self):
        counts = [0] * self.bm.num_blocks
        groups = range(len(self.windows))
        for s, _ in self.seqs:
            if s.is_finished or s.status is SequenceStatus.WAITING:
                assert all(t == [] for t in s.block_tables)
                continue
            for g, table in enumerate(s.block_tables):
                live = [b for b in table if b != NULL_BLOCK]
                assert table[: len(table) - len(live)] == [NULL_BLOCK] * (len(table) - len(live))  # NULLs lead
                assert len(live) <= KVCacheGroup(self.windows[g], ()).max_blocks(len(s) + 3, BS, len(s) + 3)
                kinds = [entry_kind(b) for b in live]
                n4 = kinds.count(1) + kinds.count(2)
                assert kinds[:n4] == [1, 2] * (n4 // 2), "int4 entries are a leading run of (low, high) pairs"
                assert all(entry_block(live[i]) == entry_block(live[i + 1]) for i in range(0, n4, 2))
                if n4:
                    assert self.int4_after is not None and self.windows[g] is None
                    assert n4 * BS <= s.num_computed_tokens - self.int4_after, "an int4 entry younger than the tier"
                for b in live:
                    if entry_kind(b) != 2:  # (an int4 block's low entry holds its reference)
                        counts[entry_block(b)] += 1
        assert [b.ref_count for b in self.bm.blocks] == counts
        assert set(self.bm._free) == {i for i, c in enumerate(counts) if c == 0}
        used = [
            len({entry_block(b) for s, _ in self.seqs for t in s.block_tables[g : g + 1] for b in t if b >= 0})
            for g in groups
        ]
        assert self.bm.blocks_used_by_group == used
        tables = [(g, t) for s, _ in self.seqs for g, t in enumerate(s.block_tables)]
        int4 = [sum(entry_kind(b) == 1 for h, t in tables if h == g for b in t) for g in groups]
        assert self.bm.int4_blocks_by_group == int4
        for key, b in self.bm._hash_to_block.items():
            assert self.bm.blocks[b].hash == key

    @invariant()
    def computed_kv_matches_tokens(self):
        for s in self.sched.running:
            for table in s.block_tables:
                for pos in range(s.num_computed_tokens):
                    entry = table[pos // BS]
                    if entry != NULL_BLOCK:
                        key = (entry_kind(entry), pos % BS) if entry_kind(entry) else pos % BS
                        assert self.kv.get(entry_block(entry), {}).get(key) == tuple(s.token_ids[: pos + 1])

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(3000):
            if not self.sched.has_unfinished():
                break
            self._step()
            self.blocks_consistent()
        else:
            raise AssertionError("the scheduler did not drain")
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        self.worker.begin_step(self.sched.scheduler_output(ScheduledBatch()))
        assert not self.worker.requests
        if self.twin is not None:
            assert not self.twin.has_unfinished()
            assert [s.token_ids for s, _ in self.seqs] == [t.token_ids for _, t in self.seqs]


CoordinatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCoordinatorMachine = CoordinatorMachine.TestCase


# -------------------------------------------------------------------------------------- end to end against HF
WINDOW = 8
MAX_LEN = 256


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    path = make_checkpoint(tmp_path_factory.mktemp("mistral-w8"), arch="mistral", std=0.2, sliding_window=WINDOW)
    return path, hf_model(path)


def test_a_long_sequence_holds_only_its_window(mistral):
    """One 150-token sequence (38 blocks in full attention) on a pool of 10 blocks, chunked prefill of 8 crossing the
    window's edge: HF's greedy tokens, and once decoding it holds W / 4 + 1 = 3 blocks, not context / 4."""
    path, hf = mistral
    # fp32: 2 layers x (K and V) x 2 KV heads x 16 x 4 bytes a token
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=BS,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=8,
        kv_cache_memory_bytes=2 * 2 * 2 * 16 * 4 * BS * 10,
    )
    engine = llm.engine
    assert engine.block_manager.num_blocks == 10
    prompt = torch.randint(0, hf.config.vocab_size, (30,), generator=torch.Generator().manual_seed(1)).tolist()
    engine.add_request(
        "r", {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    )
    held, outs = [], None
    while engine.has_unfinished_requests():
        for seq in engine.scheduler.running:
            held.append((len(seq), engine.block_manager.blocks_in_use(seq)[0]))
        outs = engine.step() or outs
    # (measured between steps: a sequence holds what its last step's window needed; once past the prompt's chunks)
    assert max(b for n, b in held if n > len(prompt) + 1) == WINDOW // BS + 1
    assert max(b for _, b in held) <= KVCacheGroup(WINDOW, ()).max_blocks(MAX_LEN, BS, 8) == 5
    assert engine.block_manager.num_free_blocks == 10
    tokens = [o for o in outs if o.finished][0].outputs[0].token_ids
    assert len(tokens) == 120
    assert_teacher_forced(hf, prompt, list(tokens))


def test_kv_per_sequence_follows_the_window_in_the_capacity_log(mistral):
    path, _ = mistral
    llm = LLM(str(path), dtype="float32", block_size=BS, max_model_len=MAX_LEN, max_num_batched_tokens=8)
    text = llm.engine.describe_kv_cache()
    # a 256-token sequence holds ceil((8 - 1 + 8 - 1) / 4) + 1 = 5 blocks of the window's group, not 64
    # fp32, 2 layers x 2 x 2 KV heads x 16 x 4 bytes = 512 bytes a token: 20 tokens are 10 KiB
    assert "sliding window 8 (layers 0,1): 5 blocks = 20 tokens a sequence (10.0 KiB, 2 layers' pages a block)" in text
    assert llm.engine.executor.kv_cache_info.max_blocks_per_seq == 5


def test_a_fresh_block_is_never_another_groups_hit():
    """Found by the state machine: with hits in both groups, fresh blocks are taken after every group adopted its
    hits, so a hit still in the free list is not handed out fresh too (once, one block sat in both tables)."""
    bm = KVCacheCoordinator(18, BS, (None, 6), True, chunk=19)
    sched = Scheduler(SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=19), bm)
    for prompt, max_tokens in [([1], 1)] * 11 + [([0] * 20, 3), ([1] * 21, 1)]:
        seq = Sequence(prompt, max_tokens)
        seq.stop_token_ids = frozenset({STOP})
        sched.add(seq)
    while sched.has_unfinished():
        batch = sched.schedule()
        for seq in sched.running:
            live = [b for t in seq.block_tables for b in t if b != NULL_BLOCK]
            assert len(live) == len(set(live)), seq.block_tables
        sched.update(batch, [fake_token(s) if f else None for s, f in zip(batch.seqs, batch.sample)])
    assert bm.num_free_blocks == 18


def test_plan_reports_each_layer_groups_kv():
    """infertune plan on a Gemma 2 shape (window 4096, alternating): per group its layers and the tokens a 32K
    sequence keeps, the windowed layers' capped at the window; the bytes add up to the plan's KV per sequence."""
    from infertune.plan import ModelSpec
    from infertune.plan.catalog import load_catalog
    from infertune.plan.planner import PlanRequest, make_plan
    from infertune.plan.render import render_text

    cfg = dict(architectures=["Gemma2ForCausalLM"], vocab_size=1000, hidden_size=256, intermediate_size=512)
    spec = ModelSpec.from_dict({**cfg, "num_hidden_layers": 4, "num_attention_heads": 4, "sliding_window": 4096})
    plan = make_plan(PlanRequest(spec, load_catalog()["h100"], input_len=32000, output_len=768))
    groups = plan["kv"]["groups"]
    assert [(g["window"], g["layers"], g["tokens_per_sequence"]) for g in groups] == [(None, 2, 32768), (4096, 2, 4096)]
    assert sum(g["bytes_per_sequence"] for g in groups) == plan["kv"]["bytes_per_sequence"]
    assert "KV groups   per 32768-token sequence: full attention: 2 layers x 32,768 tokens" in render_text(plan)


def test_speculative_decoding_gives_back_windowed_blocks(mistral):
    """n-gram drafts on a windowed model with chunks crossing the window and a 12-block pool: drafts are proposed
    (their KV slots allocated in the window's group), the rejected ones' blocks come back (nothing leaks), and the
    tokens are HF's."""
    path, hf = mistral
    llm = LLM(
        str(path),
        dtype="float32",
        block_size=BS,
        max_model_len=MAX_LEN,
        max_num_batched_tokens=8,
        kv_cache_memory_bytes=2 * 2 * 2 * 16 * 4 * BS * 12,
        speculative_config={"method": "ngram", "num_speculative_tokens": 3},
    )
    prompt = [5, 6, 7, 8, 9, 10, 11, 12] * 4  # repeats: the proposer finds drafts
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    tokens = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids
    stats = llm.engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert_teacher_forced(hf, prompt, list(tokens))


def test_the_cut_never_makes_more_groups_than_the_fused_step_reads():
    from infertune.kernels import cpu
    from infertune.scheduler_output import MAX_KV_CACHE_GROUPS

    assert MAX_KV_CACHE_GROUPS == cpu.MAX_KV_GROUPS
    # 1 full layer to 40 windowed: groups of one layer would be 41; the cut stops at 8 (a group of 6 layers' pages)
    groups = kv_cache_groups((None,) + (16,) * 40, 41, 4096)
    assert len(groups) <= MAX_KV_CACHE_GROUPS and max(len(g.layers) for g in groups) == 6
