"""Record every aten op a piece of torch code dispatches, with shapes and dtypes, under a TorchDispatchMode.

CompositeImplicitAutograd ops (linear, matmul, scaled_dot_product_attention, einsum ...) are recorded and
then decomposed inside the mode, so the ops they turn into are recorded too, with the composite as their
parent: a backend table can then judge either level. Nothing runs on a target device; tracing is CPU-only
unless the caller's code itself uses another device.

Native kernels (the CPU's fused C decode step, the kernels' linears) are C calls, not aten ops: they never reach
the dispatcher, so no TorchDispatchMode sees them. `trace_native_steps` records what an engine runs there
instead, per step: whether the fused step ran (its own C timers), and which kernels ran (the
`infertune_kernels::<name>` ranges the kernels open while a profiler runs).
"""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from infertune.profile.op_tables import op_key, op_namespace

TensorSig = tuple[tuple[int, ...], str]  # (shape, dtype name without "torch.")


def _sigs(obj) -> tuple[TensorSig, ...]:
    leaves, _ = tree_flatten(obj)
    return tuple((tuple(t.shape), str(t.dtype).removeprefix("torch.")) for t in leaves if isinstance(t, torch.Tensor))


def _is_composite_implicit(func) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd")


# The model stages the audit reports op by op (a MoE layer's, MLA's): an op belongs to the innermost frame of
# one of these functions it runs under. (file suffix, function name, class of `self` or None) -> stage key.
STAGE_FRAMES = {
    ("layers/moe.py", "route", None): "moe_router",
    ("layers/moe.py", "_route", None): "moe_router",
    ("layers/moe.py", "forward_native", "Router"): "moe_router",
    ("layers/moe.py", "forward_kernels", "Router"): "moe_router",
    ("layers/moe.py", "group_by_expert", None): "moe_grouping",
    ("layers/moe.py", "run_experts", None): "moe_experts",
    ("layers/moe.py", "forward_native", "Experts"): "moe_experts",
    ("quant/experts.py", None, None): "moe_experts",
    ("layers/moe.py", "forward", "MoE"): "moe_shared",
    ("models/deepseek.py", "project", "DeepseekAttention"): "mla_project",
    ("layers/attention/mla.py", "write_kv", None): "mla_cache_write",
    ("layers/attention/mla.py", "_decode", None): "mla_decode",
    ("layers/attention/mla.py", "decompress", None): "mla_decompress",
    ("layers/attention/mla.py", "_read_slots", None): "mla_cache_read",
    ("layers/attention/mla.py", "forward", None): "mla_prefill",
}
_STAGE_FILES = tuple(sorted({f for f, _, _ in STAGE_FRAMES}))


def stage_of(frame) -> str | None:
    """The stage (STAGE_FRAMES) of the innermost matching frame from `frame` outwards, None outside them all."""
    while frame is not None:
        code = frame.f_code
        path = code.co_filename.replace("\\", "/")
        if path.endswith(_STAGE_FILES):
            suffix = next(f for f in _STAGE_FILES if path.endswith(f))
            owner = frame.f_locals.get("self")
            cls = type(owner).__name__ if owner is not None else None
            for key in ((suffix, code.co_name, cls), (suffix, code.co_name, None), (suffix, None, None)):
                if key in STAGE_FRAMES:
                    return STAGE_FRAMES[key]
        frame = frame.f_back
    return None


@dataclass(slots=True)
class OpEvent:
    name: str  # "aten.mm.default"
    key: str  # "mm" (native_functions.yaml spelling)
    namespace: str  # "aten"
    phase: str
    parent: int | None  # index of the composite op this one came from
    inputs: tuple[TensorSig, ...]
    outputs: tuple[TensorSig, ...] = ()
    tags: tuple[str, ...] = ()
    has_children: bool = False
    stage: str | None = None  # the MoE / MLA stage it ran in (STAGE_FRAMES), None elsewhere


@dataclass(slots=True)
class OpTrace:
    events: list[OpEvent] = field(default_factory=list)
    # phase -> what it was ("prefill": {"tokens": 20}); filled by the caller
    phases: dict[str, dict] = field(default_factory=dict)


class OpRecorder(TorchDispatchMode):
    """`with OpRecorder() as rec: ...` records into rec.trace; set rec.phase between steps to label them.

    Composite ops reach the mode only under torch.inference_mode() (the engine's forward runs in it):
    with autograd on, their Autograd kernel decomposes them first and only the parts are recorded.
    """

    def __init__(self, decompose: bool = True) -> None:
        super().__init__()
        self.trace = OpTrace()
        self.phase = "run"
        self.decompose = decompose
        self._parents: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        events = self.trace.events
        index = len(events)
        event = OpEvent(
            name=str(func),
            key=op_key(func),
            namespace=op_namespace(func),
            phase=self.phase,
            parent=self._parents[-1] if self._parents else None,
            inputs=_sigs((args, kwargs)),
            tags=tuple(t.name for t in func.tags),
            stage=self._parent_stage() if self._parents else stage_of(sys._getframe(1)),
        )
        events.append(event)
        if self.decompose and _is_composite_implicit(func):
            self._parents.append(index)
            try:
                with self:  # re-enter so the ops it decomposes into are recorded as its children
                    out = func.decompose(*args, **kwargs)
            finally:
                self._parents.pop()
            if out is not NotImplemented:
                event.has_children = len(events) > index + 1
                event.outputs = _sigs(out)
                return out
        out = func(*args, **kwargs)
        event.outputs = _sigs(out)
        return out

    def _parent_stage(self) -> str | None:
        return self.trace.events[self._parents[-1]].stage  # a decomposition's parts run where their composite did


REQUEST_ID = "infertune-audit"


def _audit_request(engine, prompt_len: int, sample: bool, decode_steps: int, salt: int = 0) -> list[tuple[str, int]]:
    """Queue the audit's request (a fixed, deterministic prompt, so traces are reproducible); its steps' phases.

    Another salt gives a prompt that shares no prefix with salt 0's, so that an engine that ran one still prefills
    all of the other (no prefix-cache hit shortens the traced prefill)."""
    from infertune.sampling_params import SamplingParams

    vocab = engine.config.model.arch.vocab_size
    if prompt_len < 2:
        raise ValueError(f"prompt_len={prompt_len}: give at least 2 tokens so the prefill differs from a decode")
    if prompt_len + decode_steps >= engine.max_model_len:
        raise ValueError(
            f"prompt_len={prompt_len} + {decode_steps} decode step(s) does not fit max_model_len="
            f"{engine.max_model_len}; lower --prompt-len"
        )
    token_ids = [(17 + 7919 * i + 104729 * salt) % vocab for i in range(prompt_len)]
    params = (
        SamplingParams(max_tokens=decode_steps + 1, temperature=0.8, top_p=0.95, top_k=50, seed=0, ignore_eos=True)
        if sample
        else SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True)
    )
    engine.add_request(REQUEST_ID, {"prompt_token_ids": token_ids}, params)
    return [("prefill", prompt_len)] + [
        (f"decode{i + 1}" if decode_steps > 1 else "decode", 1) for i in range(decode_steps)
    ]


def trace_engine_steps(llm, prompt_len: int, sample: bool = False, decode_steps: int = 1) -> OpTrace:
    """Run one prefill of prompt_len tokens and decode_steps decode steps through llm's real engine, recorded.

    The prompt is a fixed, deterministic run of token ids, so traces are reproducible. The request is
    aborted afterwards, leaving the engine as it was. Native kernels the engine calls (see trace_native_steps)
    are invisible here: trace an engine with decode_kernels="off" to see every op of the PyTorch path.
    """
    engine = llm.engine
    phases = _audit_request(engine, prompt_len, sample, decode_steps)
    request_id = REQUEST_ID
    recorder = OpRecorder()
    trace = recorder.trace
    try:
        for phase, tokens in phases:
            recorder.phase = phase
            with recorder:
                engine.step()
            trace.phases[phase] = {"tokens": tokens, "tokens_seen": tokens_embedded(trace, phase)}
    finally:
        engine.abort_request(request_id)
    return trace


@dataclass(slots=True)
class NativeStep:
    """What one engine step ran outside the dispatcher."""

    phase: str  # "prefill", "decode" / "decode<i>"
    tokens: int
    fused: bool  # the fused C step (every decoder layer in one call) ran in this step
    fused_rows: int  # token rows it took
    fused_ms: dict[str, float]  # its C timers: ms per part (the kernels' FUSED_PARTS)
    kernels: dict[str, int]  # native kernel -> calls (its infertune_kernels::<name> ranges)
    aten_ops: int  # outermost aten ops the step still dispatched (embedding lookup, sampler, glue)


@dataclass(slots=True)
class NativeTrace:
    decode_kernels: bool  # the engine has native kernels (runner.decode_kernels is not None)
    fused_built: bool  # runner.fused is not None: the fused step exists for this model
    steps: list[NativeStep] = field(default_factory=list)


KERNEL_RANGE = "infertune_kernels::"
_STEP_MARK = "infertune_audit::step#"


def trace_native_steps(llm, prompt_len: int, sample: bool = False, decode_steps: int = 1) -> NativeTrace:
    """Run the audit's request (one prefill, decode_steps decodes) through llm's engine as it is configured, and
    record per step whether the fused C step ran and which native kernels ran, with the aten ops still dispatched.

    Reads the engine only through runner.fused (None or the fused step, whose step_timers(reset) give this
    engine's fused calls, rows and seconds per part) and runner.decode_kernels (None or the kernels). Like
    trace_engine_steps, the request is aborted afterwards.
    """
    from torch.profiler import ProfilerActivity, record_function

    from infertune.profile.quiet import quiet_profile

    engine = llm.engine
    runner = engine.executor.runner
    kernels = getattr(runner, "decode_kernels", None)
    timers = getattr(getattr(runner, "fused", None), "step_timers", None)
    native = NativeTrace(decode_kernels=kernels is not None, fused_built=getattr(runner, "fused", None) is not None)
    # (its own prompt: the torch-path trace may run on this engine afterwards and must not hit this one's prefix)
    phases = _audit_request(engine, prompt_len, sample, decode_steps, salt=1)
    parts: list[dict] = []
    try:
        with quiet_profile(activities=[ProfilerActivity.CPU]) as prof:  # the kernels open their ranges only under one
            for i in range(len(phases)):
                if timers is not None:
                    timers(reset=True)
                with record_function(f"{_STEP_MARK}{i}"):
                    engine.step()
                parts.append(timers(reset=True) if timers is not None else {})
    finally:
        engine.abort_request(REQUEST_ID)
    events = list(prof.events())
    marks = {
        int(e.name[len(_STEP_MARK) :]): (e.time_range.start, e.time_range.end)
        for e in events
        if e.name.startswith(_STEP_MARK)
    }
    counts = [Counter() for _ in phases]
    aten = [0] * len(phases)

    def step_of(e) -> int | None:
        t = e.time_range.start
        return next((i for i, (a, b) in marks.items() if a <= t <= b), None)

    for e in events:
        if e.name.startswith(KERNEL_RANGE):
            i = step_of(e)
            if i is not None:
                counts[i][e.name[len(KERNEL_RANGE) :]] += 1
        elif e.name.startswith("aten::"):
            parent = e.cpu_parent
            while parent is not None and not parent.name.startswith("aten::"):
                parent = parent.cpu_parent
            i = step_of(e) if parent is None else None
            if i is not None:
                aten[i] += 1
    for i, (phase, tokens) in enumerate(phases):
        t = dict(parts[i])
        calls, rows = int(t.pop("calls", 0)), int(t.pop("rows", 0))
        native.steps.append(
            NativeStep(
                phase,
                tokens,
                calls > 0,
                rows,
                {k: 1000 * v for k, v in t.items()} if calls else {},
                dict(counts[i].most_common()),
                aten[i],
            )
        )
    return native


def tokens_embedded(trace: OpTrace, phase: str) -> int | None:
    """Tokens the model embedded in a phase (the length of the embedding lookup's index), None if it ran none."""
    for e in trace.events:
        if e.phase == phase and e.key == "embedding" and len(e.inputs) >= 2:
            return e.inputs[1][0][0] if e.inputs[1][0] else 1
    return None
