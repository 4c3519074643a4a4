"""Which upstream instance gets a request: round robin, the fewest requests in flight, or prefix-cache affinity.

The router counts its own requests in flight to each instance (its queue depth as the router sees it: every request
an instance serves comes through the router). Affinity (data parallel): a request whose prompt starts like an
earlier one's goes to the instance that served that one, where the prompt's first blocks are likely still in the
prefix cache, unless that instance has `slack` more requests in flight than the least loaded one. The key is a hash
of the prompt's first `prefix_chars` characters (the router has no tokenizer; characters stand in for the first
blocks' tokens).
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from dataclasses import dataclass

POLICIES = ("round_robin", "least_loaded", "affinity")


@dataclass(slots=True)
class Instance:
    url: str
    role: str  # "prefill" | "decode" | "replica"
    inflight: int = 0
    served: int = 0
    failures: int = 0


def prompt_key(body: dict, prefix_chars: int) -> str | None:
    """The affinity key of an OpenAI request body: its prompt's (or rendered messages') first characters, hashed."""
    if "messages" in body:
        text = json.dumps(body.get("messages"), sort_keys=True, ensure_ascii=False)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    if not text:
        return None
    return hashlib.sha1(text[:prefix_chars].encode("utf-8", "replace")).hexdigest()


class Picker:
    """Picks among one role's instances by `policy`; affinity remembers up to `capacity` prompt keys."""

    def __init__(self, instances: list[Instance], policy: str, slack: int = 4, capacity: int = 65536) -> None:
        if policy not in POLICIES:
            raise ValueError(f"routing policy {policy!r} is not one of {POLICIES}")
        assert instances
        self.instances, self.policy, self.slack, self.capacity = instances, policy, slack, capacity
        self._next = 0
        self._owner: OrderedDict[str, int] = OrderedDict()  # prompt key -> index of the instance that served it
        self.affinity_hits = 0

    def _round_robin(self) -> int:
        i = self._next % len(self.instances)
        self._next += 1
        return i

    def _least_loaded(self) -> int:
        n = len(self.instances)
        start = self._next % n  # ties go round robin
        self._next += 1
        return min(((start + k) % n for k in range(n)), key=lambda i: self.instances[i].inflight)

    def pick(self, key: str | None = None, exclude: set[str] = frozenset()) -> Instance:
        candidates = [i for i, x in enumerate(self.instances) if x.url not in exclude] or list(
            range(len(self.instances))
        )
        if self.policy == "round_robin":
            i = self._round_robin()
            while i not in candidates:
                i = self._round_robin()
            return self.instances[i]
        if self.policy == "affinity" and key is not None:
            owner = self._owner.get(key)
            least = min(self.instances[i].inflight for i in candidates)
            if owner in candidates and self.instances[owner].inflight <= least + self.slack:
                self._owner.move_to_end(key)
                self.affinity_hits += 1
                return self.instances[owner]
        i = self._least_loaded()
        while i not in candidates:
            i = self._least_loaded()
        if self.policy == "affinity" and key is not None:
            self._owner[key] = i
            self._owner.move_to_end(key)
            while len(self._owner) > self.capacity:
                self._owner.popitem(last=False)
        return self.instances[i]
