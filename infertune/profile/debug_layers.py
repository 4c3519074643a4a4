"""`infertune debug-layers`: find the first module whose output goes non-finite or drifts from an fp32 reference.

The equivalent of ASCEND_LAYER_DEBUG=1. The model is loaded twice, in the dtype (and on the device) under
test and in float32 as the reference (on the CPU by default), the same prompt is prefilled through both,
and forward hooks capture the output of every submodule: the embedding, each decoder layer with its
norms, attention (qkv / rotary / o_proj) and MLP, the final norm, and lm_head (called by compute_logits).
Per module it reports max-abs and mean-abs difference, each divided by the reference output's scale
(max |ref| and mean |ref|), and the share of non-finite values in each run; then it names the first module, in
the order outputs were produced, that has NaN/Inf where the reference is finite (the dtype under test is at
fault), whose reference output itself has NaN/Inf (the checkpoint or the prompt is at fault: both runs are
broken there), or whose relative max error exceeds the threshold. Children finish before their parents, so the
innermost culprit is named. It never reports "no divergence" while any module's output, in either run, is
non-finite.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from infertune.files import add_json_flag, print_report

if TYPE_CHECKING:  # torch is imported inside the functions, so building the CLI does not load it
    import torch
    from torch import nn


@dataclass(slots=True)
class ModuleDiff:
    index: int  # position in execution (completion) order
    module: str
    shape: list[int]
    max_abs: float  # over positions finite in both runs
    mean_abs: float
    rel_max: float  # max_abs / max |ref|
    rel_mean: float  # mean_abs / mean |ref|
    nonfinite_share: float  # in the run under test
    ref_nonfinite_share: float
    new_nonfinite_share: float = 0.0  # non-finite under test where the reference is finite

    def diverges(self, threshold: float) -> str | None:
        """Why this module is flagged: "reference non-finite" (the fp32 reference itself has NaN/Inf here: the
        checkpoint or the prompt is broken, whatever the run under test does), "non-finite" (NaN/Inf under test
        where the reference is finite), "error above threshold", or None."""
        if self.ref_nonfinite_share > 0:
            return "reference non-finite"
        if self.new_nonfinite_share > 0:
            return "non-finite"
        if self.rel_max > threshold:
            return "error above threshold"
        return None


@dataclass(slots=True)
class LayerDebugReport:
    dtype: str
    ref_dtype: str
    device: str
    ref_device: str
    prompt_tokens: int
    threshold: float
    modules: list[ModuleDiff]
    first_divergent: dict | None = None  # the first flagged module: {"module", "index", "reason"}
    first_nonfinite: dict | None = None  # the first with NaN/Inf under test where the reference is finite
    first_ref_nonfinite: dict | None = None  # the first whose fp32 reference output itself has NaN/Inf
    notes: list[str] = field(default_factory=list)

    def verdict(self) -> str:
        """One line: the first module to go non-finite (under test, or in the reference) or to drift, or that none did."""
        d, r = self.first_divergent, self.first_ref_nonfinite
        if d is None:
            return f"no divergence: every module is finite in both runs and within {self.threshold} of the reference"
        if d["reason"] == "reference non-finite":
            return (
                f"REFERENCE NON-FINITE: the {self.ref_dtype} reference itself is non-finite at {r['module']} "
                f"(#{r['index']}): the checkpoint's weights (or the prompt) are broken there, not the {self.dtype} dtype"
            )
        if d["reason"] == "non-finite":
            return (
                f"FIRST NON-FINITE MODULE: {d['module']} (#{d['index']}): NaN/Inf under {self.dtype} where the "
                f"{self.ref_dtype} reference is finite"
            )
        return f"FIRST DIVERGENT MODULE: {d['module']} (#{d['index']}, {d['reason']})"

    def to_dict(self) -> dict:
        d = asdict(self)
        for m in d["modules"]:  # JSON has no NaN/Inf
            for k, v in m.items():
                if isinstance(v, float) and not math.isfinite(v):
                    m[k] = str(v)
        d["verdict"] = self.verdict()
        return d


class OutputCapture:
    """Forward hooks on every submodule; records (label, output tensors in fp32 on the CPU) in completion order.

    A module called from several places (the shared rotary embedding) is labelled by where its caller holds it,
    e.g. model.layers.3.self_attn.rotary, so each call has its own row. Integer outputs are indices, not values:
    they are left out of the records, and a MoE router's expert ids [T, k] are kept apart in `routes` (its
    weights are recorded in expert-id order).
    """

    def __init__(self, model: nn.Module) -> None:
        self.records: list[tuple[str, list[torch.Tensor]]] = []
        self.routes: dict[str, torch.Tensor] = {}  # label -> expert ids [T, k] of a router's call
        self._stack: list[str] = []
        self._handles = []
        self._all_names: dict[int, list[str]] = {}  # every name a module is reachable under (shared ones: several)
        for name, module in model.named_modules(remove_duplicate=False):
            if name:
                self._all_names.setdefault(id(module), []).append(name)
        for name, module in model.named_modules():
            if not name:  # the root returns the same tensor as model.model
                continue
            self._handles.append(module.register_forward_pre_hook(self._pre(name, id(module))))
            self._handles.append(module.register_forward_hook(self._post(name)))

    def _label(self, name: str, key: int) -> str:
        caller = self._stack[-1] if self._stack else ""
        if caller and not name.startswith(caller + "."):
            inside = [n for n in self._all_names.get(key, []) if n.startswith(caller + ".")]
            return min(inside, key=len) if inside else f"{caller}.{name.rsplit('.', 1)[-1]}"
        return name

    def _pre(self, name: str, key: int):
        def hook(module, args):
            self._stack.append(self._label(name, key))

        return hook

    def _post(self, name: str):
        import torch

        def hook(module, args, output):
            label = self._stack.pop()
            leaves = [
                t for t in (output if isinstance(output, (tuple, list)) else [output]) if isinstance(t, torch.Tensor)
            ]
            ids = next((t for t in leaves if not t.is_floating_point() and t.dim() == 2), None)
            # clone: an output may be a view of a buffer that later stages write in place
            tensors = [t.detach().float().cpu().clone() for t in leaves if t.is_floating_point()]
            if ids is not None:
                ids = ids.detach().cpu().clone()
                self.routes[label] = ids
                # A router's weights [T, k] come in its top-k order, which two near-equal scores swap between
                # dtypes with the same experts picked: compared slot by slot, equal routes would read as an
                # error of the size of the weights. In expert-id order each weight meets its own expert's.
                order = ids.argsort(dim=-1)
                tensors = [t.gather(-1, order) if t.shape == ids.shape else t for t in tensors]
            if tensors:
                self.records.append((label, tensors))

        return hook

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


def compare(label: str, index: int, test: list[torch.Tensor], ref: list[torch.Tensor]) -> ModuleDiff:
    import torch

    a = torch.cat([t.reshape(-1) for t in test])
    r = torch.cat([t.reshape(-1) for t in ref])
    if a.shape != r.shape:
        raise RuntimeError(f"{label}: output has {a.numel()} values under test but {r.numel()} in the reference")
    fin_a, fin_r = torch.isfinite(a), torch.isfinite(r)
    both = fin_a & fin_r
    diff = (a[both] - r[both]).abs()
    ref_abs = r[fin_r].abs()
    nan = float("nan")  # no position is finite in both runs: there is no error to measure
    max_abs = float(diff.max()) if diff.numel() else nan
    mean_abs = float(diff.mean()) if diff.numel() else nan
    scale_max = float(ref_abs.max()) if ref_abs.numel() else 0.0
    scale_mean = float(ref_abs.mean()) if ref_abs.numel() else 0.0
    tiny = torch.finfo(torch.float32).tiny
    return ModuleDiff(
        index=index,
        module=label,
        shape=list(test[0].shape),
        max_abs=max_abs,
        mean_abs=mean_abs,
        rel_max=max_abs / max(scale_max, tiny) if max_abs != 0 else 0.0,
        rel_mean=mean_abs / max(scale_mean, tiny) if mean_abs != 0 else 0.0,
        nonfinite_share=float((~fin_a).float().mean()),
        ref_nonfinite_share=float((~fin_r).float().mean()),
        new_nonfinite_share=float((~fin_a & fin_r).float().mean()),
    )


def run_prefill_captured(llm, token_ids: list[int]) -> OutputCapture:
    """Prefill token_ids into a fresh engine's blocks 0.. and capture every submodule's output."""
    runner = llm.engine.executor.runner
    capture = OutputCapture(runner.model)
    try:
        runner.prompt_logits(token_ids, list(range(-(-len(token_ids) // runner.block_size))))
    finally:
        capture.remove()
    return capture


def rerouted_tokens(test: torch.Tensor, ref: torch.Tensor) -> int:
    """Tokens (rows of expert ids [T, k]) sent to a different set of experts in the two runs."""
    return int((test.sort(dim=-1).values != ref.sort(dim=-1).values).any(dim=-1).sum())


def plant_nan(module_name: str, value: float = float("nan")) -> Callable[[nn.Module], None]:
    """A perturbation for debug_layers: set one weight of the named module to NaN (or value, e.g. inf) in the model
    under test only (to test the hunt itself)."""

    def perturb(model: nn.Module) -> None:
        import torch

        try:
            module = model.get_submodule(module_name)
        except AttributeError as e:
            raise ValueError(
                f"--plant-nan {module_name!r}: no such module ({e}); names look like model.layers.0.mlp.down_proj"
            ) from e
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor):  # e.g. MoE experts: gate_up_proj [E, 2I, H], down_proj
            weight = next(module.parameters(recurse=False), None)
        if not isinstance(weight, torch.Tensor):
            raise ValueError(f"--plant-nan {module_name!r}: the module has no weight tensor")
        with torch.no_grad():
            weight.view(-1)[0] = value

    return perturb


def _load(model: str | None, dtype: str, device: str, max_model_len: int):
    from types import SimpleNamespace

    from infertune.config import EngineConfig
    from infertune.engine.llm_engine import LLMEngine

    # decode_kernels="linear": the kernels under the per-module forward, so that every module runs and its hooks
    # see it (the fused step would run short prompts as one call, with no modules to compare); plain bf16 weights,
    # since the 12-bit gate_up hands the MLP its activation without running the gate_up module.
    # (An engine, not infertune.llm.LLM: LLM.check_consistency reaches this module, so that import would be a circle.)
    make = lambda model, **options: SimpleNamespace(engine=LLMEngine(EngineConfig.create(model, **options)))  # noqa: E731
    return make(
        model,
        dtype=dtype,
        device=device,
        max_model_len=max_model_len,
        max_num_seqs=1,
        max_num_batched_tokens=max(2048, max_model_len),
        enable_prefix_caching=False,
        decode_kernels="linear",
        compress_weights="off",
    )


def debug_layers(
    model: str | None,
    prompt: str | list[int],
    dtype: str = "bfloat16",
    device: str = "cpu",
    ref_dtype: str = "float32",
    ref_device: str = "cpu",
    threshold: float = 0.05,
    perturb: Callable[[nn.Module], None] | None = None,
) -> LayerDebugReport:
    """Compare every submodule's output in (dtype, device) against (ref_dtype, ref_device) for one prefill.

    perturb(model) is applied to the model under test after loading (tests plant a NaN this way).
    """
    if not threshold > 0:
        raise ValueError(f"threshold={threshold} must be positive (a relative error, e.g. 0.05)")
    from infertune.config import ArchConfig, default_model_path
    from infertune.engine.tokenizer import load_tokenizer

    path = model or default_model_path()
    limit = ArchConfig.from_model_dir(path).max_position_embeddings
    token_ids = load_tokenizer(path).encode(prompt) if isinstance(prompt, str) else list(prompt)
    if not token_ids:
        raise ValueError("the prompt is empty (0 tokens); give some text")
    if len(token_ids) >= limit:
        raise ValueError(f"the prompt has {len(token_ids)} tokens; this model takes at most {limit - 1}")
    # The KV cache only needs to hold this prompt.
    max_len = len(token_ids) + 1
    ref = _load(model, ref_dtype, ref_device, max_len)
    ref_capture = run_prefill_captured(ref, token_ids)
    ref_records = ref_capture.records
    ref_dtype_name = str(ref.engine.executor.runner.dtype).removeprefix("torch.")
    del ref

    test = _load(model, dtype, device, max_len)
    if perturb is not None:
        perturb(test.engine.executor.runner.model)
    test_capture = run_prefill_captured(test, token_ids)
    test_records = test_capture.records
    runner = test.engine.executor.runner

    notes = []
    test_outputs = dict(reversed(test_records))  # label -> its first call's outputs
    for label, ids in test_capture.routes.items():
        ref_ids = ref_capture.routes.get(label)
        moved = rerouted_tokens(ids, ref_ids) if ref_ids is not None and ref_ids.shape == ids.shape else 0
        if moved:
            # a router fed NaN / Inf picks arbitrary experts: that is the non-finite values', not a near-tie
            nonfinite = any(not bool(t.isfinite().all()) for t in test_outputs.get(label, []))
            why = "its scores are NaN/Inf under test" if nonfinite else "near-ties in the router's scores"
            notes.append(
                f"{label}: {moved} of {ids.shape[0]} tokens routed to other experts than in the {ref_dtype_name} run "
                f"({why}); those tokens' expert outputs differ by more than rounding"
            )
    if [label for label, _ in test_records] != [label for label, _ in ref_records]:
        raise RuntimeError("the two runs called different modules; the model code must not depend on dtype/device")
    modules = [compare(label, i, t, r) for i, ((label, t), (_, r)) in enumerate(zip(test_records, ref_records))]
    report = LayerDebugReport(
        dtype=str(runner.dtype).removeprefix("torch."),
        ref_dtype=ref_dtype_name,
        device=runner.backend.describe(),
        ref_device=ref_device,
        prompt_tokens=len(token_ids),
        threshold=threshold,
        modules=modules,
        notes=notes,
    )
    for m in modules:
        why = m.diverges(threshold)
        if why and report.first_divergent is None:
            report.first_divergent = {"module": m.module, "index": m.index, "reason": why}
        if m.new_nonfinite_share > 0 and report.first_nonfinite is None:
            report.first_nonfinite = {"module": m.module, "index": m.index}
        if m.ref_nonfinite_share > 0 and report.first_ref_nonfinite is None:
            report.first_ref_nonfinite = {"module": m.module, "index": m.index}
    # Every non-finite value under test is either where the reference is finite or where it is not: both flag.
    assert report.first_divergent is not None or not any(m.nonfinite_share or m.ref_nonfinite_share for m in modules)
    return report


def format_report(report: LayerDebugReport, show: str = "all") -> str:
    lines = [
        f"infertune debug-layers: {report.prompt_tokens} prompt tokens, {report.dtype} on {report.device} vs "
        f"{report.ref_dtype} on {report.ref_device}; threshold {report.threshold} (max-abs error / max |ref|)",
        "",
    ]
    header = (
        f"{'#':>4}  {'module':<46} {'max-abs':>10} {'rel-max':>9} {'mean-abs':>10} {'rel-mean':>9} "
        f"{'non-finite':>10} {'ref n-f':>8}"
    )
    lines += [header, "-" * len(header)]
    firsts = {f["index"] for f in (report.first_divergent, report.first_nonfinite, report.first_ref_nonfinite) if f}
    for m in report.modules:
        why = m.diverges(report.threshold)
        if show == "layers" and m.index not in firsts and m.module.count(".") > 2:
            continue
        flag = "  <- " + why if why else ""
        lines.append(
            f"{m.index:>4}  {m.module:<46} {m.max_abs:>10.3g} {m.rel_max:>9.3g} {m.mean_abs:>10.3g} "
            f"{m.rel_mean:>9.3g} {m.nonfinite_share:>10.1%} {m.ref_nonfinite_share:>8.1%}{flag}"
        )
    lines += ["", report.verdict()]
    d, t, r = report.first_divergent, report.first_nonfinite, report.first_ref_nonfinite
    if d is not None and d["reason"] == "reference non-finite":
        m = report.modules[r["index"]]
        lines.append(
            f"non-finite there: {m.nonfinite_share:.1%} of its outputs under test, {m.ref_nonfinite_share:.1%} "
            f"in the reference; later modules' errors are measured only over the values finite in both runs"
        )
        lines.append(
            "what to do: check that module's weights in the checkpoint for NaN/Inf (torch.isfinite over its "
            "tensors), and the prompt's token ids; switching the dtype will not help"
        )
    elif d is not None:
        if t is not None and t["index"] != d["index"]:
            lines.append(f"first non-finite output under {report.dtype}: {t['module']} (#{t['index']})")
        if r is not None:
            lines.append(
                f"the {report.ref_dtype} reference itself goes non-finite later, at {r['module']} "
                f"(#{r['index']}): the checkpoint or the prompt is broken there too"
            )
        lines.append(
            "what to do: check that module's weights for NaN/Inf and its inputs' range; for a dtype overflow "
            "keep that op in float32 (norms and softmax already are), or try float16 <-> bfloat16"
        )
    lines += [f"note: {n}" for n in report.notes]
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from infertune.config import engine_option_kwargs as option  # the engine options' help, choices and defaults

    devices = ("cpu", "cuda", "npu")
    p.add_argument("--model", **option("model"))
    p.add_argument("--prompt", required=True, help="text to prefill through both runs")
    p.add_argument(
        "--dtype",
        **option(
            "dtype",
            choices=("float32", "bfloat16", "float16"),
            default="bfloat16",
            help="dtype under test (default: bfloat16)",
        ),
    )
    p.add_argument(
        "--device", **option("device", choices=devices, default="cpu", help="device under test (default: cpu)")
    )
    p.add_argument(
        "--ref-device",
        **option("device", choices=devices, default="cpu", help="device of the float32 reference (default: cpu)"),
    )
    p.add_argument(
        "--threshold",
        type=float,
        default=0.05,
        help="flag a module whose max-abs error exceeds this share of its reference's max |value| (default: 0.05)",
    )
    p.add_argument(
        "--plant-nan",
        default=None,
        metavar="MODULE",
        help="set one weight of MODULE (e.g. model.layers.1.mlp.down_proj) to NaN in the run under test, "
        "to see the hunt work",
    )
    p.add_argument(
        "--only-layers",
        action="store_true",
        help="print decoder-layer level rows (and the first flagged modules) instead of every submodule",
    )
    add_json_flag(p, "the report")
    if p.epilog is None:
        p.epilog = EXIT_STATUS


EXIT_STATUS = (
    "exit status: 0 when every module's output is finite in both runs and within --threshold of the "
    "reference; 1 when a module is flagged: NaN/Inf under the dtype under test, NaN/Inf already in the "
    "float32 reference (a broken checkpoint or prompt), or an error above --threshold"
)


def run(args: argparse.Namespace) -> int:
    report = debug_layers(
        args.model,
        args.prompt,
        dtype=args.dtype,
        device=args.device,
        ref_device=args.ref_device,
        threshold=args.threshold,
        perturb=plant_nan(args.plant_nan) if args.plant_nan else None,
    )
    print_report(args, format_report(report, "layers" if args.only_layers else "all"), report.to_dict())
    return 1 if report.first_divergent else 0
