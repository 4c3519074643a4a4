"""Which upstream instance gets a request: round robin, the fewest requests in flight, or prefix-cache affinity.

The router counts its own requests in flight to each instance (its queue depth as the router sees it: every request
an instance serves comes through the router). Affinity: a request whose prompt starts like an earlier one's goes to
the instance that served that one, where the prompt's first blocks are likely still in the prefix cache, unless that
instance has `slack` more requests in flight than the least loaded one. The keys are hashes of the prompt's first
32, 64, 96, ... characters up to `prefix_chars` (the router has no tokenizer; characters stand in for the first
blocks' tokens): the longest one some instance served wins, so prompts that share only a system prompt of 100
characters still meet on one instance (a radix tree's lookup, at 32-character steps).
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


KEY_STEP = 32  # characters between two affinity keys of one prompt


def prompt_key(body: dict, prefix_chars: int) -> tuple[str, ...] | None:
    """The affinity keys of an OpenAI request body: its prompt's (or rendered messages') first KEY_STEP, 2 KEY_STEP,
    ... characters (up to prefix_chars and the text's length), each hashed; shortest first."""
    if "messages" in body:
        text = json.dumps(body.get("messages"), sort_keys=True, ensure_ascii=False)
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)
    if not text:
        return None
    text = text[:prefix_chars]
    ends = [*range(KEY_STEP, len(text), KEY_STEP), len(text)]
    return tuple(hashlib.sha1(text[:end].encode("utf-8", "replace")).hexdigest() for end in ends)


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

    def pick(self, key: str | tuple[str, ...] | None = None, exclude: set[str] = frozenset()) -> Instance:
        """key: a prompt's affinity keys, shortest first (prompt_key), or one key."""
        keys = (key,) if isinstance(key, str) else key
        candidates = [i for i, x in enumerate(self.instances) if x.url not in exclude] or list(
            range(len(self.instances))
        )
        if self.policy == "round_robin":
            i = self._round_robin()
            while i not in candidates:
                i = self._round_robin()
            return self.instances[i]
        if self.policy == "affinity" and keys:
            least = min(self.instances[i].inflight for i in candidates)
            for k in reversed(keys):  # the longest prefix an instance served
                owner = self._owner.get(k)
                if owner is None:
                    continue
                if owner in candidates and self.instances[owner].inflight <= least + self.slack:
                    self.affinity_hits += 1
                    self._remember(keys, owner)
                    return self.instances[owner]
                break  # (its holder is busy or excluded: the least loaded takes it, and the prefix moves)
        i = self._least_loaded()
        while i not in candidates:
            i = self._least_loaded()
        if self.policy == "affinity" and keys:
            self._remember(keys, i)
        return self.instances[i]

    def _remember(self, keys: tuple[str, ...], i: int) -> None:
        for k in keys:
            self._owner[k] = i
            self._owner.move_to_end(k)
        while len(self._owner) > self.capacity:
            self._owner.popitem(last=False)
