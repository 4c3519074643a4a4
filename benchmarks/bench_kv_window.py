#!/usr/bin/env python3
"""KV memory that follows the sliding window: KV bytes per sequence, and the sequences a fixed KV budget holds, at
1K / 4K / 16K / 32K contexts, for a windowed model against the same weights with the window off, side by side.

The model is a tiny random Mistral (every layer windowed; built here with transformers' save_pretrained): what the
KV cache holds depends on the layers, KV heads, head size, window and context, not on the weights. For each context
one sequence is prefilled in chunks and decodes a few tokens; the blocks it holds are read from the engine's block
manager after every step (while decoding, and the peak, in a prefill chunk), then turned into bytes with the
engine's own block bytes. The sequences that fit the budget are its bytes over a decoding sequence's; the most a
sequence can hold at once (a chunk's window) is what the engine checks one sequence against at start-up. At the
smallest context the fit is also run: as many sequences as the budget lets run at once. No timings (the machine is
shared): memory only. The target (issue 18): at 32K, a windowed model's KV per sequence within 10% of window x
layers x bytes per token plus one block per layer.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
from pathlib import Path

import torch

from infertune import LLM, SamplingParams
from infertune.bench.offline import cpu_model

ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
ap.add_argument("--contexts", default="1024,4096,16384,32768")
ap.add_argument("--window", type=int, default=1024)
ap.add_argument("--layers", type=int, default=4)
ap.add_argument("--block-size", type=int, default=16)
ap.add_argument("--budget-mib", type=float, default=512.0, help="the fixed KV budget the sequences are fitted into")
ap.add_argument("--decode", type=int, default=8, help="tokens decoded after each prompt")
ap.add_argument("--chunk", type=int, default=512, help="max_num_batched_tokens: prefill chunks of this many tokens")
ap.add_argument("--dtype", default="bfloat16")
ap.add_argument("--fit-context", type=int, default=2048, help="the run that admits as many sequences as fit")
ap.add_argument("--fit-budget-mib", type=float, default=8.0)
ap.add_argument("--fit-seqs", type=int, default=24, help="sequences submitted to that run")
ap.add_argument("--fit-decode", type=int, default=256, help="tokens each decodes there (long enough to pile up)")
args = ap.parse_args()
contexts = [int(c) for c in args.contexts.split(",")]


def build(path: Path, window: int | None) -> Path:
    """A tiny random Mistral with a byte-level tokenizer (every byte one token; only token ids are fed here)."""
    from transformers import MistralConfig, MistralForCausalLM

    from infertune.bench.offline_models import SPECIAL_TOKENS, make_tokenizer

    fast = make_tokenizer(256 + len(SPECIAL_TOKENS))  # every byte one token, nothing padded
    cfg = MistralConfig(
        vocab_size=len(fast),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max(*contexts, args.fit_context) + max(args.decode, args.fit_decode) + 16,
        sliding_window=window,
    )
    torch.manual_seed(0)
    MistralForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    fast.save_pretrained(path)
    return path


def measure(path: Path, context: int) -> dict:
    max_len = context + args.decode
    llm = LLM(
        str(path),
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=max_len,
        max_num_seqs=1,
        max_num_batched_tokens=args.chunk,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    info = engine.executor.kv_cache_info
    block_bytes = info.bytes_per_token * info.block_size
    prompt = torch.randint(0, 256, (context,), generator=torch.Generator().manual_seed(context)).tolist()
    params = SamplingParams(temperature=0, max_tokens=args.decode, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": prompt}, params)
    bm = engine.block_manager
    peak = decode = 0
    while engine.has_unfinished_requests():
        engine.step()
        for seq in engine.scheduler.running:
            held = sum(bm.blocks_in_use(seq)) if hasattr(bm, "blocks_in_use") else len(seq.block_table)
            peak = max(peak, held)
            if seq.num_output_tokens >= 2:  # past the prompt's last chunk
                decode = max(decode, held)
    assert bm.num_free_blocks == bm.num_blocks
    return dict(
        peak=peak * block_bytes,
        decode=decode * block_bytes,
        reserve=info.max_blocks_per_seq * block_bytes,
        bytes_per_token_layer=info.bytes_per_token // args.layers,
    )


def fit_at_once(path: Path, context: int, budget: int) -> int:
    """The most sequences of `context` + decode tokens running at once in a pool of `budget` bytes, of --fit-seqs."""
    llm = LLM(
        str(path),
        dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=context + args.fit_decode,
        max_num_seqs=256,
        max_num_batched_tokens=args.chunk,
        kv_cache_memory_bytes=budget,
        enable_prefix_caching=False,
    )
    engine = llm.engine
    g = torch.Generator().manual_seed(1)
    for i in range(args.fit_seqs):
        prompt = torch.randint(0, 256, (context,), generator=g).tolist()
        engine.add_request(
            str(i), {"prompt_token_ids": prompt}, SamplingParams(max_tokens=args.fit_decode, ignore_eos=True)
        )
    most = 0
    for _ in range(100_000):
        if not engine.has_unfinished_requests():
            break
        engine.step()
        most = max(most, engine.scheduler.num_running)
    return most


print("$", shlex.join([sys.executable, *sys.argv]))
print(f"CPU: {cpu_model()}, {os.cpu_count()} cores; load average {os.getloadavg()[0]:.2f}; torch {torch.__version__}")
budget = int(args.budget_mib * 2**20)
with tempfile.TemporaryDirectory() as tmp:
    models = {
        f"window {args.window}": build(Path(tmp) / "win", args.window),
        "window off": build(Path(tmp) / "full", None),
    }
    rows = []
    for context in contexts:
        res = {name: measure(path, context) for name, path in models.items()}
        rows.append((context, res))
        w, f = res[f"window {args.window}"], res["window off"]
        ideal = (args.window + args.block_size) * args.layers * w["bytes_per_token_layer"]
        print(
            f"context {context}: window {w['decode'] / 2**20:.2f} MiB decoding (peak {w['peak'] / 2**20:.2f}), "
            f"off {f['decode'] / 2**20:.2f} MiB; ideal (window + one block) x layers x bytes {ideal / 2**20:.2f} MiB",
            flush=True,
        )
    print()
    print(
        f"| context | KV / seq, window {args.window} (decoding; in a prefill chunk) | KV / seq, window off | "
        f"window / off | seqs in {args.budget_mib:g} MiB, window | seqs, off | (W + block) x layers x bytes/token | "
        "window vs that |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for context, res in rows:
        w, f = res[f"window {args.window}"], res["window off"]
        ideal = (args.window + args.block_size) * args.layers * w["bytes_per_token_layer"]
        print(
            f"| {context} | {w['decode'] / 2**20:.2f} MiB; {w['peak'] / 2**20:.2f} | {f['decode'] / 2**20:.2f} MiB "
            f"| {w['decode'] / f['decode']:.3f} | {budget // w['decode']} | {budget // f['decode']} "
            f"| {ideal / 2**20:.2f} MiB | {w['decode'] / ideal - 1:+.1%} |"
        )
    fit_budget = int(args.fit_budget_mib * 2**20)
    print()
    print(
        f"running at once, {args.fit_seqs} sequences of {args.fit_context} tokens in {args.fit_budget_mib:g} MiB: ",
        end="",
    )
    print(", ".join(f"{name} {fit_at_once(path, args.fit_context, fit_budget)}" for name, path in models.items()))
