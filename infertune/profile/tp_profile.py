"""`infertune profile --tensor-parallel-size N`: where a step's time goes when the model runs on N ranks.

torch.profiler sees one process; under tensor parallel the model runs in the ranks' worker processes. So each
rank counts what it spends itself (layers/parallel.py CommStats: every collective timed, with its bytes, the fused
C step's own all-reduces as the kernels counted them, and the runner's whole step, executor/worker.py run_step), and
the driver times each step from the outside. A step's time
splits into:
  compute        rank 0's step minus its time in collectives (the matmuls, attention, sampling of its share)
  communication  rank 0's time inside all-reduces and gathers, waiting for the slower rank included (so an
                 imbalance between the ranks shows here, and in the ranks' own lines)
  driver + IPC   the rest of the driver's step: scheduling, sending the step to every rank, rank 0's answer back
The counts are taken after every step (one round trip, outside the timed step) so each lands in its phase.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from infertune.profile.timeline import make_prompts

PARTS = ("compute", "communication", "driver + IPC")


def step_phase(so) -> str:
    """ "prefill" | "mixed" | "decode" of a SchedulerOutput: an entry scheduled more tokens than 1 + its drafts is
    a prompt chunk (a one-token final chunk counts as a decode: the same work)."""
    drafts = so.scheduled_spec_decode_tokens
    prefill = decode = False
    for rid, n in zip(so.req_ids, so.num_scheduled_tokens):
        if n > 1 + len(drafts.get(rid, ())):
            prefill = True
        else:
            decode = True
    return ("mixed" if decode else "prefill") if prefill else "decode"


@dataclass
class PhaseStats:
    steps: int = 0
    wall_ns: list[int] = field(default_factory=list)
    exec_ns: list[int] = field(default_factory=list)  # per rank, summed over the steps
    comm_ns: list[int] = field(default_factory=list)  # per rank
    collectives: dict[str, dict[str, int]] = field(default_factory=dict)  # rank 0's, by kind

    def add(self, wall: int, ranks: list[dict]) -> None:
        if not self.exec_ns:
            self.exec_ns, self.comm_ns = [0] * len(ranks), [0] * len(ranks)
        self.steps += 1
        self.wall_ns.append(wall)
        for r, stats in enumerate(ranks):
            self.exec_ns[r] += stats["exec_ns"]
            self.comm_ns[r] += sum(c["ns"] for c in stats["collectives"].values())
        for kind, c in ranks[0]["collectives"].items():
            mine = self.collectives.setdefault(kind, {"calls": 0, "bytes": 0, "ns": 0})
            for key in mine:
                mine[key] += c[key]

    def summary(self) -> dict:
        n = self.steps
        wall = sum(self.wall_ns) / n / 1e6
        exec0, comm0 = self.exec_ns[0] / n / 1e6, self.comm_ns[0] / n / 1e6
        parts = {"compute": exec0 - comm0, "communication": comm0, "driver + IPC": max(0.0, wall - exec0)}
        return {
            "steps": n,
            "step_ms_mean": wall,
            "step_ms_median": sorted(self.wall_ns)[n // 2] / 1e6,
            "ms_per_step": parts,
            "share": {k: v / wall if wall else 0.0 for k, v in parts.items()},
            "ranks": [
                {"rank": r, "step_ms": e / n / 1e6, "communication_ms": c / n / 1e6}
                for r, (e, c) in enumerate(zip(self.exec_ns, self.comm_ns))
            ],
            "collectives_per_step": {
                kind: {
                    "calls": c["calls"] / n,
                    "bytes_per_call": c["bytes"] / c["calls"],
                    "us_per_call": c["ns"] / c["calls"] / 1e3,
                }
                for kind, c in sorted(self.collectives.items())
            },
        }


def _token_prompts(vocab: int, input_len: int, batch: int, salt: int) -> list[dict]:
    return [{"prompt_token_ids": p} for p in make_prompts(vocab, input_len, batch, salt)]


def profile_tensor_parallel(llm, input_len: int, output_len: int, batch: int, params, warmup: bool = True) -> dict:
    """Run batch prompts of input_len tokens for output_len new ones and split each phase's steps into PARTS."""
    engine = llm.engine
    executor = engine.executor
    if not hasattr(executor, "comm_stats"):
        raise ValueError(f"{type(executor).__name__} keeps no per-rank counts (tensor parallel needs mp or ray)")
    vocab = engine.config.model.arch.vocab_size
    if warmup:
        llm.generate(_token_prompts(vocab, input_len, batch, 1), params, use_tqdm=False)
    executor.comm_stats()  # start from zero
    phases: dict[str, PhaseStats] = {}
    execute = executor.execute_model

    def timed(so):
        phase = step_phase(so)
        t0 = time.perf_counter_ns()
        out = execute(so)
        wall = time.perf_counter_ns() - t0
        phases.setdefault(phase, PhaseStats()).add(wall, executor.comm_stats())
        return out

    executor.execute_model = timed
    try:
        t0 = time.perf_counter()
        llm.generate(_token_prompts(vocab, input_len, batch, 2), params, use_tqdm=False)
        total = time.perf_counter() - t0
    finally:
        del executor.execute_model  # the class's method again
    order = [p for p in ("prefill", "mixed", "decode") if p in phases]
    return {
        "tensor_parallel_size": engine.config.parallel.tensor_parallel_size,
        "executor": executor.describe(),
        "wall_s": total,
        "phases": {p: phases[p].summary() for p in order},
    }


def format_tp_report(s: dict, context: dict) -> str:
    lines = [
        f"infertune profile: tensor parallel over {s['tensor_parallel_size']} ranks ({s['executor']})",
        f"  workload: batch {context['batch']}, {context['input_len']} prompt + {context['output_len']} new tokens, "
        f"{context['sampling']}; {s['wall_s']:.2f} s in all",
        "",
        f"  {'phase':<8} {'steps':>5} {'ms/step':>8}  " + "  ".join(f"{p:>20}" for p in PARTS),
    ]
    for phase, p in s["phases"].items():
        cells = "  ".join(f"{p['ms_per_step'][k]:>11.3f} ({p['share'][k]:>5.1%})" for k in PARTS)
        lines.append(f"  {phase:<8} {p['steps']:>5} {p['step_ms_mean']:>8.3f}  {cells}")
    lines.append("")
    for phase, p in s["phases"].items():
        lines.append(f"  {phase}: collectives per step on rank 0")
        for kind, c in p["collectives_per_step"].items():
            lines.append(
                f"    {kind:<28} {c['calls']:>6.1f} calls, {c['bytes_per_call'] / 1024:>9.1f} KiB each, "
                f"{c['us_per_call']:>8.1f} us each"
            )
        ranks = ", ".join(
            f"rank {r['rank']}: {r['communication_ms']:.3f} of {r['step_ms']:.3f} ms in collectives" for r in p["ranks"]
        )
        lines.append(f"    {ranks}")
    lines += [
        "",
        "  communication = rank 0's time inside collectives, waiting for the slower rank included; compute = the rest "
        "of rank 0's step; driver + IPC = the driver's step time beyond rank 0's (scheduling, sending the step to "
        "every rank, the answer back).",
    ]
    return "\n".join(lines)


def write_tp_plot(s: dict, path: str) -> None:
    from infertune.plotting import pyplot

    plt = pyplot(RuntimeError)
    phases = list(s["phases"])
    fig, ax = plt.subplots(figsize=(6, 1.2 + 0.6 * len(phases)))
    left = [0.0] * len(phases)
    for part in PARTS:
        widths = [s["phases"][p]["ms_per_step"][part] for p in phases]
        ax.barh(phases, widths, left=left, label=part)
        left = [a + b for a, b in zip(left, widths)]
    ax.set_xlabel("ms per step")
    ax.set_title(f"tensor parallel over {s['tensor_parallel_size']} ranks")
    ax.legend(loc="lower right", fontsize="small")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
