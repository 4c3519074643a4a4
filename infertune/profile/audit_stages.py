"""The MoE and MLA stages of `infertune audit`: each stage's kernel-level ops (op_trace tags every op with the stage it
ran in, op_trace.STAGE_FRAMES) with their status on the target, and the target's own fused op for the stage."""

from __future__ import annotations

from infertune.profile.op_tables import SEVERITY

# The MoE and MLA stages the trace tags (op_trace.STAGE_FRAMES), in the order a layer runs them.
STAGE_LABELS = {
    "moe_router": "MoE router: logits, scores, top-k, weights",
    "moe_grouping": "MoE grouping: (token, slot) rows sorted by expert, rows per expert",
    "moe_experts": "MoE experts: rows gathered, one gate_up / down matmul per picked expert, weighted index_add back "
    "(the loop also reads the rows per expert on the host: one device->host sync per MoE layer, not an aten op)",
    "moe_shared": "MoE shared expert and the sum",
    "mla_project": "MLA projections: q, latent (kv_a), norms, rotary",
    "mla_cache_write": "MLA latent cache write",
    "mla_decode": "MLA absorbed decode: W_UK into the query, attention over latent rows, W_UV after",
    "mla_prefill": "MLA prefill attention (decompressed K / V, SDPA)",
    "mla_decompress": "MLA decompression (kv_b_proj over the latents)",
    "mla_cache_read": "MLA cache read (a chunk's earlier context)",
}


def stage_ops(events, visible: list[bool], status) -> dict[str, list[dict]]:
    """stage -> [{op, status, counts per phase}] over the ops that reach a kernel (not the decomposed composites)."""
    stages: dict[str, dict[tuple[str, str], dict]] = {}
    for i, e in enumerate(events):
        if visible[i] and status[i].status != "decomposed" and e.stage is not None:
            op = stages.setdefault(e.stage, {}).setdefault((e.name, status[i].status), {})
            op[e.phase] = op.get(e.phase, 0) + 1
    return {
        st: [
            {"op": name, "status": state, "counts": counts}
            for (name, state), counts in sorted(ops_.items(), key=lambda kv: (SEVERITY.get(kv[0][1], 9), kv[0][0]))
        ]
        for st, ops_ in sorted(stages.items(), key=lambda kv: list(STAGE_LABELS).index(kv[0]))
    }


def format_stages(stages: dict[str, list[dict]], fused: dict[str, str], backend: str, phases: list[str]) -> list[str]:
    """The MoE / MLA stages: each one's kernel-level ops on the torch path with their status, and the target's own
    fused op for the stage where its table names one."""
    if not stages:
        return []
    lines = ["", "MoE / MLA stages (torch path, kernel-level ops per stage; counts per step):"]
    for stage, ops in stages.items():
        lines.append(f"  {STAGE_LABELS.get(stage, stage)}:")
        for r in ops:
            counts = " ".join(f"{p} {r['counts'].get(p, 0)}" for p in phases)
            lines.append(f"    {r['status']:<11} {r['op']:<44} {counts}")
        op = fused.get(stage)
        if op:
            lines.append(f"    {backend}'s fused op: {op}")
    return lines
