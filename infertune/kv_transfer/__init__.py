"""KV connectors: moving prompt KV between engines for prefill/decode disaggregation (docs/distributed.md).

`base.py` is the contract (scheduler side, worker side, the plain-data metadata between them); `local.py` the
connector for engines on one host (shared-memory files); `p2p.py` the one across hosts (a TCPStore the producer hosts,
the blocks' bytes over a gloo pair per rank: torch.distributed point-to-point). Not built yet: the NIXL / Mooncake /
LMCache transports the contract leaves room for.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from infertune.kv_transfer.base import KVConnectorScheduler, KVConnectorWorker, KVTransferError

__all__ = [
    "KVConnectorScheduler",
    "KVConnectorWorker",
    "KVTransferError",
    "kv_layout",
    "scheduler_connector",
    "worker_connector",
]


def _model_identity(model_dir: str) -> str:
    """The checkpoint's config.json, hashed: two engines serve the same model only if it is the same text."""
    f = Path(model_dir) / "config.json"
    try:
        return hashlib.sha1(f.read_bytes()).hexdigest()[:16]
    except OSError:
        return str(model_dir)


def kv_layout(config, cache_shape: tuple[int, ...], cache_dtype: str, groups) -> dict:
    """What both sides of a transfer must agree on, as plain data (a worker computes it; the cards carry it).
    cache_shape: the runner's whole KV storage [pages, 2, num_blocks, block_size, ...]."""
    block_shape = [cache_shape[0], cache_shape[1], *cache_shape[3:]]
    return {
        "model": _model_identity(config.model.model),
        "architecture": config.model.arch.architecture,
        "num_layers": config.model.arch.num_hidden_layers,
        "tensor_parallel_size": config.parallel.tensor_parallel_size,
        "block_size": config.cache.block_size,
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "cache_dtype": cache_dtype,
        "block_shape": block_shape,
        "kv_cache_groups": [g.window for g in groups],
    }


def _settings(config) -> dict:
    p = config.parallel
    if p.kv_connector == "p2p":
        from infertune.kv_transfer.p2p import connector_settings
    elif p.kv_connector == "local":
        from infertune.kv_transfer.local import connector_settings
    else:
        raise ValueError(f"kv_connector={p.kv_connector!r}: 'local' (one host) and 'p2p' (across hosts) are built")
    return connector_settings(p.kv_connector_config)


def scheduler_connector(config, kv_info) -> KVConnectorScheduler | None:
    """The engine's half for config.parallel.kv_role (None without one); kv_info: the runner's KVCacheInfo."""
    p = config.parallel
    if p.kv_role is None:
        return None
    if getattr(config.cache, "kv_compression", None) is not None:
        raise ValueError(
            "KV transfer (kv_role) does not run with kv_compression yet: a compressed prompt's blocks "
            "no longer hold one token a slot"
        )
    if getattr(config.cache, "kv_int4_after", None) is not None:
        raise ValueError("KV transfer (kv_role) does not move int4 blocks yet: drop kv_int4_after on both sides")
    if p.kv_connector == "p2p":
        from infertune.kv_transfer.p2p import P2PConnectorScheduler as cls
    else:
        from infertune.kv_transfer.local import LocalConnectorScheduler as cls

    return cls(
        p.kv_role,
        _settings(config),
        kv_info.kv_layout,
        kv_info.num_blocks,
        kv_info.block_size,
        p.kv_load_failure_policy,
    )


def worker_connector(config, rank: int, device_type: str) -> KVConnectorWorker | None:
    """A rank's half for config.parallel.kv_role (None without one)."""
    p = config.parallel
    if p.kv_role is None:
        return None
    if device_type != "cpu":
        raise ValueError(
            f"the {p.kv_connector} KV connector moves the KV cache through host memory: CPU only, not {device_type}"
        )
    if p.kv_connector == "p2p":
        from infertune.kv_transfer.p2p import P2PConnectorWorker as cls
    else:
        from infertune.kv_transfer.local import LocalConnectorWorker as cls

    return cls(p.kv_role, _settings(config), rank)
