#!/usr/bin/env python3
"""Long contexts on a fixed KV budget: full attention, sliding windows, SnapKV and the seeds' policy side by side.

Part 1 (memory and speed) runs a tiny random Llama (built here with transformers' save_pretrained; 4 layers, 2 KV
heads of 32, a long max_position_embeddings): for each context (1K, 4K, 16K, 32K) one sequence is prefilled in
chunks and decodes --decode tokens, the configurations' engines stepped in turn so that they share the machine's
load alike (TTFT: a run's own steps until its first token; decode tok/s: one over its median decode step, batch 1); the KV it holds while decoding is read from the engine's block manager (blocks x the engine's block bytes), and
the sequences a --budget-mib pool holds at that size are the budget over it. Every configuration runs the same
per-op decode path (fp32: the fused C decode step, bf16 only, does not know KV compression).

The configurations: full attention; every layer in a window of --window; SnapKV keeping --keep of every layer;
"length policy": full up to --threshold prompt tokens, that SnapKV above; "policy", the seeds' recipe: layers 0-1
in a window of 128, the others as the length policy.

Part 2 (accuracy) runs the built-in demo model on its held-out text (infertune/assets/calib/heldout.jsonl, which
the model never saw): windows of --acc-prompt tokens are prefilled (and compressed), then --acc-cont tokens of the
true text are fed one decode step at a time (teacher forcing: the harness puts the true token in place of the
sampled one, in the engine's sequence and the runner's request state, before the next step); each step's
next-token distribution is compared with full attention's at the same position: KL(full || compressed) in nats and
top-1 agreement.

kvpress's compression_ratio is the share REMOVED: "SnapKV at 0.25" in issue 18's targets (a quarter kept, 4x the
sequences) is compression_ratio 0.75 here.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from infertune import LLM, SamplingParams
from infertune.bench.offline import cpu_model

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--contexts", default="1024,4096,16384,32768")
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--block-size", type=int, default=16)
ap.add_argument("--budget-mib", type=float, default=1024.0)
ap.add_argument("--decode", type=int, default=64)
ap.add_argument("--chunk", type=int, default=1024, help="max_num_batched_tokens (prefill chunks)")
ap.add_argument("--window", type=int, default=1024, help="the 'window' configuration: every layer")
ap.add_argument("--keep", type=float, default=0.25, help="the share SnapKV keeps (compression_ratio = 1 - keep)")
ap.add_argument("--threshold", type=int, default=4096, help="the policy's max_length of full attention")
ap.add_argument("--acc-prompt", type=int, default=768)
ap.add_argument("--acc-cont", type=int, default=64)
ap.add_argument("--acc-windows", type=int, default=8)
ap.add_argument(
    "--threads", type=int, default=1, help="torch threads (1: no OpenMP region waits on a thread another process took)"
)
ap.add_argument("--skip-speed", action="store_true")
ap.add_argument("--skip-accuracy", action="store_true")
ap.add_argument("--plot", default=None, help="write a PNG of KV per sequence and decode tok/s by context")
ap.add_argument("--json", default=None, help="write the rows as JSON")
args = ap.parse_args()
contexts = [int(c) for c in args.contexts.split(",")]
torch.set_num_threads(args.threads)
ratio = round(1 - args.keep, 6)
SNAP = {"press": "snapkv", "compression_ratio": ratio, "window_size": 64, "kernel_size": 5}
CONFIGS = {
    "full": None,
    f"window {args.window}": {"policy": [{"window": args.window}]},
    f"snapkv keep {args.keep:g}": SNAP,
    "length policy": {"policy": [{"max_length": args.threshold, "press": "none"}, SNAP]},
    "policy": {
        "policy": [
            {"layers": "0-1", "window": 128},
            {"max_length": args.threshold, "press": "none"},
            {"press": "snapkv", "compression_ratio": ratio},
        ]
    },
}


def build(path: Path) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max(contexts) + args.decode + 16,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path


class Run:
    """One configuration's engine with one sequence of `context` tokens, stepped by the caller."""

    def __init__(self, path: Path, context: int, press) -> None:
        llm = LLM(
            str(path),
            dtype="float32",
            block_size=args.block_size,
            max_model_len=context + args.decode,
            max_num_seqs=1,
            max_num_batched_tokens=args.chunk,
            enable_prefix_caching=False,
            kv_compression=press,
        )
        self.llm, self.engine = llm, llm.engine
        info = self.engine.executor.kv_cache_info
        self.block_bytes = info.bytes_per_token * info.block_size
        prompt = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(context)).tolist()
        params = SamplingParams(max_tokens=args.decode, ignore_eos=True)
        self.engine.add_request("r", {"prompt_token_ids": prompt}, params)
        self.ttft = 0.0  # its own steps' time until the first token (other runs' steps interleave)
        self.first = False
        self.steps: list[float] = []  # each decode step's wall time
        self.held = 0

    def step(self) -> None:
        engine, bm = self.engine, self.engine.block_manager
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        if not self.first:
            self.ttft += dt
        for seq in engine.scheduler.running:
            if not self.first and seq.num_output_tokens:
                self.first = True
            elif seq.num_output_tokens >= 2:
                self.steps.append(dt)
                self.held = max(
                    self.held, sum(bm.blocks_in_use(seq)) if hasattr(bm, "blocks_in_use") else len(seq.block_table)
                )

    def result(self) -> dict:
        bm = self.engine.block_manager
        assert bm.num_free_blocks == bm.num_blocks
        return dict(kv=self.held * self.block_bytes, ttft=self.ttft, tok_s=1 / statistics.median(self.steps))


def speed_rows(path: Path) -> list[dict]:
    """Per context, every configuration's engine stepped in turn (one step each, round after round), so that they
    share the machine's load alike; TTFT sums a run's own prefill steps, decode tok/s is one over its median step."""
    rows = []
    budget = int(args.budget_mib * 2**20)
    warm = Run(path, 1024, None)  # first-call costs, not reported
    while warm.engine.has_unfinished_requests():
        warm.step()
    for context in contexts:
        runs = {name: Run(path, context, press) for name, press in CONFIGS.items()}
        while any(r.engine.has_unfinished_requests() for r in runs.values()):
            for r in runs.values():
                if r.engine.has_unfinished_requests():
                    r.step()
        for name, run in runs.items():
            r = run.result()
            r.update(context=context, config=name, seqs=budget // r["kv"])
            rows.append(r)
            print(
                f"  {context:>6} {name:<18} KV/seq {r['kv'] / 2**20:8.2f} MiB  seqs in budget {r['seqs']:>6}  "
                f"TTFT {r['ttft']:7.2f} s  decode {r['tok_s']:7.1f} tok/s",
                flush=True,
            )
        del runs
    return rows


def teacher_forced(llm: LLM, prompt: list[int], cont: list[int]) -> torch.Tensor:
    """log-probs [len(cont), V]: row j predicts cont[j] (row 0 from the prefill, the rest from decode steps fed the
    true tokens)."""
    engine = llm.engine
    runner = engine.executor.runner
    logged: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda h: logged.append(compute(h).float()) or logged[-1]
    try:
        params = SamplingParams(temperature=0, max_tokens=len(cont), ignore_eos=True)
        engine.add_request("r", {"prompt_token_ids": prompt}, params)
        while engine.has_unfinished_requests():
            engine.step()
            for seq in engine.scheduler.running:  # the true token in place of the sampled one
                j = seq.num_output_tokens - 1
                seq.token_ids[-1] = cont[j]
                runner.requests.requests[str(seq.seq_id)].token_ids[-1] = cont[j]
    finally:
        runner.model.compute_logits = compute
    return torch.log_softmax(torch.cat(logged), dim=-1)


def accuracy_rows() -> list[dict]:
    from infertune.config import default_model_path

    model = default_model_path()
    llm0 = LLM(model, dtype="float32")
    tok = llm0.get_tokenizer()
    texts = [json.loads(line)["text"] for line in (Path(model).parent / "calib" / "heldout.jsonl").open()]
    ids = [t for text in texts for t in tok.encode(text) + [tok.eos_token_id]]
    span = args.acc_prompt + args.acc_cont
    step = max(span, (len(ids) - span) // max(1, args.acc_windows))
    windows = [ids[i : i + span] for i in range(0, len(ids) - span, step)][: args.acc_windows]
    presses = {
        f"snapkv keep {args.keep:g}": SNAP,
        "snapkv keep 0.5": {**SNAP, "compression_ratio": 0.5},
        f"streaming_llm keep {args.keep:g}": {"press": "streaming_llm", "compression_ratio": ratio, "n_sink": 4},
        "window 256 (all layers)": {"policy": [{"window": 256}]},
        "policy (layers 0-1 window 128, snapkv keep 0.5 above 512)": {
            "policy": [
                {"layers": "0-1", "window": 128},
                {"max_length": 512, "press": "none"},
                {"press": "snapkv", "compression_ratio": 0.5},
            ]
        },
    }
    full = [teacher_forced(llm0, w[: args.acc_prompt], w[args.acc_prompt :]) for w in windows]
    rows = []
    for name, press in presses.items():
        llm = LLM(model, dtype="float32", kv_compression=press)
        kl, agree, n = 0.0, 0, 0
        for w, ref in zip(windows, full):
            got = teacher_forced(llm, w[: args.acc_prompt], w[args.acc_prompt :])
            # rows 1.. were computed over the compressed cache (row 0 is the prefill's, before the press)
            p, q = ref[1:], got[1:]
            kl += float((p.exp() * (p - q)).sum())
            agree += int((p.argmax(-1) == q.argmax(-1)).sum())
            n += p.shape[0]
        rows.append(dict(config=name, kl=kl / n, top1=agree / n, positions=n))
        print(f"  {name:<58} KL {kl / n:.4f} nats  top-1 agreement {agree / n:.3f}  ({n} positions)", flush=True)
    return rows


print("$", shlex.join([sys.executable, *sys.argv]))
print(
    f"CPU: {cpu_model()}, {os.cpu_count()} cores, {args.threads} torch thread(s); load average {os.getloadavg()}; "
    f"torch {torch.__version__}"
)
out: dict = {}
with tempfile.TemporaryDirectory() as tmp:
    if not args.skip_speed:
        print("memory and speed (tiny random Llama, fp32, batch 1):")
        out["speed"] = speed_rows(build(Path(tmp) / "llama"))
if not args.skip_accuracy:
    print(f"accuracy vs full attention (built-in model, held-out text, {args.acc_prompt}-token prompts):")
    out["accuracy"] = accuracy_rows()
print(f"load average after: {os.getloadavg()}")

if "speed" in out:
    print()
    print(
        f"| context | config | KV / sequence | sequences in {args.budget_mib:g} MiB | TTFT | decode tok/s | vs full |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in out["speed"]:
        base = next(b for b in out["speed"] if b["context"] == r["context"] and b["config"] == "full")
        print(
            f"| {r['context']} | {r['config']} | {r['kv'] / 2**20:.2f} MiB | {r['seqs']} | {r['ttft']:.2f} s "
            f"| {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x, {base['kv'] / r['kv']:.1f}x seqs |"
        )
if "accuracy" in out:
    print()
    print("| config | KL(full ‖ config), nats / token | top-1 agreement |")
    print("|---|---|---|")
    for r in out["accuracy"]:
        print(f"| {r['config']} | {r['kl']:.4f} | {r['top1']:.3f} |")
if args.json:
    Path(args.json).write_text(json.dumps(out, indent=1))
if args.plot and "speed" in out:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in CONFIGS:
        rs = [r for r in out["speed"] if r["config"] == name]
        a.plot([r["context"] for r in rs], [r["kv"] / 2**20 for r in rs], marker="o", label=name)
        b.plot([r["context"] for r in rs], [r["tok_s"] for r in rs], marker="o", label=name)
    for ax, title in ((a, "KV per sequence (MiB)"), (b, "decode tok/s, batch 1")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens)")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
    a.set_yscale("log")
    a.legend(fontsize=8)
    fig.suptitle("infertune: KV compression on a fixed budget (" + cpu_model() + ")", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    print(f"plot: {args.plot}")
