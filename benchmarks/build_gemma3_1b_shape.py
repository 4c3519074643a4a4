#!/usr/bin/env python3
"""Build a random-weight Gemma 3 text model of Gemma-3-1B's shape (hidden 1152, 26 layers, 4 query heads over 1 KV
head of 256, intermediate 6912, a window of 512 on five layers of six, rope bases 1e6 / 1e4), with the bench
tokenizer's 32000-token vocabulary instead of Gemma's 262144: 735M parameters in bf16, for `infertune bench
throughput --model DIR` against the peers (BENCHMARKS.md, "Gemma 2 / 3 in the fused decode step").

    python benchmarks/build_gemma3_1b_shape.py /tmp/gemma-bench/gemma3-1b-v32k
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the model folder to write")
    args = ap.parse_args()
    import transformers

    from infertune.bench.offline_models import make_tokenizer

    layers = 26
    kinds = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(layers)]
    cfg = transformers.Gemma3TextConfig(
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        layer_types=kinds,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        vocab_size=32000,
        max_position_embeddings=32768,
        tie_word_embeddings=True,
        hidden_activation="gelu_pytorch_tanh",
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).to(torch.bfloat16)
    with torch.no_grad():  # (the norms' w around 0, as trained Gemma checkpoints store them: the scale is 1 + w)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0, 0.1)
    model.save_pretrained(args.out)
    make_tokenizer(32000).save_pretrained(args.out)
    print(f"{args.out}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
