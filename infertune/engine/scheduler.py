"""Token-budget continuous batching: chunked prefill mixed with decode, FCFS, preemption by recompute. Pure Python.

Every step, running sequences come first (oldest first), each asking for all the tokens it has not
computed yet (1 for a decode, the rest of its prompt for a chunked prefill), capped by the step's token
budget. Then waiting sequences are admitted while budget, max_num_seqs and KV blocks allow. When a
running sequence cannot get a block, the newest running sequence is preempted: its blocks are freed and
it goes back to the front of the queue, to be recomputed later (its tokens are kept).

With speculative decoding (SchedulerConfig.speculative_config) a decode also carries the draft tokens the n-gram
proposer (engine/spec_decode.py) finds for it: 1 + d new tokens against the budget, with KV slots for all of them,
the drafts capped so that what the step may accept stays within max_tokens. Drafts never preempt anything: they are
dropped where their blocks are not to be had. After the step the sequence keeps the drafts the runner accepted plus
its one new token, and gives back the blocks only rejected drafts used. How many drafts a sequence carries adapts to
its acceptance (spec_decode.AdaptiveK); with a draft model, the drafts are those its worker proposed after the last
step (asked for in SchedulerOutput.num_drafts_to_propose, returned with the step's output).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from infertune.config import SchedulerConfig
from infertune.engine.block_manager import BlockManager
from infertune.engine.sequence import Sequence, SequenceStatus
from infertune.engine.spec_decode import AdaptiveK, make_proposer
from infertune.scheduler_output import CachedRequest, NewRequest, SchedulerOutput


@dataclass(slots=True)
class ScheduledBatch:
    seqs: list[Sequence] = field(default_factory=list)
    num_scheduled_tokens: list[int] = field(default_factory=list)
    # True where this step completes the sequence's known tokens, so the step samples its next token.
    sample: list[bool] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # Speculative decoding: the draft tokens each sequence carries after its last token (counted in its scheduled
    # tokens); and, once update() ran, the tokens each sequence was given (its accepted drafts, then the new one).
    draft_token_ids: list[list[int]] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)

    def add(self, seq: Sequence, num_tokens: int, drafts: list[int] = ()) -> None:
        self.seqs.append(seq)
        self.num_scheduled_tokens.append(num_tokens + len(drafts))
        self.sample.append(seq.num_computed_tokens + num_tokens == len(seq))
        self.draft_token_ids.append(list(drafts))

    @property
    def total_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs


class Scheduler:
    def __init__(self, config: SchedulerConfig, block_manager: BlockManager, kv_connector=None) -> None:
        self.config = config
        self.block_manager = block_manager
        # Prefill/decode disaggregation: the scheduler side of a KV connector (kv_transfer.base.KVConnectorScheduler)
        # or None. A consumer loads prompt KV into a sequence's blocks at admission; a producer keeps a finished
        # prefill's blocks for a consumer until the connector releases them.
        self.kv_connector = kv_connector
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._packs: list[tuple[int, int, int, int]] = []  # the int4 tier's packs since the last scheduler_output
        # What the workers were told of each sequence: seq_id -> (seq, block ids sent per KV cache group, its
        # preemptions then).
        self._sent: dict[int, tuple[Sequence, tuple[int, ...], int]] = {}
        spec = config.speculative_config
        self.proposer = make_proposer(spec) if spec is not None else None
        self.adaptive_k = AdaptiveK(spec) if spec is not None else None
        # Speculative decoding's counts (vLLM's): steps of a sequence with drafts, drafts proposed, drafts accepted.
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # ---- queue -----------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        assert seq.status is SequenceStatus.WAITING
        need = self.block_manager.max_blocks_per_seq(seq.num_prompt_tokens + seq.max_tokens - 1, seq.num_prompt_tokens)
        assert need <= self.block_manager.num_blocks, "the engine must reject sequences larger than the KV pool"
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Take seq out of the queues with a finished status and return its blocks (abort, stop string)."""
        assert status.finished
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        seq.status = status
        self._free_finished(seq)

    def _free_finished(self, seq: Sequence) -> None:
        if self.kv_connector is not None:
            delay, seq.kv_transfer_params = self.kv_connector.request_finished(seq, seq.block_table)
            if delay:
                return  # the connector holds the blocks (a lease) and hands seq back through released()
        self.block_manager.free(seq)

    def release_kv_transfers(self) -> None:
        """Free the blocks of finished prefills the KV connector no longer holds (confirmed, or the lease ran out)."""
        if self.kv_connector is not None:
            for seq in self.kv_connector.released():
                self.block_manager.free(seq)

    # ---- one step --------------------------------------------------------------------------------
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.config.max_num_batched_tokens
        bm = self.block_manager
        self.release_kv_transfers()

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_tokens = min(len(seq) - seq.num_computed_tokens, budget)
            assert num_tokens > 0
            self._pack_int4(seq)
            drafts = self._propose(seq, budget - 1, len(self.running) - i - 1) if num_tokens == 1 else []
            if drafts and not bm.allocate_slots(seq, len(seq) + len(drafts)):
                drafts = []
            while not bm.allocate_slots(seq, seq.num_computed_tokens + num_tokens):
                victim = self.running.pop()  # newest first: FCFS keeps the oldest progressing
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.add(seq, num_tokens, drafts)
                budget -= num_tokens + len(drafts)
                i += 1

        # No admissions after a preemption: memory is short, and the preempted go first next time.
        running_tokens = sum(len(s) for s in self.running) if self.config.max_running_tokens else 0
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs and not batch.preempted:
            seq = self.waiting[0]
            if (
                self.config.max_running_tokens
                and self.running
                and (running_tokens + len(seq) > self.config.max_running_tokens)
            ):
                break  # dynamic batch: a long input waits for room; a lone sequence is always admitted
            hits = [] if seq.skip_prefix_cache else bm.get_computed_blocks(seq)
            num_cached = bm.num_hit_tokens(hits)
            # (a consumer: the prompt tokens after the hits whose KV a producer computed, loaded instead)
            external = self.kv_connector.get_num_new_matched_tokens(seq, num_cached) if self.kv_connector else 0
            num_tokens = len(seq) - num_cached - external
            if not self.config.enable_chunked_prefill and num_tokens > budget:
                break
            num_tokens = min(num_tokens, budget)
            if not bm.allocate_slots(seq, num_cached + external + num_tokens, hits):
                break
            bm.record_prefix_lookup(len(seq), num_cached)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = seq.num_cached_tokens = num_cached
            if self.kv_connector is not None:
                self.kv_connector.update_state_after_alloc(seq, seq.block_table, external)
                seq.num_computed_tokens += external
            self.running.append(seq)
            running_tokens += len(seq)
            batch.add(seq, num_tokens)
            budget -= num_tokens
        return batch

    def _pack_int4(self, seq: Sequence) -> None:
        """The int4 tier (CacheConfig.kv_int4_after): pack seq's old int8 blocks before its step; the workers do the
        packs (SchedulerOutput.kv_packs) and re-read its tables from the first entry that changed."""
        if self.kv_connector is not None and self.kv_connector.role == "producer":
            params = getattr(seq.params, "kv_transfer_params", None) or {}
            if params.get("do_remote_decode"):
                return  # (its prompt's blocks go to a consumer as int8; the consumer's own tier packs them there)
        packs = self.block_manager.pack_int4(seq)
        if not packs:
            return
        self._packs.extend((g, first, second, dst) for g, _, first, second, dst in packs)
        sent = self._sent.get(seq.seq_id)
        if sent is not None:  # (the worker cuts its tables to the first changed entry and takes the rest again)
            kept = list(sent[1])
            for g, index, *_ in packs:
                kept[g] = min(kept[g], index)
            self._sent[seq.seq_id] = (seq, tuple(kept), sent[2])

    def _propose(self, seq: Sequence, room: int, num_after: int) -> list[int]:
        """Drafts for a decoding seq: at most `room` (what is left of the step's budget), never so many that the
        step could take it past max_tokens, and only where their blocks leave one free block for each of the
        num_after running sequences still to schedule (drafts must not cost another sequence its step)."""
        if self.proposer is None or not seq.spec_decode:
            return []
        k = min(self.adaptive_k.num_drafts(seq), room, seq.max_tokens - seq.num_output_tokens - 1)
        if k <= 0:
            return []
        drafts = self.proposer.propose(seq, k)
        bm = self.block_manager
        need = bm.blocks_needed(len(seq) + len(drafts)) - len(seq.block_table)  # its token's block included
        extra = need - max(bm.blocks_needed(len(seq)) - len(seq.block_table), 0)  # the drafts' own blocks
        if extra > 0 and bm.num_free_blocks - need < num_after:
            return []
        return drafts

    def scheduler_output(self, batch: ScheduledBatch) -> SchedulerOutput:
        """The batch as plain data for the workers: new sequences whole, known ones by what changed, and the
        sequences they should forget (finished, aborted, or preempted since they were sent)."""
        out = SchedulerOutput()
        for seq_id, (seq, _, preemptions) in list(self._sent.items()):
            if seq.is_finished or seq.num_preemptions != preemptions:
                out.finished_req_ids.append(str(seq_id))
                del self._sent[seq_id]
        for seq, num_tokens, drafts in zip(batch.seqs, batch.num_scheduled_tokens, batch.draft_token_ids):
            sent = self._sent.get(seq.seq_id)
            if sent is None:
                out.new_requests.append(
                    NewRequest(
                        str(seq.seq_id),
                        list(seq.token_ids),
                        seq.num_prompt_tokens,
                        seq.params,
                        list(seq.block_table),
                        seq.num_computed_tokens,
                        seq.structured_output,
                        [list(t) for t in seq.block_tables[1:]],
                        kv_kept=seq.kv_kept,
                        kv_compression=seq.kv_compression if seq.kv_kept is not None else None,
                    )
                )
            else:
                kept = sent[1]
                new_ids = [t[k:] for t, k in zip(seq.block_tables, kept)]
                out.cached_requests.append(
                    CachedRequest(
                        str(seq.seq_id), new_ids[0], seq.num_computed_tokens, kept[0], new_ids[1:], list(kept[1:])
                    )
                )
            self._sent[seq.seq_id] = (seq, tuple(len(t) for t in seq.block_tables), seq.num_preemptions)
            out.req_ids.append(str(seq.seq_id))
            out.num_scheduled_tokens.append(num_tokens)
            if drafts:
                out.scheduled_spec_decode_tokens[str(seq.seq_id)] = list(drafts)
        out.kv_packs, self._packs = self._packs, []
        if self.kv_connector is not None:
            out.kv_connector_metadata = self.kv_connector.build_connector_meta()
        if self.config.speculative_config is not None and self.config.speculative_config.method == "draft_model":
            for seq, samples in zip(batch.seqs, batch.sample):
                # the drafts for its next step, which starts at least one token further on
                k = min(self.adaptive_k.num_drafts(seq), seq.max_tokens - seq.num_output_tokens - 2)
                if samples and seq.spec_decode and k > 0:
                    out.num_drafts_to_propose[str(seq.seq_id)] = k
        return out

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def keep_proposals(self, batch: ScheduledBatch, draft_token_ids: list[list[int] | None]) -> None:
        """Keep the drafts a draft model proposed, after the batch's step, for each sequence's next step."""
        for seq, drafts in zip(batch.seqs, draft_token_ids):
            if drafts and seq.spec_decode and self.adaptive_k is not None:
                self.adaptive_k.state(seq).proposal = list(drafts)

    def update(
        self, batch: ScheduledBatch, sampled: list[int | None], num_accepted: list[int] | None = None
    ) -> list[Sequence]:
        """Advance the batch by what the step computed; append each sequence's accepted drafts (num_accepted, where
        the step had drafts) and its sampled token, stopping at the first stop token or at max_tokens; record them
        in batch.new_token_ids; return the newly finished seqs."""
        finished = []
        batch.new_token_ids = [[] for _ in batch.seqs]
        for j, (seq, num_tokens, samples, token) in enumerate(
            zip(batch.seqs, batch.num_scheduled_tokens, batch.sample, sampled)
        ):
            if seq.is_finished:  # aborted while the step ran
                continue
            if not samples:
                seq.num_computed_tokens += num_tokens
                self.block_manager.cache_full_blocks(seq)
                continue
            assert token is not None
            drafts = batch.draft_token_ids[j]
            accepted = drafts[: num_accepted[j]] if drafts else []
            if drafts:
                self.num_drafts += 1
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += len(accepted)
            if seq.spec_decode and self.adaptive_k is not None:
                self.adaptive_k.record(seq, len(drafts), len(accepted))
            status = None
            for t in [*accepted, token]:
                seq.append_token(t)
                batch.new_token_ids[j].append(t)
                if t in seq.stop_token_ids:
                    status = SequenceStatus.FINISHED_STOPPED
                elif seq.num_output_tokens >= seq.max_tokens:
                    status = SequenceStatus.FINISHED_LENGTH
                else:
                    continue
                break
            # KV now holds the last token and the accepted drafts (those the tokens kept still reach)
            seq.num_computed_tokens = min(seq.num_computed_tokens + num_tokens - len(drafts) + len(accepted), len(seq))
            self.block_manager.cache_full_blocks(seq)
            if status is not None:
                self.finish(seq, status)
                finished.append(seq)
            elif drafts and self.block_manager.trim(seq, len(seq)):
                sent = self._sent.get(seq.seq_id)
                if sent is not None:  # the worker cuts its table to these at the next step (CachedRequest)
                    kept = tuple(min(k, len(t)) for k, t in zip(sent[1], seq.block_tables))
                    self._sent[seq.seq_id] = (seq, kept, sent[2])
            if status is None and self.block_manager.compress(seq):  # KV compression gave its tail blocks back
                sent = self._sent.get(seq.seq_id)
                if sent is not None:  # (the worker cuts its tables to these too)
                    kept = tuple(min(k, len(t)) for k, t in zip(sent[1], seq.block_tables))
                    self._sent[seq.seq_id] = (seq, kept, sent[2])
        return finished
