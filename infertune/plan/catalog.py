"""Hardware catalog: accelerator specs kept as JSON data (plan/data/devices/*.json), validated on load.

A device file holds one device object or {"devices": [...]}. Fields (units in the names; nominal decimal GB):

  name (str, required)                      key for --device, lower case
  display_name (str, required)
  memory_bytes (int > 0, required)          nominal capacity, 1 GB = 1e9 bytes (conservative for HBM sold in GiB)
  memory_bandwidth_bytes_per_s (> 0, req.)  datasheet peak
  bf16_tflops (> 0, required)               dense (no 2:4 sparsity), tensor/cube units
  source (str or list of str, required)     where the figures come from: URL or document name
  aliases (list of str), vendor (str), notes (str)
  fp16_tflops, fp32_tflops, int8_tops (> 0 or null)   dense
  tdp_watts, purchase_price_usd (> 0 or null)
  price (object or null): {usd_per_hour > 0, kind, provider, date YYYY-MM-DD, source}   per card
  interconnect (object or null): {name, bandwidth_bytes_per_s (> 0 or null; bidirectional, per card)}
  measured (bool)                           true for figures measured on the machine (the `local` device)

Unknown fields are errors, so a typo never silently drops a number.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

DATA_DIR = Path(__file__).parent / "data" / "devices"


class DeviceFileError(ValueError):
    """A device file that does not match the schema; the message names the file and the field."""


@dataclass(frozen=True)
class Price:
    usd_per_hour: float
    kind: str
    provider: str
    date: str
    source: str


@dataclass(frozen=True)
class Interconnect:
    name: str
    bandwidth_bytes_per_s: float | None


@dataclass(frozen=True)
class Device:
    name: str
    display_name: str
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    bf16_tflops: float
    source: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    vendor: str = ""
    notes: str = ""
    fp16_tflops: float | None = None
    fp32_tflops: float | None = None
    int8_tops: float | None = None
    tdp_watts: float | None = None
    purchase_price_usd: float | None = None
    price: Price | None = None
    interconnect: Interconnect | None = None
    measured: bool = False
    origin: str = field(default="", compare=False)  # the file it came from
    # The memory free when the local device was probed (None for catalog devices): what the engine's
    # kv_cache_memory_fraction takes its share of, once the weights are loaded.
    free_memory_bytes: int | None = field(default=None, compare=False)

    @property
    def peak_flops_16bit(self) -> float:
        return self.bf16_tflops * 1e12

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "origin"}
        d["source"], d["aliases"] = list(self.source), list(self.aliases)
        d["price"] = None if self.price is None else dict(self.price.__dict__)
        d["interconnect"] = None if self.interconnect is None else dict(self.interconnect.__dict__)
        return d


_REQUIRED = {
    "name": str,
    "display_name": str,
    "memory_bytes": int,
    "memory_bandwidth_bytes_per_s": float,
    "bf16_tflops": float,
    "source": "sources",
}
_OPTIONAL_NUMBERS = ("fp16_tflops", "fp32_tflops", "int8_tops", "tdp_watts", "purchase_price_usd")
_KNOWN = set(_REQUIRED) | set(_OPTIONAL_NUMBERS) | {"aliases", "vendor", "notes", "price", "interconnect", "measured"}
_PRICE_FIELDS = {"usd_per_hour", "kind", "provider", "date", "source"}
_INTERCONNECT_FIELDS = {"name", "bandwidth_bytes_per_s"}


def _positive(where: str, key: str, value, integer: bool = False):
    ok_type = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok_type or not value > 0:
        kind = "a positive integer" if integer else "a positive number"
        raise DeviceFileError(f"{where}: field {key!r} must be {kind} (got {value!r})")
    return value


def _string(where: str, key: str, value) -> str:
    if not isinstance(value, str) or not value.strip():
        raise DeviceFileError(f"{where}: field {key!r} must be a non-empty string (got {value!r})")
    return value


def _unknown(where: str, obj: dict, known: set[str], what: str = "field") -> None:
    extra = sorted(set(obj) - known)
    if extra:
        raise DeviceFileError(f"{where}: unknown {what} {extra[0]!r}; known: {', '.join(sorted(known))}")


def device_from_dict(obj, where: str) -> Device:
    """Validate one device object; `where` (file and index) prefixes every error."""
    if not isinstance(obj, dict):
        raise DeviceFileError(f"{where}: a device must be a JSON object (got {type(obj).__name__})")
    _unknown(where, obj, _KNOWN)
    for key in _REQUIRED:
        if key not in obj:
            raise DeviceFileError(f"{where}: required field {key!r} is missing")
    name = _string(where, "name", obj["name"])
    if not re.fullmatch(r"[a-z0-9][a-z0-9._-]*", name):
        raise DeviceFileError(
            f"{where}: field 'name' must be lower case letters, digits, '.', '_' or '-' (got {name!r})"
        )
    src = obj["source"]
    sources = [src] if isinstance(src, str) else src
    if not isinstance(sources, list) or not sources or not all(isinstance(s, str) and s.strip() for s in sources):
        raise DeviceFileError(f"{where}: field 'source' must be a non-empty string or list of strings (got {src!r})")
    aliases = obj.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(x, str) and x for x in aliases):
        raise DeviceFileError(f"{where}: field 'aliases' must be a list of strings (got {aliases!r})")
    numbers = {k: (None if obj.get(k) is None else _positive(where, k, obj[k])) for k in _OPTIONAL_NUMBERS}
    price = obj.get("price")
    if price is not None:
        pw = f"{where}: price"
        if not isinstance(price, dict):
            raise DeviceFileError(f"{pw} must be an object or null (got {price!r})")
        _unknown(pw, price, _PRICE_FIELDS)
        missing = sorted(_PRICE_FIELDS - set(price))
        if missing:
            raise DeviceFileError(f"{pw}: required field {missing[0]!r} is missing")
        if not isinstance(price["date"], str) or not re.fullmatch(r"\d{4}-\d{2}-\d{2}", price["date"]):
            raise DeviceFileError(f"{pw}: field 'date' must be YYYY-MM-DD (got {price['date']!r})")
        price = Price(
            float(_positive(pw, "usd_per_hour", price["usd_per_hour"])),
            _string(pw, "kind", price["kind"]),
            _string(pw, "provider", price["provider"]),
            price["date"],
            _string(pw, "source", price["source"]),
        )
    link = obj.get("interconnect")
    if link is not None:
        iw = f"{where}: interconnect"
        if not isinstance(link, dict):
            raise DeviceFileError(f"{iw} must be an object or null (got {link!r})")
        _unknown(iw, link, _INTERCONNECT_FIELDS)
        bw = link.get("bandwidth_bytes_per_s")
        link = Interconnect(
            _string(iw, "name", link.get("name")),
            None if bw is None else float(_positive(iw, "bandwidth_bytes_per_s", bw)),
        )
    measured = obj.get("measured", False)
    if not isinstance(measured, bool):
        raise DeviceFileError(f"{where}: field 'measured' must be true or false (got {measured!r})")
    return Device(
        name=name,
        display_name=_string(where, "display_name", obj["display_name"]),
        memory_bytes=_positive(where, "memory_bytes", obj["memory_bytes"], integer=True),
        memory_bandwidth_bytes_per_s=float(
            _positive(where, "memory_bandwidth_bytes_per_s", obj["memory_bandwidth_bytes_per_s"])
        ),
        bf16_tflops=float(_positive(where, "bf16_tflops", obj["bf16_tflops"])),
        source=tuple(sources),
        aliases=tuple(a.lower() for a in aliases),
        vendor=obj.get("vendor", "") or "",
        notes=obj.get("notes", "") or "",
        price=price,
        interconnect=link,
        measured=measured,
        **{k: (None if v is None else float(v)) for k, v in numbers.items()},
    )


def load_device_file(path: str | Path) -> list[Device]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"device file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DeviceFileError(f"{path}: not valid JSON: {e}") from e
    if isinstance(data, dict) and "devices" in data:
        _unknown(str(path), data, {"devices"}, what="top-level key")
        items = data["devices"]
        if not isinstance(items, list) or not items:
            raise DeviceFileError(f"{path}: 'devices' must be a non-empty list")
        wheres = [f"{path} devices[{i}]" for i in range(len(items))]
    else:
        items, wheres = [data], [str(path)]
    devices = [device_from_dict(obj, where) for obj, where in zip(items, wheres)]
    return [Device(**{**d.__dict__, "origin": str(path)}) for d in devices]


def load_catalog(extra_files: list[str | Path] = ()) -> dict[str, Device]:
    """Built-in devices, then each extra file (a user's device replaces a built-in one of the same name)."""
    catalog: dict[str, Device] = {}
    for path in sorted(DATA_DIR.glob("*.json")):
        for dev in load_device_file(path):
            if dev.name in catalog:
                raise DeviceFileError(
                    f"{path}: device name {dev.name!r} is already defined in {catalog[dev.name].origin}"
                )
            catalog[dev.name] = dev
    for path in extra_files:
        for dev in load_device_file(path):
            catalog[dev.name] = dev
    return catalog


def find_device(catalog: dict[str, Device], name: str) -> Device:
    key = name.lower()
    if key in catalog:
        return catalog[key]
    for dev in catalog.values():
        if key in dev.aliases:
            return dev
    known = ", ".join(sorted(catalog)) + ", local"
    raise ValueError(f"device {name!r} is not in the catalog; choose one of {known}, or add one with --device-file")
