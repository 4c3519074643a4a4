"""The router's /metrics: its own families, then every instance's, each sample labelled with the instance it came from.

`vllm serve --data-parallel-size N` serves its engines' metrics on the front port, labelled engine="0".."N-1", and
vLLM dashboards read them there. The router does the same for the instances behind it: each instance's samples get
engine="<its index in the router's list>" (replacing the engine="0" that a single server writes) and role="replica" /
"prefill" / "decode", so the same family from several instances is one family with several label sets.
"""

from __future__ import annotations

from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families


class MergedFamilies:
    """A prometheus_client collector over the families parsed from the instances' texts (set before each scrape)."""

    def __init__(self) -> None:
        self.families: list[Metric] = []

    def collect(self):
        return list(self.families)

    def set_from(self, texts: list[tuple[dict[str, str], str]]) -> None:
        """texts: (the labels that say which instance, its /metrics text) per instance that answered."""
        merged: dict[tuple[str, str], Metric] = {}
        for labels, text in texts:
            for family in text_string_to_metric_families(text):
                key = (family.name, family.type)
                into = merged.get(key)
                if into is None:
                    into = merged[key] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples.extend(s._replace(labels={**s.labels, **labels}) for s in family.samples)
        self.families = list(merged.values())
