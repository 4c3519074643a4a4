"""Prometheus metrics of one server: engine gauges read at scrape time, request counters and latency histograms.

Each server owns its CollectorRegistry (no process-global state), so tests can run several servers. Every family is
also served under vLLM's name (VLLM_ALIASES, with vLLM's model_name and engine labels), so that dashboards and alerts
made for vLLM read this server: the alias is the same family re-labelled at scrape time, never a second count.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from infertune.engine.async_engine import AsyncLLMEngine
from infertune.engine.host_memory import process_rss
from infertune.engine.outputs import RequestOutput

# (past 120 s as vLLM's: a long generation on a CPU takes minutes, and a request past the last bucket is only +Inf)
_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0
)  # fmt: skip
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)

# vLLM's names (vllm/v1/metrics/loggers.py, in seconds and tokens as ours) of the families above: infertune family ->
# the vLLM families it is also served as. Both TPOT names carry our per-request mean time per output token (one
# observation per request); vLLM's inter_token_latency observes every token's interval, which is not recorded here.
VLLM_ALIASES = {
    "infertune_requests_running": ("vllm:num_requests_running",),
    "infertune_requests_waiting": ("vllm:num_requests_waiting",),
    "infertune_kv_cache_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "infertune_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "infertune_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "infertune_preemptions": ("vllm:num_preemptions",),
    "infertune_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "infertune_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "infertune_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "infertune_prompt_tokens": ("vllm:prompt_tokens",),
    "infertune_generation_tokens": ("vllm:generation_tokens",),
    "infertune_requests": ("vllm:request_success",),
    "infertune_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "infertune_time_per_output_token_seconds": (
        "vllm:time_per_output_token_seconds",
        "vllm:request_time_per_output_token_seconds",
        "vllm:inter_token_latency_seconds",
    ),
    "infertune_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    "infertune_request_queue_time_seconds": ("vllm:request_queue_time_seconds",),
}
_VLLM_LABEL_NAMES = {"finish_reason": "finished_reason"}


class _EngineCollector:
    """Reads the engine thread's latest stats snapshot whenever /metrics is scraped."""

    def __init__(self, engine: AsyncLLMEngine) -> None:
        self.engine = engine

    def collect(self):
        s = self.engine.stats
        yield GaugeMetricFamily("infertune_requests_running", "Sequences being decoded or prefilled", s["num_running"])
        yield GaugeMetricFamily("infertune_requests_waiting", "Sequences queued for admission", s["num_waiting"])
        used = s["kv_blocks_total"] - s["kv_blocks_free"]
        yield GaugeMetricFamily("infertune_kv_blocks_used", "KV-cache blocks held by sequences", used)
        yield GaugeMetricFamily(
            "infertune_kv_blocks_free", "KV-cache blocks free (cached prefixes included)", s["kv_blocks_free"]
        )
        yield GaugeMetricFamily(
            "infertune_kv_cache_usage", "Share of KV-cache blocks in use", used / max(s["kv_blocks_total"], 1)
        )
        by_group = GaugeMetricFamily(
            "infertune_kv_blocks_used_by_group",
            "KV-cache blocks held in each kind of layer group (full attention, each sliding window: its own block "
            "tables; a kind cut into several equal groups sums their blocks)",
            labels=["group"],
        )
        tokens = GaugeMetricFamily(
            "infertune_kv_tokens_by_group", "Tokens of KV held in each layer group", labels=["group"]
        )
        int4 = s.get("kv_int4_blocks") or [0] * len(s.get("kv_groups", ()))
        counts = s.get("kv_group_counts") or [1] * len(s.get("kv_groups", ()))
        for (label, blocks), packed, n in zip(s.get("kv_groups", ()), int4, counts):
            by_group.add_metric([label], blocks)
            # (an int4 block: two blocks' tokens; a kind cut into n equal groups holds its tokens in each)
            tokens.add_metric([label], (blocks + packed) * s["kv_block_size"] // n)
        yield by_group
        yield tokens
        yield CounterMetricFamily(
            "infertune_kv_int4_packs",
            "The int4 tier (kv_int4_after): pairs of int8 KV blocks re-stored as one int4 block",
            s.get("kv_int4_packs", 0),
        )
        yield GaugeMetricFamily(
            "infertune_prefix_cache_hit_rate", "Prompt tokens served from the prefix cache", s["prefix_cache_hit_rate"]
        )
        yield CounterMetricFamily(
            "infertune_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            s.get("prefix_cache_queries", 0),
        )
        yield CounterMetricFamily(
            "infertune_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (hit rate = hits / queries)",
            s.get("prefix_cache_hits", 0),
        )
        yield CounterMetricFamily(
            "infertune_preemptions", "Sequences preempted for lack of KV blocks", s["num_preemptions"]
        )
        yield CounterMetricFamily(
            "infertune_spec_decode_num_drafts",
            "Speculative decoding: decode steps of a sequence that carried drafts",
            s["spec_decode_num_drafts"],
        )
        yield CounterMetricFamily(
            "infertune_spec_decode_num_draft_tokens",
            "Speculative decoding: draft tokens proposed",
            s["spec_decode_num_draft_tokens"],
        )
        yield CounterMetricFamily(
            "infertune_spec_decode_num_accepted_tokens",
            "Speculative decoding: draft tokens accepted (mean acceptance length = 1 + accepted / drafts)",
            s["spec_decode_num_accepted_tokens"],
        )
        yield CounterMetricFamily(
            "infertune_generation_tokens",
            "Output tokens generated, counted as each step makes them (those of requests aborted later included)",
            s.get("generation_tokens", 0),
        )
        yield CounterMetricFamily(
            "infertune_prefill_tokens_computed",
            "Prompt tokens computed here (not served by the prefix cache nor loaded from a prefill instance)",
            s.get("prefill_tokens_computed", 0),
        )
        for name, (value, kind, help_) in s.get("kv_transfer", {}).items():  # prefill/decode disaggregation
            family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
            yield family(f"infertune_{name}", help_, value)
        finished = CounterMetricFamily(
            "infertune_requests",
            "Finished sequences by finish reason: a request with n samples or several prompts counts each one (the "
            "latency histograms count requests)",
            labels=["finish_reason"],
        )
        for reason, count in sorted(dict(self.engine.num_finished).items()):
            finished.add_metric([reason], count)
        yield finished
        yield CounterMetricFamily(
            "infertune_requests_aborted", "Requests aborted before finishing (client gone)", self.engine.num_aborted
        )
        yield CounterMetricFamily(
            "infertune_requests_timed_out", "Requests aborted at their deadline", self.engine.num_timed_out
        )
        a = self.engine.admission
        yield GaugeMetricFamily(
            "infertune_process_resident_memory_bytes", "Resident host memory of the server process", process_rss()
        )
        yield GaugeMetricFamily(
            "infertune_host_memory_ceiling_bytes", "Host memory the server refuses work above", a.ceiling_bytes
        )
        yield GaugeMetricFamily(
            "infertune_host_memory_reserved_bytes",
            "Host memory held by admitted requests, by their estimated cost",
            a.reserved_bytes,
        )


class _Exposition:
    """Every family of one server, each also under its vLLM names (VLLM_ALIASES), from one reading per scrape."""

    def __init__(self, engine: AsyncLLMEngine, own: list, model_name: str) -> None:
        self.engine_collector, self.own, self.model_name = _EngineCollector(engine), own, model_name

    def collect(self):
        families = list(self.engine_collector.collect())
        families += [f for metric in self.own for f in metric.collect()]
        yield from families
        for f in families:
            for alias in VLLM_ALIASES.get(f.name, ()):
                yield _relabelled(f, alias, {"model_name": self.model_name, "engine": "0"})


def _relabelled(family: Metric, name: str, labels: dict[str, str]) -> Metric:
    """family under another name, its label names as vLLM's and `labels` added to each sample."""
    out = Metric(name, f"{family.documentation} (vLLM's name for {family.name})", family.type)
    for sample in family.samples:
        own = {_VLLM_LABEL_NAMES.get(k, k): v for k, v in sample.labels.items()}
        out.samples.append(sample._replace(name=name + sample.name[len(family.name) :], labels={**labels, **own}))
    return out


class ServerMetrics:
    def __init__(self, engine: AsyncLLMEngine, model_name: str = "") -> None:
        """model_name: the served name, vLLM's model_name label on the vLLM-named families."""
        self.prompt_tokens = Counter("infertune_prompt_tokens", "Prompt tokens of finished requests", registry=None)
        self.rejected = Counter(
            "infertune_requests_rejected",
            "Requests refused, by HTTP status and reason",
            ["status", "reason"],
            registry=None,
        )
        self.queue_time = Histogram(
            "infertune_request_queue_time_seconds",
            "Arrival to the first scheduled step",
            registry=None,
            buckets=_LATENCY_BUCKETS,
        )
        self.ttft = Histogram(
            "infertune_time_to_first_token_seconds", "Time to first token", registry=None, buckets=_LATENCY_BUCKETS
        )
        self.tpot = Histogram(
            "infertune_time_per_output_token_seconds",
            "Mean time between output tokens",
            registry=None,
            buckets=_TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            "infertune_e2e_request_latency_seconds", "Arrival to last token", registry=None, buckets=_LATENCY_BUCKETS
        )
        own = [self.prompt_tokens, self.rejected, self.queue_time, self.ttft, self.tpot, self.e2e]
        self.registry = CollectorRegistry()
        self.registry.register(_Exposition(engine, own, model_name))

    def refuse(self, status: int, reason: str) -> None:
        self.rejected.labels(str(status), reason).inc()

    def observe_finished(self, out: RequestOutput) -> None:
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        m = out.metrics
        if m is not None and m.queue_time is not None:
            self.queue_time.observe(m.queue_time)
        if m is None or m.first_token_time is None:
            return
        self.ttft.observe(m.first_token_time - m.arrival_time)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
            n = max(len(c.token_ids) for c in out.outputs)
            if n > 1:
                self.tpot.observe((m.finished_time - m.first_token_time) / (n - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)
