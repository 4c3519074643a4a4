"""`infertune bench longctx`: long contexts on a fixed KV budget, full attention beside sliding windows, SnapKV and
the seeds' length policy.

Memory and speed run a tiny random Llama (built once with transformers' save_pretrained: --layers layers, 2 KV heads
of 32, hidden 128, a long max_position_embeddings). For each context one sequence is prefilled in chunks and
decodes --decode tokens; the configurations' engines are stepped in turn, so that they share the machine's load
alike. TTFT is a run's own steps until its first token; decode tok/s is one over its median decode step (batch 1).
The KV a sequence holds while decoding is read from the engine's block manager (blocks x the engine's bytes per
block), and the sequences a --budget-mib pool holds at that size are the budget over it. Every configuration runs
in --dtype: float32 (the default) on the per-op path, bfloat16 in the fused C decode step where the CPU has the
kernels.

The configurations: full attention; every layer in a window of --window; SnapKV keeping --keep of every layer;
"length policy": full up to --threshold prompt tokens, that SnapKV above; "policy", the seeds' recipe: layers 0-1 in
a window of 128, the others as the length policy; the int8 KV cache; and int8 with the int4 tier for tokens
--int4-after or more behind the newest (kv_int4_after).

Accuracy runs the built-in demo model on its held-out text (infertune/assets/calib/heldout.jsonl, which the model
never saw): windows of --acc-prompt tokens are prefilled (and compressed), then --acc-cont tokens of the true text
are fed one decode step at a time (teacher forcing: the true token replaces the sampled one before the next step).
Each step's next-token distribution is compared with full attention's at the same position: KL(full || compressed)
in nats and top-1 agreement.

kvpress's compression_ratio is the share REMOVED: "SnapKV at 0.25" (a quarter kept, 4x the sequences) is --keep 0.25,
compression_ratio 0.75. Used by `benchmarks/bench_longctx.py` and `infertune ledger --longctx`.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from infertune.files import add_json_flag, emit_json


@dataclass(slots=True)
class Settings:
    contexts: list[int] = field(default_factory=lambda: [1024, 4096, 16384, 32768])
    layers: int = 4
    block_size: int = 16
    budget_mib: float = 1024.0
    decode: int = 64
    chunk: int = 1024  # max_num_batched_tokens: the prefill's chunks
    window: int = 1024  # the "window" configuration, every layer
    keep: float = 0.25  # the share SnapKV keeps
    threshold: int = 4096  # the length policy's longest full-attention prompt
    acc_prompt: int = 768
    acc_cont: int = 64
    acc_windows: int = 8
    int4_after: int = 1024  # the int4 tier's configuration: int8, tokens this far behind the newest in int4
    dtype: str = "float32"  # the engines' dtype (bfloat16: the fused C decode step runs)
    only: list[str] | None = None  # the configurations run (names or their first words); None: all

    def check(self) -> None:
        """Clear errors for settings that cannot be measured (before anything is built)."""
        if not 0 < self.keep < 1:
            raise ValueError(f"keep={self.keep}: the share SnapKV keeps must lie in (0, 1)")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}: float32 or bfloat16")
        if self.int4_after < 0:
            raise ValueError(f"int4_after={self.int4_after}: a token count >= 0")
        if self.decode < 3:
            raise ValueError(f"decode={self.decode}: at least 3 decode steps (the first two are not timed)")
        if not self.contexts or min(self.contexts) < 1:
            raise ValueError(f"contexts={self.contexts}: expected positive prompt lengths")
        if not self.budget_mib > 0:  # (0 or less counted 0 or negative sequences in the budget; nan too)
            raise ValueError(f"--budget-mib {self.budget_mib:g}: the KV pool must be a positive size in MiB")
        sizes = {
            "--layers": self.layers,
            "--block-size": self.block_size,
            "--chunk": self.chunk,
            "--window": self.window,
            "--threshold": self.threshold,
            "--acc-prompt": self.acc_prompt,
            "--acc-cont": self.acc_cont,
            "--acc-windows": self.acc_windows,
        }
        bad = [f"{flag} {v}" for flag, v in sizes.items() if v < 1]
        if bad:
            raise ValueError(
                f"{', '.join(bad)}: layers, block size, chunk, window, threshold and the accuracy sizes "
                "must be positive"
            )


def snapkv(keep: float, window_size: int = 64) -> dict:
    """SnapKV keeping `keep` of the prompt (kvpress's compression_ratio is the share removed)."""
    return {"press": "snapkv", "compression_ratio": round(1 - keep, 6), "window_size": window_size, "kernel_size": 5}


def seeds_policy(keep: float, threshold: int, window: int = 128) -> dict:
    """The seeds' recipe: layers 0-1 in a window, full attention up to `threshold` prompt tokens, SnapKV above."""
    return {
        "policy": [
            {"layers": "0-1", "window": window},
            {"max_length": threshold, "press": "none"},
            {"press": "snapkv", "compression_ratio": round(1 - keep, 6)},
        ]
    }


def int8(int4_after: int | None = None) -> dict:
    """A configuration that is engine options, not a press: the int8 KV cache, with the int4 tier if int4_after."""
    return {"engine": {"kv_cache_dtype": "int8", "kv_int4_after": int4_after}}


def engine_options(config: dict | None) -> dict:
    """A configuration as LLM keywords: a press (or None: full attention) is kv_compression, {"engine": {...}} the
    options themselves."""
    if config is None:
        return {}
    return dict(config["engine"]) if "engine" in config else {"kv_compression": config}


def chosen(configs: dict, only: list[str] | None, kind: str) -> dict:
    """The configurations whose name starts with one of `only` (all where None); full attention always, as the
    baseline of the speed part's ratios. A prefix that matches none is an error naming the choices."""
    if not only:
        return configs
    for prefix in only:
        if not any(name.startswith(prefix) for name in configs):
            raise ValueError(f"--only {prefix!r} matches no {kind} configuration: {', '.join(configs)}")
    return {k: v for k, v in configs.items() if (kind == "speed" and k == "full") or any(map(k.startswith, only))}


def speed_configs(s: Settings) -> dict[str, dict | None]:
    snap = snapkv(s.keep)
    return {
        "full": None,
        f"window {s.window}": {"policy": [{"window": s.window}]},
        f"snapkv keep {s.keep:g}": snap,
        "length policy": {"policy": [{"max_length": s.threshold, "press": "none"}, snap]},
        "policy": seeds_policy(s.keep, s.threshold),
        "int8 KV": int8(),
        f"int8 + int4 after {s.int4_after}": int8(s.int4_after),
    }


def accuracy_configs(s: Settings) -> dict[str, dict]:
    """What the accuracy part compares with full attention (on --acc-prompt tokens: the policy's threshold is
    scaled down to 512 so that it compresses there)."""
    return {
        f"snapkv keep {s.keep:g}": snapkv(s.keep),
        "snapkv keep 0.5": snapkv(0.5),
        f"streaming_llm keep {s.keep:g}": {
            "press": "streaming_llm",
            "compression_ratio": round(1 - s.keep, 6),
            "n_sink": 4,
        },
        "window 256 (all layers)": {"policy": [{"window": 256}]},
        "policy (layers 0-1 window 128, snapkv keep 0.5 above 512)": seeds_policy(0.5, 512),
        "int8 KV": int8(),
        "int8 + int4 after 128": int8(128),
        "int8 + int4 after 0": int8(0),
    }


def build_model(path: Path, layers: int, max_positions: int) -> Path:
    """A tiny random Llama with a byte-level tokenizer and a long context, saved once at `path`."""
    if (path / "config.json").exists():
        cfg = json.loads((path / "config.json").read_text())
        if cfg.get("num_hidden_layers") == layers and cfg.get("max_position_embeddings", 0) >= max_positions:
            return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from infertune.bench.offline_models import SPECIAL_TOKENS, make_tokenizer

    fast = make_tokenizer(256 + len(SPECIAL_TOKENS))  # every byte one token, nothing padded
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path


class Run:
    """One configuration's engine with one sequence of `context` tokens, stepped by the caller."""

    def __init__(self, path: Path, context: int, config: dict | None, s: Settings) -> None:
        import torch

        from infertune import LLM, SamplingParams

        llm = LLM(
            str(path),
            dtype=s.dtype,
            block_size=s.block_size,
            max_model_len=context + s.decode,
            max_num_seqs=1,
            max_num_batched_tokens=s.chunk,
            enable_prefix_caching=False,
            **engine_options(config),
        )
        self.llm, self.engine = llm, llm.engine
        info = self.engine.executor.kv_cache_info
        self.block_bytes = info.bytes_per_token * info.block_size
        prompt = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(context)).tolist()
        self.engine.add_request("r", {"prompt_token_ids": prompt}, SamplingParams(max_tokens=s.decode, ignore_eos=True))
        self.ttft = 0.0  # its own steps' time until the first token (other runs' steps interleave)
        self.first = False
        self.steps: list[float] = []  # each decode step's wall time
        self.held = 0  # the most blocks the sequence held while decoding

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
                # a hybrid (windowed) cache's coordinator counts each group's blocks; a plain block manager's
                # sequence holds its block table
                held = sum(bm.blocks_in_use(seq)) if hasattr(bm, "blocks_in_use") else len(seq.block_table)
                self.held = max(self.held, held)

    def result(self) -> dict:
        bm = self.engine.block_manager
        if bm.num_free_blocks != bm.num_blocks:
            raise RuntimeError(f"the finished sequence left {bm.num_blocks - bm.num_free_blocks} blocks allocated")
        if not self.steps:
            raise ValueError("no decode step was timed: --decode must be at least 3")
        return dict(kv=self.held * self.block_bytes, ttft=self.ttft, tok_s=1 / statistics.median(self.steps))


def speed_rows(
    path: Path, s: Settings, configs: dict[str, dict | None], log: Callable[[str], None] = print, warmup: bool = True
) -> list[dict]:
    """Per context, every configuration's engine stepped in turn (one step each, round after round)."""
    from tqdm import tqdm

    rows = []
    budget = int(s.budget_mib * 2**20)
    if warmup:  # first-call costs, not reported
        warm = Run(path, min(1024, min(s.contexts)), None, s)
        while warm.engine.has_unfinished_requests():
            warm.step()
        del warm
    for context in tqdm(s.contexts, desc="contexts", unit="ctx", file=sys.stderr, disable=len(s.contexts) < 2):
        runs = {name: Run(path, context, config, s) for name, config in configs.items()}
        while any(r.engine.has_unfinished_requests() for r in runs.values()):
            for r in runs.values():
                if r.engine.has_unfinished_requests():
                    r.step()
        for name, run in runs.items():
            r = run.result()
            r.update(context=context, config=name, seqs=budget // r["kv"])
            rows.append(r)
            log(
                f"  {context:>6} {name:<18} KV/seq {r['kv'] / 2**20:8.2f} MiB  seqs in budget {r['seqs']:>6}  "
                f"TTFT {r['ttft']:7.2f} s  decode {r['tok_s']:7.1f} tok/s"
            )
        del runs
    return rows


def teacher_forced(llm, prompt: list[int], cont: list[int]):
    """log-probs [len(cont), V]: row j predicts cont[j] (row 0 from the prefill, the rest from decode steps fed the
    true tokens)."""
    import torch

    from infertune import SamplingParams

    engine = llm.engine
    runner = engine.executor.runner
    logged: list[torch.Tensor] = []
    compute = runner.model.compute_logits
    runner.model.compute_logits = lambda h, fp32=True: logged.append(compute(h).float()) or logged[-1]
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


def heldout_windows(model: str, span: int, count: int) -> list[list[int]]:
    """`count` spans of `span` tokens spread over the model's held-out text (calib/heldout.jsonl beside it)."""
    from infertune.engine.tokenizer import load_tokenizer

    tok = load_tokenizer(model)
    texts = [json.loads(line)["text"] for line in (Path(model).parent / "calib" / "heldout.jsonl").open()]
    ids = [t for text in texts for t in tok.encode(text) + [tok.eos_token_id]]
    if len(ids) < 2 * span:
        raise ValueError(f"the held-out text has {len(ids)} tokens, too few for spans of {span}")
    step = max(span, (len(ids) - span) // max(1, count))
    return [ids[i : i + span] for i in range(0, len(ids) - span, step)][:count]


def accuracy_rows(
    s: Settings, presses: dict[str, dict], model: str | None = None, log: Callable[[str], None] = print
) -> list[dict]:
    """KL(full || press) and top-1 agreement per press, teacher-forced on held-out text (the built-in model by
    default). Row 0 of each window (the prefill's, before any press) is left out."""
    from infertune import LLM
    from infertune.config import default_model_path

    model = model or default_model_path()
    windows = heldout_windows(model, s.acc_prompt + s.acc_cont, s.acc_windows)
    llm0 = LLM(model, dtype="float32", max_model_len=s.acc_prompt + s.acc_cont + 8)
    full = [teacher_forced(llm0, w[: s.acc_prompt], w[s.acc_prompt :]) for w in windows]
    del llm0
    rows = []
    for name, config in presses.items():
        llm = LLM(model, dtype="float32", max_model_len=s.acc_prompt + s.acc_cont + 8, **engine_options(config))
        kl, agree, n = 0.0, 0, 0
        for w, ref in zip(windows, full):
            got = teacher_forced(llm, w[: s.acc_prompt], w[s.acc_prompt :])
            p, q = ref[1:], got[1:]
            kl += float((p.exp() * (p - q)).sum())
            agree += int((p.argmax(-1) == q.argmax(-1)).sum())
            n += p.shape[0]
        del llm
        rows.append(dict(config=name, kl=kl / n, top1=agree / n, positions=n))
        log(f"  {name:<58} KL {kl / n:.4f} nats  top-1 agreement {agree / n:.3f}  ({n} positions)")
    return rows


def render(out: dict, budget_mib: float) -> str:
    lines: list[str] = []
    if out.get("speed"):
        lines += [
            f"| context | config | KV / sequence | sequences in {budget_mib:g} MiB | TTFT | decode tok/s | vs full |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in out["speed"]:
            base = next(b for b in out["speed"] if b["context"] == r["context"] and b["config"] == "full")
            lines.append(
                f"| {r['context']} | {r['config']} | {r['kv'] / 2**20:.2f} MiB | {r['seqs']} | {r['ttft']:.2f} s "
                f"| {r['tok_s']:.1f} | {r['tok_s'] / base['tok_s']:.2f}x, {base['kv'] / r['kv']:.1f}x seqs |"
            )
    if out.get("accuracy"):
        lines += ["", "| config | KL(full ‖ config), nats / token | top-1 agreement |", "|---|---|---|"]
        lines += [f"| {r['config']} | {r['kl']:.4f} | {r['top1']:.3f} |" for r in out["accuracy"]]
    return "\n".join(lines).strip("\n")


def write_plot(out: dict, path: Path) -> None:
    from infertune.bench.offline import cpu_model
    from infertune.plotting import pyplot

    plt = pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for name in dict.fromkeys(r["config"] for r in out["speed"]):
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
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _positive_ints(text: str) -> list[int]:
    try:
        vals = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated token counts, e.g. 1024,4096") from None
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: expected positive token counts")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    d = Settings()
    p.add_argument(
        "--contexts",
        type=_positive_ints,
        default=d.contexts,
        help="prompt lengths, comma-separated (default: 1024,4096,16384,32768)",
    )
    p.add_argument("--layers", type=int, default=d.layers, help="layers of the tiny random Llama (default: 4)")
    p.add_argument("--block-size", type=int, default=d.block_size, help="KV block size (default: 16)")
    p.add_argument(
        "--budget-mib", type=float, default=d.budget_mib, help="the KV pool the sequences count is for (default: 1024)"
    )
    p.add_argument("--decode", type=int, default=d.decode, help="decode steps per sequence, >= 3 (default: 64)")
    p.add_argument("--chunk", type=int, default=d.chunk, help="prefill chunk, max_num_batched_tokens (default: 1024)")
    p.add_argument(
        "--window", type=int, default=d.window, help="the 'window' configuration, every layer (default: 1024)"
    )
    p.add_argument("--keep", type=float, default=d.keep, help="the share SnapKV keeps, in (0, 1) (default: 0.25)")
    p.add_argument(
        "--threshold", type=int, default=d.threshold, help="the policy's longest full-attention prompt (default: 4096)"
    )
    p.add_argument("--acc-prompt", type=int, default=d.acc_prompt, help="accuracy: prompt tokens (default: 768)")
    p.add_argument("--acc-cont", type=int, default=d.acc_cont, help="accuracy: teacher-forced tokens (default: 64)")
    p.add_argument("--acc-windows", type=int, default=d.acc_windows, help="accuracy: held-out spans (default: 8)")
    p.add_argument(
        "--int4-after",
        type=int,
        default=d.int4_after,
        help="the 'int8 + int4' configuration's kv_int4_after: tokens this far behind the newest are int4 (default: "
        "1024)",
    )
    p.add_argument(
        "--only",
        default=None,
        metavar="NAMES",
        help="run only the configurations whose names start with these, comma-separated (e.g. 'int8,snapkv'; full "
        "attention always runs in the speed part, as the baseline) (default: all)",
    )
    p.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default=d.dtype,
        help="memory and speed: the engines' dtype; bfloat16 decodes in the fused C step where the CPU has the "
        "kernels (default: float32, the per-op path)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads (default: 1, so no OpenMP region waits on a busy core)"
    )
    p.add_argument("--cache-dir", type=Path, default=Path("/tmp/infertune-bench"), help="where the model is built")
    p.add_argument("--skip-speed", action="store_true", help="only the accuracy part")
    p.add_argument("--skip-accuracy", action="store_true", help="only the memory and speed part")
    add_json_flag(p, "the rows")
    p.add_argument("--plot", type=Path, default=None, metavar="OUT.png", help="KV per sequence and tok/s by context")


def settings_from(args: argparse.Namespace) -> Settings:
    s = Settings(
        contexts=list(args.contexts),
        layers=args.layers,
        block_size=args.block_size,
        budget_mib=args.budget_mib,
        decode=args.decode,
        chunk=args.chunk,
        window=args.window,
        keep=args.keep,
        threshold=args.threshold,
        acc_prompt=args.acc_prompt,
        acc_cont=args.acc_cont,
        acc_windows=args.acc_windows,
        int4_after=args.int4_after,
        dtype=args.dtype,
        only=[x.strip() for x in args.only.split(",") if x.strip()] if args.only else None,
    )
    s.check()
    return s


def model_path(cache_dir: Path, s: Settings) -> Path:
    longest = max(s.contexts) + s.decode + 16
    return build_model(Path(cache_dir) / f"longctx-llama-{s.layers}l", s.layers, longest)


def run(args: argparse.Namespace) -> int:
    import torch

    from infertune.bench.offline import cpu_model

    s = settings_from(args)
    if args.plot is not None:
        from infertune.plotting import require_matplotlib

        require_matplotlib()
    # (each part's --only choice, checked before either part runs: a prefix only one part has failed the other
    # after the first had run, the speed part minutes long)
    speed = None if args.skip_speed else chosen(speed_configs(s), s.only, "speed")
    accuracy = None if args.skip_accuracy else chosen(accuracy_configs(s), s.only, "accuracy")
    torch.set_num_threads(args.threads)
    print("$", shlex.join([sys.executable, *sys.argv]))
    print(
        f"CPU: {cpu_model()}, {os.cpu_count()} cores, {args.threads} torch thread(s); load average "
        f"{os.getloadavg()}; torch {torch.__version__}"
    )
    out: dict = {}
    if not args.skip_speed:
        print(f"memory and speed (tiny random Llama, {s.dtype}, batch 1):", flush=True)
        out["speed"] = speed_rows(model_path(args.cache_dir, s), s, speed)
    if not args.skip_accuracy:
        print(f"accuracy vs full attention (built-in model, held-out text, {s.acc_prompt}-token prompts):", flush=True)
        out["accuracy"] = accuracy_rows(s, accuracy)
    print(f"load average after: {os.getloadavg()}\n")
    print(render(out, s.budget_mib))
    emit_json(args.json, out)
    if args.plot is not None and out.get("speed"):
        write_plot(out, args.plot)
        print(f"plot: {args.plot}")
    return 0
