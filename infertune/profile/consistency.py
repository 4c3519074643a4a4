"""`infertune doctor --consistency` and `LLM.check_consistency`: do the paths that must agree agree, and if not, where
do they part?

The user's model runs greedy over a prompt set along each pair of paths of infertune/profile/consistency_pairs.py
(batch 1 vs N, prefix cache off vs on, whole vs chunked prefill, preemption forced vs not, the fast kernels vs the
torch path, and where set int8 KV / quantization against the accuracy gate). Each path is its own engine built from
the user's options with one thing changed; the runs are compared token by token. A flipped greedy pick where the two
candidates are within the dtype's tolerance of each other is noise; one with a clear margin is a failure: the run of
both paths is replayed in fresh engines up to the diverging step with debug-layers' forward hooks
(debug_layers.OutputCapture) on every module, the diverging request's row is cut out of each module's output, and
debug_layers.compare names the first module whose activations differ between the two paths. In a MoE model a
clear-margin divergence is first tried as a router near-tie (explain_by_route_flip): two correct paths may route one
token to different experts where two experts' scores are within rounding, and that moves every later logit.

`--long N` instead runs one generation of N tokens and watches non-finite logits, the logit scale, repetition and
the process's RSS (every 1,000 tokens, or every N/10 for a short run).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable

from infertune.files import print_report
from infertune.profile import consistency_pairs as cp

K_TOP = 8  # top-k logprobs kept per step: both candidates of a flipped pick are almost always among them
DEFAULT_MAX_TOKENS = 16

# instrument(engine, path_label): called on every engine built, before it runs (tests plant bugs this way)
Instrument = Callable[[object, str], None]


# ---- options -------------------------------------------------------------------------------------------------


def options_of(config) -> tuple[str, dict]:
    """(model folder, the engine options of an EngineConfig that differ from their defaults)."""
    from dataclasses import MISSING

    from infertune.config import OPTION_GROUPS, option_fields

    out = {}
    for group in OPTION_GROUPS:
        for f in option_fields(group):
            if f.name in ("model", "max_model_len"):
                continue
            value = getattr(getattr(config, group), f.name)
            default = f.default if f.default is not MISSING else None
            if f.name == "tokenizer" and value == config.model.model:
                continue
            if value != default:
                out[f.name] = value
    return config.model.model, out


def reproduce_command(model: str | None, user: dict, key: str, prompts_file: str | None, max_tokens: int) -> str:
    """The `infertune doctor --consistency` line that runs only this pair with these options."""
    import shlex

    from infertune.config import engine_flag, engine_option

    parts = ["infertune", "doctor", "--consistency"]
    if model:
        parts += ["--model", model]
    for name, value in user.items():
        flag = engine_flag(name)
        if flag is None or value is None:
            continue
        f = engine_option(name)
        if str(f.type) == "bool":
            if bool(value) != bool(f.default):
                parts.append(flag)
            continue
        parts += [flag, ",".join(value) if isinstance(value, tuple) else str(value)]
    if prompts_file:
        parts += ["--prompts", prompts_file]
    parts += ["--max-tokens", str(max_tokens), "--pair", key]
    return " ".join(shlex.quote(p) for p in parts)


# ---- running one path ----------------------------------------------------------------------------------------


def _build(model: str, options: dict, instrument: Instrument | None, label: str):
    from infertune.config import EngineConfig
    from infertune.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig.create(model, **options))
    if instrument is not None:
        instrument(engine, label)
    return engine


def _params(max_tokens: list[int]):
    from infertune.sampling_params import SamplingParams

    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=K_TOP) for m in max_tokens]


class _LogitWatch:
    """Wraps model.compute_logits: per call, max |logit| and whether every logit is finite."""

    def __init__(self, model) -> None:
        self.model, self.scales, self.finite = model, [], []
        self._orig = model.compute_logits

        def wrapped(hidden, fp32: bool = True):
            import torch

            logits = self._orig(hidden, fp32)
            if logits.numel():
                fin = torch.isfinite(logits)
                self.finite.append(bool(fin.all()))
                vals = logits[fin]
                self.scales.append(float(vals.abs().max()) if vals.numel() else float("nan"))
            return logits

        model.compute_logits = wrapped

    def remove(self) -> None:
        del self.model.compute_logits  # the instance attribute: the class's method shows through again


def _drive(engine, prompts: list[list[int]], params, on_step=None) -> dict:
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    results = {}
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        outs = engine.step()
        for o in outs:
            if o.finished:
                results[o.request_id] = o
        if on_step is not None:
            on_step(outs, time.perf_counter() - t)
    return results


def _dtype_name(engine) -> str:
    return str(engine.executor.runner.dtype).removeprefix("torch.")


def run_path(model: str, options: dict, prompts, max_tokens, instrument=None, label="", engine=None) -> dict:
    """Greedy over the prompts on one path: per request its tokens and per step the top-k logprobs."""
    engine = engine or _build(model, options, instrument, label)
    watch = _LogitWatch(engine.executor.runner.model)
    try:
        results = _drive(engine, prompts, _params(max_tokens))
    finally:
        watch.remove()
    tokens, tops = [], []
    for i in range(len(prompts)):
        c = results[str(i)].outputs[0]
        tokens.append(list(c.token_ids))
        tops.append([list(lp.top) for lp in (c.logprobs or [])])
    stats = engine.stats()
    finite = [s for s in watch.scales if math.isfinite(s)]
    return {
        "tokens": tokens,
        "tops": tops,
        "logit_scale": statistics.median(finite) if finite else 1.0,
        "nonfinite_steps": sum(not f for f in watch.finite),
        "dtype": _dtype_name(engine),
        "hit_rate": stats["prefix_cache_hit_rate"],
        "preemptions": stats["num_preemptions"],
        "engine": engine,
    }


# ---- localisation --------------------------------------------------------------------------------------------


def capture_step(engine, prompts, max_tokens, request: int, step: int, no_fused: bool = False) -> dict:
    """Run the prompts again in this fresh engine, and at the step that produces token `step` of `request` capture
    every module's output (debug_layers.OutputCapture), cut down to that request's row."""
    from infertune.profile.debug_layers import OutputCapture

    runner = engine.executor.runner
    if no_fused:
        runner.fused = None
    for i, (p, sp) in enumerate(zip(prompts, _params(max_tokens))):
        engine.add_request(str(i), {"prompt_token_ids": p}, sp)
    seq = engine.requests[str(request)].samples[0].seq
    seen: dict = {}
    orig_prepare, orig_execute = runner._prepare, runner.execute_model

    def prepare(entries):
        out = orig_prepare(entries)
        # (which entries sample, decided now: the runner appends the sampled token to these lists after the step)
        sampled = [i for i, e in enumerate(entries) if e[1] + e[2] == len(e[0])]
        seen.update(sampled=sampled, T=out[0].shape[0], last_rows=out[3])
        return out

    def execute(so):
        seen["req_ids"] = list(so.req_ids)
        return orig_execute(so)

    while engine.has_unfinished_requests():
        armed = not seq.is_finished and len(seq.output_token_ids) == step
        cap = None
        if armed:
            seen.clear()
            cap = OutputCapture(runner.model)
            runner._prepare, runner.execute_model = prepare, execute
        try:
            engine.step()
        finally:
            if cap is not None:
                cap.remove()
                del runner._prepare, runner.execute_model
        if not armed or len(seq.output_token_ids) <= step or str(seq.seq_id) not in seen.get("req_ids", []):
            continue
        idx = seen["req_ids"].index(str(seq.seq_id))
        row, rows = seen["last_rows"][idx], seen["T"]
        sampled = seen["sampled"]
        sidx = sampled.index(idx)
        records = []
        for name, tensors in cap.records:
            cut = []
            for t in tensors:
                if t.dim() and t.shape[0] == rows:
                    cut.append(t[row])
                elif t.dim() and t.shape[0] == len(sampled):
                    cut.append(t[sidx])
            if cut:
                records.append((name, cut))
        for r in list(engine.requests):
            engine.abort_request(r)
        return {"records": records, "token": seq.output_token_ids[step], "batch_rows": rows}
    raise RuntimeError(f"request {request} never produced token {step} in the replay")


def locate(ref_cap: dict, test_cap: dict, dtype: str) -> dict:
    """The first module (in execution order) whose output for the diverging row differs between the two paths."""
    from infertune.profile.debug_layers import compare

    threshold = cp.LOCATE_THRESHOLD.get(dtype, 1e-3)
    seen_ref: dict[str, int] = {}
    by_key = {}
    for name, ts in test_cap["records"]:
        n = seen_ref.get(name, 0)
        by_key[(name, n)] = ts
        seen_ref[name] = n + 1
    counts: dict[str, int] = {}
    diffs = []
    for name, ts in ref_cap["records"]:
        n = counts.get(name, 0)
        counts[name] = n + 1
        other = by_key.get((name, n))
        if other is None or [t.shape for t in other] != [t.shape for t in ts]:
            continue
        diffs.append(compare(name, len(diffs), other, ts))
    if not any(d.module.startswith("model.layers") for d in diffs):
        return {"module": None, "threshold": threshold, "note": "no decoder module ran on one path (fused step)"}
    worst = max(diffs, key=lambda d: d.rel_max if math.isfinite(d.rel_max) else float("inf"), default=None)
    for d in diffs:
        if d.new_nonfinite_share > 0 or d.rel_max > threshold:
            return {
                "module": d.module,
                "index": d.index,
                "rel_max": d.rel_max,
                "max_abs": d.max_abs,
                "threshold": threshold,
                "modules_compared": len(diffs),
            }
    return {
        "module": None,
        "threshold": threshold,
        "note": f"no module's output at this step differs by more than {threshold:g} (largest: "
        f"{worst.module if worst else '-'}, rel-max {worst.rel_max if worst else 0:.3g}); the difference is below "
        "the localisation threshold or came from earlier steps' KV",
    }


def localise(model, ref_opts, test_opts, prompts, max_tokens, d: cp.Divergence, instrument, labels, dtype) -> dict:
    ref_cap = capture_step(_build(model, ref_opts, instrument, labels[0]), prompts, max_tokens, d.request, d.step)
    test_cap = capture_step(_build(model, test_opts, instrument, labels[1]), prompts, max_tokens, d.request, d.step)
    loc = locate(ref_cap, test_cap, dtype)
    notes = []
    if loc["module"] is None and "fused step" in loc.get("note", ""):
        # The fused step runs every layer in one call: no module hooks fire. Replay with it off (the same kernels
        # under the per-module forward, as debug-layers does) to find the layer.
        eng = _build(model, test_opts, instrument, labels[1])
        test_cap = capture_step(eng, prompts, max_tokens, d.request, d.step, no_fused=True)
        loc = locate(ref_cap, test_cap, dtype)
        notes.append("replayed with the fused decode step off (the kernels under the per-module forward)")
        if loc["module"] is None:
            notes.append("no module differs with the fused step off: the divergence is inside the fused step")
    if test_cap["token"] != d.test_token or ref_cap["token"] != d.ref_token:
        notes.append(
            f"the replay picked {ref_cap['token']} / {test_cap['token']} (the run: {d.ref_token} / {d.test_token})"
        )
    if notes:
        loc["note"] = "; ".join(([loc["note"]] if loc.get("note") else []) + notes)
    return loc


# ---- a flipped route: a MoE router's near-tie ------------------------------------------------------------------

MAX_ROUTE_FLIPS = 6  # the nearest ties tried per divergence, each one prefill of the diverging sequence
# where no single flip explains it, pairs of those ties (nearest pairs first), each one prefill too
MAX_ROUTE_PAIRS = 15


class RouterProbe:
    """A torch-path engine whose MoE routers record each step's logits and can send tokens of layers to the expert
    just left out in place of the worst one picked (the routes the other side of near-ties)."""

    def __init__(self, engine) -> None:
        from infertune.layers.moe import Router

        self.engine = engine
        self.routers = [m for m in engine.executor.runner.model.modules() if isinstance(m, Router)]
        self.logits: list[list] = [[] for _ in self.routers]
        self.force: tuple[tuple[int, int, int, int], ...] = ()  # each (router, row, expert out, expert in)
        self._rows = [0] * len(self.routers)
        for i, r in enumerate(self.routers):
            r._route = self._wrapped(i, r, r._route)

    def _wrapped(self, i: int, router, route):
        from infertune.kernels.interface import MoeRouting
        from infertune.layers.moe import weights_of_picks

        def _route(logits):
            routing = route(logits)
            self.logits[i].append(logits.detach().float().clone())
            first = self._rows[i]
            self._rows[i] += logits.shape[0]
            mine = [f for f in self.force if f[0] == i and first <= f[1] < self._rows[i]]
            if not mine:
                return routing
            ids = routing.ids.clone()
            for f in mine:
                row = ids[f[1] - first]
                row[row == f[2]] = f[3]
            weights = weights_of_picks(logits, router.moe, router.e_score_correction_bias, ids)
            return MoeRouting.grouped(weights, ids, router.moe.num_experts)

        return _route

    def run(self, prefix: list[int], force: tuple[tuple[int, int, int, int], ...] = ()) -> int:
        """The greedy token after `prefix` (one prefill), the routers recording, with the routes of `force` (each
        (router, row, expert out, expert in)) sent to their other side."""
        from infertune.sampling_params import SamplingParams

        self.logits = [[] for _ in self.routers]
        self._rows = [0] * len(self.routers)
        self.force = tuple(force)
        (out,) = _drive(self.engine, [prefix], [SamplingParams(temperature=0.0, max_tokens=1, logprobs=K_TOP)]).values()
        self.top = out.outputs[0].logprobs[0].top
        return out.outputs[0].token_ids[0]

    def near_ties(self, dtype: str) -> list[tuple[float, int, int, int, int, float, float]]:
        """The last run's routes within the dtype's noise of another pick, nearest first: (margin / tolerance, router,
        row, expert picked, expert left out, margin, tolerance); the margins in the router's logit units, the
        tolerance the doctor's rule (cp.tolerance) at the row's logit scale."""
        import torch

        from infertune.layers.moe import boundary_margins

        found = []
        for i, (router, chunks) in enumerate(zip(self.routers, self.logits)):
            if not chunks:
                continue
            logits = torch.cat(chunks)
            margin, kth, out = boundary_margins(logits, router.moe, router.e_score_correction_bias)
            tol = [cp.tolerance(dtype, float(s)) for s in logits.abs().amax(dim=-1)]
            for row in range(logits.shape[0]):
                m = float(margin[row])
                if m <= tol[row]:
                    found.append((m / tol[row], i, row, int(kth[row]), int(out[row]), m, tol[row]))
        return sorted(found)


def explain_by_route_flip(
    probe: RouterProbe, prefix: list[int], d: cp.Divergence, dtype: str, logit_tol: float
) -> dict | None:
    """Why a divergence that looks like a failure may be noise in a MoE model: the torch path, given the sequence up
    to the divergence, picks one of the two tokens; if sending one token of one layer to the other side of a router
    near-tie (a margin within the dtype's noise) makes it pick the other, and by the margin the other path picks it
    with (within logit_tol, the pair's tolerance), the two paths differ by no more than rounding, amplified by a
    discrete route. Where no single near-tie does, pairs of them are tried (two routes flipped together, as two
    rounding differences in one sequence can be). Returns that finding (the flips, the prefix they were found on, a
    note; the first flip's fields also at the top level), or None (a failure)."""
    from itertools import combinations

    base = probe.run(prefix)
    if base not in (d.ref_token, d.test_token):
        return None
    if base == d.ref_token:
        other, theirs, bound = d.test_token, d.test_margin, d.test_bound
    else:
        other, theirs, bound = d.ref_token, d.ref_margin, d.ref_bound
    if bound or not math.isfinite(theirs):  # (the other path's own margin not known exactly)
        return None
    ties = probe.near_ties(dtype)[:MAX_ROUTE_FLIPS]
    singles = [(t,) for t in ties]
    pairs = sorted(combinations(ties, 2), key=lambda p: p[0][0] + p[1][0])[:MAX_ROUTE_PAIRS]
    for tried in (*singles, *pairs):
        if probe.run(prefix, tuple((t[1], t[2], t[3], t[4]) for t in tried)) != other:
            continue
        gap, gap_bound = cp.gap(other, base, probe.top)
        if gap_bound or abs(gap - theirs) > logit_tol:  # (the other token, but not the other path's logits)
            continue
        flips = [
            {"router": r, "position": row, "picked": picked, "left_out": out, "margin": m, "tolerance": tol}
            for _, r, row, picked, out, m, tol in tried
        ]
        routes = " and ".join(
            f"router {f['router']} (of {len(probe.routers)}), position {f['position']}: experts {f['picked']} "
            f"(picked) and {f['left_out']} are {f['margin']:.3g} apart in logits (tolerance {f['tolerance']:.3g})"
            for f in flips
        )
        one = len(flips) == 1
        what = "a MoE router near-tie explains it" if one else "two MoE router near-ties explain it"
        which = "that token to the left-out expert" if one else "those two tokens to the left-out experts"
        note = (
            f"request {d.request}, step {d.step}: {what}: {routes}; routing {which} makes the torch path pick "
            f"{other} over {base} by {gap:.3g}, as the other path does ({theirs:.3g})"
        )
        return {"request": d.request, "step": d.step, **flips[0], "flips": flips, "prefix": list(prefix), "note": note}
    return None


# ---- the pairs -----------------------------------------------------------------------------------------------


def _teacher_forced(engine, prompts, ref_tokens) -> list[tuple[list[float], list[int]]]:
    """Per request, over its generated positions: log p(reference token) and the argmax, teacher-forced on the
    reference's sequence: the prompt as one prefill, then each reference token as a one-token decode step that reads
    the cache back (so an int8 KV cache is exercised as in generation), through the runner's own _prepare / _forward
    into blocks 0.. (the engine is idle; with several KV cache groups, windowed models', each group its own blocks,
    as a block id is a page of every group). With the int4 tier (kv_int4_after) each full-attention group's blocks
    are packed before each step as the scheduler packs them (in place), so the steps read the int4 blocks too."""
    import torch

    from infertune.scheduler_output import int4_entries_due, int4_entry

    runner = engine.executor.runner
    age = engine.config.cache.kv_int4_after
    groups = runner.kv_groups
    out = []
    with torch.inference_mode():
        for p, toks in zip(prompts, ref_tokens):
            if not toks:
                out.append(([], []))
                continue
            seq = p + toks[:-1]
            per_group = -(-len(seq) // runner.block_size)
            if len(groups) * per_group > runner.kv_info.num_blocks:
                raise ValueError(
                    f"the accuracy check holds {len(seq)} tokens in each of {len(groups)} KV cache groups, "
                    f"{len(groups) * per_group} blocks, more than the KV cache's {runner.kv_info.num_blocks}; give a "
                    "larger kv_cache_memory_bytes or shorter prompts / max_tokens"
                )
            tables = [list(range(g * per_group, (g + 1) * per_group)) for g in range(len(groups))]
            rows, packed = [], 0
            for start, n in [(0, len(p))] + [(j, 1) for j in range(len(p), len(seq))]:
                while age is not None and packed + 2 <= int4_entries_due(start, age, runner.block_size):
                    for g, blocks in enumerate(tables):
                        if groups[g].window is None:  # (windowed layers free old blocks instead: never packed)
                            first, second = blocks[packed], blocks[packed + 1]
                            runner._pack_int4([(g, first, second, first)])
                            blocks[packed], blocks[packed + 1] = int4_entry(first, False), int4_entry(first, True)
                    packed += 2
                table = tables[0] if len(groups) == 1 else tables
                ids, pos, meta, last = runner._prepare([(seq, start, n, table)])
                hidden = runner._forward(ids, pos, meta, [last[0]])
                rows.append(runner.model.compute_logits(hidden[last[0] : last[0] + 1]).float()[0])
            lp = torch.log_softmax(torch.stack(rows), dim=-1)
            tgt = torch.tensor(toks)
            out.append((lp.gather(1, tgt[:, None]).squeeze(1).tolist(), lp.argmax(-1).tolist()))
    return out


def _accuracy(ref_engine, test_engine, prompts, ref_tokens, gate: dict) -> dict:
    r = _teacher_forced(ref_engine, prompts, ref_tokens)
    t = _teacher_forced(test_engine, prompts, ref_tokens)
    diffs, agree, n = [], 0, 0
    for (rl, ra), (tl, ta) in zip(r, t):
        diffs += [abs(a - b) for a, b in zip(rl, tl)]
        agree += sum(a == b for a, b in zip(ra, ta))
        n += len(ra)
    return {
        "top1": agree / max(n, 1),
        "mean_abs_logprob": sum(diffs) / max(len(diffs), 1),
        "positions": n,
        "gate": gate,
    }


def compare_runs(pair: cp.Pair, ref: dict, test: dict) -> cp.PairResult:
    res = cp.PairResult(pair.key, pair.name, pair.ref_label, pair.test_label)
    res.dtype = ref["dtype"]
    res.logit_scale = ref["logit_scale"]
    res.tolerance = cp.tolerance(res.dtype, res.logit_scale)
    for i, (a, b) in enumerate(zip(ref["tokens"], test["tokens"])):
        res.compared += 1
        res.ref_margins.append([top[0][1] - top[1][1] if len(top) > 1 else float("inf") for top in ref["tops"][i]])
        s = cp.first_divergence(a, b)
        if s is None:
            res.identical += 1
            continue
        if s >= min(len(a), len(b)):
            res.divergences.append(cp.Divergence(i, s, -1, -1, float("inf"), float("inf"), float("inf"), False, "FAIL"))
            continue
        res.divergences.append(
            cp.judge_divergence(i, s, a[s], b[s], ref["tops"][i][s], test["tops"][i][s], res.tolerance)
        )
    for name, run in (("reference", ref), ("under test", test)):
        if run["nonfinite_steps"]:
            res.notes.append(f"{run['nonfinite_steps']} steps had non-finite logits ({name})")
    return res


def check_consistency(
    model_or_config=None,
    prompts: list | None = None,
    *,
    options: dict | None = None,
    pairs: list[str] | tuple[str, ...] | None = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    batch: int | None = None,
    gates: dict | None = None,
    instrument: Instrument | None = None,
    localise_failures: bool = True,
    prompts_file: str | None = None,
    progress: bool = False,
) -> dict:
    """Run every pair of paths that must agree and judge them; returns the report (see format_report).

    model_or_config: a model folder (None: the built-in model) or an EngineConfig (its non-default options are the
    base of every path; `options` adds to them). prompts: text or token-id lists (default: the built-in set).
    pairs: keys of consistency_pairs.PAIR_KEYS to run (default: all that apply). instrument(engine, path label) is
    called on every engine built (tests plant bugs with it).
    """
    from tqdm import tqdm

    from infertune.config import ArchConfig, EngineConfig, default_model_path
    from infertune.engine.tokenizer import load_tokenizer

    if isinstance(model_or_config, EngineConfig):
        model, user = options_of(model_or_config)
    else:
        model, user = (model_or_config or default_model_path()), {}
    user = {**user, **(options or {})}
    user.pop("distributed_executor_backend", None)  # the replay hooks the runner: it must run in this process
    _one_process(user)
    arch = ArchConfig.from_model_dir(model)
    bs = int(user.get("block_size", 16))
    n_batch = batch or min(int(user.get("max_num_seqs", 64)), 8)
    chunk = n_batch + 3
    tok = load_tokenizer(user.get("tokenizer") or model)
    limit = int(user.get("max_model_len") or arch.max_position_embeddings)
    if prompts is None:
        max_prompt = max(4, min(4 * bs, limit - max_tokens - 8))
        prompt_ids = cp.default_prompts(tok.encode(cp.SEED_TEXT), bs, chunk, max_prompt)
    else:
        prompt_ids = [tok.encode(p) if isinstance(p, str) else list(p) for p in prompts]
        if not prompt_ids or not all(prompt_ids):
            raise ValueError("every prompt must have at least one token")
    maxes = [cp.max_tokens_for(i, max_tokens) for i in range(len(prompt_ids))]
    max_len = max(len(p) + m for p, m in zip(prompt_ids, maxes)) + 1
    if max_len > limit:
        raise ValueError(f"the prompts need max_model_len {max_len}, more than this model's {limit}")
    base = {
        **user,
        "max_model_len": max_len,
        "max_num_seqs": n_batch,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": max(int(user.get("max_num_batched_tokens", 2048)), max_len),
        "distributed_executor_backend": "uni",
    }
    all_pairs = cp.make_pairs(user, n_batch, chunk)
    unknown = set(pairs or ()) - set(cp.PAIR_KEYS)
    if unknown:
        raise ValueError(f"unknown pair {sorted(unknown)}; pairs are {', '.join(cp.PAIR_KEYS)}")
    chosen = [p for p in all_pairs if not pairs or p.key in pairs]
    for key in set(pairs or ()) - {p.key for p in all_pairs}:
        chosen.append(
            cp.Pair(
                key, {"kv-int8": "bf16 KV vs int8 KV", "quant": "unquantized vs quantized"}[key], {}, {}, "accuracy"
            )
        )
    runs: dict = {}
    bytes_per_token: list[int] = []
    probe: RouterProbe | None = None  # (MoE models: built at the first failure to explain)

    def resolve(overrides: dict) -> dict:
        opts = {**base, **overrides}
        if opts.pop("__tiny_kv__", False):
            if not bytes_per_token:
                eng = _build(model, base, None, "probe")
                info = eng.executor.kv_cache_info
                # (the blocks one max_model_len sequence holds: fewer than its tokens' where windows free theirs)
                bytes_per_token.extend((info.bytes_per_token, info.max_blocks_per_seq or -(-max_len // bs)))
                del eng
            opts["kv_cache_memory_bytes"] = bytes_per_token[0] * bs * (bytes_per_token[1] + 1)
        return opts

    def run_of(opts: dict, label: str, engine=None) -> dict:
        key = tuple(sorted((k, repr(v)) for k, v in opts.items()))
        if key not in runs:
            runs[key] = run_path(model, opts, prompt_ids, maxes, instrument, label, engine)
            runs[key]["engine"] = None  # keep the tokens, not the model
        return runs[key]

    results = []
    bar = tqdm(chosen, desc="consistency pairs", unit="pair", disable=not progress)
    for pair in bar:
        bar.set_postfix_str(pair.name, refresh=True)
        ref_opts, test_opts = resolve(pair.ref), resolve(pair.test)
        if pair.key in ("kv-int8", "quant") and not (pair.ref or pair.test):
            r = cp.PairResult(
                pair.key,
                pair.name,
                "",
                "",
                skipped=f"give --{'kv-cache-dtype int8' if pair.key == 'kv-int8' else 'quantization'}",
            )
            r.decide()
            results.append(r)
            continue
        if pair.key == "kernels":
            eng = _build(model, test_opts, instrument, pair.test_label)
            runner = eng.executor.runner
            if runner.decode_kernels is None:
                why = (
                    f"the model runs in {_dtype_name(eng)}; the decode kernels are bf16 kernels"
                    if runner.dtype.itemsize != 2
                    else runner.backend.kernels_unavailable_reason() or "no kernels on this backend"
                )
                r = cp.PairResult(pair.key, pair.name, pair.ref_label, pair.test_label, skipped=why)
                r.decide()
                results.append(r)
                continue
            ref, test = run_of(ref_opts, pair.ref_label), run_of(test_opts, pair.test_label, eng)
        elif pair.gate == "accuracy":
            ref_eng = _build(model, ref_opts, instrument, pair.ref_label)
            ref = run_path(model, ref_opts, prompt_ids, maxes, engine=ref_eng)
            test_eng = _build(model, test_opts, instrument, pair.test_label)
            test = run_path(model, test_opts, prompt_ids, maxes, engine=test_eng)
        else:
            ref, test = run_of(ref_opts, pair.ref_label), run_of(test_opts, pair.test_label)
        res = compare_runs(pair, ref, test)
        if pair.gate == "accuracy":
            gate = {**cp.GATES[pair.key], **(gates or {})}
            res.accuracy = _accuracy(ref_eng, test_eng, prompt_ids, ref["tokens"], gate)
            tier = test_eng.config.cache.kv_int4_after if pair.key == "kv-int8" else None
            if tier is not None:  # (a tier no sequence reaches packs nothing: the pair gated the int8 cache alone)
                from infertune.scheduler_output import int4_entries_due

                bs = test_eng.executor.runner.block_size
                longest = max((len(p) + len(t) - 1 for p, t in zip(prompt_ids, ref["tokens"]) if t), default=0)
                if int4_entries_due(max(0, longest - 1), tier, bs) < 2:
                    res.notes.append(
                        f"the int4 tier packed no block: the longest sequence holds {longest} tokens, and a pair of "
                        f"blocks is packed once {2 * bs} tokens lie kv_int4_after={tier} behind the newest; give "
                        "longer --prompts, a larger --max-tokens or a smaller --kv-int4-after"
                    )
            for d in res.divergences:  # judged by the gate, not by identity
                d.verdict = "noise" if d.verdict == "FAIL" else d.verdict
            del ref_eng, test_eng
        if pair.key == "prefix":
            res.notes.append(f"prefix-cache hit rate {test['hit_rate']:.0%}")
            if not test["hit_rate"]:
                res.notes.append("no prefix-cache hit happened: give prompts that share full blocks")
        if pair.key == "preempt":
            res.notes.append(f"{test['preemptions']} preemptions forced")
            if not test["preemptions"]:
                res.notes.append("no preemption happened: the pair compared nothing it is meant to")
        if arch.moe is not None and res.accuracy is None and any(d.verdict == "FAIL" for d in res.divergences):
            if probe is None:
                probe = RouterProbe(_build(model, resolve({"decode_kernels": "off"}), None, "route probe"))
            for d in res.divergences:
                if d.verdict == "FAIL" and d.ref_token >= 0:
                    prefix = prompt_ids[d.request] + ref["tokens"][d.request][: d.step]
                    flip = explain_by_route_flip(probe, prefix, d, res.dtype, res.tolerance)
                    if flip is not None:
                        d.verdict = "noise"
                        res.route_flips.append(flip)
                        res.notes.append(flip["note"])
        res.decide()
        if res.failed:
            res.reproduce = reproduce_command(
                None if model == default_model_path() else model, user, pair.key, prompts_file, max_tokens
            )
            h = res.headline()
            if localise_failures and h is not None and h.ref_token >= 0 and res.accuracy is None:
                res.location = localise(
                    model,
                    ref_opts,
                    test_opts,
                    prompt_ids,
                    maxes,
                    h,
                    instrument,
                    (pair.ref_label, pair.test_label),
                    res.dtype,
                )
        results.append(res)
    bar.close()
    return {
        "model": model,
        "options": {k: (list(v) if isinstance(v, tuple) else v) for k, v in user.items()},
        "prompts": len(prompt_ids),
        "prompt_lengths": [len(p) for p in prompt_ids],
        "max_tokens": maxes,
        "batch": n_batch,
        "chunk_tokens": chunk,
        "pairs": [r.to_dict() for r in results],
        "results": results,
        "exit_code": 1 if any(r.failed for r in results) else 0,
    }


def format_report(report: dict) -> str:
    results = report["results"]
    lens = report["prompt_lengths"]
    lines = [
        f"infertune doctor --consistency: {report['model']}",
        f"  {report['prompts']} prompts of {min(lens)}..{max(lens)} tokens, {min(report['max_tokens'])}.."
        f"{max(report['max_tokens'])} greedy tokens each; batch N = {report['batch']}, chunk budget "
        f"{report['chunk_tokens']} tokens",
        "",
        cp.format_table(results),
    ]
    tail = cp.format_failures(results)
    if tail:
        lines += ["", tail.lstrip("\n")]
    lines += [
        "",
        "result: "
        + (
            "FAIL: a pair diverges with a clear margin, or misses its accuracy gate (exit 1)"
            if report["exit_code"]
            else "consistent (divergences, if any, are near-ties within the dtype's tolerance)"
        ),
    ]
    return "\n".join(lines)


def json_ready(report: dict) -> dict:
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, list):
            return [clean(v) for v in x]
        return x

    return clean({k: v for k, v in report.items() if k != "results"})


# ---- the long run --------------------------------------------------------------------------------------------


def rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            import os

            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def check_long(
    model_or_config=None,
    n: int = 1000,
    *,
    options: dict | None = None,
    prompt: str | list[int] | None = None,
    instrument: Instrument | None = None,
    step_listeners: list | None = None,
) -> dict:
    """One greedy generation of n tokens: non-finite logits, logit-scale drift, repetition collapse, and the RSS
    every memory_interval(n) tokens. step_listeners: callables(outputs, step_seconds) run after every step (the
    AsyncLLMEngine.step_listeners signature; the engine's own, where it has them, run too)."""
    from infertune.config import ArchConfig, EngineConfig, default_model_path
    from infertune.engine.tokenizer import load_tokenizer

    if n < 1:
        raise ValueError(f"--long {n}: give a positive number of tokens")
    if isinstance(model_or_config, EngineConfig):
        model, user = options_of(model_or_config)
    else:
        model, user = (model_or_config or default_model_path()), {}
    user = {**user, **(options or {}), "distributed_executor_backend": "uni", "max_num_seqs": 1}
    _one_process(user)
    limit = ArchConfig.from_model_dir(model).max_position_embeddings
    tok = load_tokenizer(user.get("tokenizer") or model)
    ids = tok.encode(prompt if isinstance(prompt, str) else cp.SEED_TEXT) if not isinstance(prompt, list) else prompt
    ids = ids[: max(1, min(len(ids), 64))]
    if len(ids) + n + 1 > limit:
        raise ValueError(f"--long {n}: the prompt ({len(ids)}) plus {n} tokens exceed this model's {limit} positions")
    user["max_model_len"] = len(ids) + n + 1
    engine = _build(model, user, instrument, "long")
    watch = _LogitWatch(engine.executor.runner.model)
    interval = cp.memory_interval(n)
    readings: list[tuple[int, int]] = []
    listeners = list(step_listeners or []) + list(getattr(engine, "step_listeners", []) or [])
    from infertune.sampling_params import SamplingParams

    engine.add_request(
        "long", {"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=2)
    )
    seq = engine.requests["long"].samples[0].seq
    next_reading = interval
    started = time.perf_counter()
    final = None
    try:
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            outs = engine.step()
            for listener in listeners:
                listener(outs, time.perf_counter() - t)
            for o in outs:
                if o.finished:
                    final = o
            while len(seq.output_token_ids) >= next_reading:
                readings.append((next_reading, rss_bytes()))
                next_reading += interval
    finally:
        watch.remove()
    tokens = list(final.outputs[0].token_ids) if final else list(seq.output_token_ids)
    margins = [lp.top[0][1] - lp.top[1][1] for lp in (final.outputs[0].logprobs or []) if len(lp.top) > 1]
    nonfinite = [i for i, f in enumerate(watch.finite) if not f]
    report = {
        "model": model,
        "tokens": len(tokens),
        "prompt_tokens": len(ids),
        "seconds": time.perf_counter() - started,
        "interval": interval,
        "rss": readings,
        "memory": cp.memory_verdict(readings),
        "nonfinite_steps": len(nonfinite),
        "first_nonfinite": nonfinite[0] if nonfinite else None,
        "drift": cp.drift([s for s in watch.scales if math.isfinite(s)]),
        "repetition": cp.repetition(tokens),
        "margins": margins,
        "logit_scales": watch.scales,
    }
    report["verdict"] = cp.long_verdict(report)
    report["exit_code"] = 1 if report["verdict"].startswith("FAIL") else 0
    return report


# ---- the plot ------------------------------------------------------------------------------------------------


def plot(report: dict, path: str) -> None:
    """Logit margins (top-1 minus top-2 logprob of the reference path) along the sequences, one panel per pair,
    with the tolerance and each divergence marked; for --long, the margins and the RSS along the run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if "rss" in report:
        fig, (a, b) = plt.subplots(2, 1, figsize=(10, 6))
        a.plot(report["margins"], lw=0.7)
        a.set_ylabel("top-1 - top-2 logprob")
        a.set_title(f"--long {report['tokens']}: {report['verdict']}")
        b.plot([t for t, _ in report["rss"]], [m / 2**20 for _, m in report["rss"]], marker="o")
        b.set_xlabel("tokens generated")
        b.set_ylabel("RSS (MiB)")
    else:
        pairs = [r for r in report["results"] if not r.skipped]
        fig, axes = plt.subplots(max(len(pairs), 1), 1, figsize=(10, 2.2 * max(len(pairs), 1)), squeeze=False)
        for ax, r in zip(axes[:, 0], pairs):
            x0 = 0
            for i, m in enumerate(r.ref_margins):
                xs = range(x0, x0 + len(m))
                floor = max(r.tolerance, 1e-9) / 10  # margins are >= 0; a log axis needs them above 0
                ax.plot(xs, [max(v, floor) if math.isfinite(v) else floor for v in m], lw=0.7, color="C0")
                for d in r.divergences:
                    if d.request == i:
                        ax.axvline(x0 + d.step, color="red" if d.verdict == "FAIL" else "orange", lw=1)
                x0 += len(m) + 1
            ax.axhline(r.tolerance, color="gray", ls="--", lw=0.8)
            ax.set_yscale("log")
            ax.set_title(f"{r.name}: {r.verdict}", fontsize=9)
            ax.set_ylabel("margin")
        axes[-1, 0].set_xlabel("step, request after request (red: failure, orange: near-tie; dashed: tolerance)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- the command ---------------------------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    """doctor's --consistency flags (the engine flags are made from config.py's declarations, as cli's are)."""
    from infertune.config import OPTION_GROUPS, engine_flag, engine_option_kwargs, option_fields

    g = p.add_argument_group(
        "consistency", "--consistency: run the model along the paths that must agree (docs/consistency.md)"
    )
    g.add_argument("--consistency", action="store_true", help="check that the engine's paths agree on this model")
    g.add_argument("--prompts", default=None, metavar="FILE", help="prompts, one per line (default: the built-in set)")
    g.add_argument("--plot", default=None, metavar="PNG", help="write the logit margins along the sequences")
    g.add_argument("--long", type=int, default=None, metavar="N", help="instead: one generation of N tokens")
    g.add_argument(
        "--pair", action="append", choices=cp.PAIR_KEYS, default=None, help="run only this pair (repeatable)"
    )
    g.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS, help="greedy tokens per prompt (about)")
    g.add_argument("--batch", type=int, default=None, help="N of 'batch 1 vs N' (default: max-num-seqs, at most 8)")
    e = p.add_argument_group("engine (with --consistency)", "the options every path starts from")
    for f in option_fields(*[x for x in OPTION_GROUPS if x != "limits"]):
        flag = engine_flag(f.name)
        if flag:
            kw = engine_option_kwargs(f.name)
            kw["default"] = None if kw.get("action") is None else kw.get("default")
            if kw.get("action"):
                kw["default"] = argparse.SUPPRESS
            e.add_argument(flag, dest=f.name, **kw)


def _user_options(args: argparse.Namespace) -> tuple[str | None, dict]:
    from infertune.config import OPTION_GROUPS, engine_flag, option_fields

    out = {}
    for f in option_fields(*[x for x in OPTION_GROUPS if x != "limits"]):
        if f.name == "model" or not engine_flag(f.name) or not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value is not None:
            out[f.name] = value
    return getattr(args, "model", None), out


def run(args: argparse.Namespace) -> int:
    model, options = _user_options(args)
    if args.long is not None:
        report = check_long(model, args.long, options=options)
        text = cp.format_long(report)
        data = {k: v for k, v in report.items() if k not in ("margins", "logit_scales")}
    else:
        prompts = None
        if args.prompts:
            with open(args.prompts) as fh:
                prompts = [line.rstrip("\n") for line in fh if line.strip()]
        report = check_consistency(
            model,
            prompts,
            options=options,
            pairs=args.pair,
            max_tokens=args.max_tokens,
            batch=args.batch,
            prompts_file=args.prompts,
            progress=True,
        )
        text = format_report(report)
        data = json_ready(report)
    if args.plot:
        plot(report, args.plot)
    print_report(args, text, json_ready(data))
    return report["exit_code"]


def _one_process(user: dict) -> None:
    """The checks hook the model runner, which must then run in this process: no tensor parallel."""
    tp = int(user.get("tensor_parallel_size") or 1)
    if tp != 1:
        raise ValueError(
            f"the consistency checks run the model in this process (they hook its runner), so tensor_parallel_size "
            f"must be 1 (got {tp}); drop --tensor-parallel-size (a tensor-parallel engine's greedy tokens can be "
            "compared with one process's through the LLM API)"
        )
