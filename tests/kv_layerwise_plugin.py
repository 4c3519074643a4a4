"""A KV connector from outside infertune (kv_connector="kv_layerwise_plugin:LAYERWISE"), as a NIXL / Mooncake-style
transport would plug in: the local connector's files, but the consumer's worker copies each layer's blocks only when
the model asks for that layer (wait_for_layer_load), records every call, and reports finished loads through
get_finished. tests/test_pd.py checks the greedy tokens against a plain engine and the order of the calls."""

from __future__ import annotations

import torch

from infertune.kv_transfer.base import KVConnectorSpec
from infertune.kv_transfer.local import LocalConnectorScheduler, LocalConnectorWorker, connector_settings

CALLS: list[tuple] = []  # (what, args) in call order, every instance in this process
FINISHED: list[tuple[set, set]] = []  # what the scheduler side's update_finished got


class LayerwiseScheduler(LocalConnectorScheduler):
    def update_finished(self, finished_sending: set[str], finished_recving: set[str]) -> None:
        FINISHED.append((set(finished_sending), set(finished_recving)))


class LayerwiseWorker(LocalConnectorWorker):
    layerwise = True

    def __init__(self, role: str, settings: dict, rank: int) -> None:
        super().__init__(role, settings, rank)
        self.kv_caches: list[torch.Tensor] = []
        self.pending: list[tuple[str, torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (req, pool, src, dst)
        self.done: set[str] = set()

    def register_kv_caches(self, kv_caches: list) -> None:
        CALLS.append(("register", len(kv_caches)))
        self.kv_caches = kv_caches

    def start_load_kv(self, metadata, kv_storage) -> list[str]:
        CALLS.append(("start", tuple(load.req_id for load in metadata.loads)))
        self.storage = kv_storage
        failed = []
        for load in metadata.loads:  # (nothing copied yet: each layer when it is asked for)
            pool = self._producer_pool(load, kv_storage)
            if pool is None:
                failed.append(load.req_id)
                continue
            src = torch.tensor(load.src_block_ids, dtype=torch.long)
            dst = torch.tensor(load.dst_block_ids, dtype=torch.long)
            self.pending.append((load.req_id, pool, src, dst))
        return failed

    def wait_for_layer_load(self, layer: int) -> None:
        CALLS.append(("wait", layer))
        page = next(
            p for p in range(self.storage.shape[0]) if self.storage[p].data_ptr() == self.kv_caches[layer].data_ptr()
        )
        for _, pool, src, dst in self.pending:
            self.kv_caches[layer].index_copy_(1, dst, pool[page].index_select(1, src))  # [2, blocks, ...]

    def save_kv_layer(self, layer: int, kv_cache, metadata) -> None:
        CALLS.append(("save", layer))

    def wait_for_save(self) -> None:
        self.done |= {req for req, *_ in self.pending}
        self.pending = []

    def get_finished(self) -> tuple[set[str], set[str]]:
        done, self.done = self.done, set()
        return set(), done


LAYERWISE = KVConnectorSpec("layerwise-test", LayerwiseScheduler, LayerwiseWorker, connector_settings)
NOT_A_SPEC = object()
