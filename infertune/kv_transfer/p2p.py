"""The KV connector across hosts ("p2p"): a consumer pulls a producer's prompt blocks over torch.distributed.

Nothing is shared through files: every exchange goes through one `torch.distributed.TCPStore` that the producer's
tensor-parallel rank 0 hosts (kv_connector_config "host" / "port", 127.0.0.1:29650 by default), and the blocks'
bytes through a gloo pair (`ProcessGroupGloo` of size 2 over a `PrefixStore` of it) per consumer rank. Neither
touches the default process group, so tensor parallel runs beside it. The store holds:

- `card`: the producer's card (engine id, KV layout, pool size), set by its scheduler side at start-up. A consumer
  reads it at its first transfer from that producer (and at start-up when its own config names the producer's
  host / port) and refuses a layout that differs (`base.layout_mismatch`), naming both sides' values.
- `lease/<transfer_id>`: a finished prefill whose blocks the producer keeps for a consumer. The consumer deletes it
  once its workers have the blocks (the confirmation); the producer frees the blocks when it is gone, or deletes it
  itself when the lease ("lease_s", 30 s) runs out, and frees them then.
- `rank<r>/hello`, `rank<r>/conn<k>/...`: a queue where consumer rank r announces connection k to producer rank r
  (TP ranks pair up: each holds its own KV heads), that connection's gloo rendezvous, its request queue and answers.

A load: consumer rank r pushes {transfer id, block ids} onto its connection's queue; producer rank r's serving
thread copies the blocks out of its KV cache while the lease key exists, checks that it still exists after the copy
(the scheduler deletes it before it frees the blocks, so the copy read blocks nothing overwrote), answers with the
copy's shape, and sends the bytes; the consumer receives them into its own blocks. Every wait has "timeout_s"
(5 s): a producer that is dead or unreachable fails the transfer at admission (kv_load_failure_policy: recompute or
fail, as the local connector does) or in the worker (always recomputed), never a hang.

CPU only (gloo moves host memory), and a producer's ranks on one host (they share its store's address).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import socket
import threading
import time
import uuid
from dataclasses import dataclass

from infertune.kv_transfer.base import KVConnectorMetadata, KVConnectorWorker, KVTransferError, layout_mismatch
from infertune.kv_transfer.local import LocalConnectorScheduler, RemoteKV, _Failed, group_windows

log = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 29650
DEFAULT_TIMEOUT_S = 5.0
DEFAULT_LEASE_S = 30.0
DEFAULT_MARGIN_S = 1.0
_CONFIG_KEYS = {"host", "port", "timeout_s", "lease_s", "margin_s", "engine_id"}
_IDLE = datetime.timedelta(hours=1)  # a serving thread's wait for the next request (shutdown wakes it)


def connector_settings(cfg: dict | None) -> dict:
    """kv_connector_config with its defaults; ValueError naming an unknown key or a bad value."""
    cfg = dict(cfg or {})
    unknown = set(cfg) - _CONFIG_KEYS
    if unknown:
        raise ValueError(
            f"kv_connector_config: unknown keys {sorted(unknown)} for the p2p connector; it takes {sorted(_CONFIG_KEYS)}"
        )
    out = {
        "host": str(cfg.get("host") or DEFAULT_HOST),
        "port": cfg.get("port", DEFAULT_PORT),
        "timeout_s": float(cfg.get("timeout_s", DEFAULT_TIMEOUT_S)),
        "lease_s": float(cfg.get("lease_s", DEFAULT_LEASE_S)),
        "margin_s": float(cfg.get("margin_s", DEFAULT_MARGIN_S)),
        "engine_id": str(cfg.get("engine_id") or ""),
        # a consumer told where its producer is checks the producer's layout at start-up
        "check_peer": "host" in cfg or "port" in cfg,
    }
    if not isinstance(out["port"], int) or not 0 < out["port"] < 65536:
        raise ValueError(f"kv_connector_config: port={out['port']!r} must be an integer in 1..65535")
    if out["host"] in ("0.0.0.0", "::"):
        raise ValueError(
            "kv_connector_config: host must be this producer's address that consumers reach (it is sent to them), "
            f"not the wildcard {out['host']!r}"
        )
    if not out["timeout_s"] > 0:
        raise ValueError(f"kv_connector_config: timeout_s ({out['timeout_s']}) must be > 0")
    if not out["lease_s"] > 0 or not 0 <= out["margin_s"] < out["lease_s"]:
        raise ValueError(
            f"kv_connector_config: lease_s ({out['lease_s']}) must be > 0 and margin_s "
            f"({out['margin_s']}) in [0, lease_s)"
        )
    return out


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def _client(host: str, port: int, timeout_s: float):
    """A client of the producer's store; RuntimeError within timeout_s if none answers. (A plain connect first: where
    nothing listens, e.g. the producer died, TCPStore's own connect retries with a random back-off of seconds on top
    of the timeout, so a refused connection would take longer than timeout_s to report.)"""
    import torch.distributed as dist

    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        raise RuntimeError(f"no store listens at {host}:{port} ({e})") from e
    return dist.TCPStore(host, port, None, False, _td(timeout_s))


def _gloo_pair(store, rank: int, my_host: str, timeout_s: float):
    """A two-rank gloo group (0: the producer rank, 1: the consumer rank) over `store`, apart from any default group."""
    import torch.distributed as dist

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = _td(timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=my_host)]
    return dist.ProcessGroupGloo(store, rank, 2, opts)


def _local_address(host: str, port: int) -> str:
    """This machine's address on the route to host (the one a peer there reaches us at); no packet is sent."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


@dataclass(slots=True)
class PeerKV(RemoteKV):
    """RemoteKV plus where the producer serves it."""

    peer: str = ""  # "host:port" of the producer's store


class P2PConnectorScheduler(LocalConnectorScheduler):
    """The local connector's scheduler side (the same planning, counters and policy), with the cards and leases in
    the producer's store instead of files."""

    name = "p2p"

    def __init__(self, role: str, settings: dict, layout: dict, num_blocks: int, block_size: int, policy: str):
        assert role in ("producer", "consumer")
        self.role, self.layout, self.block_size, self.policy = role, layout, block_size, policy
        self.windows = group_windows(layout)
        self.host, self.port, self.timeout_s = settings["host"], settings["port"], settings["timeout_s"]
        self.lease_s, self.margin_s = settings["lease_s"], settings["margin_s"]
        self.engine_id = settings["engine_id"]
        assert self.engine_id, "ParallelConfig gives every engine with a kv_role an engine_id"
        self._cards: dict[str, dict] = {}  # "host:port" -> the card of the producer there (layout checked)
        self._peers: dict[str, object] = {}  # "host:port" -> a store client (dropped after an error)
        self._loads = []
        self._inflight: dict[str, RemoteKV] = {}
        self._leases: dict[str, tuple[object, float]] = {}  # transfer id -> (seq, expires_at)
        self.counts = dict.fromkeys(
            ("loads", "tokens_loaded", "load_failures", "leases_confirmed", "leases_expired", "transfers_granted"), 0
        )
        self.counts["blocks_loaded"] = 0
        self.card = {"engine_id": self.engine_id, "role": role, "layout": layout, "num_blocks": num_blocks}
        if role == "producer":
            # (rank 0's worker hosts the store; it started before this side, with the runner)
            try:
                self._own = _client(self.host, self.port, self.timeout_s)
            except RuntimeError as e:
                raise ValueError(f"the p2p KV connector's store at {self.host}:{self.port} does not answer: {e}") from e
            self._own.set("card", json.dumps(self.card))
        elif settings["check_peer"]:
            self._check_producer_at_start()
        log.info("KV connector p2p: %s %s, store %s:%d", role, self.engine_id, self.host, self.port)

    def _check_producer_at_start(self) -> None:
        peer = f"{self.host}:{self.port}"
        try:
            card = self._card(peer)
        except _Failed as e:  # it may start later: the first transfer checks it then
            log.warning("KV connector p2p: the producer at %s cannot be checked at start-up (%s)", peer, e)
            return
        bad = layout_mismatch(self.layout, card.get("layout") or {}, "consumer", "producer")
        if bad:
            raise ValueError(
                f"KV connector mismatch with the producer {card.get('engine_id')} at {peer}: " + "; ".join(bad) + ". "
                "Start both sides with the same model, dtype, kv_cache_dtype, block_size and tensor_parallel_size"
            )

    # ---- the producer's store, as a client ------------------------------------------------------
    def _peer(self, peer: str):
        client = self._peers.get(peer)
        if client is None:
            host, _, port = peer.rpartition(":")
            try:
                client = _client(host, int(port), self.timeout_s)
            except (RuntimeError, ValueError) as e:
                raise _Failed(
                    f"the producer's store at {peer} does not answer within {self.timeout_s:g} s ({e})"
                ) from None
            self._peers[peer] = client
        return client

    def _ask(self, peer: str, what: str, call):
        """call(client) on the producer's store; once more on a new client if the cached one broke (the producer
        restarted at the same address); _Failed when it does not answer."""
        for fresh in (False, True):
            cached = peer in self._peers
            client = self._peer(peer)
            try:
                return call(client)
            except (RuntimeError, ValueError) as e:
                self._peers.pop(peer, None)
                if fresh or not cached:
                    raise _Failed(f"the producer at {peer} gives no {what} ({e})") from None
        raise AssertionError("unreachable")

    def _card(self, peer: str) -> dict:
        return self._ask(peer, "card", lambda client: json.loads(client.get("card")))

    def shutdown(self) -> None:
        if self.role == "producer":
            with contextlib.suppress(RuntimeError):
                self._own.delete_key("card")
        self._peers.clear()

    # ---- producer ------------------------------------------------------------------------------
    def _publish_lease(self, transfer_id: str, expires: float) -> None:
        self._own.set(f"lease/{transfer_id}", str(expires))  # a key in the store this producer hosts

    def _end_lease(self, transfer_id: str) -> None:
        with contextlib.suppress(RuntimeError):
            self._own.delete_key(f"lease/{transfer_id}")

    def _where(self) -> dict:
        return {"host": self.host, "port": self.port}

    def released(self) -> list:
        if not self._leases:
            return []
        now, out = time.time(), []
        for tid, (seq, expires) in list(self._leases.items()):
            key = f"lease/{tid}"
            if not self._own.check([key]):
                self.counts["leases_confirmed"] += 1
            elif now > expires:
                self._own.delete_key(key)  # before the blocks are freed: a serving rank checks it after its copy
                self.counts["leases_expired"] += 1
                log.warning("KV transfer %s: the lease ran out before a consumer confirmed; blocks freed", tid)
            else:
                continue
            del self._leases[tid]
            out.append(seq)
        return out

    # ---- consumer ------------------------------------------------------------------------------
    def _check(self, p: dict, prompt_token_ids: list[int]) -> PeerKV:
        if p.get("error"):
            raise _Failed(f"the prefill did not run: {p['error']}")
        self._check_connector(p)
        for key in ("engine_id", "transfer_id", "block_ids", "num_tokens", "expires_at", "host", "port"):
            if key not in p:
                raise _Failed(f"kv_transfer_params has no {key!r} (a producer of the p2p connector sends it)")
        eid, peer = str(p["engine_id"]), f"{p['host']}:{p['port']}"
        card = self._cards.get(peer)
        if card is None or card.get("engine_id") != eid:  # first transfer from there, or the producer restarted
            card = self._card(peer)
            if card.get("engine_id") != eid:
                raise _Failed(f"the producer at {peer} is now {card.get('engine_id')}, not {eid} (it restarted)")
            bad = layout_mismatch(self.layout, card.get("layout") or {}, "consumer", "producer")
            if bad:
                raise KVTransferError(
                    f"KV connector mismatch with the producer {eid} at {peer}: " + "; ".join(bad),
                    500,
                    "kv_transfer_mismatch",
                )
            self._cards[peer] = card
        self._check_transfer(p, prompt_token_ids, card)
        blocks, pool = p["block_ids"], int(card.get("num_blocks", 0))
        if not self._ask(peer, "lease", lambda client: client.check([f"lease/{p['transfer_id']}"])):
            raise _Failed(f"transfer {p['transfer_id']} was used already, or the producer released it")
        return PeerKV(
            eid, str(p["transfer_id"]), self._group_blocks(blocks), int(p["num_tokens"]), float(p["expires_at"]),
            pool, peer=peer,
        )  # fmt: skip

    def update_state_after_alloc(self, seq, block_ids: list[int], num_external_tokens: int) -> None:
        remote = getattr(seq, "kv_transfer", None)
        planned = len(self._loads)
        super().update_state_after_alloc(seq, block_ids, num_external_tokens)
        if remote is not None and len(self._loads) > planned:
            self._loads[-1].peer = remote.peer  # where the workers fetch from

    def after_step(self, metadata: KVConnectorMetadata | None, failed_req_ids: list[str]) -> None:
        if metadata is not None:
            failed = set(failed_req_ids)
            self.counts["blocks_loaded"] += sum(len(x.dst_block_ids) for x in metadata.loads if x.req_id not in failed)
        super().after_step(metadata, failed_req_ids)

    def _drop_user(self, remote: RemoteKV) -> None:
        remote.users -= 1
        if remote.users > 0:
            return
        # Confirm, and the producer frees the blocks. Only through the client _check opened: after it broke, the
        # producer is gone or its lease runs out (no reconnect waits in the engine's step).
        client = self._peers.get(remote.peer)
        try:
            if client is None:
                raise _Failed("the connection to it broke")
            client.delete_key(f"lease/{remote.transfer_id}")
        except (_Failed, RuntimeError) as e:
            self._peers.pop(remote.peer, None)
            log.warning("KV transfer %s: could not confirm to %s (%s)", remote.transfer_id, remote.peer, e)

    def stats(self) -> dict[str, tuple[float, str, str]]:
        out = super().stats()
        if self.role == "consumer":
            out["kv_transfer_blocks_loaded"] = (
                self.counts["blocks_loaded"],
                "counter",
                "KV blocks received from a producer",
            )
        return out


class P2PConnectorWorker(KVConnectorWorker):
    """A rank's half. Producer: its KV cache, served to consumers by background threads (rank 0 also hosts the
    store). Consumer: one connection per producer it loads from, each a store client and a gloo pair."""

    def __init__(self, role: str, settings: dict, rank: int) -> None:
        self.role, self.rank = role, rank
        self.host, self.port, self.timeout_s = settings["host"], settings["port"], settings["timeout_s"]
        self._storage = None
        self._stop = threading.Event()
        self._serving: list[str] = []  # producer: the request queues of the connections served
        self._conns: dict[str, _Connection] = {}  # consumer: "host:port" -> connection
        self._store = None
        if role != "producer":
            return
        import torch.distributed as dist

        try:
            if rank == 0:
                self._store = dist.TCPStore(
                    self.host, self.port, None, True, _td(self.timeout_s), wait_for_workers=False
                )
            else:
                self._store = _client(self.host, self.port, self.timeout_s)
        except RuntimeError as e:
            what = "host" if rank == 0 else "reach"
            raise ValueError(
                f"the p2p KV connector cannot {what} its store at {self.host}:{self.port} ({e}); is the port in use? "
                'Give each producer its own kv_connector_config {"port": ...}'
            ) from e

    def allocate(self, shape: tuple[int, ...], dtype):
        if self.role != "producer":
            return None
        import torch

        self._storage = torch.zeros(shape, dtype=dtype)  # [pages, 2, num_blocks, ...], read by the serving threads
        threading.Thread(target=self._accept, name=f"kv-p2p-accept-{self.rank}", daemon=True).start()
        return self._storage

    # ---- producer ------------------------------------------------------------------------------
    def _accept(self) -> None:
        """Start a serving thread for each connection consumer ranks announce to this rank."""
        store = self._store.clone()
        store.set_timeout(_IDLE)
        while not self._stop.is_set():
            try:
                msg = store.queue_pop(f"rank{self.rank}/hello", True).decode()
            except RuntimeError:  # an idle hour, or the store went away: the stop flag decides (no busy loop)
                self._stop.wait(1.0)
                continue
            if msg == "stop":
                return
            threading.Thread(target=self._serve, args=(msg,), name=f"kv-p2p-{msg}", daemon=True).start()

    def _serve(self, conn: str) -> None:
        """Answer one consumer rank's requests until it closes the connection (or it breaks)."""
        prefix = f"rank{self.rank}/{conn}/"
        store = self._store.clone()
        import torch
        import torch.distributed as dist

        try:
            pair = _gloo_pair(dist.PrefixStore(prefix + "pg/", store.clone()), 0, self.host, self.timeout_s)
        except RuntimeError as e:
            log.warning("KV p2p: connection %s did not form: %s", conn, e)
            return
        self._serving.append(prefix + "req")
        store.set_timeout(_IDLE)
        while not self._stop.is_set():
            try:
                raw = store.queue_pop(prefix + "req", True)
            except RuntimeError:
                self._stop.wait(1.0)
                continue
            req = json.loads(raw)
            if req.get("close"):
                return
            i, lease = int(req["seq"]), f"lease/{req['transfer_id']}"
            data = None
            try:
                if not store.check([lease]):
                    answer = {"ok": False, "error": f"no lease {req['transfer_id']} (used, released or expired)"}
                elif not all(0 <= b < self._storage.shape[2] for b in req["block_ids"]):
                    answer = {"ok": False, "error": f"block ids outside the producer's {self._storage.shape[2]}"}
                else:
                    data = self._storage.index_select(2, torch.tensor(req["block_ids"], dtype=torch.long))
                    if store.check([lease]):  # still leased after the copy: nothing overwrote the blocks during it
                        answer = {"ok": True, "shape": list(data.shape)}
                    else:
                        answer, data = {"ok": False, "error": f"lease {req['transfer_id']} ended during the copy"}, None
                store.set(f"{prefix}resp{i}", json.dumps(answer))
                if data is not None:
                    pair.send([data], 1, i).wait()
            except RuntimeError as e:  # the consumer went away
                log.warning("KV p2p: connection %s ends: %s", conn, e)
                return

    # ---- consumer ------------------------------------------------------------------------------
    def start_load_kv(self, metadata: KVConnectorMetadata, kv_storage) -> list[str]:
        import torch

        failed = []
        for load in metadata.loads:
            try:
                data = self._fetch(load, kv_storage)
                dst = torch.tensor(load.dst_block_ids, dtype=torch.long)
                kv_storage.index_copy_(2, dst, data)  # [pages, 2, blocks, ...]
            except (_Failed, RuntimeError, ValueError, OSError) as e:
                log.warning("KV p2p: loading %s from %s failed: %s", load.transfer_id, load.peer, e)
                failed.append(load.req_id)
        return failed

    def _fetch(self, load, kv_storage):
        """The load's blocks from its producer; a cached connection that broke (the producer restarted, or a
        serving thread ended) is replaced once."""
        for fresh in (False, True):
            conn = self._conns.get(load.peer)
            cached = conn is not None
            if conn is None:
                conn = self._conns[load.peer] = _Connection(load.peer, self.rank, self.timeout_s)
            try:
                return conn.fetch(load.transfer_id, load.src_block_ids, kv_storage)
            except _Failed:  # the producer answered: the connection is fine, unless the answer was unusable
                if conn.broken:
                    self._conns.pop(load.peer, None)
                raise
            except (RuntimeError, ValueError, OSError):
                self._conns.pop(load.peer, None)
                if fresh or not cached:
                    raise
        raise AssertionError("unreachable")

    def shutdown(self) -> None:
        self._stop.set()
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        if self._store is not None:
            with contextlib.suppress(RuntimeError):
                self._store.queue_push(f"rank{self.rank}/hello", "stop")
                for queue in self._serving:
                    self._store.queue_push(queue, json.dumps({"close": True}))


class _Connection:
    """Consumer rank r's link to producer rank r: a store client (requests, answers) and a gloo pair (the bytes)."""

    def __init__(self, peer: str, rank: int, timeout_s: float) -> None:
        import torch.distributed as dist

        host, _, port = peer.rpartition(":")
        self.timeout = _td(timeout_s)
        self.store = _client(host, int(port), timeout_s)
        name = f"conn{self.store.add(f'rank{rank}/connections', 1)}-{uuid.uuid4().hex[:6]}"
        self.prefix = f"rank{rank}/{name}/"
        self.store.queue_push(f"rank{rank}/hello", name)
        self.pair = _gloo_pair(
            dist.PrefixStore(self.prefix + "pg/", self.store.clone()), 1, _local_address(host, int(port)), timeout_s
        )
        self.seq, self.broken = 0, False

    def fetch(self, transfer_id: str, block_ids: list[int], kv_storage):
        import torch

        self.seq += 1
        self.store.queue_push(
            self.prefix + "req", json.dumps({"seq": self.seq, "transfer_id": transfer_id, "block_ids": block_ids})
        )
        key = f"{self.prefix}resp{self.seq}"
        self.store.wait([key], self.timeout)
        answer = json.loads(self.store.get(key))
        self.store.delete_key(key)
        if not answer["ok"]:
            raise _Failed(answer["error"])
        want = [*kv_storage.shape[:2], len(block_ids), *kv_storage.shape[3:]]
        if answer["shape"] != want:  # (the bytes it sends now would wait in the pair: do not reuse it)
            self.broken = True
            raise _Failed(f"the producer sends blocks of shape {answer['shape']}, not {want}")
        buf = torch.empty(want, dtype=kv_storage.dtype)
        self.pair.recv([buf], 0, self.seq).wait(self.timeout)
        return buf

    def close(self) -> None:
        with contextlib.suppress(RuntimeError):
            self.store.queue_push(self.prefix + "req", json.dumps({"close": True}))
