"""Admission control: what a request will cost, weighed before it is queued. Pure Python.

A request asks for n sequences per prompt, each of up to prompt + max_tokens tokens. Before it reaches the
waiting queue it must pass, in this order:
1. what it could never get (a 400, `NeverFits`): more sequences than its share of the waiting queue, n copies of
   one prompt (as many as run at once, max_num_seqs) that the whole KV cache cannot hold side by side, or more host
   memory than the server has left above its start-up footprint;
2. what it cannot get now (429 / 503 with Retry-After, `Overloaded`): room in the waiting queue, room in the
   host-memory budget (the sum of admitted requests' estimates), and the process's measured RSS below the ceiling.

A request's own kv_compression (SamplingParams.kv_compression) is checked against the engine before any of that
(`check_kv_compression`): a press the engine cannot run for it is a 400 naming the field.

The host-memory estimate is linear: bytes per sequence, per token, and per logprob entry a token carries, with
coefficients measured on the engine's own per-request structures (see `HostCost`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from infertune.config import EngineConfig, LimitsConfig
from infertune.kv_compression import KVCompressionConfig
from infertune.sampling_params import ParamError


class NeverFits(ValueError):
    """A request no state of the server could ever admit; `param` names what to change (HTTP 400)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


class Overloaded(RuntimeError):
    """The server cannot take the request now; retry after `retry_after` seconds. `reason`: queue_full /
    memory (the budget of admitted requests) / memory_rss (the process is over its ceiling)."""

    def __init__(self, reason: str, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.reason, self.retry_after = reason, retry_after


@dataclass(slots=True, frozen=True)
class HostCost:
    """Host bytes a request holds while it lives: per sequence, per token, per logprob entry of a token."""

    per_seq: float
    per_token: float
    per_logprob: float

    def bytes(self, seqs: int, tokens_per_seq: int, logprobs: int | None) -> int:
        entries = 0 if logprobs is None else 1 + logprobs  # the sampled token and its top-k alternatives
        return int(seqs * (self.per_seq + tokens_per_seq * (self.per_token + entries * self.per_logprob)))


@dataclass(slots=True, frozen=True)
class Cost:
    seqs: int
    host_bytes: int


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


class Admission:
    """The ledger of admitted requests' costs, and the checks a new one must pass. Used by one thread only."""

    def __init__(
        self,
        limits: LimitsConfig,
        kv_blocks: int,
        block_size: int,
        host: HostCost | None,
        ceiling_bytes: int,
        baseline_bytes: int,
        rss: Callable[[], int],
        max_num_seqs: int = 2**31,
        blocks_per_seq: Callable[[int], int] | None = None,
    ) -> None:
        """blocks_per_seq: the most KV blocks a sequence of so many tokens holds (the block manager's: fewer than its
        tokens' blocks where layers attend within sliding windows); None: every token's block."""
        self.limits = limits
        self.blocks_per_seq = blocks_per_seq or (lambda tokens, prompt=None: -(-tokens // block_size))
        self.max_num_seqs = max_num_seqs  # the most sequences that ever run (hold KV) at once
        self.kv_blocks, self.block_size = kv_blocks, block_size
        self.host = host
        self.ceiling_bytes, self.baseline_bytes = ceiling_bytes, baseline_bytes
        self.rss = rss
        self._held: dict[str, Cost] = {}
        self.reserved_bytes = 0

    @property
    def budget_bytes(self) -> int:
        """Host memory that admitted requests may take together: the ceiling less the start-up footprint."""
        return max(self.ceiling_bytes - self.baseline_bytes, 0)

    def cost(self, prompt_lens: list[int], max_tokens: list[int], n: int, logprobs: int | None) -> Cost:
        """Check what the request could never get (NeverFits) and return what it will hold."""
        assert self.host is not None, "the host cost must be measured before requests are weighed"
        seqs = n * len(prompt_lens)
        share = self.limits.max_seqs_per_request
        if seqs > share:
            raise NeverFits(
                "n",
                (
                    f"this request asks for {seqs} sequences ({len(prompt_lens)} prompt(s) x n={n}) but one request may "
                    f"queue at most {share} ({self.limits.max_request_share:g} of max_waiting={self.limits.max_waiting}); "
                    f"lower n or send fewer prompts at once"
                ),
            )
        host_bytes = 0
        together = min(n, self.max_num_seqs)  # the samples of one prompt run side by side, as many as may run
        for p, m in zip(prompt_lens, max_tokens):
            blocks = together * self.blocks_per_seq(p + m, p)
            if blocks > self.kv_blocks:
                raise NeverFits(
                    "n" if n > 1 else "max_tokens",
                    (
                        f"n={n} x (prompt {p} + max_tokens {m} tokens) needs {blocks} KV-cache blocks at once "
                        f"({together} sequences side by side) but the cache holds {self.kv_blocks} "
                        f"({self.kv_blocks * self.block_size} tokens); lower n or max_tokens"
                    ),
                )
            host_bytes += self.host.bytes(n, p + m, logprobs)
        if host_bytes > self.budget_bytes:
            raise NeverFits(
                "n" if n > 1 else "max_tokens",
                (
                    f"this request would hold about {_mib(host_bytes)} of host memory ({seqs} sequence(s), "
                    f"logprobs={logprobs}) but the server's budget for requests is {_mib(self.budget_bytes)} "
                    f"(ceiling {_mib(self.ceiling_bytes)} less {_mib(self.baseline_bytes)} at start-up); lower n, "
                    f"max_tokens or logprobs"
                ),
            )
        return Cost(seqs, host_bytes)

    def reserve(self, key: str, cost: Cost, num_waiting: int) -> None:
        """Hold cost under key, or raise Overloaded when the queue or the memory has no room now."""
        if key in self._held:  # (a caller's id used twice at once: its second submission is refused, nothing else)
            raise ValueError(f"request id {key!r} is already in use")
        if num_waiting + cost.seqs > self.limits.max_waiting:
            raise Overloaded(
                "queue_full",
                (
                    f"the server is at capacity ({num_waiting} of {self.limits.max_waiting} waiting sequences taken, "
                    f"this request needs {cost.seqs}); retry later"
                ),
            )
        if self.reserved_bytes + cost.host_bytes > self.budget_bytes:
            raise Overloaded(
                "memory",
                (
                    f"the server's host-memory budget is taken ({_mib(self.reserved_bytes)} of "
                    f"{_mib(self.budget_bytes)} held by running requests, this one needs {_mib(cost.host_bytes)}); "
                    f"retry later"
                ),
            )
        rss = self.rss()
        if rss > self.ceiling_bytes:
            raise Overloaded(
                "memory_rss",
                (f"the server's memory ({_mib(rss)}) is over its ceiling ({_mib(self.ceiling_bytes)}); retry later"),
                retry_after=5.0,
            )
        self._held[key] = cost
        self.reserved_bytes += cost.host_bytes

    def release(self, key: str) -> None:
        cost = self._held.pop(key, None)
        if cost is not None:
            self.reserved_bytes -= cost.host_bytes

    @property
    def num_held(self) -> int:
        return len(self._held)


def check_kv_compression(request: KVCompressionConfig | None, config: EngineConfig, groups) -> None:
    """A request's own kv_compression against the engine (its options, its KV cache groups: scheduler_output.
    KVCacheGroup): ParamError("kv_compression", why) where the engine cannot run it. A press of "none" (full KV) runs
    anywhere. Any other needs an engine started with kv_compression (its coordinator plans each sequence and its
    runner evicts), not refused there (MLA, speculative decoding, a KV connector), layers the model has, and the same
    count kept in every layer of each full-attention group, since a group's layers share one block table."""
    if request is None:
        return

    def bad(message: str) -> ParamError:
        return ParamError("kv_compression", f"kv_compression: {message}")

    try:
        request.check(config.model.arch.num_hidden_layers)
    except ValueError as e:
        raise bad(str(e).removeprefix("kv_compression ")) from None
    if not request.presses:
        return
    refusal = config.kv_compression_refusal()
    if refusal is not None:
        raise bad(f"this engine runs {refusal}, which KV compression does not run with yet; drop it from the request")
    if config.cache.kv_compression is None:
        raise bad(
            "this engine was started without kv_compression, so it cannot drop a request's KV; start it with "
            'kv_compression (--kv-compression \'{"press": "none"}\' keeps full KV unless a request asks for a press)'
        )
    for group in groups:
        if group.window is not None:
            continue  # (no press compresses a windowed layer: it keeps its window)
        keys = {}
        for layer in group.layers:
            keys.setdefault(request.layer_key(layer), []).append(layer)
        if len(keys) > 1:
            a, b = (layers[0] for layers in list(keys.values())[:2])
            raise bad(
                f"this press keeps different token counts in layers {a} and {b}, which share one KV cache group (one "
                f"block table: layers {','.join(map(str, group.layers))}) in this engine; per-layer budgets "
                "(pyramidkv, layer_ratios, rules over some layers) need an engine whose own kv_compression splits "
                "its layers alike (start it with such a press), or send a press that treats every layer alike"
            )
