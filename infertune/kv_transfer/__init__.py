"""KV connectors: moving prompt KV between engines for prefill/decode disaggregation (docs/distributed.md).

`base.py` is the contract (scheduler side, worker side, the plain-data metadata between them); `local.py` the
connector for engines on one host (shared-memory files); `p2p.py` the one across hosts (a TCPStore the producer hosts,
the blocks' bytes over a gloo pair per rank: torch.distributed point-to-point). Other transports plug in as
kv_connector="pkg.module:NAME" (a KVConnectorSpec); NIXL / Mooncake / LMCache ones are not built here.
"""

from __future__ import annotations

import hashlib
import importlib
import json
from pathlib import Path

from infertune.kv_transfer.base import KVConnectorScheduler, KVConnectorSpec, KVConnectorWorker, KVTransferError

__all__ = [
    "KVConnectorScheduler",
    "KVConnectorSpec",
    "KVConnectorWorker",
    "connector_spec",
    "KVTransferError",
    "kv_layout",
    "scheduler_connector",
    "worker_connector",
]


# config.json keys that say how a checkpoint was written, not what model it is (a copy saved by another
# transformers version, or from another folder, is the same model)
_CONFIG_NOISE = {"transformers_version", "_name_or_path", "_commit_hash"}
_SAMPLE_BYTES = 4096  # bytes of weight data hashed at each of three places of each safetensors file


def _model_identity(model_dir: str) -> str:
    """What two engines must share to exchange KV: "config <hash>, weights <hash>". The config is config.json's
    values (not its text: key order, indentation and the keys of _CONFIG_NOISE do not count); the weights are each
    safetensors file's header (tensor names, dtypes, shapes) and 4 KiB of its data at its start, middle and end, so
    the same config with other weights (a fine-tune, another seed) differs while reading almost nothing."""
    folder = Path(model_dir)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return str(model_dir)
    if isinstance(config, dict):
        config = {k: v for k, v in config.items() if k not in _CONFIG_NOISE}
    config_hash = hashlib.sha1(json.dumps(config, sort_keys=True).encode()).hexdigest()[:12]
    weights = hashlib.sha1()
    for f in sorted(folder.glob("*.safetensors")):
        try:
            with f.open("rb") as fh:
                size = f.stat().st_size
                head = int.from_bytes(fh.read(8), "little")
                weights.update(fh.read(head))
                start = 8 + head
                for at in (start, start + (size - start) // 2, max(start, size - _SAMPLE_BYTES)):
                    fh.seek(at)
                    weights.update(fh.read(_SAMPLE_BYTES))
        except OSError:
            weights.update(f.name.encode())
    return f"config {config_hash}, weights {weights.hexdigest()[:12]}"


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


def connector_spec(name: str) -> KVConnectorSpec:
    """kv_connector -> its KVConnectorSpec: "local", "p2p", or "pkg.module:NAME" (imported here)."""
    if name == "local":
        from infertune.kv_transfer import local

        return KVConnectorSpec(
            "local", local.LocalConnectorScheduler, local.LocalConnectorWorker, local.connector_settings
        )
    if name == "p2p":
        from infertune.kv_transfer import p2p

        return KVConnectorSpec("p2p", p2p.P2PConnectorScheduler, p2p.P2PConnectorWorker, p2p.connector_settings)
    module, sep, attr = name.partition(":")
    if not sep or not module or not attr:
        raise ValueError(
            f"kv_connector={name!r}: 'local' (one host), 'p2p' (across hosts), or 'pkg.module:NAME' naming a "
            "KVConnectorSpec (infertune/kv_transfer/base.py) of another transport"
        )
    try:
        spec = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"kv_connector={name!r}: cannot import it ({type(e).__name__}: {e})") from None
    if not isinstance(spec, KVConnectorSpec):
        raise ValueError(f"kv_connector={name!r} is a {type(spec).__name__}, not a KVConnectorSpec")
    return spec


def _settings(config) -> dict:
    p = config.parallel
    return connector_spec(p.kv_connector).settings(p.kv_connector_config)


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
    spec = connector_spec(p.kv_connector)
    side = spec.scheduler(
        p.kv_role, spec.settings(p.kv_connector_config), kv_info.kv_layout, kv_info.num_blocks, kv_info.block_size,
        p.kv_load_failure_policy,
    )  # fmt: skip
    side.name = spec.name  # (what its answers carry and a consumer checks: the name both sides were given)
    return side


def worker_connector(config, rank: int, device_type: str) -> KVConnectorWorker | None:
    """A rank's half for config.parallel.kv_role (None without one)."""
    p = config.parallel
    if p.kv_role is None:
        return None
    spec = connector_spec(p.kv_connector)
    if device_type not in spec.devices:
        raise ValueError(
            f"the {spec.name} KV connector moves the KV cache on {', '.join(spec.devices)} only, not {device_type}"
            + (" (through host memory)" if spec.devices == ("cpu",) else "")
        )
    return spec.worker(p.kv_role, spec.settings(p.kv_connector_config), rank)
