"""KV compression as configured: the presses (kvpress's names and parameters) and the policy that picks one per layer
and per sequence length. Pure Python: the engine plans blocks with it, the runner evicts by it (layers/attention/
press.py scores and moves the KV).

A press runs once per sequence, when its prefill (its whole prompt, or after a preemption its prompt and outputs so
far) is computed: each compressed layer keeps, per KV head, `kept_tokens(layer, n)` of the n tokens (the same count
for every head, other tokens per head) and the others' KV is dropped. K is cached after rotary, so the kept tokens
keep their original positions, and decoding goes on at the true position n, n + 1, ...; only the KV slots the
sequence holds shrink (position and slot part ways: `RequestState.num_evicted`).

Forms (`KVCompressionConfig.from_dict`):
- one press for every layer: {"press": "snapkv", "compression_ratio": 0.5, "window_size": 16, "kernel_size": 5};
  {"press": "streaming_llm", "compression_ratio": 0.5, "n_sink": 4}; {"press": "pyramidkv", ..., "beta": 20};
  "layer_ratios": [r0, r1, ...] gives each layer its own compression_ratio (per-layer budgets);
- a policy: {"policy": [rule, ...]}, a rule being {"layers": "0-1", "window": 128} (a sliding window on those layers,
  whatever the length: their blocks are freed as they leave it) or {"layers": ..., "max_length": N, "press": ...,
  <its parameters>} ("layers" and "max_length" optional: every layer, every length). A layer takes its window rule
  if it has one, else the first press rule that names it and whose max_length is at least the prefill's length;
  none: full attention. So {"policy": [{"layers": "0-1", "window": 128}, {"max_length": 4096, "press": "none"},
  {"press": "snapkv", "compression_ratio": 0.25}]} is the seeds' recipe: windows in layers 0-1, the rest full up to
  4096 prompt tokens and SnapKV at 0.25 above.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# press -> its parameters and kvpress's defaults (compression_ratio 0.0 there too: nothing dropped unless asked)
PRESSES: dict[str, dict[str, float | int]] = {
    "none": {},
    "streaming_llm": {"compression_ratio": 0.0, "n_sink": 4},
    "snapkv": {"compression_ratio": 0.0, "window_size": 64, "kernel_size": 5},
    "pyramidkv": {"compression_ratio": 0.0, "window_size": 64, "kernel_size": 5, "beta": 20},
}
RULE_KEYS = ("layers", "max_length")


@dataclass(frozen=True, slots=True)
class Press:
    """One press with its parameters (kvpress's names); layer_ratios: per-layer compression_ratio, or None."""

    name: str
    compression_ratio: float = 0.0
    n_sink: int = 4
    window_size: int = 64
    kernel_size: int = 5
    beta: int = 20
    layer_ratios: tuple[float, ...] | None = None

    @classmethod
    def from_dict(cls, value: dict, where: str = "kv_compression") -> Press:
        name = value.get("press")
        if name not in PRESSES:
            raise ValueError(f"{where}: press={name!r} is not one of {sorted(PRESSES)}")
        allowed = set(PRESSES[name]) | ({"layer_ratios"} if name in ("streaming_llm", "snapkv") else set())
        unknown = sorted(set(value) - allowed - {"press"} - set(RULE_KEYS))
        if unknown:
            raise ValueError(f"{where}: press {name!r} takes {sorted(allowed) or 'no parameters'}, not {unknown}")
        params = {k: v for k, v in value.items() if k in allowed}
        if "layer_ratios" in params:
            ratios = params["layer_ratios"]
            if not isinstance(ratios, (list, tuple)) or not ratios:
                raise ValueError(f"{where}: layer_ratios={ratios!r} must be a list of ratios, one per layer")
            params["layer_ratios"] = tuple(ratios)
        press = cls(name, **params)
        press.check(where)
        return press

    def check(self, where: str) -> None:
        def ratio_ok(r) -> bool:
            return isinstance(r, (int, float)) and not isinstance(r, bool) and 0 <= r < 1

        if not ratio_ok(self.compression_ratio):
            raise ValueError(f"{where}: compression_ratio={self.compression_ratio!r} must be in [0, 1) (e.g. 0.5)")
        for r in self.layer_ratios or ():
            if not ratio_ok(r):
                raise ValueError(f"{where}: layer_ratios holds {r!r}; each must be in [0, 1)")
        for name in ("window_size", "kernel_size", "beta"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{where}: {name}={v!r} must be an integer >= 1")
        if self.kernel_size % 2 == 0:  # (an even window has no centre: its pooled scores are one key too many)
            raise ValueError(
                f"{where}: kernel_size={self.kernel_size!r} must be odd (a pooling window centred on each key)"
            )
        if not isinstance(self.n_sink, int) or isinstance(self.n_sink, bool) or self.n_sink < 0:
            raise ValueError(f"{where}: n_sink={self.n_sink!r} must be an integer >= 0")

    @property
    def needs_queries(self) -> bool:
        """Whether its scores read the observation window's queries (SnapKV and PyramidKV do)."""
        return self.name in ("snapkv", "pyramidkv")

    def ratio(self, layer: int) -> float:
        return self.layer_ratios[layer] if self.layer_ratios is not None else self.compression_ratio

    def layer_key(self, layer: int):
        """Equal for two layers that keep the same tokens count at every length."""
        return layer if self.name == "pyramidkv" else self.ratio(layer)

    def kept_tokens(self, layer: int, num_layers: int, n: int) -> int:
        """Tokens a layer keeps of a prefill of n (n: the press leaves it whole). As kvpress counts: ScorerPress keeps
        max(1, int(n * (1 - ratio))); PyramidKV its layer's budget. A prefill no longer than the press needs
        (n_sink, window_size: kvpress asserts there) is left whole."""
        r = self.ratio(layer)
        if self.name == "none" or r == 0:
            return n
        if self.name == "streaming_llm" and n <= self.n_sink:
            return n
        if self.needs_queries and n <= self.window_size:
            return n
        if self.name == "pyramidkv":
            return min(n, max(1, _pyramid_budget(n, r, self.window_size, self.beta, layer, num_layers)))
        return max(1, int(n * (1 - r)))


def _pyramid_budget(n: int, ratio: float, window: int, beta: int, layer: int, num_layers: int) -> int:
    """PyramidKV's per-layer budget (kvpress's get_layer_budget): from about twice the mean at layer 0 down to a
    beta-th of it at the last layer, SnapKV's uniform budget where the pyramid does not fit."""
    capacity = window + n * (1 - ratio)
    low = (capacity - window) / beta
    high = (capacity - window) * 2 - low
    if high >= n - window:
        high = n - window
        low = (capacity - window) * 2 - high
    if not (n >= high >= low >= window) or num_layers < 2:
        return round(n * (1 - ratio))
    steps = (high - low) / (num_layers - 1)
    return round(high - layer * steps)


@dataclass(frozen=True, slots=True)
class Rule:
    layers: frozenset[int] | None  # None: every layer
    max_length: int | None = None  # the rule holds for prefills of at most this many tokens (None: any)
    window: int | None = None  # a sliding-window rule (press is None then)
    press: Press | None = None

    def covers(self, layer: int, n: int | None = None) -> bool:
        in_layers = self.layers is None or layer in self.layers
        return in_layers and (n is None or self.max_length is None or n <= self.max_length)


def parse_layers(spec, where: str) -> frozenset[int] | None:
    """ "0-1", "0,2,5-7", [0, 1] or "all" -> the layer indices (None: all)."""
    if spec is None or spec == "all":
        return None
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = [spec]
    out: set[int] = set()
    try:
        if isinstance(spec, (list, tuple)):
            if not all(isinstance(x, int) and not isinstance(x, bool) for x in spec):
                raise ValueError
            out.update(spec)
        elif isinstance(spec, str):
            for part in spec.replace(" ", "").split(","):
                lo, _, hi = part.partition("-")
                lo_i, hi_i = int(lo), int(hi) if hi else int(lo)
                if hi_i < lo_i:
                    raise ValueError
                out.update(range(lo_i, hi_i + 1))
        else:
            raise ValueError
    except ValueError:
        raise ValueError(
            f'{where}: layers={spec!r} is not a layer list; write "0-1", "0,2,5-7", [0, 1] or "all"'
        ) from None
    if not out or min(out) < 0:
        raise ValueError(f"{where}: layers={spec!r} must name layers 0 and up")
    return frozenset(out)


@dataclass(frozen=True, slots=True)
class KVCompressionConfig:
    """The kv_compression option, parsed: rules in order (a single press is one rule over every layer)."""

    rules: tuple[Rule, ...]
    source: dict = field(default_factory=dict, compare=False)

    @classmethod
    def from_dict(cls, value: dict) -> KVCompressionConfig:
        if not isinstance(value, dict):
            raise ValueError(
                f"kv_compression={value!r} must be a dict such as "
                '{"press": "snapkv", "compression_ratio": 0.5} or {"policy": [...]}'
            )
        if "policy" in value:
            if set(value) != {"policy"}:
                raise ValueError(f"kv_compression: a policy stands alone; drop {sorted(set(value) - {'policy'})}")
            rules = value["policy"]
            if not isinstance(rules, list) or not rules:
                raise ValueError("kv_compression: policy must be a non-empty list of rules")
            return cls(tuple(_rule(r, f"kv_compression policy rule {i}") for i, r in enumerate(rules)), value)
        if "press" not in value:
            raise ValueError(
                f'kv_compression needs "press" (one of {sorted(PRESSES)}) or "policy" (a list of rules); got '
                f"{sorted(value)}"
            )
        return cls((_rule(value, "kv_compression"),), value)

    def __str__(self) -> str:
        return json.dumps(self.source)

    # ---- checks against a model ------------------------------------------------------------------
    def check(self, num_layers: int) -> None:
        for i, rule in enumerate(self.rules):
            if rule.layers is not None and max(rule.layers) >= num_layers:
                raise ValueError(
                    f"kv_compression rule {i}: layer {max(rule.layers)} does not exist; the model has layers "
                    f"0-{num_layers - 1}"
                )
            ratios = rule.press.layer_ratios if rule.press is not None else None
            if ratios is not None and len(ratios) != num_layers:
                raise ValueError(
                    f"kv_compression rule {i}: layer_ratios has {len(ratios)} ratios; the model has {num_layers} layers"
                )

    # ---- what each layer does --------------------------------------------------------------------
    def layer_windows(self, model_windows: tuple[int | None, ...] | None, num_layers: int):
        """The model's per-layer windows with the window rules' (the smaller where both): None if every layer is
        full."""
        windows = list(model_windows or (None,) * num_layers)
        for rule in self.rules:
            if rule.window is not None:
                for i in range(num_layers):
                    if rule.covers(i):
                        windows[i] = rule.window if windows[i] is None else min(windows[i], rule.window)
        return tuple(windows) if any(w is not None for w in windows) else None

    def press_for(self, layer: int, n: int) -> Press | None:
        """The press a full-attention layer runs on a prefill of n tokens (None: kept whole)."""
        if any(r.window is not None and r.covers(layer) for r in self.rules):
            return None
        rule = next((r for r in self.rules if r.window is None and r.covers(layer, n)), None)
        return None if rule is None or rule.press.name == "none" else rule.press

    def kept_tokens(self, layer: int, num_layers: int, n: int) -> int:
        press = self.press_for(layer, n)
        return n if press is None else press.kept_tokens(layer, num_layers, n)

    def layer_key(self, layer: int):
        """Equal for layers that keep the same count at every length (they can share one KV cache group); None for
        a layer no press ever compresses."""
        if any(r.window is not None and r.covers(layer) for r in self.rules):
            return None
        key = tuple(
            (i, r.max_length, r.press.name, r.press.layer_key(layer))
            for i, r in enumerate(self.rules)
            if r.window is None and r.covers(layer)
        )
        # rules after one that covers every length are never reached; "none" everywhere compresses nothing
        cut = next((j for j, k in enumerate(key) if k[1] is None), len(key) - 1)
        key = key[: cut + 1]
        return None if all(k[2] == "none" for k in key) else key

    def plan(self, groups, n: int) -> list[int] | None:
        """Per KV cache group (scheduler_output.KVCacheGroup), the tokens of a prefill of n it keeps (n in a windowed
        group, which no press compresses); None where no group drops any. The groups are the engine's: every layer
        of a full-attention group keeps the same count under this config (the engine's own, by its grouping; a
        request's, checked at admission), so its first layer's count is the group's."""
        num_layers = sum(len(g.layers) for g in groups)
        kept = [self.kept_tokens(g.layers[0], num_layers, n) if g.window is None else n for g in groups]
        return kept if any(k < n for k in kept) else None

    @property
    def presses(self) -> list[Press]:
        return [r.press for r in self.rules if r.press is not None and r.press.name != "none"]

    def observation_window(self) -> int:
        """The most prompt queries a press reads (SnapKV's window_size), 0 where none reads any."""
        return max((p.window_size for p in self.presses if p.needs_queries), default=0)


def _rule(value, where: str) -> Rule:
    if not isinstance(value, dict):
        raise ValueError(
            f"{where}: {value!r} must be a dict such as " + '{"press": "snapkv", "compression_ratio": 0.5}'
        )
    layers = parse_layers(value.get("layers"), where)
    max_length = value.get("max_length")
    if max_length is not None and (not isinstance(max_length, int) or isinstance(max_length, bool) or max_length < 1):
        raise ValueError(f"{where}: max_length={max_length!r} must be a positive integer (prefill tokens)")
    if "window" in value:
        extra = sorted(set(value) - {"window", "layers"})
        if extra:
            raise ValueError(f'{where}: a window rule takes "layers" and "window" only, not {extra}')
        w = value["window"]
        if not isinstance(w, int) or isinstance(w, bool) or w < 1:
            raise ValueError(f"{where}: window={w!r} must be a positive integer (tokens)")
        return Rule(layers, window=w)
    if "press" not in value:
        raise ValueError(f'{where}: a rule needs "press" (one of {sorted(PRESSES)}) or "window"; got {sorted(value)}')
    return Rule(layers, max_length, press=Press.from_dict(value, where))
