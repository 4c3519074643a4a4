"""Record every aten op a piece of torch code dispatches, with shapes and dtypes, under a TorchDispatchMode.

CompositeImplicitAutograd ops (linear, matmul, scaled_dot_product_attention, einsum ...) are recorded and
then decomposed inside the mode, so the ops they turn into are recorded too, with the composite as their
parent: a backend table can then judge either level. Nothing runs on a target device; tracing is CPU-only
unless the caller's code itself uses another device.
"""

from __future__ import annotations

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
            name=str(func), key=op_key(func), namespace=op_namespace(func), phase=self.phase,
            parent=self._parents[-1] if self._parents else None, inputs=_sigs((args, kwargs)),
            tags=tuple(t.name for t in func.tags),
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


def trace_engine_steps(llm, prompt_len: int, sample: bool = False, decode_steps: int = 1) -> OpTrace:
    """Run one prefill of prompt_len tokens and decode_steps decode steps through llm's real engine, recorded.

    The prompt is a fixed, deterministic run of token ids, so traces are reproducible. The request is
    aborted afterwards, leaving the engine as it was.
    """
    from infertune.sampling_params import SamplingParams

    engine = llm.engine
    vocab = engine.config.model.arch.vocab_size
    if prompt_len < 2:
        raise ValueError(f"prompt_len={prompt_len}: give at least 2 tokens so the prefill differs from a decode")
    if prompt_len + decode_steps >= engine.max_model_len:
        raise ValueError(f"prompt_len={prompt_len} + {decode_steps} decode step(s) does not fit max_model_len="
                         f"{engine.max_model_len}; lower --prompt-len")
    token_ids = [(17 + 7919 * i) % vocab for i in range(prompt_len)]
    params = (SamplingParams(max_tokens=decode_steps + 1, temperature=0.8, top_p=0.95, top_k=50, seed=0, ignore_eos=True)
              if sample else SamplingParams(max_tokens=decode_steps + 1, temperature=0.0, ignore_eos=True))
    request_id = "infertune-audit"
    engine.add_request(request_id, {"prompt_token_ids": token_ids}, params)
    recorder = OpRecorder()
    trace = recorder.trace
    phases = [("prefill", prompt_len)] + [(f"decode{i + 1}" if decode_steps > 1 else "decode", 1)
                                          for i in range(decode_steps)]
    try:
        for phase, tokens in phases:
            recorder.phase = phase
            with recorder:
                engine.step()
            trace.phases[phase] = {"tokens": tokens, "tokens_seen": tokens_embedded(trace, phase)}
    finally:
        engine.abort_request(request_id)
    return trace


def tokens_embedded(trace: OpTrace, phase: str) -> int | None:
    """Tokens the model embedded in a phase (the length of the embedding lookup's index), None if it ran none."""
    for e in trace.events:
        if e.phase == phase and e.key == "embedding" and len(e.inputs) >= 2:
            return e.inputs[1][0][0] if e.inputs[1][0] else 1
    return None
