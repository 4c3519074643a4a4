"""Planner: a hardware catalog (data) and a memory / roofline / cost model that answer capacity, speed and cost
questions from a model's config.json alone. Pure arithmetic; only the `local` device probe imports torch, lazily."""

from infertune.plan.catalog import Device, DeviceFileError, find_device, load_catalog, load_device_file
from infertune.plan.cost import PDSplit, pd_split, tokens_per_joule, usd_per_million_tokens
from infertune.plan.memory import (
    KVFormat,
    ModelSpec,
    WeightFormat,
    kv_bytes,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    memory_budget,
    shipped_models,
    weight_breakdown,
)
from infertune.plan.planner import PlanRequest, make_plan
from infertune.plan.roofline import Efficiency, Roofline, calibrate_decode, calibrate_prefill
from infertune.plan.weights import expected_experts_touched

__all__ = [
    "Device",
    "DeviceFileError",
    "Efficiency",
    "KVFormat",
    "ModelSpec",
    "PDSplit",
    "PlanRequest",
    "Roofline",
    "WeightFormat",
    "calibrate_decode",
    "calibrate_prefill",
    "expected_experts_touched",
    "find_device",
    "kv_bytes",
    "kv_bytes_per_sequence",
    "kv_bytes_per_token",
    "load_catalog",
    "load_device_file",
    "make_plan",
    "memory_budget",
    "pd_split",
    "shipped_models",
    "tokens_per_joule",
    "usd_per_million_tokens",
    "weight_breakdown",
]
