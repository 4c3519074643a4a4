"""Unit and property-based tests of Scheduler + BlockManager, driven by a deterministic fake model."""

from __future__ import annotations

import pickle

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from infertune.config import SchedulerConfig
from infertune.engine.block_manager import BlockManager
from infertune.engine.scheduler import ScheduledBatch, Scheduler
from infertune.engine.sequence import Sequence, SequenceStatus
from infertune.runner.request_state import RequestStates

BS = 4


def make(num_blocks=64, block_size=BS, max_num_seqs=8, budget=16, chunked=True, prefix=True) -> Scheduler:
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, enable_chunked_prefill=chunked)
    return Scheduler(cfg, BlockManager(num_blocks, block_size, enable_prefix_caching=prefix))


def new_seq(prompt, max_tokens=4, stop=()):
    if isinstance(prompt, int):
        prompt = list(range(1, prompt + 1))
    seq = Sequence(list(prompt), max_tokens)
    seq.stop_token_ids = frozenset(stop)
    return seq


def default_token(seq: Sequence) -> int:
    return 1000 + seq.num_output_tokens


def step(sched: Scheduler, token_fn=default_token):
    """One engine step with a fake model; returns (batch, finished). Checks the budget every step."""
    batch = sched.schedule()
    assert batch.total_tokens <= sched.config.max_num_batched_tokens
    assert sum(batch.num_scheduled_tokens) == batch.total_tokens
    assert all(n > 0 for n in batch.num_scheduled_tokens)
    assert len(batch.seqs) <= sched.config.max_num_seqs
    sampled = [token_fn(seq) if s else None for seq, s in zip(batch.seqs, batch.sample)]
    finished = sched.update(batch, sampled)
    return batch, finished


def plan(batch: ScheduledBatch):
    """(request_id, num_tokens, sample) per scheduled sequence."""
    return [(s.request_id, n, f) for s, n, f in zip(batch.seqs, batch.num_scheduled_tokens, batch.sample)]


def run_to_end(sched: Scheduler, max_steps=1000, token_fn=default_token):
    steps = []
    for _ in range(max_steps):
        if not sched.has_unfinished():
            return steps
        steps.append(step(sched, token_fn))
    raise AssertionError("scheduler did not finish")


# ---- chunked prefill, budget, mixing -----------------------------------------------------------------
def test_chunked_prefill_exact_chunks_and_sample_flags():
    sched = make(budget=8)
    a = new_seq(20, max_tokens=3)
    a.request_id = "a"
    sched.add(a)
    plans = [plan(b) for b, _ in run_to_end(sched)]
    assert plans == [
        [("a", 8, False)],
        [("a", 8, False)],
        [("a", 4, True)],
        [("a", 1, True)],
        [("a", 1, True)],
    ]
    assert a.status is SequenceStatus.FINISHED_LENGTH
    assert a.output_token_ids == [1000, 1001, 1002]
    assert a.num_computed_tokens == 22  # the last sampled token is never computed
    assert sched.block_manager.num_free_blocks == 64


def test_chunk_progress_and_block_table_after_each_step():
    sched = make(budget=6)
    a = new_seq(13, max_tokens=2)
    sched.add(a)
    expected = [(6, 2, 13), (12, 3, 13), (13, 4, 14)]  # (num_computed, blocks, len) after each step
    for comp, blocks, length in expected:
        step(sched)
        assert (a.num_computed_tokens, len(a.block_table), len(a)) == (comp, blocks, length)
    step(sched)
    assert a.status is SequenceStatus.FINISHED_LENGTH
    assert a.block_table == []


def test_decode_and_prefill_mixed_in_one_step():
    sched = make(budget=8)
    a = new_seq(4, max_tokens=5)
    a.request_id = "a"
    sched.add(a)
    b1, _ = step(sched)
    assert plan(b1) == [("a", 4, True)]
    b = new_seq(list(range(50, 60)), max_tokens=2)
    b.request_id = "b"
    sched.add(b)
    b2, _ = step(sched)
    assert plan(b2) == [("a", 1, True), ("b", 7, False)]
    b3, _ = step(sched)
    assert plan(b3) == [("a", 1, True), ("b", 3, True)]
    b4, fin = step(sched)
    assert plan(b4) == [("a", 1, True), ("b", 1, True)]
    assert fin == [b]
    assert b.output_token_ids == [1000, 1001]


def test_budget_respected_with_many_sequences():
    sched = make(budget=10, max_num_seqs=16)
    seqs = [new_seq(list(range(i, i + 7)), max_tokens=3) for i in range(0, 70, 7)]
    for s in seqs:
        sched.add(s)
    steps = run_to_end(sched)
    totals = [b.total_tokens for b, _ in steps]
    assert all(t <= 10 for t in totals)
    assert sum(totals) == 10 * 7 + 10 * 2  # prompts + the 2 decodes per sequence (the 3rd token is sampled only)
    assert all(s.status is SequenceStatus.FINISHED_LENGTH and s.num_output_tokens == 3 for s in seqs)
    assert sched.block_manager.num_free_blocks == 64


def test_running_sequences_beyond_budget_wait_their_turn():
    sched = make(budget=2, max_num_seqs=8)
    seqs = [new_seq([10 + i], max_tokens=3) for i in range(3)]
    for i, s in enumerate(seqs):
        s.request_id = str(i)
        sched.add(s)
    b1, _ = step(sched)
    assert plan(b1) == [("0", 1, True), ("1", 1, True)]
    b2, _ = step(sched)  # the two running decodes take the whole budget: seq 2 is not admitted
    assert plan(b2) == [("0", 1, True), ("1", 1, True)]
    assert seqs[2].status is SequenceStatus.WAITING
    b3, fin = step(sched)
    assert plan(b3) == [("0", 1, True), ("1", 1, True)]
    assert fin == [seqs[0], seqs[1]]
    b4, _ = step(sched)
    assert plan(b4) == [("2", 1, True)]


def test_max_num_seqs_respected():
    sched = make(budget=64, max_num_seqs=2)
    seqs = [new_seq([i + 1, i + 2], max_tokens=2) for i in range(3)]
    for s in seqs:
        sched.add(s)
    b1, _ = step(sched)
    assert b1.seqs == seqs[:2]
    assert sched.num_running == 2 and sched.num_waiting == 1
    b2, fin = step(sched)
    assert b2.seqs == seqs[:2]
    assert fin == seqs[:2]
    b3, _ = step(sched)
    assert b3.seqs == [seqs[2]]


def test_fcfs_order():
    sched = make(budget=64, max_num_seqs=1)
    seqs = [new_seq([7, i], max_tokens=2) for i in range(4)]
    for s in seqs:
        sched.add(s)
    finished = []
    for _b, fin in run_to_end(sched):
        finished += fin
    assert finished == seqs


def test_fcfs_head_of_line_blocks_on_memory():
    # The head of the queue does not fit; a smaller later request is not admitted around it.
    sched = make(num_blocks=4, budget=64, prefix=False)
    a = new_seq(8, max_tokens=1)
    big = new_seq(list(range(100, 112)), max_tokens=1)
    small = new_seq([5], max_tokens=1)
    sched.add(a)
    b1, _ = step(sched)
    assert b1.seqs == [a]
    # a now finished; occupy memory with c then queue big and small
    c = new_seq(list(range(200, 208)), max_tokens=3)
    sched.add(c)
    sched.add(big)
    sched.add(small)
    b2, _ = step(sched)
    assert b2.seqs == [c]  # big needs 3 blocks, only 2 left; small must not jump the queue
    assert list(sched.waiting) == [big, small]


def test_running_seqs_scheduled_oldest_first():
    sched = make(budget=64)
    seqs = [new_seq([i], max_tokens=3) for i in range(3)]
    for s in seqs:
        sched.add(s)
    b1, _ = step(sched)
    b2, _ = step(sched)
    assert b1.seqs == seqs and b2.seqs == seqs


# ---- preemption --------------------------------------------------------------------------------------
def preemption_setup(budget):
    sched = make(num_blocks=4, budget=budget, prefix=False)
    a, b = new_seq([1, 2, 3, 4], max_tokens=8), new_seq([5, 6, 7, 8], max_tokens=8)
    a.request_id, b.request_id = "a", "b"
    sched.add(a)
    sched.add(b)
    return sched, a, b


def test_preemption_of_newest_when_blocks_run_out():
    sched, a, b = preemption_setup(budget=64)
    for _ in range(5):
        batch, _ = step(sched)
        assert batch.seqs == [a, b] and not batch.preempted
    assert (a.num_computed_tokens, len(a), a.block_table) == (8, 9, [0, 2])
    assert (b.num_computed_tokens, len(b), b.block_table) == (8, 9, [1, 3])
    tokens_b = list(b.token_ids)

    batch, _ = step(sched)  # a needs a 3rd block: none free -> b (newest) is preempted
    assert batch.preempted == [b]
    assert plan(batch) == [("a", 1, True)]
    assert b.status is SequenceStatus.WAITING
    assert b.num_computed_tokens == 0
    assert b.block_table == []
    assert b.token_ids == tokens_b
    assert b.num_output_tokens == 5
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert list(sched.waiting) == [b]
    assert sched.running == [a]
    assert a.block_table == [0, 2, 1]

    batch, _ = step(sched)  # b (9 tokens, 3 blocks) does not fit in the one free block
    assert plan(batch) == [("a", 1, True)]
    batch, fin = step(sched)
    assert fin == [a] and a.status is SequenceStatus.FINISHED_LENGTH
    assert a.num_output_tokens == 8

    batch, _ = step(sched)  # b recomputes its prompt and its 5 outputs, then samples its 6th
    assert plan(batch) == [("b", 9, True)]
    assert b.num_cached_tokens == 0
    steps = run_to_end(sched)
    assert len(steps) == 2
    assert b.status is SequenceStatus.FINISHED_LENGTH
    assert b.token_ids[:9] == tokens_b
    assert b.output_token_ids == [1000 + i for i in range(8)]
    assert sched.block_manager.num_free_blocks == 4


def test_preempted_sequence_goes_to_front_of_waiting():
    sched, a, b = preemption_setup(budget=64)
    for _ in range(5):
        step(sched)
    c = new_seq([9], max_tokens=1)
    sched.waiting.append(c)  # queued behind, without going through admission yet
    batch, _ = step(sched)
    assert batch.preempted == [b]
    assert list(sched.waiting) == [b, c]


def test_no_admission_in_a_step_that_preempted():
    # Budget 5 leaves 4 tokens after a's decode; the preempted b could then be admitted as a 4-token
    # chunk in the one block left free. It must wait for the next step.
    sched, a, b = preemption_setup(budget=5)
    b1, _ = step(sched)
    assert plan(b1) == [("a", 4, True), ("b", 1, False)]
    b2, _ = step(sched)
    assert plan(b2) == [("a", 1, True), ("b", 3, True)]
    for _ in range(3):
        batch, _ = step(sched)
        assert plan(batch) == [("a", 1, True), ("b", 1, True)]
    batch, _ = step(sched)
    assert batch.preempted == [b]
    assert plan(batch) == [("a", 1, True)]
    assert sched.block_manager.num_free_blocks == 1
    assert list(sched.waiting) == [b] and len(b) == 8
    batch, _ = step(sched)
    assert plan(batch) == [("a", 1, True), ("b", 4, False)]
    assert not batch.preempted


def test_preemption_of_several_keeps_fcfs_order_in_waiting():
    sched = make(num_blocks=3, budget=64, prefix=False)
    a, b, c = (new_seq([i, i, i, i], max_tokens=9) for i in (1, 2, 3))
    for s in (a, b, c):
        sched.add(s)
    step(sched)  # all three admitted: 1 block each, the pool is full
    assert sched.running == [a, b, c] and sched.block_manager.num_free_blocks == 0
    batch, _ = step(sched)  # a needs a 2nd block: c then b are preempted
    assert batch.preempted == [c, b]
    assert batch.seqs == [a]
    assert list(sched.waiting) == [b, c]
    run_to_end(sched)
    assert all(s.status is SequenceStatus.FINISHED_LENGTH and s.num_output_tokens == 9 for s in (a, b, c))
    assert sched.block_manager.num_free_blocks == 3


def test_preempted_sequence_reuses_its_cached_prefix():
    sched = make(num_blocks=4, budget=64, prefix=True)
    a, b = new_seq([1, 2, 3, 4], max_tokens=8), new_seq([5, 6, 7, 8], max_tokens=8)
    sched.add(a)
    sched.add(b)
    for _ in range(5):
        step(sched)
    batch, _ = step(sched)
    assert batch.preempted == [b]
    # a took b's tail block (the cached tail is evicted first); b's first block stays cached.
    assert a.block_table == [0, 2, 3]
    # a finishes in 2 more steps; b is then readmitted and hits its first (still cached) block
    step(sched)
    _, fin = step(sched)
    assert fin == [a]
    batch, _ = step(sched)
    assert batch.seqs == [b]
    assert b.num_cached_tokens == 4
    assert b.block_table[0] == 1
    assert batch.num_scheduled_tokens == [5]
    assert batch.sample == [True]
    run_to_end(sched)
    assert b.status is SequenceStatus.FINISHED_LENGTH and b.num_output_tokens == 8
    assert sched.block_manager.num_free_blocks == 4


# ---- finishing -----------------------------------------------------------------------------------------
def test_finish_from_waiting():
    sched = make()
    a, b = new_seq(5), new_seq(6)
    sched.add(a)
    sched.add(b)
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert a.status is SequenceStatus.FINISHED_ABORTED
    assert list(sched.waiting) == [b]
    assert sched.block_manager.num_free_blocks == 64
    batch, _ = step(sched)
    assert batch.seqs == [b]


def test_finish_from_running_frees_blocks():
    sched = make(budget=64)
    a, b = new_seq(9, max_tokens=10), new_seq(5, max_tokens=10)
    sched.add(a)
    sched.add(b)
    step(sched)
    assert sched.block_manager.num_free_blocks == 64 - 3 - 2
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert a.status is SequenceStatus.FINISHED_ABORTED
    assert a.block_table == []
    assert sched.running == [b]
    assert sched.block_manager.num_free_blocks == 62
    # Finishing twice is a no-op.
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    assert a.status is SequenceStatus.FINISHED_ABORTED
    assert sched.block_manager.num_free_blocks == 62
    batch, _ = step(sched)
    assert batch.seqs == [b]


def test_abort_between_schedule_and_update_is_skipped():
    sched = make(budget=64)
    a, b = new_seq(5, max_tokens=3), new_seq(6, max_tokens=3)
    sched.add(a)
    sched.add(b)
    batch = sched.schedule()
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    fin = sched.update(batch, [1, 2])
    assert fin == []
    assert a.num_computed_tokens == 0 and len(a) == 5
    assert b.num_computed_tokens == 6 and b.output_token_ids == [2]
    run_to_end(sched)
    assert sched.block_manager.num_free_blocks == 64


def test_max_tokens_finishes_with_length():
    sched = make()
    a = new_seq(3, max_tokens=2)
    sched.add(a)
    _, fin1 = step(sched)
    assert fin1 == [] and a.status is SequenceStatus.RUNNING
    _, fin2 = step(sched)
    assert fin2 == [a]
    assert a.status is SequenceStatus.FINISHED_LENGTH
    assert a.output_token_ids == [1000, 1001]
    assert not sched.has_unfinished()
    assert sched.block_manager.num_free_blocks == 64


def test_max_tokens_one_finishes_after_prefill():
    sched = make()
    a = new_seq(3, max_tokens=1)
    sched.add(a)
    _, fin = step(sched)
    assert fin == [a] and a.output_token_ids == [1000]
    assert a.status is SequenceStatus.FINISHED_LENGTH


def test_stop_token_finishes_with_stopped():
    sched = make()
    a = new_seq([42, 42, 1], max_tokens=10, stop={42})  # stop tokens in the prompt do not stop
    sched.add(a)
    emitted = iter([10, 11, 42, 12])
    steps = run_to_end(sched, token_fn=lambda seq: next(emitted))
    assert len(steps) == 3
    assert a.status is SequenceStatus.FINISHED_STOPPED
    assert a.output_token_ids == [10, 11, 42]
    assert steps[-1][1] == [a]


def test_stop_token_on_last_allowed_token_is_stopped():
    sched = make()
    a = new_seq(2, max_tokens=2, stop={7})
    sched.add(a)
    emitted = iter([5, 7])
    run_to_end(sched, token_fn=lambda seq: next(emitted))
    assert a.status is SequenceStatus.FINISHED_STOPPED


# ---- chunked prefill off -----------------------------------------------------------------------------
def test_chunked_prefill_disabled_never_splits_a_prompt():
    sched = make(budget=8, chunked=False)
    a, b = new_seq(6, max_tokens=3), new_seq(list(range(30, 36)), max_tokens=3)
    a.request_id, b.request_id = "a", "b"
    sched.add(a)
    sched.add(b)
    b1, _ = step(sched)
    assert plan(b1) == [("a", 6, True)]  # b (6 tokens) does not fit in the 2 left, and is not split
    b2, _ = step(sched)
    assert plan(b2) == [("a", 1, True), ("b", 6, True)]
    for batch, _ in run_to_end(sched):
        for _s, n in zip(batch.seqs, batch.num_scheduled_tokens):
            assert n == 1  # decodes only
    assert a.num_output_tokens == 3 and b.num_output_tokens == 3


def test_chunked_prefill_enabled_splits_the_same_prompt():
    sched = make(budget=8, chunked=True)
    a, b = new_seq(6, max_tokens=3), new_seq(list(range(30, 36)), max_tokens=3)
    a.request_id, b.request_id = "a", "b"
    sched.add(a)
    sched.add(b)
    b1, _ = step(sched)
    assert plan(b1) == [("a", 6, True), ("b", 2, False)]
    b2, _ = step(sched)
    assert plan(b2) == [("a", 1, True), ("b", 4, True)]


def test_chunked_prefill_disabled_prompt_exactly_budget():
    sched = make(budget=8, chunked=False)
    a = new_seq(8, max_tokens=2)
    sched.add(a)
    b1, _ = step(sched)
    assert b1.num_scheduled_tokens == [8] and b1.sample == [True]


# ---- prefix caching through the scheduler --------------------------------------------------------------
def test_prefix_hit_at_admission_skips_cached_tokens():
    sched = make(budget=64)
    bm = sched.block_manager
    a = new_seq(list(range(10)), max_tokens=1)
    sched.add(a)
    step(sched)
    assert a.block_table == [] and bm.num_free_blocks == 64
    assert a.is_finished
    assert (bm.prefix_queries, bm.prefix_hits) == (10, 0)
    b = new_seq(list(range(9)) + [77], max_tokens=2)
    sched.add(b)
    batch, _ = step(sched)
    assert b.num_cached_tokens == 8
    assert batch.num_scheduled_tokens == [2] and batch.sample == [True]
    assert b.block_table[:2] == [0, 1]  # a's first two blocks, freed but still cached
    assert (bm.prefix_queries, bm.prefix_hits) == (20, 8)
    assert bm.prefix_hit_rate == pytest.approx(0.4)


def test_add_rejects_sequences_larger_than_pool():
    sched = make(num_blocks=2)
    sched.add(new_seq(5, max_tokens=4))  # 8 tokens of KV: fits exactly
    with pytest.raises(AssertionError):
        sched.add(new_seq(5, max_tokens=5))


# ---- property-based: random add / step / abort --------------------------------------------------------
SHARED = [0, 1, 2, 0, 1, 2, 3, 3, 0, 1, 2, 0, 1, 2, 3, 3] * 4  # a common "system prompt"
STOP = 3


def fake_token(seq: Sequence) -> int:
    return (len(seq) * 7 + seq.num_prompt_tokens) % 5


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        num_blocks=st.integers(6, 20),
        max_num_seqs=st.integers(1, 6),
        budget=st.integers(1, 32),
        chunked=st.booleans(),
        prefix=st.booleans(),
    )
    def setup(self, num_blocks, max_num_seqs, budget, chunked, prefix):
        self.capacity = num_blocks * BS
        if not chunked:
            budget = self.capacity  # every (re)admission must fit in one step
        self.sched = make(num_blocks, BS, max_num_seqs, budget, chunked, prefix)
        self.bm = self.sched.block_manager
        self.seqs: list[Sequence] = []
        # Shadow KV: block -> slot -> the token prefix whose last token's KV was written there (a KV
        # vector depends on the whole prefix, not just on its own token).
        self.kv: dict[int, dict[int, tuple[int, ...]]] = {}
        # A worker that sees only the pickled SchedulerOutputs and its own sampled tokens (as one in another
        # process would) must know every scheduled request exactly as the engine does.
        self.worker = RequestStates()

    # ---- operations -------------------------------------------------------------------------------
    @rule(data=st.data())
    def add(self, data):
        max_tokens = data.draw(st.integers(1, min(16, self.capacity)), label="max_tokens")
        max_len = min(60, self.capacity - max_tokens + 1)
        n = data.draw(st.integers(1, max_len), label="prompt_len")
        kind = data.draw(st.sampled_from(["shared", "random"]), label="kind")
        if kind == "shared":
            tail = data.draw(st.lists(st.integers(0, 4), max_size=n), label="tail")
            prompt = (SHARED[: n - len(tail)] + tail)[:n]
        else:
            prompt = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n), label="prompt")
        seq = Sequence(prompt, max_tokens)
        if data.draw(st.booleans(), label="stop"):
            seq.stop_token_ids = frozenset({STOP})
        self.sched.add(seq)
        self.seqs.append(seq)

    def _step(self, abort_index=None):
        batch = self.sched.schedule()
        assert batch.total_tokens <= self.sched.config.max_num_batched_tokens
        assert len(batch.seqs) == len(set(id(s) for s in batch.seqs))
        assert len(batch.seqs) <= self.sched.config.max_num_seqs
        for seq, n, sample in zip(batch.seqs, batch.num_scheduled_tokens, batch.sample):
            assert n > 0
            assert seq.status is SequenceStatus.RUNNING
            assert sample == (seq.num_computed_tokens + n == len(seq))
            if not self.sched.config.enable_chunked_prefill:
                assert sample, "a prompt was split with chunked prefill off"
            assert len(seq.block_table) * BS >= seq.num_computed_tokens + n
            # "Write" the KV of the scheduled tokens: only into private, unhashed blocks.
            for pos in range(seq.num_computed_tokens, seq.num_computed_tokens + n):
                block = self.bm.blocks[seq.block_table[pos // BS]]
                assert block.ref_count == 1, f"write into shared block {block.block_id}"
                assert block.hash is None, f"write into cached block {block.block_id}"
                self.kv.setdefault(block.block_id, {})[pos % BS] = tuple(seq.token_ids[: pos + 1])
        for victim in batch.preempted:
            assert victim.status is SequenceStatus.WAITING
            assert victim.num_computed_tokens == 0 and victim.block_table == []
            assert victim not in batch.seqs
        if batch.preempted:
            assert all(s in self.sched.running for s in batch.seqs)  # nothing newly admitted
        worker_step = self.worker.begin_step(pickle.loads(pickle.dumps(self.sched.scheduler_output(batch))))
        assert len(worker_step) == len(batch.seqs)
        for (state, n, samples), seq, num_tokens, sample in zip(
            worker_step, batch.seqs, batch.num_scheduled_tokens, batch.sample
        ):
            assert (state.token_ids, state.num_prompt_tokens) == (seq.token_ids, seq.num_prompt_tokens)
            assert (state.block_table, state.num_computed_tokens) == (seq.block_table, seq.num_computed_tokens)
            assert (n, samples) == (num_tokens, sample)
        assert set(self.worker.requests) <= {str(s.seq_id) for s in self.sched.running}  # finished: forgotten
        if abort_index is not None and batch.seqs:
            self.sched.finish(batch.seqs[abort_index % len(batch.seqs)], SequenceStatus.FINISHED_ABORTED)
        sampled = [fake_token(s) if f else None for s, f in zip(batch.seqs, batch.sample)]
        self.worker.end_step(worker_step, sampled)
        self.sched.update(batch, sampled)
        return batch

    @rule()
    def step(self):
        self._step()

    @rule(i=st.integers(0, 100))
    def step_with_abort_mid_step(self, i):
        self._step(abort_index=i)

    @precondition(lambda self: any(not s.is_finished for s in self.seqs))
    @rule(i=st.integers(0, 1000))
    def abort(self, i):
        live = [s for s in self.seqs if not s.is_finished]
        self.sched.finish(live[i % len(live)], SequenceStatus.FINISHED_ABORTED)

    # ---- invariants -------------------------------------------------------------------------------
    @invariant()
    def blocks_consistent(self):
        live = [s for s in self.seqs if not s.is_finished]
        counts = [0] * self.bm.num_blocks
        for s in live:
            assert len(set(s.block_table)) == len(s.block_table), f"duplicate block in {s}"
            for b in s.block_table:
                counts[b] += 1
        assert [b.ref_count for b in self.bm.blocks] == counts
        free = {b.block_id for b in self.bm.blocks if b.ref_count == 0}
        assert set(self.bm._free) == free
        assert self.bm.num_free_blocks == len(free)
        for h, b in self.bm._hash_to_block.items():
            assert self.bm.blocks[b].hash == h

    @invariant()
    def sequences_consistent(self):
        for s in self.seqs:
            assert s.num_computed_tokens <= len(s)
            assert s.num_output_tokens <= s.max_tokens
            if s.is_finished:
                assert s.block_table == []
                assert s not in self.sched.running and s not in self.sched.waiting
            elif s.status is SequenceStatus.WAITING:
                assert s.block_table == [] and s.num_computed_tokens == 0
                assert s in self.sched.waiting
            else:
                assert s in self.sched.running
                assert s.num_computed_tokens < len(s)
                assert len(s.block_table) * BS >= s.num_computed_tokens
        assert len(self.sched.running) <= self.sched.config.max_num_seqs
        assert len(self.sched.running) + len(self.sched.waiting) == sum(not s.is_finished for s in self.seqs)

    @invariant()
    def computed_kv_matches_tokens(self):
        # Every computed position of a running sequence holds the KV of that sequence's own prefix, whether
        # it computed it or adopted it from the prefix cache.
        for s in self.sched.running:
            for pos in range(s.num_computed_tokens):
                assert self.kv.get(s.block_table[pos // BS], {}).get(pos % BS) == tuple(s.token_ids[: pos + 1]), (
                    f"{s} position {pos} holds wrong KV"
                )

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        for _ in range(5000):
            if not self.sched.has_unfinished():
                break
            self._step()
            self.blocks_consistent()
            self.sequences_consistent()
            self.computed_kv_matches_tokens()
        else:
            raise AssertionError("the scheduler did not drain")
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert all(b.ref_count == 0 for b in self.bm.blocks)
        self.worker.begin_step(self.sched.scheduler_output(ScheduledBatch()))
        assert not self.worker.requests  # the worker was told of every finish
        for s in self.seqs:
            assert s.is_finished
            assert s.num_output_tokens <= s.max_tokens
            if s.status is SequenceStatus.FINISHED_LENGTH:
                assert s.num_output_tokens == s.max_tokens
            elif s.status is SequenceStatus.FINISHED_STOPPED:
                assert s.output_token_ids[-1] == STOP and STOP not in s.output_token_ids[:-1]


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSchedulerMachine = SchedulerMachine.TestCase


def test_dynamic_batch_by_input_length():
    """max_running_tokens: short inputs run many at a time, long ones few; a lone long input still runs."""
    from infertune.config import SchedulerConfig
    from infertune.engine.block_manager import BlockManager
    from infertune.engine.scheduler import Scheduler
    from infertune.engine.sequence import Sequence

    def admitted(prompt_len: int, n: int) -> int:
        sched = Scheduler(
            SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=4096, max_running_tokens=256), BlockManager(512, 4)
        )
        for _ in range(n):
            sched.add(Sequence(list(range(prompt_len)), 4))
        sched.schedule()
        return sched.num_running

    assert admitted(16, 20) == 16  # 16 x 16 = 256 tokens: the max_num_seqs cap binds first
    assert admitted(64, 20) == 4  # 4 x 64 = 256
    assert admitted(100, 5) == 2  # 2 x 100 <= 256 < 3 x 100
    assert admitted(300, 3) == 1  # longer than the cap alone: admitted by itself, never starved
