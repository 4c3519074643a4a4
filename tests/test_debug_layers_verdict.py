"""`infertune debug-layers` verdicts when outputs go non-finite: under the dtype under test only, or already in the
float32 reference (a broken checkpoint).

Oracles: the value planted, and where: a NaN / Inf written into one weight of the saved safetensors file (both
runs load it, so the fp32 reference is non-finite from that module on), an Inf set in the model under test only
(through debug_layers' perturb seam), and a checkpoint value that torch itself says is finite in float32 but
rounds to Inf in bfloat16.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil

import pytest
import torch
from conftest import make_checkpoint
from safetensors.torch import load_file, save_file

from infertune.profile import debug_layers
from infertune.profile.debug_layers import LayerDebugReport, compare, format_report

PROMPT_IDS = [5, 17, 42, 99, 7, 63, 120, 3]
CULPRIT = "model.layers.1.mlp.down_proj"
CLEAN = "every module is finite"


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("dl-base"), "llama")


def planted(base, dest, tensor: str, index: tuple, value: float):
    """A copy of the checkpoint with one value of one tensor replaced in its safetensors file."""
    shutil.copytree(base, dest)
    path = dest / "model.safetensors"
    weights = load_file(path)
    weights[tensor][index] = value
    save_file(weights, path, metadata={"format": "pt"})
    stored = load_file(path)[tensor][index]
    assert (
        stored.isnan().item() if math.isnan(value) else stored.item() == torch.tensor(value, dtype=stored.dtype).item()
    )
    return dest


def check_never_claims_clean(report: LayerDebugReport, text: str) -> None:
    if any(m.nonfinite_share > 0 or m.ref_nonfinite_share > 0 for m in report.modules):
        assert CLEAN not in text and "no divergence" not in text
        assert report.first_divergent is not None


@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_a_non_finite_weight_in_the_checkpoint_is_blamed_on_the_checkpoint(base, tmp_path, value, capsys):
    ckpt = planted(base, tmp_path / "ckpt", f"{CULPRIT}.weight", (0, 0), value)
    report = debug_layers.debug_layers(str(ckpt), PROMPT_IDS, dtype="bfloat16")
    names = [m.module for m in report.modules]
    at = names.index(CULPRIT)
    # Both runs loaded the planted value: every module before the culprit is finite in both, the culprit is not.
    assert all(m.nonfinite_share == 0 and m.ref_nonfinite_share == 0 for m in report.modules[:at])
    culprit = report.modules[at]
    assert culprit.ref_nonfinite_share > 0 and culprit.nonfinite_share > 0
    assert report.first_ref_nonfinite == {"module": CULPRIT, "index": at}
    assert report.first_divergent == {"module": CULPRIT, "index": at, "reason": "reference non-finite"}
    assert report.first_nonfinite is None  # nothing is non-finite under bf16 where fp32 is finite
    assert report.modules[-1].module == "lm_head" and report.modules[-1].ref_nonfinite_share == 1.0

    for show in ("all", "layers"):
        text = format_report(report, show)
        check_never_claims_clean(report, text)
        verdict = next(line for line in text.splitlines() if line.startswith("REFERENCE NON-FINITE"))
        assert CULPRIT in verdict and "float32 reference" in verdict and "checkpoint" in verdict
        assert f"{CULPRIT:<46}" in text  # the culprit's row is printed even with --only-layers
    assert report.to_dict()["verdict"] == report.verdict()

    parser = argparse.ArgumentParser()
    debug_layers.add_arguments(parser)
    assert debug_layers.run(parser.parse_args(["--model", str(ckpt), "--prompt", "hi there", "--only-layers"])) == 1
    out = capsys.readouterr().out
    assert f"REFERENCE NON-FINITE: the float32 reference itself is non-finite at {CULPRIT}" in out
    assert CLEAN not in out
    assert debug_layers.run(parser.parse_args(["--model", str(ckpt), "--prompt", "hi there", "--json"])) == 1
    js = json.loads(capsys.readouterr().out)
    assert js["first_ref_nonfinite"]["module"] == CULPRIT and js["first_divergent"]["reason"] == "reference non-finite"
    assert CULPRIT in js["verdict"]


def test_an_inf_in_the_model_under_test_only_is_blamed_on_the_run(base):
    report = debug_layers.debug_layers(
        str(base), PROMPT_IDS, dtype="bfloat16", perturb=debug_layers.plant_nan(CULPRIT, float("inf"))
    )
    at = [m.module for m in report.modules].index(CULPRIT)
    assert report.first_divergent == {"module": CULPRIT, "index": at, "reason": "non-finite"}
    assert report.first_nonfinite == {"module": CULPRIT, "index": at} and report.first_ref_nonfinite is None
    assert all(m.ref_nonfinite_share == 0 for m in report.modules)
    text = format_report(report)
    check_never_claims_clean(report, text)
    assert (
        f"FIRST NON-FINITE MODULE: {CULPRIT} (#{at}): NaN/Inf under bfloat16 where the float32 reference is finite"
        in text
    )
    assert "REFERENCE NON-FINITE" not in text


def test_a_value_beyond_bf16s_range_is_blamed_on_the_dtype(base, tmp_path):
    big = 3.4e38  # below float32's max, above bfloat16's: rounds to Inf in bf16
    assert math.isfinite(torch.tensor(big, dtype=torch.float32).item())
    assert torch.tensor(big, dtype=torch.float32).to(torch.bfloat16).isinf().item()
    token = PROMPT_IDS[1]
    ckpt = planted(base, tmp_path / "ckpt", "model.embed_tokens.weight", (token, 3), big)
    report = debug_layers.debug_layers(str(ckpt), PROMPT_IDS, dtype="bfloat16")
    assert report.modules[0].module == "model.embed_tokens"
    # The fp32 embedding output holds the value itself, finite; bf16's holds Inf at exactly that position.
    assert report.modules[0].ref_nonfinite_share == 0
    assert report.modules[0].nonfinite_share == pytest.approx(1 / (len(PROMPT_IDS) * 64))
    assert report.first_nonfinite == {"module": "model.embed_tokens", "index": 0}
    assert report.first_divergent["reason"] == "non-finite" and report.first_divergent["module"] == "model.embed_tokens"
    text = format_report(report, "layers")
    check_never_claims_clean(report, text)
    assert "FIRST NON-FINITE MODULE: model.embed_tokens (#0)" in text
    if report.first_ref_nonfinite is not None:  # the reference may overflow later; then it says where
        assert f"reference itself goes non-finite later, at {report.first_ref_nonfinite['module']}" in text


def test_modules_non_finite_in_both_runs_are_never_reported_clean():
    """The issue's case in miniature: rows 100% non-finite in both runs, equal shares, nothing measurable."""
    nan = torch.full((2, 4), float("nan"))
    inf = torch.full((2, 4), float("inf"))
    ok = torch.ones(2, 4)
    rows = [compare("a", 0, [ok], [ok]), compare("b", 1, [nan], [nan]), compare("c", 2, [inf], [nan])]
    assert [m.diverges(0.05) for m in rows] == [None, "reference non-finite", "reference non-finite"]
    report = LayerDebugReport("bfloat16", "float32", "cpu", "cpu", 2, 0.05, rows)
    for m in rows:  # as debug_layers fills them
        if m.diverges(0.05) and report.first_divergent is None:
            report.first_divergent = {"module": m.module, "index": m.index, "reason": m.diverges(0.05)}
    report.first_ref_nonfinite = {"module": "b", "index": 1}
    text = format_report(report)
    check_never_claims_clean(report, text)
    assert "REFERENCE NON-FINITE: the float32 reference itself is non-finite at b (#1)" in text
    # Non-finite under test where the reference is finite is the run's fault.
    half = torch.tensor([1.0, float("nan")])
    m = compare("d", 0, [half], [torch.ones(2)])
    assert m.diverges(0.05) == "non-finite" and m.new_nonfinite_share == 0.5 and m.ref_nonfinite_share == 0


def test_a_router_that_picks_the_same_experts_in_another_order_is_not_an_error():
    """Two near-equal router scores swap places in the top-k between dtypes while the same experts get the same
    weights: that is no error. Oracle: the (expert, weight) pairs, equal by construction in both runs; the capture
    compared the weights slot by slot and reported the size of the weights themselves (0.686 on a tiny
    DeepSeek-V3 in bf16, a false FIRST DIVERGENT MODULE at its router). A token sent to another expert still
    counts as an error."""

    class Router(torch.nn.Module):
        def __init__(self, weights, ids):
            super().__init__()
            self.out = (weights, ids)

        def forward(self, x):
            return self.out

    class Model(torch.nn.Module):
        def __init__(self, weights, ids):
            super().__init__()
            self.gate = Router(weights, ids)

        def forward(self, x):
            return self.gate(x)

    def captured(weights, ids):
        model = Model(torch.tensor(weights), torch.tensor(ids))
        capture = debug_layers.OutputCapture(model)
        model(torch.zeros(1))
        capture.remove()
        return capture

    ref = captured([[0.6, 1.3, 0.6], [0.9, 0.1, 1.0]], [[4, 6, 7], [0, 1, 2]])
    swapped = captured([[1.3, 0.6, 0.6], [0.9, 1.0, 0.1]], [[6, 4, 7], [0, 2, 1]])
    (label, test), (_, reference) = swapped.records[0], ref.records[0]
    assert label == "gate" and swapped.routes["gate"].tolist() == [[6, 4, 7], [0, 2, 1]]  # the router's own order
    m = compare(label, 0, test, reference)
    assert m.max_abs == 0.0 and m.diverges(0.05) is None
    moved = captured([[0.6, 1.3, 0.6], [0.9, 0.1, 0.2]], [[4, 6, 7], [0, 1, 3]])  # expert 3 (0.2) takes 2's place
    m = compare("gate", 0, moved.records[0][1], reference)
    assert m.max_abs == pytest.approx(0.8) and m.diverges(0.05) == "error above threshold"


def test_a_router_fed_nan_is_not_said_to_be_at_a_near_tie(tmp_path):
    """A NaN planted in layer 0's experts reaches layer 1's router, which then picks arbitrary experts: the note
    says its scores are NaN/Inf (the planted value's doing), not "near-ties in the router's scores"."""
    path = make_checkpoint(
        tmp_path / "moe", "qwen3_moe", std=0.2, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32
    )

    def nan_in_experts(model) -> None:
        with torch.no_grad():
            model.model.layers[0].mlp.experts.gate_up_proj[:, 0, 0] = float("nan")

    report = debug_layers.debug_layers(str(path), PROMPT_IDS, dtype="float32", perturb=nan_in_experts)
    assert report.first_nonfinite["module"] == "model.layers.0.mlp.experts"
    notes = [n for n in report.notes if n.startswith("model.layers.1.mlp.gate:")]
    assert len(notes) == 1 and "(its scores are NaN/Inf under test)" in notes[0] and "near-ties" not in notes[0]
