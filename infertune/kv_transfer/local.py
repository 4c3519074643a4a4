"""The single-host KV connector ("local"): a producer's KV cache lives in shared memory, a consumer copies blocks.

Everything sits under one directory (kv_connector_config "path", /dev/shm/infertune-kv by default; both sides must
name the same one):

- `<role>-<engine_id>.json`: each engine's card (role, pid, KV layout, pool size), written at start-up. A consumer
  and a producer read each other's at start-up and refuse to start when the layouts differ (model, block size, KV
  dtype, block shape, tensor-parallel size), naming both sides' values; a consumer checks its producer's card again
  at the first transfer from it.
- `<engine_id>-rank<r>.kv`: a producer rank's whole KV cache, a shared file mapped as the runner's KV storage, so
  after a prefill its blocks are readable where they lie: nothing is copied on the producer's side.
- `leases/<engine_id>.<transfer_id>`: one file a finished prefill whose blocks the producer keeps for a consumer.
  The consumer deletes it once its workers copied the blocks (the confirmation); the producer frees the blocks when
  the file is gone or when the lease (kv_connector_config "lease_s", 30 s) has run out, whichever is first.

A consumer copies only what it can trust: the producer's card must exist with a live pid (a restarted producer has a
new engine id), the prompt's tokens must be the producer's (their hash), and the copy must finish before the lease
ends (wall-clock time on one host; it starts only with "margin_s" left, and is checked again after). What fails at
admission follows kv_load_failure_policy (recompute: a plain prefill; fail: a 503 naming the cause); a lease that
runs out while the request waits in the consumer's queue, and a copy the worker finds invalid, are recomputed
whatever the policy (the worker computes the whole prompt in that step).

Tensor parallel: rank r of the consumer copies from rank r of the producer (each holds its own KV heads), so both
must have the same tensor_parallel_size (a layout key). CPU only: the pool is host memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import mmap
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

from infertune.kv_transfer.base import (
    KVConnectorMetadata,
    KVConnectorScheduler,
    KVConnectorWorker,
    KVLoad,
    KVTransferError,
    connector_mismatch,
    layout_mismatch,
)
from infertune.scheduler_output import NULL_BLOCK, entry_block

log = logging.getLogger(__name__)

DEFAULT_PATH = "/dev/shm/infertune-kv"
DEFAULT_LEASE_S = 30.0
DEFAULT_MARGIN_S = 1.0
_CONFIG_KEYS = {"path", "lease_s", "margin_s", "engine_id"}


def connector_settings(cfg: dict | None) -> dict:
    """kv_connector_config with its defaults; ValueError naming an unknown key or a bad value."""
    cfg = dict(cfg or {})
    unknown = set(cfg) - _CONFIG_KEYS
    if unknown:
        raise ValueError(
            f"kv_connector_config: unknown keys {sorted(unknown)} for the local connector; it takes "
            f"{sorted(_CONFIG_KEYS)}"
        )
    out = {
        "path": str(cfg.get("path") or DEFAULT_PATH),
        "lease_s": float(cfg.get("lease_s", DEFAULT_LEASE_S)),
        "margin_s": float(cfg.get("margin_s", DEFAULT_MARGIN_S)),
        "engine_id": str(cfg.get("engine_id") or ""),
    }
    if not out["lease_s"] > 0 or not 0 <= out["margin_s"] < out["lease_s"]:
        raise ValueError(
            f"kv_connector_config: lease_s ({out['lease_s']}) must be > 0 and margin_s "
            f"({out['margin_s']}) in [0, lease_s)"
        )
    return out


def prompt_hash(token_ids: list[int]) -> str:
    return hashlib.sha1(b",".join(str(t).encode() for t in token_ids)).hexdigest()[:16]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _write_json(path: Path, value: dict) -> None:
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def rank_file(path: str, engine_id: str, rank: int) -> Path:
    return Path(path) / f"{engine_id}-rank{rank}.kv"


def group_windows(layout: dict) -> list[int | None]:
    """The KV cache groups' windows a layout names (None: full attention); one full group where it names none."""
    return list(layout.get("kv_cache_groups") or [None])


def needed_from(window: int | None, query: int, block_size: int) -> int:
    """The first block of a group a query at position `query` (or later) reads: 0 for full attention, else the
    block of its window's first key (query - window + 1), as KVCacheCoordinator.first_live_block."""
    return 0 if window is None else max(0, query - window + 1) // block_size


def tables_of(seq, num_groups: int) -> list[list[int]]:
    """seq's block table in each KV cache group (a model of one group: its one table)."""
    tables = list(getattr(seq, "block_tables", None) or [seq.block_table])
    return tables + [[] for _ in range(num_groups - len(tables))]


@dataclass(slots=True)
class RemoteKV:
    """What a consumer's request will load: the producer's answer, checked at admission."""

    engine_id: str
    transfer_id: str
    block_ids: list[list[int]]  # per KV cache group (NULL_BLOCK before a windowed group's window)
    num_tokens: int
    expires_at: float
    producer_num_blocks: int
    users: int = 1  # the request's samples that still have to load (or drop) it; at 0 the lease is confirmed


class LocalConnectorScheduler(KVConnectorScheduler):
    name = "local"

    @property
    def _log(self) -> logging.Logger:
        """The logger of the connector's own module (the p2p consumer's messages under kv_transfer.p2p)."""
        return logging.getLogger(type(self).__module__)

    def __init__(self, role: str, settings: dict, layout: dict, num_blocks: int, block_size: int, policy: str):
        assert role in ("producer", "consumer")
        self.role, self.layout, self.block_size, self.policy = role, layout, block_size, policy
        self.windows = group_windows(layout)
        self.path = Path(settings["path"])
        self.lease_s, self.margin_s = settings["lease_s"], settings["margin_s"]
        self.engine_id = settings["engine_id"]
        assert self.engine_id, "ParallelConfig gives every engine with a kv_role an engine_id"
        (self.path / "leases").mkdir(parents=True, exist_ok=True)
        self._cards: dict[str, dict] = {}  # producer engine id -> its card (checked once)
        self._loads: list[KVLoad] = []  # planned for the next step
        self._inflight: dict[str, RemoteKV] = {}  # req id -> what its load in the step running reads
        self._leases: dict[str, tuple[object, float]] = {}  # transfer id -> (seq, expires_at)
        self.counts = dict.fromkeys(
            ("loads", "tokens_loaded", "load_failures", "leases_confirmed", "leases_expired", "transfers_granted"), 0
        )
        self._clean_stale()  # (either side: a SIGKILLed producer's pool would hold its memory in /dev/shm until then)
        try:
            self._check_peers()
        except ValueError:
            self.shutdown()  # (a producer's workers made its pool files already)
            raise
        self.card = {
            "engine_id": self.engine_id,
            "role": role,
            "pid": os.getpid(),
            "layout": layout,
            "num_blocks": num_blocks,
            "path": str(self.path),
            "created": time.time(),
        }
        _write_json(self.path / f"{role}-{self.engine_id}.json", self.card)
        log.info("KV connector local: %s %s under %s", role, self.engine_id, self.path)

    # ---- start-up ------------------------------------------------------------------------------
    def _cards_of(self, role: str) -> list[dict]:
        cards = []
        for p in sorted(self.path.glob(f"{role}-*.json")):
            card = _read_json(p)
            if card and card.get("engine_id") != self.engine_id and _alive(int(card.get("pid", -1))):
                cards.append(card)
        return cards

    def _check_peers(self) -> None:
        """Refuse to start beside a live peer of the other role whose KV layout differs."""
        other = "consumer" if self.role == "producer" else "producer"
        for card in self._cards_of(other):
            bad = layout_mismatch(self.layout, card.get("layout") or {}, self.role, other)
            if bad:
                raise ValueError(
                    f"KV connector mismatch with the {other} {card['engine_id']} (pid {card['pid']}) under "
                    f"{self.path}: " + "; ".join(bad) + ". Start both sides with the same model, dtype, "
                    "kv_cache_dtype, block_size and tensor_parallel_size (or give them different "
                    'kv_connector_config {"path": ...})'
                )

    def _clean_stale(self) -> None:
        """Drop what engines that are no longer running left under the path (a killed engine's shutdown never ran):
        a producer's pools and leases, and its card where this is a producer (a consumer keeps it: it names the dead
        producer to a request that still points at it), a consumer's card."""
        for p in [*self.path.glob("producer-*.json"), *self.path.glob("consumer-*.json")]:
            card = _read_json(p)
            if card is None or _alive(int(card.get("pid", -1))):
                continue
            eid = card.get("engine_id", "")
            producer = card.get("role") == "producer"
            stale = [] if producer and self.role == "consumer" else [p]
            if producer and eid:
                stale += [*self.path.glob(f"{eid}-rank*.kv"), *(self.path / "leases").glob(f"{eid}.*")]
            for f in stale:
                with contextlib.suppress(OSError):
                    f.unlink()

    def shutdown(self) -> None:
        files = [self.path / f"{self.role}-{self.engine_id}.json"]
        if self.role == "producer":
            files += [
                *self.path.glob(f"{self.engine_id}-rank*.kv"),
                *(self.path / "leases").glob(f"{self.engine_id}.*"),
            ]
        for f in files:
            with contextlib.suppress(OSError):
                f.unlink()

    # ---- producer ------------------------------------------------------------------------------
    def request_finished(self, seq, block_ids: list[int]) -> tuple[bool, dict | None]:
        if self.role == "consumer":
            remote = getattr(seq, "kv_transfer", None)
            if remote is not None:  # finished (aborted) before it loaded: it will not read the blocks
                seq.kv_transfer = None
                self._drop_user(remote)
            return False, None
        return self._grant(seq, block_ids)

    def _grant(self, seq, block_ids: list[int]) -> tuple[bool, dict | None]:
        """A producer's finished prefill asked for remote decode: lease its prompt blocks (_publish_lease) and answer
        with what a consumer needs to load them (plus _where())."""
        params = getattr(seq.params, "kv_transfer_params", None) or {}
        if not params.get("do_remote_decode") or seq.status.value == "abort":
            return False, None
        n = seq.num_prompt_tokens
        if seq.num_computed_tokens < n:
            return False, None
        # per KV cache group, the prompt's blocks (a windowed group's entries before its window are NULL_BLOCK: freed
        # as the prefill went; what a consumer's query at the prompt's last token reads is all there)
        nb = -(-n // self.block_size)
        tables = [list(t[:nb]) for t in tables_of(seq, len(self.windows))]
        transfer_id = uuid.uuid4().hex[:16]
        expires = time.time() + self.lease_s
        self._publish_lease(transfer_id, expires)
        self._leases[transfer_id] = (seq, expires)
        self.counts["transfers_granted"] += 1
        return True, {
            "do_remote_prefill": True,
            "kv_connector": self.name,
            "engine_id": self.engine_id,
            "transfer_id": transfer_id,
            "block_ids": tables[0] if len(tables) == 1 else tables,  # (a model of one group: one flat list)
            "num_tokens": n,
            "prompt_hash": prompt_hash(seq.prompt_token_ids),
            "expires_at": expires,
            **self._where(),
        }

    def _publish_lease(self, transfer_id: str, expires: float) -> None:
        """Where consumers see that the lease stands: a file under the shared path."""
        (self.path / "leases" / f"{self.engine_id}.{transfer_id}").touch()

    def _where(self) -> dict:
        """How a consumer reaches this producer, in its answer."""
        return {"path": str(self.path)}

    def holds_blocks(self) -> bool:
        return bool(self._leases)

    def release(self, transfer_id: str) -> bool:
        if transfer_id not in self._leases:  # (only this producer's own leases: never a path from the request)
            return False
        self._end_lease(transfer_id)
        return True

    def _end_lease(self, transfer_id: str) -> None:
        """Take the lease's mark away, as a consumer's confirm does (released() then frees its blocks)."""
        with contextlib.suppress(OSError):
            (self.path / "leases" / f"{self.engine_id}.{transfer_id}").unlink()

    def released(self) -> list:
        if not self._leases:
            return []
        now, out = time.time(), []
        for tid, (seq, expires) in list(self._leases.items()):
            lease = self.path / "leases" / f"{self.engine_id}.{tid}"
            if not lease.exists():
                self.counts["leases_confirmed"] += 1
            elif now > expires:
                with contextlib.suppress(OSError):
                    lease.unlink()
                self.counts["leases_expired"] += 1
                log.warning("KV transfer %s: the lease ran out before a consumer confirmed; blocks freed", tid)
            else:
                continue
            del self._leases[tid]
            out.append(seq)
        return out

    # ---- consumer ------------------------------------------------------------------------------
    def check_request(self, kv_transfer_params: dict | None, prompt_token_ids: list[int]) -> RemoteKV | None:
        p = kv_transfer_params or {}
        if self.role != "consumer" or not p.get("do_remote_prefill"):
            return None
        try:
            return self._check(p, prompt_token_ids)
        except _Failed as e:
            self.counts["load_failures"] += 1
            if self.policy == "fail":
                raise KVTransferError(
                    f"KV transfer from the prefill instance failed: {e} (kv_load_failure_policy=fail; 'recompute' "
                    "would prefill here instead)"
                ) from None
            self._log.warning(
                "KV transfer failed (%s); recomputing the prompt here (kv_load_failure_policy=recompute)", e
            )
            return None

    def _check(self, p: dict, prompt_token_ids: list[int]) -> RemoteKV:
        if p.get("error"):
            raise _Failed(f"the prefill did not run: {p['error']}")
        self._check_connector(p)
        for key in ("engine_id", "transfer_id", "block_ids", "num_tokens", "expires_at"):
            if key not in p:
                raise _Failed(f"kv_transfer_params has no {key!r}")
        if p.get("path") and p["path"] != str(self.path):
            raise KVTransferError(
                f"KV connector mismatch: path: this consumer has {str(self.path)!r}, the producer {p['path']!r}; "
                'give both the same kv_connector_config {"path": ...}',
                500,
                "kv_transfer_mismatch",
            )
        eid = str(p["engine_id"])
        card = self._cards.get(eid) or _read_json(self.path / f"producer-{eid}.json")
        if card is None:
            raise _Failed(f"no producer {eid} under {self.path} (it stopped, or uses another path)")
        if not _alive(int(card.get("pid", -1))):
            raise _Failed(f"the producer {eid} (pid {card.get('pid')}) is no longer running")
        if eid not in self._cards:  # the first transfer from this producer: its layout must be this one's
            bad = layout_mismatch(self.layout, card.get("layout") or {}, "consumer", "producer")
            if bad:
                raise KVTransferError(
                    f"KV connector mismatch with the producer {eid} (pid {card.get('pid')}): " + "; ".join(bad),
                    500,
                    "kv_transfer_mismatch",
                )
            self._cards[eid] = card
        self._check_transfer(p, prompt_token_ids, card)
        if not (self.path / "leases" / f"{eid}.{p['transfer_id']}").exists():
            raise _Failed(f"transfer {p['transfer_id']} was used already, or the producer released it")
        return RemoteKV(
            eid,
            str(p["transfer_id"]),
            self._group_blocks(p["block_ids"]),
            int(p["num_tokens"]),
            float(p["expires_at"]),
            int(card["num_blocks"]),
        )

    def _check_connector(self, p: dict) -> None:
        """A producer of another kind (its answer names its kv_connector): a configuration error, named (HTTP 500)."""
        bad = connector_mismatch(self.name, p.get("kv_connector"), "consumer", "producer")
        if bad:
            raise KVTransferError(bad, 500, "kv_transfer_mismatch")

    def _check_transfer(self, p: dict, prompt_token_ids: list[int], card: dict) -> None:
        """What every connector checks of a producer's answer against the prompt and the producer's card: the same
        prompt, its blocks in the producer's pool, a lease with margin left (clocks apart: the producer checks it
        too)."""
        if int(p["num_tokens"]) != len(prompt_token_ids) or p.get("prompt_hash") != prompt_hash(prompt_token_ids):
            raise _Failed(
                f"the prompt's {len(prompt_token_ids)} tokens are not the {p['num_tokens']} the producer prefilled "
                "(another tokenizer or chat template?)"
            )
        n, pool = int(p["num_tokens"]), int(card.get("num_blocks", 0))
        groups = self._group_blocks(p["block_ids"])
        nb = -(-n // self.block_size)
        for blocks, window in zip(groups, self.windows):
            need = needed_from(window, n - 1, self.block_size)  # (what the query at the last prompt token reads)
            if (
                len(blocks) != nb
                or not all(isinstance(b, int) and 0 <= b < pool for b in blocks[need:])
                or not all(isinstance(b, int) and (b == NULL_BLOCK or 0 <= b < pool) for b in blocks[:need])
            ):
                raise _Failed(
                    f"kv_transfer_params' block_ids are not {p['num_tokens']} tokens' blocks of the producer's pool"
                )
        if time.time() > float(p["expires_at"]) - self.margin_s:
            raise _Failed(f"the producer's lease on transfer {p['transfer_id']} has run out")

    def _group_blocks(self, block_ids) -> list[list[int]]:
        """kv_transfer_params' block_ids as one list per KV cache group: one flat list for a model of one group, a list
        of lists (one per group, in the layout's order) otherwise."""
        groups = [block_ids] if len(self.windows) == 1 else block_ids
        if (
            not isinstance(groups, list)
            or len(groups) != len(self.windows)
            or not all(isinstance(g, list) for g in groups)
        ):
            raise _Failed(f"kv_transfer_params' block_ids are not one list for each of {len(self.windows)} KV groups")
        return [[b if isinstance(b, int) else -2 for b in g] for g in groups]  # (-2: no block id, refused)

    def get_num_new_matched_tokens(self, seq, num_computed_tokens: int) -> int:
        remote = getattr(seq, "kv_transfer", None)
        if remote is None or seq.num_preemptions or len(seq) != remote.num_tokens or seq.skip_prefix_cache:
            return 0  # (skip_prefix_cache: prompt logprobs need every prompt row computed here)
        if time.time() > remote.expires_at - self.margin_s:
            return 0  # (dropped, and counted, once its blocks are allocated)
        return max(0, remote.num_tokens - 1 - num_computed_tokens)

    def update_state_after_alloc(self, seq, block_ids: list[int], num_external_tokens: int) -> None:
        remote = getattr(seq, "kv_transfer", None)
        if remote is None:
            return
        seq.kv_transfer = None  # consumed: a preempted sequence later recomputes
        if num_external_tokens <= 0:
            if len(seq) == remote.num_tokens and seq.num_computed_tokens < remote.num_tokens - 1:
                self.counts["load_failures"] += 1  # (lease ran out while it waited: a plain prefill)
                self._log.warning(
                    "KV transfer %s: the lease ran out while the request waited; recomputing", remote.transfer_id
                )
            self._drop_user(remote)
            return
        start = seq.num_computed_tokens
        first, last = start // self.block_size, -(-(start + num_external_tokens) // self.block_size)
        # Per KV cache group, the blocks from `first` on, a windowed group's from the window of the first query
        # computed here (start + external) on: one flat list of pairs (a block id is a page of every group's layers,
        # so each pair copies the group's own layers' KV with the rest of the block)
        src, dst = [], []
        for g, (table, window) in enumerate(zip(tables_of(seq, len(self.windows)), self.windows)):
            lo = max(first, needed_from(window, start + num_external_tokens, self.block_size))
            src += remote.block_ids[g][lo:last]
            dst += table[lo:last]
        req_id = str(seq.seq_id)
        self._loads.append(
            KVLoad(
                req_id,
                remote.engine_id,
                src,
                dst,
                remote.producer_num_blocks,
                remote.expires_at,
                start,
                num_external_tokens,
                remote.transfer_id,
            )
        )
        self._inflight[req_id] = remote

    def build_connector_meta(self) -> KVConnectorMetadata | None:
        if not self._loads:
            return None
        meta, self._loads = KVConnectorMetadata(self._loads), []
        return meta

    def after_step(self, metadata: KVConnectorMetadata | None, failed_req_ids: list[str]) -> None:
        if metadata is None:
            return
        failed = set(failed_req_ids)
        for load in metadata.loads:
            remote = self._inflight.pop(load.req_id, None)
            if load.req_id in failed:
                self.counts["load_failures"] += 1
            else:
                self.counts["loads"] += 1
                self.counts["tokens_loaded"] += load.num_loaded_tokens
            if remote is not None:
                self._drop_user(remote)

    def _drop_user(self, remote: RemoteKV) -> None:
        """One sample of the request is done with the producer's blocks; after the last, confirm (the producer
        frees them)."""
        remote.users -= 1
        if remote.users <= 0:
            with contextlib.suppress(OSError):
                (self.path / "leases" / f"{remote.engine_id}.{remote.transfer_id}").unlink()

    def describe(self) -> dict:
        return {**super().describe(), "engine_id": self.engine_id, **self._where()}

    def stats(self) -> dict[str, tuple[float, str, str]]:
        c = self.counts
        if self.role == "producer":
            # distinct blocks: leases of prompts with a common prefix share its cached blocks (counted once)
            held = len(
                {
                    entry_block(b)
                    for seq, _ in self._leases.values()
                    for t in tables_of(seq, len(self.windows))
                    for b in t
                    if b != NULL_BLOCK
                }
            )
            return {
                "kv_transfer_leases_held": (
                    len(self._leases),
                    "gauge",
                    "Finished prefills whose KV blocks are kept for a consumer",
                ),
                "kv_transfer_blocks_held": (held, "gauge", "KV blocks kept on a lease for consumers"),
                "kv_transfer_granted": (c["transfers_granted"], "counter", "Prefills handed to a consumer"),
                "kv_transfer_leases_confirmed": (c["leases_confirmed"], "counter", "Leases a consumer confirmed"),
                "kv_transfer_leases_expired": (c["leases_expired"], "counter", "Leases that ran out unconfirmed"),
            }
        return {
            "kv_transfer_loads": (c["loads"], "counter", "Prompt KV loads from a producer"),
            "kv_transfer_tokens_loaded": (
                c["tokens_loaded"],
                "counter",
                "Prompt tokens whose KV was loaded, not computed",
            ),
            "kv_transfer_load_failures": (
                c["load_failures"],
                "counter",
                "KV transfers that failed (the prompt was recomputed, or refused under kv_load_failure_policy=fail)",
            ),
        }


class _Failed(Exception):
    """A transfer that cannot be used (what kv_load_failure_policy decides about)."""


class LocalConnectorWorker(KVConnectorWorker):
    """A rank's half: the producer's pool in a shared file; the consumer's copies out of the producers' files."""

    def __init__(self, role: str, settings: dict, rank: int) -> None:
        self.role, self.rank = role, rank
        self.path, self.margin_s = settings["path"], settings["margin_s"]
        self.engine_id = settings["engine_id"]
        self._maps: dict[str, tuple[object, object]] = {}  # engine id -> (mmap, tensor view)
        self._own = None

    def allocate(self, shape: tuple[int, ...], dtype):
        if self.role != "producer":
            return None
        import torch

        Path(self.path).mkdir(parents=True, exist_ok=True)
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        f = rank_file(self.path, self.engine_id, self.rank)
        with open(f, "w+b") as fh:  # a fresh (zero-filled) file: stale memory is never read as KV
            fh.truncate(nbytes)
            mm = mmap.mmap(fh.fileno(), nbytes, mmap.MAP_SHARED)
        self._own = mm
        return torch.frombuffer(mm, dtype=dtype, count=numel).view(shape)

    def _producer_pool(self, load: KVLoad, kv_storage):
        import torch

        cached = self._maps.get(load.engine_id)
        if cached is not None:
            return cached[1]
        f = rank_file(self.path, load.engine_id, self.rank)
        shape = (*kv_storage.shape[:2], load.producer_num_blocks, *kv_storage.shape[3:])
        numel = 1
        for s in shape:
            numel *= s
        nbytes = numel * kv_storage.element_size()
        try:
            with open(f, "r+b") as fh:
                if os.fstat(fh.fileno()).st_size != nbytes:
                    log.warning(
                        "KV pool %s has %d bytes, not the %d its card says", f, os.fstat(fh.fileno()).st_size, nbytes
                    )
                    return None
                mm = mmap.mmap(fh.fileno(), nbytes, mmap.MAP_SHARED)
        except OSError as e:
            log.warning("KV pool %s cannot be mapped: %s", f, e)
            return None
        view = torch.frombuffer(mm, dtype=kv_storage.dtype, count=numel).view(shape)
        if len(self._maps) > 8:  # producers come and go: keep the newest few mapped
            self._maps.pop(next(iter(self._maps)))
        self._maps[load.engine_id] = (mm, view)
        return view

    def start_load_kv(self, metadata: KVConnectorMetadata, kv_storage) -> list[str]:
        import torch

        failed = []
        for load in metadata.loads:
            if time.time() > load.expires_at - self.margin_s:
                failed.append(load.req_id)
                continue
            pool = self._producer_pool(load, kv_storage)
            if pool is None:
                failed.append(load.req_id)
                continue
            src = torch.tensor(load.src_block_ids, dtype=torch.long)
            dst = torch.tensor(load.dst_block_ids, dtype=torch.long)
            kv_storage.index_copy_(2, dst, pool.index_select(2, src))  # [pages, 2, blocks, ...]
            # The producer frees the blocks only once their lease file is gone or the lease ran out: if neither
            # happened by the end of the copy, nothing overwrote them during it.
            lease = Path(self.path) / "leases" / f"{load.engine_id}.{load.transfer_id}"
            if time.time() >= load.expires_at or not lease.exists():
                failed.append(load.req_id)
        return failed

    def shutdown(self) -> None:
        self._maps.clear()
