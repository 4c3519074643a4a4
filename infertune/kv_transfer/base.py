"""The KV connector contract (modelled on vLLM's KVConnectorBase_V1): how prompt KV moves between engines.

A transfer has two halves. The scheduler side runs in the engine's process next to the block manager and decides:
how many of a request's prompt tokens the remote side already holds (`get_num_new_matched_tokens`), what to load
into the blocks just allocated for them (`update_state_after_alloc`), and, when a request finishes, whether its
blocks must outlive it for a consumer to read (`request_finished` -> (delay_free, kv_transfer_params)). What it asks
the workers to do goes down in each step's SchedulerOutput as plain data (`KVConnectorMetadata`), never as live
objects, so the same connector works with the in-process, worker-process and tensor-parallel executors: each
tensor-parallel rank moves its own share of the KV heads.

The worker side runs beside the runner's KV cache: `register_kv_caches` once (each layer's cache), `start_load_kv`
before the step's forward, `wait_for_layer_load` before a layer reads its cache, `save_kv_layer` after a layer wrote
it, `wait_for_save` at the end of the step and `get_finished` after it (what completed since; the engine hands it to
the scheduler side's `update_finished`). A connector whose worker sets `layerwise = True` gets the two per-layer
calls from inside the forward, layer by layer, in every step that carries its metadata (those steps run the
per-module forward, not the fused C step or a compiled graph: a layer-by-layer transport overlaps its transfers with
the earlier layers' compute); otherwise `start_load_kv` must have loaded every layer when it returns (the local and
p2p connectors copy synchronously) and the runner calls `save_kv_layer` for each layer after the whole forward.

Other transports (NIXL, Mooncake, LMCache style) plug in without touching infertune: `kv_connector="pkg.module:NAME"`
names a `KVConnectorSpec` (the two classes and the settings parser) that each process imports.

Roles: a producer (the prefill instance) computes prompts and keeps their KV for a consumer (the decode instance),
which loads it and decodes without computing the prompt again.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field


class KVTransferError(ValueError):
    """A KV transfer that cannot go ahead: the two sides' layouts differ (a configuration mistake, HTTP 500), or a
    transfer failed under kv_load_failure_policy="fail" (HTTP 503). A ValueError, so the admission path refuses the
    request with it; the server reads .status and .code."""

    def __init__(self, message: str, status: int = 503, code: str = "kv_transfer_failed") -> None:
        super().__init__(message)
        self.status, self.code = status, code


# What must be equal on both sides for KV blocks to be copied as bytes, in the order a mismatch names them.
LAYOUT_KEYS = (
    "model",
    "architecture",
    "num_layers",
    "tensor_parallel_size",
    "block_size",
    "kv_cache_dtype",
    "cache_dtype",
    "block_shape",
    "kv_cache_groups",
)


def connector_mismatch(mine: str, theirs: object, my_role: str, their_role: str) -> str | None:
    """The line naming two sides' different kv_connector, None where they agree (or theirs says nothing)."""
    if theirs is None or theirs == mine:
        return None
    return (
        f"KV connector mismatch: kv_connector: this {my_role} has {mine!r}, the {their_role} {theirs!r}; start both "
        "sides with the same --kv-connector"
    )


def layout_mismatch(mine: dict, theirs: dict, my_role: str, their_role: str) -> list[str]:
    """One line per layout key that differs: 'block_size: this consumer has 4, the producer 8'."""
    return [
        f"{k}: this {my_role} has {mine.get(k)!r}, the {their_role} {theirs.get(k)!r}"
        for k in LAYOUT_KEYS
        if mine.get(k) != theirs.get(k)
    ]


@dataclass(slots=True)
class KVLoad:
    """Copy a request's prompt KV from a producer's blocks into this engine's blocks (plain data)."""

    req_id: str
    engine_id: str  # the producer's
    src_block_ids: list[int]  # the producer's blocks, in order
    dst_block_ids: list[int]  # this engine's blocks receiving them, same order
    producer_num_blocks: int  # the size of the producer's pool (its shared file's shape)
    expires_at: float  # the producer frees the blocks after this wall-clock time (time.time())
    num_local_tokens: int  # prompt tokens this engine had already (prefix cache): a failed load recomputes from here
    num_loaded_tokens: int  # prompt tokens the load covers (after num_local_tokens)
    transfer_id: str = ""  # the producer's lease on the blocks
    peer: str = ""  # where the producer serves them ("host:port" of its store: the p2p connector; "" for local)


@dataclass(slots=True)
class KVConnectorMetadata:
    """What the scheduler side tells the workers this step (travels in SchedulerOutput.kv_connector_metadata)."""

    loads: list[KVLoad] = field(default_factory=list)


class KVConnectorScheduler(abc.ABC):
    """The scheduler side of a connector: pure Python, in the engine's process."""

    role: str  # "producer" | "consumer"
    name: str = ""  # the kv_connector name ("local", "p2p"): answers carry it, a consumer checks it

    def describe(self) -> dict:
        """What this side is, as plain data (the server's GET /kv_transfer; the router checks its instances by it)."""
        return {"kv_role": self.role, "kv_connector": self.name, "layout": getattr(self, "layout", {})}

    @abc.abstractmethod
    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> int:
        """Prompt tokens after num_computed_tokens (this engine's own prefix-cache hits, whole blocks) whose KV the
        remote side holds and will load; 0 for none. Never the prompt's last token: its logits sample the first
        output token, so it is computed here."""

    @abc.abstractmethod
    def update_state_after_alloc(self, seq, block_ids: list[int], num_external_tokens: int) -> None:
        """seq's blocks now cover its num_computed + num_external_tokens + new tokens: plan the load of the external
        ones into them (sent with this step's metadata)."""

    @abc.abstractmethod
    def build_connector_meta(self) -> KVConnectorMetadata | None:
        """What this step's workers must do (None: nothing); clears what was planned."""

    @abc.abstractmethod
    def request_finished(self, seq, block_ids: list[int]) -> tuple[bool, dict | None]:
        """seq finished: (True: keep its blocks, this connector frees them later through `released`, the
        kv_transfer_params a consumer needs to load them (returned to the client))."""

    def check_request(self, kv_transfer_params: dict | None, prompt_token_ids: list[int]):
        """At admission: what seq should load (connector's own plain object), None for nothing; raises
        KVTransferError where the request must be refused."""
        return None

    def released(self) -> list:
        """Sequences whose delayed blocks may be freed now (confirmed, or their lease expired)."""
        return []

    def release(self, transfer_id: str) -> bool:
        """A producer's lease nobody will load (the decode side refused the request): end it now, as a consumer's
        confirm does, so `released` frees its blocks at once instead of when the lease runs out. False where this
        side holds no such lease (or is no producer)."""
        return False

    def update_finished(self, finished_sending: set[str], finished_recving: set[str]) -> None:
        """What the workers' get_finished reported after a step (rank 0's): req ids whose blocks were sent, or
        received, since the last report (an asynchronous transport frees or admits by it; the built-ins copy
        synchronously and ignore it)."""

    def holds_blocks(self) -> bool:
        """Whether finished requests' blocks are still held (a step may then find no room, and wait)."""
        return False

    def after_step(self, metadata: KVConnectorMetadata | None, failed_req_ids: list[str]) -> None:
        """The step that carried `metadata` ran; failed_req_ids are the loads the workers could not do (recomputed)."""

    def stats(self) -> dict[str, tuple[float, str, str]]:
        """name -> (value, 'counter' | 'gauge', help), for /metrics."""
        return {}

    def shutdown(self) -> None:
        """Drop what this engine published."""


class KVConnectorWorker(abc.ABC):
    """The worker side of a connector: beside the runner's KV cache, one per tensor-parallel rank."""

    # True: the runner calls wait_for_layer_load / save_kv_layer from inside the forward, before / after each layer,
    # in the steps that carry this connector's metadata; False: start_load_kv loads everything, saves follow the step
    layerwise: bool = False

    def register_kv_caches(self, kv_caches: list) -> None:
        """Each layer's KV cache (views into the storage: layer i's is kv_caches[i]), once, before the first step."""

    def allocate(self, shape: tuple[int, ...], dtype):
        """The KV cache storage [pages, 2, num_blocks, ...] (None: the runner allocates it itself)."""
        return None

    @abc.abstractmethod
    def start_load_kv(self, metadata: KVConnectorMetadata, kv_storage) -> list[str]:
        """Load what metadata asks into kv_storage before the forward; returns the req ids whose load failed."""

    def wait_for_layer_load(self, layer: int) -> None:
        """Block until `layer`'s KV is loaded (a synchronous connector has loaded it already)."""

    def save_kv_layer(self, layer: int, kv_cache, metadata: KVConnectorMetadata | None) -> None:
        """`layer` has written its KV for this step (a connector that pushes KV sends it here)."""

    def wait_for_save(self) -> None:
        """Block until this step's saves are done (before the blocks may be reused)."""

    def get_finished(self) -> tuple[set[str], set[str]]:
        """(req ids whose sending finished, req ids whose receiving finished) since the last call."""
        return set(), set()

    def shutdown(self) -> None:
        """Release the storage."""


@dataclass(frozen=True)
class KVConnectorSpec:
    """A connector as kv_connector names it: its two halves and its settings. Built-ins: "local", "p2p"; any other
    is "pkg.module:NAME", NAME a KVConnectorSpec in that module (imported by the engine and by every worker).

    scheduler(role, settings, layout, num_blocks, block_size, policy) -> KVConnectorScheduler
    worker(role, settings, rank) -> KVConnectorWorker
    settings(kv_connector_config dict | None) -> dict: the config with its defaults, a ValueError naming a bad key;
        the result must keep "engine_id" (the engine's id, made in the driver)."""

    name: str
    scheduler: type
    worker: type
    settings: object
    devices: tuple[str, ...] = ("cpu",)  # the device types whose KV cache it moves
