"""ModelRunner: SchedulerOutput (plain data) -> tensors -> forward over the paged KV cache -> sampled tokens.

It keeps its own per-request state (request_state.py), so it needs nothing from the engine but each step's output.

The KV cache is allocated once, at start-up, from a memory budget, and reused for the engine's life.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import torch

from infertune.backends import Backend
from infertune.config import EngineConfig
from infertune.kv_transfer import kv_layout, worker_connector
from infertune.layers.attention import AttentionMetadata, PrefillChunk, attention_backend
from infertune.layers.attention.press import KVPress
from infertune.layers.kernel_op import attach_kernels
from infertune.layers.parallel import TensorParallel
from infertune.models.loader import load_model
from infertune.runner.compiled import CompiledForward, should_compile
from infertune.runner.draft_model import DraftModel
from infertune.runner.fused_decode import FusedDecode
from infertune.runner.request_state import RequestState, RequestStates
from infertune.runner.sampler import Sampler, SampleRequest, SamplerOutput, argmax_only, verify_drafts
from infertune.runner.structured_output import StructuredOutputs
from infertune.scheduler_output import KVCacheGroup, SchedulerOutput, kv_cache_groups

log = logging.getLogger(__name__)


@dataclass(slots=True)
class KVCacheInfo:
    num_blocks: int
    block_size: int
    bytes_per_token: int  # of one block id (a page of each KV cache group's layers, its i-th layer the i-th page)
    # The layers grouped by sliding window, each group with its own block tables (one group without windows).
    groups: tuple[KVCacheGroup, ...] = ()
    max_blocks_per_seq: int = 0  # the blocks one sequence of max_model_len holds at most, every group's together
    # With a KV connector (config.parallel.kv_role): what a peer's blocks must match to be copied (kv_transfer).
    kv_layout: dict | None = None

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def total_bytes(self) -> int:
        return self.num_tokens * self.bytes_per_token


class ModelRunner:
    def __init__(
        self, config: EngineConfig, backend: Backend, show_progress: bool = False, tp: TensorParallel | None = None
    ) -> None:
        """tp: this worker's rank of a tensor-parallel group (its process group initialised), None for one process.
        Every rank runs every step alike (the same SchedulerOutput, the same logits after the head's gather, the
        same seeded sampler), so each keeps the same request states; the executor reads rank 0's output."""
        self.config = config
        self.backend = backend
        self.device = backend.device
        self.tp = tp if tp is not None and tp.size > 1 else None
        # the shape this process builds and caches: with tensor parallel, its share of the heads and features
        self.arch = arch = (
            config.model.arch.for_tensor_parallel(tp.size, tp.expert_parallel) if self.tp else config.model.arch
        )
        self.kv_compression = config.cache.kv_compression
        if self.kv_compression is not None:  # its window rules: sliding windows on those layers
            windows = self.kv_compression.layer_windows(arch.layer_windows, arch.num_hidden_layers)
            self.arch = arch = replace(arch, layer_windows=windows)
        self.dtype = backend.resolve_dtype(config.model.dtype, arch.torch_dtype)
        backend.seed(config.model.seed)
        # The backend's own small-batch linear kernels (None: torch's matmuls throughout). They are bf16 kernels:
        # an fp32 model never builds or loads them.
        use = config.model.decode_kernels != "off" and self.dtype is torch.bfloat16
        self.decode_kernels = backend.decode_kernels() if use else None
        if config.model.decode_kernels == "linear" and self.decode_kernels is None:  # (asked for by name: say so)
            why = "they are bf16 kernels" if not use else backend.kernels_unavailable_reason()
            log.warning("decode_kernels='linear' has no effect here (dtype %s): %s", str(self.dtype)[6:], why)
        elif use and self.decode_kernels is None:
            log.info("decode kernels off: %s; torch's operators run", backend.kernels_unavailable_reason())
        elif self.decode_kernels is not None:
            log.info("decode kernels: %s", self.decode_kernels.name)
        self.attn = attention_backend(
            arch,
            config.cache.kv_cache_dtype,
            self.dtype,
            config.cache.kv_int4_after is not None,
            config.cache.mla_cache,
        )
        self.model = load_model(
            arch,
            config.model.model,
            self.dtype,
            self.device,
            config.model.max_model_len,
            self.attn,
            show_progress,
            quant=config.quant,
            backend=backend,
            prepack=config.model.prepack_weights,
            kernels=self.decode_kernels,
            compress=config.model.compress_weights == "auto" and config.model.compile != "on",
            tp=self.tp,
        )
        self.block_size = config.cache.block_size
        # KV cache groups (scheduler_output.KVCacheGroup): a block id is a page of every group's cache, the i-th
        # layer of each group in the i-th tensor, so the tensors are as many as the largest group's layers (the
        # kinds of layers are cut into groups of equal size where their counts differ: kv_cache_groups).
        # (KV compression: the full layers grouped further by what they keep, kv_compression.layer_key)
        keys = None
        if self.kv_compression is not None:
            keys = tuple(self.kv_compression.layer_key(i) for i in range(arch.num_hidden_layers))
        self.kv_groups = kv_cache_groups(arch.layer_windows, arch.num_hidden_layers, config.model.max_model_len, keys)
        self._group_of_layer = [
            next(g for g, group in enumerate(self.kv_groups) if i in group.layers)
            for i in range(arch.num_hidden_layers)
        ]
        # (with kv_compression, even one that compresses nothing by default, a request may bring its own press)
        self.press = None
        if self.kv_compression is not None:
            self.press = KVPress(self.kv_compression, arch.num_hidden_layers, arch.num_attention_heads, self.attn)
        self._group_of_window = {
            w: next(g for g, group in enumerate(self.kv_groups) if i in group.layers)
            for i, w in enumerate(arch.layer_windows or (None,) * arch.num_hidden_layers)
        }
        self.kv_info = self._plan_kv_cache()
        shape = self.attn.kv_cache_shape(
            self.kv_info.num_blocks, self.block_size, arch.num_key_value_heads, arch.head_dim
        )
        # One allocation for every layer; each layer gets a view. torch.zeros so stale memory is never read as KV.
        cache_dtype = self.attn.cache_dtype or self.dtype
        pages = max(len(g.layers) for g in self.kv_groups)
        # A KV connector (prefill/decode disaggregation) may keep the storage where a peer reads it (shared memory).
        self.kv_connector = worker_connector(config, self.tp.rank if self.tp else 0, self.device.type)
        storage = self.kv_connector.allocate((pages, *shape), cache_dtype) if self.kv_connector else None
        if storage is None:
            storage = backend.kv_cache_storage((pages, *shape), cache_dtype, self.device)
        self._kv_storage = storage
        if self.kv_connector is not None:
            self.kv_info.kv_layout = kv_layout(
                config, tuple(storage.shape), str(cache_dtype).removeprefix("torch."), self.kv_groups
            )
        self.kv_caches = list(self._kv_storage.unbind(0))
        if len(self.kv_groups) > 1:  # layer i: the page of its rank in its group
            page_of = {i: r for g in self.kv_groups for r, i in enumerate(g.layers)}
            self.kv_caches = [self.kv_caches[page_of[i]] for i in range(arch.num_hidden_layers)]
        if self.kv_connector is not None:
            self.kv_connector.register_kv_caches(self.kv_caches)
        # After the load, so that its transients go back to the OS as before; the steps then reuse their memory.
        backend.prepare_host_memory()
        self.sampler = Sampler(config.model.seed, self.device, self.decode_kernels)
        spec = config.scheduler.speculative_config  # a draft model proposes at the end of each step
        self.drafter = None
        if spec is not None and spec.method == "draft_model":
            self.drafter = DraftModel(
                config, backend, self.dtype, self.kv_info.num_blocks, self._prepare, self.decode_kernels
            )
        self.fused: FusedDecode | None = None
        self.requests = RequestStates()  # the requests this worker knows, kept from each SchedulerOutput
        # structured output: the grammar matchers of the constrained requests (runner/structured_output.py)
        self.structured = StructuredOutputs(config.model.tokenizer, arch.vocab_size)
        self.compiled: CompiledForward | None = None
        if self.tp is not None and config.model.compile == "on":
            raise ValueError("compile='on' does not run with tensor parallel yet; use compile='auto' or 'off'")
        if (
            self.tp is None
            and config.model.compile != "off"
            and should_compile(config.model.compile, backend, self._num_weights())
        ):
            try:
                self.compiled = CompiledForward(self.model)
                self.compiled.warm_up(self._warm_up_step)
            except Exception as e:  # no C++ compiler, an Inductor bug, ...: auto falls back, on says why
                self.compiled = None
                if config.model.compile == "on":
                    raise RuntimeError(
                        f"compile='on': torch.compile failed ({type(e).__name__}: {e}); "
                        "run with compile='off' (--compile off)"
                    ) from e
                log.warning("torch.compile failed (%s: %s); running eager (compile='auto')", type(e).__name__, e)
        # Decode-only steps of up to 16 sequences: every layer in one kernel call (runner/fused_decode.py).
        # Not with torch.compile: its warm-up must run (and compile) the graphs that decode steps use.
        if self.decode_kernels is not None and config.model.decode_kernels == "auto":
            attach_kernels(self.model, self.decode_kernels)  # prefills' norms, rotary and SiLU-and-multiply
        # (with tensor parallel, where the ranks share a host: the step sums each row-parallel output over them
        # through the shared-memory all-reduce, in C)
        fuse = config.model.decode_kernels == "auto"
        # (KV compression: a compressed sequence's decode rows read their kept slots through their block table and
        # context length, and rotate at their true positions, as the per-op path does; the steps whose layers write
        # the queries a press reads run the per-op path: _forward)
        if self.decode_kernels is not None and self.compiled is None and fuse:
            # (a step holds at most max_num_batched_tokens tokens, and at most max_num_seqs whole sequences)
            step_rows = min(
                config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs * config.model.max_model_len
            )
            self.fused = FusedDecode.build(
                self.model,
                self.kv_caches,
                self.attn,
                self.decode_kernels,
                config.model.max_model_len,
                self.block_size,
                self.dtype,
                step_rows,
                self.kv_groups,
                self.tp,
                config.cache.kv_int4_after is not None,
            )

    def _num_weights(self) -> int:
        """Parameters plus buffers (prepacked and quantized weights live in buffers)."""
        return sum(p.numel() for p in self.model.parameters()) + sum(b.numel() for b in self.model.buffers())

    @property
    def compile_seconds(self) -> float | None:
        """Start-up time spent compiling (None when the forward runs eager)."""
        return self.compiled.warmup_seconds if self.compiled is not None else None

    def _forward(self, input_ids, positions, meta, out_rows: list[int] | None = None) -> torch.Tensor:
        """Hidden states [T, hidden]; where out_rows (ascending) is given, only those rows are sure to be
        computed (the fused step takes just them through the last layer's o_proj and MLP)."""
        if meta.press_rows is not None or meta.kv_hook is not None:
            # (the layers write the queries KV compression keeps; a KV connector's per-layer calls: eager)
            return self.model(input_ids, positions, self.kv_caches, meta)
        if self.fused is not None and self.fused.applicable(input_ids.shape[0], meta):
            rows = self._tensor(out_rows) if out_rows and len(out_rows) < input_ids.shape[0] else None
            return self.fused(input_ids, positions, meta, rows)
        if self.compiled is not None and input_ids.shape[0] >= self.compiled.min_tokens:
            return self.compiled(input_ids, positions, self.kv_caches, meta)
        return self.model(input_ids, positions, self.kv_caches, meta)

    @torch.inference_mode()
    def _warm_up_step(self, n: int) -> None:
        """A decode step of n one-token sequences, each in slot i of block 0 (no block is in use before serving)."""
        assert n <= self.block_size, "warm-up rows must fit one block"
        entries = [([1], 0, 1, [0]) for _ in range(n)]
        if len(self.kv_groups) > 1:
            entries = [(t, s, k, [[0]] * len(self.kv_groups)) for t, s, k, _ in entries]
        input_ids, positions, meta, _ = self._prepare(entries)
        for m in {id(m): m for m in [*(meta.by_window or {None: meta}).values(), *(meta.by_layer or ())]}.values():
            m.slot_mapping = self._tensor(list(range(n)))
        self.model.compute_logits(self._forward(input_ids, positions, meta))

    def _plan_kv_cache(self) -> KVCacheInfo:
        """Blocks of the KV cache. With tensor parallel each rank keeps its heads' share of every block, in its
        share of the budget (the ranks share the host's memory), and all take the fewest blocks any of them fits."""
        cfg, arch = self.config, self.arch
        ranks = self.tp.size if self.tp is not None else 1
        pages = max(len(g.layers) for g in self.kv_groups)  # all the layers, with one group
        bytes_per_token = pages * self.attn.kv_bytes_per_token(arch.num_key_value_heads, arch.head_dim, self.dtype)
        block_bytes = bytes_per_token * self.block_size
        max_len = cfg.model.max_model_len
        chunk = cfg.scheduler.max_num_batched_tokens
        per_seq = sum(g.max_blocks(max_len, self.block_size, chunk) for g in self.kv_groups)
        if cfg.cache.kv_cache_memory_bytes is not None:
            budget = cfg.cache.kv_cache_memory_bytes // ranks
            num_blocks = budget // block_bytes
        else:
            # (more blocks than max_num_seqs full-length sequences can use would only waste memory)
            budget = cfg.cache.default_kv_budget(
                self.backend.free_memory_bytes(), ranks, cfg.scheduler.max_num_seqs, per_seq * block_bytes
            )
            num_blocks = budget // block_bytes
        if self.tp is not None:
            num_blocks = self.tp.min_over_ranks(int(num_blocks))
        if num_blocks < per_seq:
            need = per_seq * block_bytes
            held = f"{num_blocks * self.block_size} tokens, fewer than max_model_len={max_len}"
            if len(self.kv_groups) > 1 or self.kv_groups[0].window is not None:
                held = f"{num_blocks} blocks, fewer than the {per_seq} one sequence of max_model_len={max_len} holds"
            raise ValueError(
                f"the KV-cache budget ({budget / 2**20:.1f} MiB) holds {held}; give kv_cache_memory_bytes >= {need} "
                "or lower max_model_len"
            )
        return KVCacheInfo(int(num_blocks), self.block_size, bytes_per_token, self.kv_groups, per_seq)

    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> SamplerOutput:
        """Run one step; one sampled token per scheduled request (None where a prefill chunk is unfinished), after
        the drafts it accepted where it had some (speculative decoding: SamplerOutput.num_accepted)."""
        step = self.requests.begin_step(scheduler_output)
        if scheduler_output.kv_packs:  # the int4 tier: before anything reads or writes this step's KV
            self._pack_int4(scheduler_output.kv_packs)
        load_failed = self._load_kv(scheduler_output, step)
        drafts = [scheduler_output.scheduled_spec_decode_tokens.get(r, []) for r in scheduler_output.req_ids]
        entries, entries_of = self._entries(step, drafts)
        input_ids, positions, meta, entry_rows = self._prepare(entries)
        connector_meta = scheduler_output.kv_connector_metadata
        layerwise = self.kv_connector is not None and self.kv_connector.layerwise
        if layerwise and connector_meta is not None:  # (the model's layer loop calls it: the per-module forward)
            meta.kv_hook = _LayerHook(self.kv_connector, connector_meta, self.kv_caches)
        rows_of = [[entry_rows[e] for e in of] for of in entries_of]  # per request: its row, or its 1 + d rows
        last_rows = [r[-1] for r in rows_of]
        n_entries = len(step)
        tokens: list[int | None] = [None] * n_entries
        logprobs: list = [None] * n_entries
        num_accepted = [0] * n_entries if any(drafts) else None
        sampled = [i for i, (_, _, samples) in enumerate(step) if samples]
        # structured output: the sampled rows' token masks start filling (in a thread) before the forward
        # (a request with drafts is never constrained: the engine does not speculate for it)
        sampled_ids = [scheduler_output.req_ids[i] for i in sampled for _ in rows_of[i]]
        mask = self.structured.begin_step(scheduler_output, sampled_ids)
        scored = self._prompt_rows(step, last_rows)  # entry -> (first prompt token scored, its rows)
        # (only the rows read are computed to the end: a step with nothing to sample still fills the KV cache)
        read = {r for i in sampled for r in rows_of[i]} | {r for _, rs in scored.values() for r in rs}
        captured = self._press_capture(step, rows_of, meta) if self.press is not None else []
        hidden = self._forward(input_ids, positions, meta, sorted(read))  # [T, hidden]
        if self.press is not None:
            self._press_after_forward(step, captured, meta)
        kv_finished = None
        if self.kv_connector is not None:
            if not layerwise:  # (a layer-by-layer connector was told inside the forward)
                for layer, cache in enumerate(self.kv_caches):
                    self.kv_connector.save_kv_layer(layer, cache, connector_meta)
            self.kv_connector.wait_for_save()
            sending, recving = self.kv_connector.get_finished()
            kv_finished = (set(sending), set(recving)) if sending or recving else None
        if sampled:
            requests = [
                self._sample_request(step[i][0], drafts[i][:t]) for i in sampled for t in range(len(rows_of[i]))
            ]
            rows = hidden[self._tensor([r for i in sampled for r in rows_of[i]])]
            logits = self.model.compute_logits(rows, fp32=not argmax_only(requests, mask))  # [N, V]
            out = self.sampler(logits, requests, mask)
            self.structured.accept(sampled_ids, out.token_ids)
            k = 0
            for i in sampled:
                if drafts[i]:
                    num_accepted[i], tokens[i] = verify_drafts(out.token_ids[k : k + len(rows_of[i])], drafts[i])
                else:
                    tokens[i], logprobs[i] = out.token_ids[k], out.logprobs[k]
                k += len(rows_of[i])
        prompt_logprobs = None
        if scored:
            prompt_logprobs = [None] * n_entries
            for i, (first, rows) in scored.items():
                state = step[i][0]
                targets = state.token_ids[first : first + len(rows)]
                prompt_logprobs[i] = (first, self._score_rows(hidden, rows, targets, state.params.prompt_logprobs))
        self.requests.end_step(step, tokens, drafts, num_accepted)
        proposals = self.drafter.propose(scheduler_output, self.requests, tokens) if self.drafter else None
        return SamplerOutput(tokens, logprobs, prompt_logprobs, num_accepted, proposals, load_failed, kv_finished)

    def _pack_int4(self, packs: list[tuple[int, int, int, int]]) -> None:
        """Re-store each (group, first, second, dst) pair of int8 blocks as int4 block dst, in the pages of the
        group's layers (the i-th layer of a group in page i). Where two packs write one block, the later wins (the
        earlier was a sequence preempted in the same schedule, its block since given to another pack)."""
        packs = list({(p[0], p[3]): p for p in packs}.values())
        for g in sorted({p[0] for p in packs}):
            ids = self._tensor([p[1:] for p in packs if p[0] == g])  # [N, 3]
            pages = self._kv_storage[: len(self.kv_groups[g].layers)]
            self.attn.pack_int4(pages, ids[:, 0], ids[:, 1], ids[:, 2])

    def _load_kv(self, scheduler_output: SchedulerOutput, step: list) -> list[str] | None:
        """Load the prompt KV the connector's metadata asks for into this rank's blocks, before the forward. A load
        that fails (on any rank: they agree, or their collectives would differ) is recomputed in this step: its
        entry computes the loaded tokens too, into the blocks already allocated for them. Returns those req ids."""
        meta = scheduler_output.kv_connector_metadata
        if meta is None or self.kv_connector is None or not meta.loads:
            return None
        failed = self.kv_connector.start_load_kv(meta, self._kv_storage)
        if self.tp is not None and self.tp.min_over_ranks(0 if failed else 1) == 0:
            failed = [load.req_id for load in meta.loads]  # some rank failed: every rank recomputes them all
        if failed:
            log.warning("KV load failed for %d request(s); computing their prompts in this step", len(failed))
            row = {r: i for i, r in enumerate(scheduler_output.req_ids)}
            for load in meta.loads:
                if load.req_id in failed:
                    state, n, samples = step[row[load.req_id]]
                    state.num_computed_tokens = load.num_local_tokens
                    step[row[load.req_id]] = (state, n + load.num_loaded_tokens, samples)
        return failed or None

    def _press_capture(self, step, rows_of, meta: AttentionMetadata) -> list[tuple[RequestState, int]]:
        """KV compression: mark the rows whose queries the press will read (the last window_size positions of each
        prefill still to compress) in meta.press_rows; return (state, rows) in that order."""
        rows: list[int] = []
        captured = []
        for i, (state, n, _) in enumerate(step):
            if state.kv_kept is None or state.num_evicted is not None:
                continue
            # (token_ids is the prefill until it is done; the request's own press, or the engine's)
            first = self.press.capture_from(len(state.token_ids), state.kv_compression)
            start = state.num_computed_tokens
            lo = start + n if first is None else max(start, first)
            if lo < start + n:
                last = rows_of[i][-1]  # the row of position start + n - 1
                rows.extend(range(last - (start + n - 1 - lo), last + 1))
                captured.append((state, start + n - lo))
        if rows:
            meta.press_rows = self._tensor(rows)
        return captured

    def _press_after_forward(self, step, captured, meta: AttentionMetadata) -> None:
        """Keep each prefill's captured queries; compress the sequences whose prefill this step completed."""
        k = 0
        for state, count in captured:
            stash = state.press_queries if state.press_queries is not None else {}
            for layer, q in meta.press_queries.items():
                stash.setdefault(layer, []).append(q[k : k + count])
            state.press_queries = stash
            k += count
        for state, _, samples in step:
            if samples and state.kv_kept is not None and state.num_evicted is None:
                n = len(state.token_ids)
                queries = {layer: torch.cat(qs) for layer, qs in (state.press_queries or {}).items()}
                self.press.compress(
                    self.kv_caches,
                    self.kv_groups,
                    state.block_tables,
                    state.kv_kept,
                    n,
                    queries,
                    self.block_size,
                    state.kv_compression,
                )
                state.num_evicted = [n - kept for kept in state.kv_kept]
                state.press_queries = None

    @staticmethod
    def _entries(step, drafts: list[list[int]]) -> tuple[list[tuple[list[int], int, int, list[int]]], list[range]]:
        """The step's entries for _prepare, and per request the range of its entries. A request with d drafts is
        1 + d one-token entries (decode rows: its last token, then each draft at the position after), each
        attending to the cache up to itself. Every row's KV is written before any row attends, so a draft sees the
        KV of those before it; and a decode-only step stays one (the fused step, the small-batch kernels)."""
        entries: list[tuple[list[int], int, int, list[int]]] = []
        entries_of = []
        for (state, n, _), d in zip(step, drafts):
            first = len(entries)
            tables = state.block_tables if len(state.block_tables) > 1 else state.block_table  # per KV cache group
            offsets = state.slot_offsets()  # KV compression: position - cache slot, per group
            offsets = offsets if len(state.block_tables) > 1 else offsets[0]
            if d:
                ids = state.token_ids + d
                entries.extend((ids, state.num_computed_tokens + t, 1, tables, offsets) for t in range(n))
            else:
                entries.append((state.token_ids, state.num_computed_tokens, n, tables, offsets))
            entries_of.append(range(first, len(entries)))
        return entries, entries_of

    @staticmethod
    def _prompt_rows(step, last_rows: list[int]) -> dict[int, tuple[int, list[int]]]:
        """For each entry that asked for prompt_logprobs: the first prompt token this step scores, and the rows whose
        logits score it and the ones after it (the row at position p predicts the token at p + 1)."""
        scored = {}
        for i, (state, n, _) in enumerate(step):
            if state.params.prompt_logprobs is None:
                continue
            start = state.num_computed_tokens
            end = min(start + n, state.num_prompt_tokens - 1)  # positions start .. end - 1 predict prompt tokens
            if end > start:
                first_row = last_rows[i] - n + 1
                scored[i] = (start + 1, list(range(first_row, first_row + end - start)))
        return scored

    # Rows of logits computed at once when scoring a prompt ([rows, vocab] fp32 each).
    SCORE_CHUNK_ROWS = 256

    def _score_rows(self, hidden: torch.Tensor, rows: list[int], targets: list[int], k: int) -> list:
        """Per row: (logprob of its target token, its top-k (token, logprob), the target's rank: 1 + the tokens more
        likely), over the full vocabulary in fp32."""
        out = []
        for s in range(0, len(rows), self.SCORE_CHUNK_ROWS):
            idx = self._tensor(rows[s : s + self.SCORE_CHUNK_ROWS])
            logp = torch.log_softmax(self.model.compute_logits(hidden[idx]), dim=-1)
            chosen_t = logp.gather(1, self._tensor(targets[s : s + len(idx)]).unsqueeze(1))
            ranks = ((logp > chosen_t).sum(1) + 1).tolist()
            chosen = chosen_t.squeeze(1).tolist()
            if k:
                vals, ids = logp.topk(k, dim=-1)
                tops = [list(zip(i, v)) for i, v in zip(ids.tolist(), vals.tolist())]
            else:
                tops = [[] for _ in chosen]
            out.extend(zip(chosen, tops, ranks))
        return out

    @staticmethod
    def _sample_request(state: RequestState, drafts: list[int] = ()) -> SampleRequest:
        """The sampler's view of state's next token; with drafts, of the token after them (a draft row: its output
        position, and penalties over the drafts before it, as if they had been accepted)."""
        # (only penalties and bad words read the tokens: avoid copying them every step otherwise)
        if state.params.uses_penalties or state.params.bad_words_token_ids:
            return SampleRequest(state.params, state.prompt_token_ids, state.output_token_ids + list(drafts))
        return SampleRequest(state.params, [], [], state.num_output_tokens + len(drafts))

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], block_table: list[int]) -> torch.Tensor:
        """fp32 logits at every position of one sequence, prefilled into block_table (the caller owns the blocks).

        For perplexity / evaluation and parity checks; generation goes through execute_model. With several KV cache
        groups, group g takes block_table's ids moved up by g * (max(block_table) + 1): the caller owns those too.
        """
        tables = block_table
        if len(self.kv_groups) > 1:
            span = max(block_table) + 1
            if span * len(self.kv_groups) > self.kv_info.num_blocks:
                raise ValueError(
                    f"prompt_logits needs {span * len(self.kv_groups)} KV blocks for this model's "
                    f"{len(self.kv_groups)} KV cache groups; the pool has {self.kv_info.num_blocks}"
                )
            tables = [[b + g * span for b in block_table] for g in range(len(self.kv_groups))]
        input_ids, positions, meta, _ = self._prepare([(token_ids, 0, len(token_ids), tables)])
        return self.model.compute_logits(self._forward(input_ids, positions, meta))  # [n, V]

    def _prepare(self, entries: list[tuple[list[int], int, int, list[int]]]):
        """(token_ids, num_computed, num_new, block_table[, slot offset]) per entry -> flat inputs and attention
        metadata.

        Returns input_ids [T], positions [T], AttentionMetadata, and per entry the row of its last new token. With
        several KV cache groups, block_table is one table per group (and the offset one per group). The offset
        (KV compression: the tokens evicted) puts position p in cache slot p - offset; positions stay true.
        """
        if len(self.kv_groups) > 1 and entries and isinstance(entries[0][3][0], list):
            return self._prepare_groups(entries)
        bs = self.block_size
        # Entries with one new token (decodes) first, then prefill chunks: the layout AttentionMetadata expects.
        order = [i for i, e in enumerate(entries) if e[2] == 1] + [i for i, e in enumerate(entries) if e[2] > 1]
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        last_rows = [0] * len(entries)
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        for i in order:
            token_ids, start, n, table = entries[i][:4]
            off = entries[i][4] if len(entries[i]) > 4 else 0
            q_start = len(input_ids)
            input_ids.extend(token_ids[start : start + n])
            positions.extend(range(start, start + n))
            slots.extend(table[(p - off) // bs] * bs + (p - off) % bs for p in range(start, start + n))
            if n == 1:
                decode_tables.append(table[: (start - off) // bs + 1])
                decode_lens.append(start - off + 1)  # (the slots it reads: every kept token and its own)
            else:
                assert off == 0, "a compressed sequence prefills no more (a preempted one comes back whole)"
                context = None
                if start > 0:  # earlier KV (prefix-cache hit or previous chunk) is read back from the cache
                    context = self._tensor([table[p // bs] * bs + p % bs for p in range(start + n)])
                prefills.append(PrefillChunk(q_start, n, start + n, context))
            last_rows[i] = len(input_ids) - 1

        meta = AttentionMetadata(
            slot_mapping=self._tensor(slots), num_decode_tokens=len(decode_lens), prefills=prefills
        )
        if decode_lens:
            width = max(len(t) for t in decode_tables)
            meta.decode_block_tables = self._tensor([t + [0] * (width - len(t)) for t in decode_tables])
            meta.decode_context_lens = self._tensor(decode_lens)
            meta.decode_max_context_len = max(decode_lens)
        return self._tensor(input_ids), self._tensor(positions), meta, last_rows

    def _prepare_groups(self, entries):
        """_prepare with one block table per KV cache group: the inputs once, an AttentionMetadata per group (its
        slots, block tables and context slots), and each layer's found by its window (AttentionMetadata.for_window)."""
        metas = []
        for g in range(len(self.kv_groups)):
            per_group = [(e[0], e[1], e[2], e[3][g], e[4][g] if len(e) > 4 else 0) for e in entries]
            input_ids, positions, meta, last_rows = self._prepare(per_group)
            metas.append(meta)
        windows = [g.window for g in self.kv_groups]
        if self.press is not None or len(set(windows)) < len(windows):  # a window in more than one group: by layer
            metas[0].by_layer = [metas[g] for g in self._group_of_layer]
        else:
            metas[0].by_window = {w: metas[g] for w, g in self._group_of_window.items()}
        return input_ids, positions, metas[0], last_rows

    def _tensor(self, values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)


class _LayerHook:
    """AttentionMetadata.kv_hook for a layer-by-layer KV connector: the model's layer loop calls these two."""

    __slots__ = ("connector", "metadata", "kv_caches")

    def __init__(self, connector, metadata, kv_caches: list[torch.Tensor]) -> None:
        self.connector, self.metadata, self.kv_caches = connector, metadata, kv_caches

    def wait_for_layer_load(self, layer: int) -> None:
        self.connector.wait_for_layer_load(layer)

    def save_kv_layer(self, layer: int) -> None:
        self.connector.save_kv_layer(layer, self.kv_caches[layer], self.metadata)
