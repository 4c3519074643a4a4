#!/usr/bin/env python3
"""Speculative decoding (n-gram prompt lookup, a draft model) against plain decoding, batch 1, on the built-in model.

Two workloads, EOS ignored: "copy" (greedy) asks for code the prompt already holds (a snippet of the calibration
set, then the first line of the same snippet again), so the output copies the prompt and many drafts are accepted;
"novel" samples (temperature 1, seeded) from a short prompt, so the output rarely repeats itself and drafts are
mostly rejected: their verification is then pure cost (greedy decoding of this small model falls into loops, which
drafts predict well); "rejected" is "novel" with every decode step forced to carry K drafts that its own sampling
almost surely rejects (the last token K times), the worst case of the verification's cost. Every setting must give
the tokens of plain decoding (a seeded request's draws do not change with drafts), and the script checks that they
do. Per workload and setting: decode tok/s ((output tokens - 1) / (total - TTFT)), forward steps per output token, and the acceptance (mean accepted length = 1 + accepted / steps with drafts, as vLLM
reports it). Plain and speculative runs alternate, the order reversed every other round; medians.
"CPU ms / token" is the process's CPU time per output token (its prefill, the same in every setting, included): on
a loaded machine, run with OMP_NUM_THREADS=1, where it counts the work a run did whatever else runs, while
wall-clock rates swing with the load (and threads that wait at a barrier burn CPU).

The settings: "plain"; "ngram" (K adapting to each sequence's acceptance, the default); "ngram-fixed" (K drafts
every step, adaptive off: its "rejected" row measures what a draft row costs, the adaptive policy's draft_cost,
printed at the end, from CPU time); with --draft-model, "draft" (that model drafting K tokens a step; "self"
drafts with the target itself: every greedy draft is accepted, which shows the mechanics' cost). In "rejected" every speculative setting's
scheduler is handed the forced drafts for the K it asks for (a draft model still runs its forwards).

    python benchmarks/bench_spec_decode.py                         # the built-in model as LLM() loads it (fp32)
    python benchmarks/bench_spec_decode.py --dtype bfloat16        # bf16: the x86 kernels and the fused step
    python benchmarks/bench_spec_decode.py --draft-model self      # + the target drafting for itself
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from infertune import LLM, SamplingParams
from infertune.bench.offline import cpu_model

CALIB = Path(__file__).resolve().parents[1] / "infertune" / "assets" / "calib" / "calib.jsonl"
NOVEL = "import os\n\n\ndef main(argv):\n    parser = "


def copy_prompts(tokenizer, n: int, min_tokens: int) -> list[str]:
    """Snippets of at least min_tokens tokens, each followed by a request to write it again and its first line."""
    out = []
    for line in CALIB.read_text().splitlines():
        code = json.loads(line)["text"]
        if len(tokenizer.encode(code)) >= min_tokens:
            out.append(code + "\n\n# The same code again:\n\n" + code.split("\n", 1)[0] + "\n")
        if len(out) == n:
            break
    return out


def run_once(llm: LLM, prompt: str, params: SamplingParams) -> dict:
    stats0, steps0 = llm.engine.stats(), llm.engine.num_steps
    t, cpu = time.perf_counter(), time.process_time()
    out = llm.generate(prompt, params, use_tqdm=False)
    total, cpu = time.perf_counter() - t, time.process_time() - cpu
    out = out[0]
    stats = llm.engine.stats()
    n = len(out.outputs[0].token_ids)
    ttft = out.metrics.first_token_time - t
    drafts = stats["spec_decode_num_drafts"] - stats0["spec_decode_num_drafts"]
    return dict(
        decode=(n - 1) / (total - ttft),
        cpu_ms=1000 * cpu / n,
        steps_per_token=(llm.engine.num_steps - steps0) / n,
        drafts=drafts,
        draft_tokens=stats["spec_decode_num_draft_tokens"] - stats0["spec_decode_num_draft_tokens"],
        accepted=stats["spec_decode_num_accepted_tokens"] - stats0["spec_decode_num_accepted_tokens"],
        tokens=out.outputs[0].token_ids,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="HF folder (default: the built-in model)")
    ap.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens (default: 4)")
    ap.add_argument("--prompt-lookup-min", type=int, default=2, help="(default: 2)")
    ap.add_argument("--prompt-lookup-max", type=int, default=4, help="(default: 4)")
    ap.add_argument("--prompts", type=int, default=4, help="copy prompts, each run in every round (default: 4)")
    ap.add_argument("--output-len", type=int, default=96, help="(default: 96)")
    ap.add_argument("--rounds", type=int, default=3, help="(default: 3)")
    ap.add_argument("--draft-model", default=None, help='a draft model\'s folder, or "self" (default: none)')
    ap.add_argument("--workloads", default="copy,novel,rejected", help="(default: copy,novel,rejected)")
    args = ap.parse_args()
    spec = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": args.prompt_lookup_min,
        "prompt_lookup_max": args.prompt_lookup_max,
    }
    print("$ python " + " ".join(sys.argv), flush=True)
    import torch

    print(f"CPU: {cpu_model()}; torch threads {torch.get_num_threads()}; speculative_config={json.dumps(spec)}")
    load_start = os.getloadavg()[0]
    engines = {
        "plain": LLM(args.model, dtype=args.dtype),
        "ngram": LLM(args.model, dtype=args.dtype, speculative_config=spec),
        "ngram-fixed": LLM(args.model, dtype=args.dtype, speculative_config={**spec, "adaptive": False}),
    }
    if args.draft_model:
        path = engines["plain"].engine.config.model.model if args.draft_model == "self" else args.draft_model
        draft = {"method": "draft_model", "model": path, "num_speculative_tokens": args.k}
        print(f"draft: speculative_config={json.dumps(draft)}")
        engines["draft"] = LLM(args.model, dtype=args.dtype, speculative_config=draft)
    tokenizer = engines["plain"].get_tokenizer()
    greedy = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    workloads = {
        "copy": [(p, greedy) for p in copy_prompts(tokenizer, args.prompts, args.output_len)],
        "novel": [
            (NOVEL, SamplingParams(temperature=1.0, seed=i, max_tokens=args.output_len, ignore_eos=True))
            for i in range(args.prompts)
        ],
    }
    workloads["rejected"] = workloads["novel"]
    workloads = {w: workloads[w] for w in args.workloads.split(",")}
    proposers = [llm.engine.scheduler.proposer for e, llm in engines.items() if e != "plain"]
    proposes = [p.propose for p in proposers]
    for llm in engines.values():  # warm-up
        run_once(llm, NOVEL, SamplingParams(max_tokens=8))
    results = {(w, e): [] for w in workloads for e in engines}
    for r in range(args.rounds):
        for w, runs_of in workloads.items():
            for proposer, propose in zip(proposers, proposes):
                proposer.propose = (lambda seq, k: [seq.token_ids[-1]] * k) if w == "rejected" else propose
            for prompt, params in runs_of:
                names = list(engines) if r % 2 == 0 else list(engines)[::-1]
                runs = {e: run_once(engines[e], prompt, params) for e in names}
                for e in names:
                    if runs[e]["tokens"] != runs["plain"]["tokens"]:
                        raise AssertionError(f"{w}: {e} changed the tokens of {prompt[:40]!r}")
                for e, res in runs.items():
                    results[w, e].append(res)
    print()
    print(
        "| workload | decoding | decode tok/s | vs plain | CPU ms / token | vs plain | steps / token | drafted / accepted "
        "| acceptance | mean accepted length |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratio = {}
    for w in workloads:
        base = statistics.median(x["decode"] for x in results[w, "plain"])
        base_cpu = statistics.median(x["cpu_ms"] for x in results[w, "plain"])
        for e in engines:
            rs = results[w, e]
            tps = statistics.median(x["decode"] for x in rs)
            cpu = statistics.median(x["cpu_ms"] for x in rs)
            steps = statistics.median(x["steps_per_token"] for x in rs)
            drafted, accepted, with_drafts = (sum(x[k] for x in rs) for k in ("draft_tokens", "accepted", "drafts"))
            mal = f"{1 + accepted / with_drafts:.2f}" if with_drafts else "-"
            acc = f"{drafted} / {accepted}" if e != "plain" else "-"
            rate = f"{accepted / drafted:.1%}" if drafted else "-"
            ratio[w, e] = cpu / base_cpu
            print(
                f"| {w} | {e} | {tps:.1f} | {tps / base:.2f}x | {cpu:.2f} | {base_cpu / cpu:.3f}x | {steps:.2f} | {acc} "
                f"| {rate} | {mal} |"
            )
    if ("rejected", "ngram-fixed") in ratio:
        cost = (ratio["rejected", "ngram-fixed"] - 1) / args.k
        print(
            f"\nA draft row costs {cost:.3f} of a plain decode step (ngram-fixed, rejected: K = {args.k} rows a step)"
        )
    print(
        f"\n1-min load average: {load_start:.2f} at start, {os.getloadavg()[0]:.2f} at end (this script adds about 1)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
