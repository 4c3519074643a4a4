#!/usr/bin/env python3
"""Decode speed of a sliding-window model with the fused C decode step against the per-module path (the only path
windowed models had before: decode_kernels="linear"), and a full-attention model of the same shape through the fused step, at one long prompt.

A random bf16 Mistral-shaped model (transformers' save_pretrained; --hidden, --layers, 8 query heads over 2 KV heads,
--window on every layer; --qwen2-full-layers N keeps the first N layers full, as Qwen2's max_window_layers, so the
step reads two KV cache groups) decodes --new tokens after a --prompt-token prompt, batch 1, greedy, in rounds that
alternate the engines (each built once); decode tok/s is the tokens after the first over the time from the first
token to the last, and TTFT, from the engine's request metrics (a prompt of up to 128 tokens is one fused step).

    python benchmarks/bench_window_fused.py --prompt 2048 --window 256 --rounds 3
    python benchmarks/bench_window_fused.py --family gemma3 --hidden 1024 --layers 12 --prompt 1024 --window 256
    python benchmarks/bench_window_fused.py --window 0 --kv-compression '{"press": "snapkv", "compression_ratio": 0.75}'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch


def build(path: Path, arch: str, hidden: int, layers: int, window: int | None, full_layers: int) -> Path:
    import transformers

    common = dict(
        hidden_size=hidden,
        intermediate_size=hidden * 3,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=32000,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    if arch == "mistral":
        cfg = transformers.MistralConfig(sliding_window=window, **common)
    elif arch == "gemma3":  # five sliding layers to one full one, the sliding layers' own rope base, q / k norms
        kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
        common |= dict(head_dim=hidden // 8, query_pre_attn_scalar=hidden // 8, hidden_activation="gelu_pytorch_tanh")
        cfg = transformers.Gemma3TextConfig(sliding_window=window, layer_types=kinds, **common)
    elif arch == "gemma2":  # sliding and full layers alternating, both soft-caps
        common |= dict(head_dim=hidden // 8, query_pre_attn_scalar=hidden // 8, hidden_activation="gelu_pytorch_tanh")
        cfg = transformers.Gemma2Config(sliding_window=window, **common)
    else:
        cfg = transformers.Qwen2Config(
            use_sliding_window=True, sliding_window=window, max_window_layers=full_layers, **common
        )
    torch.manual_seed(0)
    cls = transformers.Gemma3ForCausalLM if arch == "gemma3" else transformers.AutoModelForCausalLM
    model = (cls(cfg) if arch == "gemma3" else cls.from_config(cfg)).to(torch.bfloat16)
    model.save_pretrained(path)
    from infertune.bench.offline_models import make_tokenizer

    make_tokenizer(32000).save_pretrained(path)
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--window", type=int, default=256)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--qwen2-full-layers", type=int, default=0, help="a Qwen2 model with its first N layers full")
    ap.add_argument(
        "--kv-compression",
        type=json.loads,
        default=None,
        metavar="JSON",
        help="a kv_compression config for the two engines (e.g. SnapKV; --window 0: no window): the fused step "
        "against the per-module path on compressed sequences",
    )
    ap.add_argument(
        "--family",
        choices=["gemma2", "gemma3"],
        help="a Gemma model of the same shape instead (head_dim hidden / 8; Gemma 3: 5 sliding layers to 1 full; "
        "Gemma 2: alternating, soft-capped), against the path Gemma took before (per-module, decode_kernels linear)",
    )
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"$ python benchmarks/bench_window_fused.py {' '.join(sys.argv[1:])}")
    from infertune import LLM, SamplingParams
    from infertune.bench.offline import cpu_model
    from infertune.kernels import cpu

    print(
        f"CPU: {cpu_model()}; kernels: {cpu.describe()}; torch {torch.__version__}, {torch.get_num_threads()} threads"
    )
    tmp = Path(tempfile.mkdtemp())
    arch = args.family or ("qwen2" if args.qwen2_full_layers else "mistral")
    windowed = build(tmp / "windowed", arch, args.hidden, args.layers, args.window or None, args.qwen2_full_layers)
    max_len = args.prompt + args.new + 16
    what = f"{args.family}, " if args.family else ""
    what += f"window {args.window}" if args.window else "no window"
    if args.kv_compression:
        what += f", kv_compression {json.dumps(args.kv_compression)}"
    kw = dict(dtype="bfloat16", max_model_len=max_len, kv_compression=args.kv_compression)
    engines = {
        f"{what}, fused step": LLM(str(windowed), **kw),
        f"{what}, per-module kernels (decode_kernels linear: the path these models took before)": LLM(
            str(windowed), decode_kernels="linear", **kw
        ),
    }
    if not args.family:
        full = build(tmp / "full", "mistral", args.hidden, args.layers, None, 0)
        engines["full attention, fused step"] = LLM(str(full), dtype="bfloat16", max_model_len=max_len)
    for name, llm in engines.items():
        print(
            f"  {name}: fused step {'on' if llm.engine.executor.runner.fused is not None else 'off'}, "
            f"KV cache groups {len(llm.engine.executor.runner.kv_groups)}"
        )
    params = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    ttfts: dict[str, list[float]] = {name: [] for name in engines}
    for r in range(args.rounds + 1):  # (the first round warms up, untimed)
        prompt = torch.randint(0, 32000, (args.prompt,), generator=g).tolist()
        for name, llm in engines.items():
            m = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0].metrics
            if r:
                rates[name].append((args.new - 1) / (m.finished_time - m.first_token_time))
                ttfts[name].append(m.ttft)
    print(f"\n| {args.prompt}-token prompt, batch 1 | decode tok/s (median of {args.rounds}) | rounds | TTFT ms |")
    print("|---|---:|---|---:|")
    for name, v in rates.items():
        rounds = ", ".join(f"{x:.1f}" for x in v)
        print(f"| {name} | {statistics.median(v):.1f} | {rounds} | {1e3 * statistics.median(ttfts[name]):.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
