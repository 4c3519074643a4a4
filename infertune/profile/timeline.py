"""Run a representative workload through the real engine under torch.profiler and split each step's time by category.

The engine is never edited: `Instrumentation` wraps instance attributes of the engine's objects (scheduler,
executor, runner, attention backend, sampler) in callables that open `record_function("infertune::<kind>")`,
and registers forward pre/post hooks on the model's modules that open one range per module call; leaving the
`with` block undoes all of it. Each engine step runs inside `infertune::step#<i>`; the batch it ran decides
its phase: a prefill step (only prefill chunks), a decode step (only decodes) or a mixed step (prefill chunks
and decodes together, as chunked prefill runs a long prompt next to sequences that decode). On a MoE model a hook
on each router counts the tokens sent to each expert (one bincount a layer, on the device, inside an
`infertune::instrumentation` range so that it counts as host time): `expert_load`.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from dataclasses import dataclass, field, replace

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from infertune.profile.profile_categories import (
    INSTRUMENTATION_SCOPE,
    ROUTER_SCOPE,
    SCOPE_PREFIX,
    PhaseSummary,
    Span,
    StepProfile,
    attribute_cpu,
    attribute_device,
    module_scope_kind,
    scope_kind,
)
from infertune.profile.quiet import quiet_profile

try:
    import resource
except ImportError:  # not on Unix: no page-fault counts
    resource = None

STEP_RANGE = SCOPE_PREFIX + "step#"


def minor_faults() -> int:
    """The process's minor page faults so far (0 where the OS does not count them)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt if resource is not None else 0


@dataclass(slots=True)
class StepRecord:
    index: int
    phase: str = "empty"  # "prefill" (only prefill chunks), "decode" (only decodes), "mixed" (both), "empty"
    num_seqs: int = 0
    num_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    wall_us: float = 0.0  # perf_counter around engine.step()
    page_faults: int = 0  # the process's minor page faults during the step (fresh pages the step touched)
    fused: dict | None = None  # seconds per part of the fused step (kernels.FUSED_PARTS), where it ran this step


def batch_phase(batch) -> tuple[str, int]:
    """("prefill" | "mixed" | "decode", prefill tokens) of a ScheduledBatch, read before the step runs.

    An entry is a prefill chunk while its sequence has not computed its whole prompt (a recompute after preemption
    counts as prefill too), else a decode; a step with both is a mixed step, counted apart from either.
    """
    prefill_tokens, decode_tokens = batch_tokens(batch)
    phase = ("mixed" if decode_tokens else "prefill") if prefill_tokens else "decode"
    return phase, prefill_tokens


def batch_tokens(batch) -> tuple[int, int]:
    """(prefill tokens, decode tokens) of a ScheduledBatch, read before the step runs."""
    prefill = decode = 0
    for seq, n in zip(batch.seqs, batch.num_scheduled_tokens):
        if seq.num_computed_tokens < seq.num_prompt_tokens:
            prefill += n
        else:
            decode += n
    return prefill, decode


class _Ranged:
    """Stands in for a callable attribute: calls it inside a profiler range, forwards every other attribute."""

    def __init__(self, target, name: str, before=None) -> None:
        self._target, self._name, self._before = target, name, before

    def __call__(self, *args, **kwargs):
        if self._before is not None:
            self._before(*args, **kwargs)
        with record_function(self._name):
            return self._target(*args, **kwargs)

    def __getattr__(self, item):
        return getattr(self._target, item)


class Instrumentation:
    """`with Instrumentation(llm) as ins: ins.step()`: engine steps with ranges around the engine's parts.

    ranges=False only notes each step's phase and wall time (for the unprofiled baseline).
    `instrumented` / `missing` list what was found; an engine refactor shows up in `missing`, not as a crash.
    """

    def __init__(self, llm, ranges: bool = True) -> None:
        self.engine = llm.engine
        self.ranges = ranges
        self.records: list[StepRecord] = []
        self.instrumented: list[str] = []
        self.missing: list[str] = []
        self._undo: list = []
        self._hook_stack: list[record_function] = []
        # router module name -> tokens routed to each expert [E] (on the model's device) over the ranged steps
        self.expert_load: dict[str, torch.Tensor] = {}

    # ---- install / restore -----------------------------------------------------------------------------------
    def __enter__(self) -> Instrumentation:
        try:
            self._install()
        except BaseException:
            self._restore()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _wrap(self, owner, attr: str, kind: str, label: str, before=None) -> None:
        target = getattr(owner, attr, None) if owner is not None else None
        if target is None or not callable(target):
            self.missing.append(label)
            return
        had_own = attr in getattr(owner, "__dict__", {})
        try:
            setattr(owner, attr, _Ranged(target, SCOPE_PREFIX + kind, before))
        except AttributeError:  # __slots__ without this attribute: leave it alone
            self.missing.append(label)
            return
        self._undo.append(lambda: setattr(owner, attr, target) if had_own else delattr(owner, attr))
        self.instrumented.append(label)

    def _install(self) -> None:
        engine = self.engine
        executor = getattr(engine, "executor", None)
        self._wrap(executor, "execute_model", "execute", "executor.execute_model")
        scheduler = getattr(engine, "scheduler", None)
        # update(batch, ...) gets the step's ScheduledBatch before it advances it: what the step ran.
        self._wrap(scheduler, "update", "update", "scheduler.update", before=self._note_batch)
        if not self.ranges:
            return
        self._wrap(scheduler, "schedule", "schedule", "scheduler.schedule")
        self._wrap(engine, "_on_new_token", "detokenize", "engine._on_new_token (detokenize, stop strings)")
        self._wrap(engine, "_output", "detokenize", "engine._output (request outputs)")
        runner = getattr(executor, "runner", None)
        self._wrap(runner, "_prepare", "prepare_inputs", "runner._prepare (input tensors)")
        self._wrap(runner, "sampler", "sampler", "runner.sampler")
        model = getattr(runner, "model", None)
        self._wrap(model, "compute_logits", "logits", "model.compute_logits")
        if not isinstance(model, nn.Module):
            self.missing.append("model module hooks")
            return
        backends = {
            id(b): b
            for b in [getattr(runner, "attn", None)] + [getattr(m, "attn", None) for m in model.modules()]
            if b is not None and not isinstance(b, nn.Module) and hasattr(b, "write_kv")
        }
        for b in backends.values():
            self._wrap(b, "forward", "attention_backend", f"{type(b).__name__}.forward (attention backend)")
            self._wrap(b, "write_kv", "kv_write", f"{type(b).__name__}.write_kv (KV-cache write)")
        for qualname, module in model.named_modules():
            kind = (
                "forward"
                if module is model
                else module_scope_kind([c.__name__ for c in type(module).__mro__ if c not in (nn.Module, object)])
            )
            if kind is not None:
                self._hook(module, f"{SCOPE_PREFIX}{kind} {qualname or type(module).__name__}")
            if kind == ROUTER_SCOPE:
                self._count_routed(module, qualname)
        self.instrumented.append("model module hooks")
        self._count_fused_routed(runner, model)

    def _count_fused_routed(self, runner, model: nn.Module) -> None:
        """The fused step routes its MoE layers in C, past the routers' hooks: it counts them itself
        (runner/fused_decode.py expert_load), added to expert_load under each layer's router name at the end."""
        fused = getattr(runner, "fused", None)
        if fused is None or not hasattr(fused, "count_experts") or not fused.count_experts(True):
            return
        fused.expert_load(reset=True)
        names = {}  # decoder layer index -> its router's name
        for qualname, module in model.named_modules():
            kinds = [c.__name__ for c in type(module).__mro__ if c not in (nn.Module, object)]
            parts = qualname.split(".")
            if module_scope_kind(kinds) == ROUTER_SCOPE and "layers" in parts[:-1]:
                index = parts[parts.index("layers") + 1]
                if index.isdigit():
                    names[int(index)] = qualname

        def collect() -> None:
            for layer, counts in fused.expert_load(reset=True).items():
                name = names.get(layer, f"model.layers.{layer} (fused)")
                self.expert_load[name] = self.expert_load.get(name, 0) + counts
            fused.count_experts(False)

        self._undo.append(collect)
        self.instrumented.append("fused step expert load")

    def _hook(self, module: nn.Module, name: str) -> None:
        handles = add_range_hooks(module, name, self._hook_stack)
        self._undo.append(lambda: [h.remove() for h in handles])

    def _count_routed(self, router: nn.Module, name: str) -> None:
        """Add each call's expert ids (the integer [T, k] tensor among the router's outputs) to expert_load[name]."""
        experts = getattr(router, "num_experts", None) or getattr(getattr(router, "moe", None), "num_experts", None)
        experts = experts or router.weight.shape[0]  # a router's weight is [E, H]
        label = f"{SCOPE_PREFIX}{INSTRUMENTATION_SCOPE} expert_load"

        def count(_module, _args, output) -> None:
            ids = next((t for t in (output if isinstance(output, tuple) else (output,)) if _is_expert_ids(t)), None)
            if ids is None:
                return
            with record_function(label):
                counts = torch.bincount(ids.reshape(-1), minlength=experts)
                self.expert_load[name] = self.expert_load.get(name, 0) + counts

        handle = router.register_forward_hook(count)
        self._undo.append(handle.remove)

    def _restore(self) -> None:
        while self._undo:
            self._undo.pop()()

    # ---- stepping ----------------------------------------------------------------------------------------------
    def _note_batch(self, batch, *args, **kwargs) -> None:
        if not self.records:  # a step run outside self.step(): nothing to note it on
            return
        rec = self.records[-1]
        rec.phase, rec.num_prefill_tokens = batch_phase(batch)
        rec.num_decode_tokens = batch_tokens(batch)[1]
        rec.num_seqs = len(batch.seqs)
        rec.num_tokens = sum(batch.num_scheduled_tokens)

    def step(self) -> StepRecord:
        rec = StepRecord(len(self.records))
        self.records.append(rec)
        # (this engine's own fused step: its counters are its own, whatever else runs in the process)
        timers = getattr(getattr(self.engine.executor.runner, "fused", None), "step_timers", None)
        if timers is not None:
            timers(reset=True)
        with record_function(f"{STEP_RANGE}{rec.index}"):
            f0 = minor_faults()
            t0 = time.perf_counter()
            self.engine.step()
            rec.wall_us = (time.perf_counter() - t0) * 1e6
            rec.page_faults = minor_faults() - f0
        if timers is not None:
            parts = timers(reset=True)
            if parts.pop("calls") > 0:
                parts.pop("rows")
                rec.fused = parts
        return rec

    def run(self, prompts: list[list[int]], params) -> list[StepRecord]:
        """Queue every prompt, then step until all are done; returns this run's step records."""
        first = len(self.records)
        ids = [f"infertune-profile-{first}-{i}" for i in range(len(prompts))]
        try:
            for request_id, prompt in zip(ids, prompts):
                self.engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
            while self.engine.has_unfinished_requests():
                self.step()
        finally:
            for request_id in ids:
                self.engine.abort_request(request_id)
        return self.records[first:]


def _is_expert_ids(t) -> bool:
    return isinstance(t, torch.Tensor) and t.dim() == 2 and not t.is_floating_point() and t.dtype is not torch.bool


def add_range_hooks(module: nn.Module, name: str, stack: list) -> tuple:
    """Forward pre/post hooks that open and close a profiler range around every call of module; their handles."""

    def pre(_module, _args):
        rf = record_function(name)
        rf.__enter__()
        stack.append(rf)

    def post(_module, _args, _output):
        stack.pop().__exit__(None, None, None)

    return module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True)


def make_prompts(vocab_size: int, input_len: int, batch: int, salt: int) -> list[list[int]]:
    """Deterministic prompts that share no prefix with each other or with another salt's (no prefix-cache hits)."""
    return [
        [(17 + 7919 * i + 104729 * b + 1299709 * salt) % vocab_size for i in range(input_len)] for b in range(batch)
    ]


def measure_launch_us(backend, repeats: int = 2000) -> float:
    """Host cost of one trivial op on the engine's device (dispatch + launch), best of three runs, in us."""
    with torch.inference_mode():
        x = torch.zeros(1, device=backend.device)
        for _ in range(50):
            x.add_(1)
        backend.synchronize()
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(repeats):
                x.add_(1)
            backend.synchronize()
            best = min(best, (time.perf_counter() - t0) / repeats)
    return best * 1e6


def measure_range_us(repeats: int = 200) -> float:
    """What one instrumented module call adds, under the active profiler, in us: an empty module called with the
    range hooks minus without them (hook dispatch, the range's enter and exit, the profiler recording it)."""
    module = nn.Identity()
    x = torch.zeros(1)

    def best_of_three() -> float:
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(repeats):
                module(x)
            best = min(best, (time.perf_counter() - t0) / repeats)
        return best

    plain = best_of_three()
    handles = add_range_hooks(module, SCOPE_PREFIX + "calibrate", [])
    try:
        hooked = best_of_three()
    finally:
        for h in handles:
            h.remove()
    return max(hooked - plain, 0.0) * 1e6


def profiler_activities(backend) -> list[ProfilerActivity]:
    """CPU always, plus the device's activity: the backend says which (only backends/ names hardware)."""
    return list(backend.profiler_activities())


@dataclass(slots=True)
class TimelineResult:
    records: list[StepRecord]
    steps: list[StepProfile]  # one per profiled record (empty steps left out)
    phases: dict[str, PhaseSummary]
    timeline: str  # "cpu" or "device"
    instrumented: list[str]
    missing: list[str]
    baseline: dict[str, list[float]] = field(default_factory=dict)  # phase -> unprofiled step wall times, us
    launch_us: float = 0.0
    range_us: float = 0.0  # what one instrumented module call adds under the profiler (hooks + range)
    prof: profile | None = None
    baseline_faults: dict[str, list[int]] = field(default_factory=dict)  # phase -> page faults of unprofiled steps
    baseline_fused: dict[str, list[dict]] = field(default_factory=dict)  # phase -> fused-step splits, unprofiled
    expert_load: dict[str, list[int]] = field(default_factory=dict)  # router -> tokens per expert, profiled run


def split_events(events) -> tuple[dict[int, list[Span]], list[Span]]:
    """Profiler events -> CPU spans per thread, and device kernels (whose id is the launching CPU op's)."""
    threads: dict[int, list[Span]] = {}
    kernels: list[Span] = []
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        if e.device_type == DeviceType.CPU:
            if not e.is_async:
                threads.setdefault(e.thread, []).append(Span(e.name, start, end, e.id))
        elif (
            getattr(e, "linked_correlation_id", 0) > 0
            and not getattr(e, "is_user_annotation", False)
            and scope_kind(e.name) is None
        ):
            # Device copies of the ranges (gpu_user_annotation) would count their kernels twice: only kernels,
            # memcpys and memsets, which point at the CPU op that launched them, are kept.
            kernels.append(Span(e.name, start, end, e.linked_correlation_id))
    return threads, kernels


def analyse(events, records: list[StepRecord]) -> tuple[list[StepProfile], dict[str, PhaseSummary], str]:
    """Attribute every recorded step's time; aggregate by phase. Steps are found by their range's name."""
    threads, kernels = split_events(events)
    by_index = {r.index: r for r in records}
    timeline = "device" if kernels else "cpu"
    steps: list[StepProfile] = []
    phases: dict[str, PhaseSummary] = {}
    for spans in threads.values():
        spans.sort(key=lambda s: s.start)
        starts = [s.start for s in spans]
        for span in spans:
            if not span.name.startswith(STEP_RANGE):
                continue
            rec = by_index.get(int(span.name[len(STEP_RANGE) :]))
            if rec is None or rec.phase == "empty":
                continue
            step = attribute_cpu(span, spans[bisect_left(starts, span.start) : bisect_left(starts, span.end)])
            if kernels:
                step = attribute_device(span, kernels, step)
            steps.append(step)
            phases.setdefault(rec.phase, PhaseSummary(rec.phase)).add(step, rec.num_tokens, rec.num_seqs)
    return steps, phases, timeline


def profile_workload(llm, input_len: int, output_len: int, batch: int, params, warmup: bool = True) -> TimelineResult:
    """Warm up (and time the steps unprofiled), then run the same-shaped workload under torch.profiler."""
    engine = llm.engine
    backend = engine.executor.backend
    vocab = engine.config.model.arch.vocab_size
    baseline: dict[str, list[float]] = {}
    baseline_faults: dict[str, list[int]] = {}
    baseline_fused: dict[str, list[dict]] = {}
    if warmup:
        with Instrumentation(llm, ranges=False) as plain:
            # A first tiny request pays the one-time costs (first forward, allocator, thread pool) untimed.
            plain.run(make_prompts(vocab, input_len, 1, salt=3), replace(params, max_tokens=2))
            plain.records.clear()
            plain.run(make_prompts(vocab, input_len, batch, salt=1), params)
        for r in plain.records:
            if r.phase != "empty":
                baseline.setdefault(r.phase, []).append(r.wall_us)
                baseline_faults.setdefault(r.phase, []).append(r.page_faults)
                if r.fused is not None:
                    baseline_fused.setdefault(r.phase, []).append(r.fused)
    launch_us = measure_launch_us(backend)
    with Instrumentation(llm) as ins:
        with quiet_profile(activities=profiler_activities(backend)) as prof:
            with torch.inference_mode():  # the profiler's first events pay its lazy start-up: not in any step
                x = torch.zeros(1, device=backend.device)
                for _ in range(20):
                    x.add_(1)
                backend.synchronize()
            range_us = measure_range_us()
            ins.run(make_prompts(vocab, input_len, batch, salt=2), params)
    steps, phases, timeline = analyse(prof.events(), ins.records)
    return TimelineResult(
        ins.records,
        steps,
        phases,
        timeline,
        ins.instrumented,
        ins.missing,
        baseline,
        launch_us,
        range_us,
        prof,
        baseline_faults,
        baseline_fused,
        {name: counts.tolist() for name, counts in ins.expert_load.items()},
    )
