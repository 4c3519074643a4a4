"""The draft model of speculative decoding (method "draft_model"): a second, small model with the target's vocabulary
that proposes each decoding request's next drafts, greedily, at the end of the worker's step.

The scheduler asks for them (SchedulerOutput.num_drafts_to_propose: how many, per request that samples this step),
the worker drafts them once the step's tokens are known, and they go back with the step's output
(SamplerOutput.draft_token_ids) for the scheduler to schedule and the target to verify in the next step, as n-gram
drafts are. Proposing after the step, not at the start of the next, keeps the step's contract as it is: the
scheduler knows every draft before it allocates the KV slots for them.

The draft model keeps its own paged KV cache, its blocks handed out here per request (the engine's block manager
never sees them). A request's draft KV holds its first `num_valid` tokens, and the drafts it proposed last time
(all but the last, whose KV was never needed) after them: where the target accepted those drafts their KV stays
valid, and each proposal first runs the tokens the draft has not seen yet (the whole prompt the first time, then the
bonus token and any accepted draft past the written ones) as one chunk, then one decode row a further draft. Drafts
are argmax tokens: the verification (runner/sampler.verify_drafts) is exact for any proposal that puts all its mass
on one token, so greedy output is the target's and sampling keeps the target's distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from infertune.backends import Backend
from infertune.config import ArchConfig, EngineConfig
from infertune.layers.attention import attention_backend
from infertune.layers.kernel_op import attach_kernels
from infertune.models.loader import load_model
from infertune.runner.request_state import RequestStates
from infertune.scheduler_output import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(slots=True)
class _DraftState:
    block_table: list[int] = field(default_factory=list)
    num_valid: int = 0  # leading tokens of the request whose KV the draft cache holds
    written: list[int] = field(default_factory=list)  # the drafts whose KV follows them (maybe rejected since)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def check_draft_vocab(draft: ArchConfig, target: ArchConfig, draft_dir: str, target_tokenizer: str | None) -> None:
    """A draft model must share the target's vocabulary: its token ids are the target's. Its size is compared, and
    where the draft's folder has a tokenizer, the token each id stands for (a tokenizer of the same size that maps
    ids to other text would draft tokens the target never meant, every one rejected)."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config model={draft_dir!r} has a vocabulary of {draft.vocab_size} tokens, the target "
            f"{target.vocab_size}: a draft model must use the target's tokenizer; pick one of the same family"
        )
    if target_tokenizer is None or not any((Path(draft_dir) / f).exists() for f in _TOKENIZER_FILES):
        return
    from transformers import AutoTokenizer  # (the engine's own loader is a layer above the runner)

    theirs = AutoTokenizer.from_pretrained(draft_dir).get_vocab()
    ours = AutoTokenizer.from_pretrained(target_tokenizer).get_vocab()
    if theirs != ours:
        differ = sorted(t for t in ours.keys() | theirs.keys() if ours.get(t) != theirs.get(t))
        raise ValueError(
            f"speculative_config model={draft_dir!r} has another tokenizer than the target's ({len(differ)} tokens "
            f"with other ids, e.g. {differ[0]!r}: {theirs.get(differ[0])} in the draft's, {ours.get(differ[0])} in "
            f"the target's): a draft model must use the target's tokenizer; pick one of the same family"
        )


class DraftModel:
    # Unseen tokens of a request up to this many run as decode rows, more as one prefill chunk.
    MAX_CATCH_UP_ROWS = 8

    def __init__(
        self,
        config: EngineConfig,
        backend: Backend,
        dtype: torch.dtype,
        target_blocks: int,
        prepare: Callable,
        kernels=None,
    ) -> None:
        """prepare: the target runner's ModelRunner._prepare (entries -> inputs and attention metadata), which needs
        only the block size and the device, the draft's too; kernels: the target's decode kernels (None: torch's
        operators), which the draft's linears, norms and rotary use as the target's do under the per-op forward."""
        spec = config.scheduler.speculative_config
        assert spec is not None and spec.method == "draft_model"
        self.arch = arch = ArchConfig.from_model_dir(spec.model)
        check_draft_vocab(arch, config.model.arch, spec.model, config.model.tokenizer)
        self.device = backend.device
        # Drafts only at the positions the draft model was made for (as vLLM's draft max_model_len): past them its
        # rotary runs beyond its context, and its drafts are noise the target rejects at a draft row's cost.
        self.max_model_len = min(config.model.max_model_len, arch.max_position_embeddings)
        if self.max_model_len < config.model.max_model_len:
            log.warning(
                "draft model %s: %d positions (max_position_embeddings), the target %d; sequences past %d decode "
                "without drafts",
                spec.model,
                arch.max_position_embeddings,
                config.model.max_model_len,
                self.max_model_len,
            )
        self.block_size = config.cache.block_size
        self.prepare = prepare
        self.attn = attention_backend(arch, config.cache.kv_cache_dtype, dtype)
        self.model = load_model(
            arch,
            spec.model,
            dtype,
            self.device,
            self.max_model_len,
            self.attn,
            backend=backend,
            prepack=config.model.prepack_weights,
            kernels=kernels,
        )
        if kernels is not None and config.model.decode_kernels == "auto":
            attach_kernels(self.model, kernels)
        # As many tokens as the target's cache holds, and a block more a sequence for the drafts past its own: a
        # request's draft KV never runs past its target KV by more than the proposed drafts.
        num_blocks = target_blocks + config.scheduler.max_num_seqs
        shape = self.attn.kv_cache_shape(num_blocks, self.block_size, arch.num_key_value_heads, arch.head_dim)
        storage = torch.zeros(
            (arch.num_hidden_layers, *shape), dtype=self.attn.cache_dtype or dtype, device=self.device
        )
        self.kv_caches = list(storage.unbind(0))
        self.free_blocks = list(range(num_blocks - 1, -1, -1))  # a stack, lowest id on top
        self.states: dict[str, _DraftState] = {}
        log.info("draft model %s: %d blocks of KV", spec.model, num_blocks)

    def forget(self, req_id: str) -> None:
        state = self.states.pop(req_id, None)
        if state is not None:
            self.free_blocks.extend(reversed(state.block_table))

    def _reserve(self, state: _DraftState, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(state.block_table)
        if need > len(self.free_blocks):
            return False
        state.block_table.extend(self.free_blocks.pop() for _ in range(max(need, 0)))
        return True

    def propose(
        self, out: SchedulerOutput, requests: RequestStates, sampled: list[int | None]
    ) -> list[list[int] | None] | None:
        """After the step: per scheduled request, the drafts for its next step where the scheduler asked for some
        and the step sampled its token (None otherwise). Forgets the finished requests first."""
        for req_id in out.finished_req_ids:
            self.forget(req_id)
        if not out.num_drafts_to_propose:
            return None
        todo: list[tuple[int, list[int], _DraftState, int]] = []  # (row, tokens, state, drafts to propose)
        for i, req_id in enumerate(out.req_ids):
            tokens = requests.requests[req_id].token_ids
            k = min(out.num_drafts_to_propose.get(req_id, 0), self.max_model_len - len(tokens))
            if k <= 0 or sampled[i] is None:
                continue
            state = self.states.setdefault(req_id, _DraftState())
            # the written drafts that the request's tokens now hold keep their KV
            valid = state.num_valid
            for t in state.written:
                if valid >= len(tokens) or tokens[valid] != t:
                    break
                valid += 1
            state.num_valid = min(valid, len(tokens) - 1)  # the last token runs again: its logits give the first draft
            if self._reserve(state, len(tokens) + k - 1):
                todo.append((i, tokens, state, k))
            # (no block left: no drafts this time; the KV it has stays valid)
        proposals: list[list[int] | None] = [None] * len(out.req_ids)
        if not todo:
            return proposals
        drafts: list[list[int]] = [[] for _ in todo]
        # The first draft: the tokens the draft model has not seen (a few after a step: decode rows, each attending up
        # to itself, as the target's drafts run; a prompt: one chunk); then one decode row a draft.
        entries, last = [], []
        for _, tokens, s, _ in todo:
            n = len(tokens) - s.num_valid
            if n <= self.MAX_CATCH_UP_ROWS:
                entries.extend((tokens, s.num_valid + t, 1, s.block_table) for t in range(n))
            else:
                entries.append((tokens, s.num_valid, n, s.block_table))
            last.append(len(entries) - 1)
        active = list(range(len(todo)))
        while active:
            for j, token in zip(active, self._argmax(entries, last)):
                drafts[j].append(token)
            active = [j for j in active if len(drafts[j]) < todo[j][3]]
            entries = []
            for j in active:
                _, tokens, state, _ = todo[j]
                ids = tokens + drafts[j]
                entries.append((ids, len(ids) - 1, 1, state.block_table))
            last = list(range(len(entries)))
        for (i, tokens, state, _), d in zip(todo, drafts):
            state.num_valid = len(tokens)
            state.written = d[:-1]
            proposals[i] = d
        return proposals

    def _argmax(self, entries: list[tuple[list[int], int, int, list[int]]], read: list[int]) -> list[int]:
        """One forward of the draft model over entries (token_ids, num_computed, num_new, block_table); the argmax
        token after the last new token of each entry in `read`."""
        input_ids, positions, meta, last_rows = self.prepare(entries)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)  # [T, hidden]
        rows = torch.tensor([last_rows[e] for e in read], device=self.device)
        logits = self.model.compute_logits(hidden[rows])  # [N, V]
        return logits.nan_to_num(nan=float("-inf")).argmax(dim=-1).tolist()
