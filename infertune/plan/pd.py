"""The prefill / decode split that `serve --pd auto` starts and `plan --pd` recommends, as a serve command.

Both take the planner's split (cost.pd_split over the roofline's prefill and decode requests/s per instance):
`plan --device D --cards N --batch B --input-len I --output-len O --pd` prints the split that `serve --pd auto:N
--pd-device D --max-num-seqs B` runs where serve plans with the same lengths (workload() below).
"""

from __future__ import annotations

import logging
import shlex
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("infertune.plan")


@dataclass(frozen=True)
class PDChoice:
    split: tuple[int, int]  # (prefill instances, decode instances)
    reason: str  # one line: what was chosen and why
    pd_split: dict  # the planner's PDSplit as a dict


def workload(max_model_len: int | None) -> tuple[int, int]:
    """(prompt, output) tokens a request is planned with: the planner's 1536 + 512, or 3/4 + 1/4 of a shorter
    max_model_len."""
    if max_model_len is not None and max_model_len < 2048:
        out = max(1, max_model_len // 4)
        return max(1, max_model_len - out), out
    return 1536, 512


def _device(name: str):
    from infertune.plan.catalog import find_device, load_catalog

    if name == "local" or name.startswith("local:"):
        from infertune.plan.probe import probe_local

        return probe_local(name.partition(":")[2] or "auto")
    return find_device(load_catalog([]), name)


def explain(pd: dict, model: str, device: str) -> str:
    """One line: the split the planner chose and why (its requests/s per instance, the prefill share)."""
    return (
        f"P/D {pd['prefill_instances']}:{pd['decode_instances']} of {pd['instances']} instances: the roofline of "
        f"{model} on {device} gives {pd['prefill_requests_per_s_per_instance']:.3g} prefill and "
        f"{pd['decode_requests_per_s_per_instance']:.3g} decode requests/s per instance (decode batch "
        f"{pd['decode_batch']}), so prefill takes {pd['ideal_prefill_share']:.0%} of a request's instance-time; "
        f"this split serves {pd['requests_per_s']:.3g} req/s ({pd['bottleneck']}-limited; colocated "
        f"{pd['colocated_requests_per_s']:.3g})"
        + (
            f"; colocated serving of the same {pd['instances']} instances is faster here: "
            f"`infertune serve --data-parallel-size {pd['instances']}` would serve more"
            if pd["colocated_requests_per_s"] > pd["requests_per_s"]
            else ""
        )
    )


def choose_pd(
    model: str | None,
    instances: int,
    device: str = "local",
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
) -> PDChoice:
    """`serve --pd auto:N`: the planner's split of N instances for this model on `device` (local: measured)."""
    from infertune.config import default_model_path
    from infertune.plan.memory import ModelSpec
    from infertune.plan.planner import PlanRequest, make_plan

    spec = ModelSpec.load(model or default_model_path())
    inp, out = workload(max_model_len)
    dev = _device(device.lower())
    plan = make_plan(
        PlanRequest(spec=spec, device=dev, input_len=inp, output_len=out, batch=max_num_seqs, cards=instances)
    )
    pd = plan["pd_split"]
    assert pd is not None  # (instances >= 2, one card each)
    reason = f"--pd auto: {explain(pd, spec.name, dev.name)}; {inp}-token prompts, {out}-token outputs"
    log.info("%s", reason)
    return PDChoice((pd["prefill_instances"], pd["decode_instances"]), reason, pd)


def serve_command(model: str, pd: dict) -> str:
    """The `infertune serve` command line that runs the planner's split on one host: the split for --rate where one
    was given (the fewest instances that serve it), else the split of every card. A shipped config's name (not a
    folder) is written as MODEL_DIR, the folder of its checkpoint."""
    from infertune.plan.memory import shipped_models

    if model in shipped_models() and not Path(model).exists():
        model = "MODEL_DIR"
    split = (
        (pd["prefill_instances_for_rate"], pd["decode_instances_for_rate"])
        if pd.get("rate") is not None and pd.get("prefill_instances_for_rate")
        else (pd["prefill_instances"], pd["decode_instances"])
    )
    cmd = ["infertune", "serve", "--model", model, "--pd", f"{split[0]}:{split[1]}"]
    if pd.get("cards_per_instance", 1) > 1:
        cmd += ["--tensor-parallel-size", str(pd["cards_per_instance"])]
    return shlex.join(cmd)
