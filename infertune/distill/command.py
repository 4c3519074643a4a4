"""``infertune distill`` and ``infertune train``.

Wire into cli.py (the tools loop takes objects with add_arguments / run):
    from infertune.distill import command as distill_command
    ("distill", distill_command, "distil a teacher into a small student (KD loss, checkpoints, resume)",
     distill_command.DESCRIPTION),
    ("train", distill_command.TRAIN, "train a model from scratch with cross-entropy (same data pipeline)",
     distill_command.TRAIN_DESCRIPTION),
Exit status: 0; 2 on a usage error (raised as ValueError and printed by cli.main).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

from infertune.files import add_json_flag, check_writable, emit_json

DESCRIPTION = (
    "Distil a teacher into a small student: loss = alpha * T^2 * KL(softmax(teacher/T) || softmax(student/T)) "
    "+ (1 - alpha) * cross-entropy, with AdamW and warm-up + cosine LR, checkpoints (--save-every) and --resume. "
    "Writes a Hugging Face folder (safetensors + the teacher's tokenizer) to --out and reports teacher and student "
    "held-out perplexity and greedy tokens/s."
)
TRAIN_DESCRIPTION = (
    "Train a causal LM from scratch with plain cross-entropy on the same data pipeline as `distill` (e.g. the "
    "teacher a later `distill` uses). Writes a Hugging Face folder to --out and reports held-out perplexity."
)


def _common(p: argparse.ArgumentParser, model_flag: str) -> None:
    p.add_argument(
        "--data",
        required=True,
        metavar="FILE|DIR",
        help='a text file, a .jsonl file ({"text": ...} per line) or a directory of .py / .txt files',
    )
    p.add_argument(
        model_flag,
        default="small",
        metavar="small|CONFIG.json",
        help="model to train: 'small' (Llama, hidden 128, 4 layers, 4 heads, 2 KV heads, MLP 384, tied "
        "embeddings, the tokenizer's vocabulary) or a config.json (default: small)",
    )
    p.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    p.add_argument("--batch", type=int, default=8, help="sequences per step (default: 8)")
    p.add_argument("--seq-len", type=int, default=128, help="tokens per sequence (default: 128)")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default: 3e-3)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on matrices (default: 0.1)")
    p.add_argument("--seed", type=int, default=0, help="initialization and batch-order seed (default: 0)")
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="output folder (HF format; checkpoints/ inside); an earlier run there is replaced, said so, unless --resume",
    )
    p.add_argument(
        "--save-every",
        type=int,
        default=100,
        help="checkpoint every N steps; 0: only at the end (or at --stop-after) (default: 100)",
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument(
        "--stop-after",
        type=int,
        default=None,
        metavar="STEP",
        help="stop after this step with a checkpoint (continue later with --resume)",
    )
    p.add_argument(
        "--val-fraction", type=float, default=0.05, help="held-out share of documents, in [0, 1) (default: 0.05)"
    )
    p.add_argument(
        "--val-data",
        default=None,
        metavar="FILE|DIR",
        help="held-out documents for perplexity (same formats as --data); then all of --data is trained "
        "on (default: hold out --val-fraction of --data by file-name hash)",
    )
    p.add_argument("--eval-windows", type=int, default=64, help="held-out windows for perplexity (default: 64)")
    p.add_argument(
        "--speed-tokens",
        type=int,
        default=64,
        help="greedy tokens per prompt for the tokens/s measure; 0 skips it (default: 64)",
    )
    p.add_argument("--device", default="cpu", help="torch device for training (default: cpu)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_json_flag(p, "the training report (losses, perplexities, speeds, settings)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--teacher", required=True, metavar="DIR", help="teacher model folder (HF format, with tokenizer)")
    _common(p, "--student-config")
    p.add_argument("--temperature", type=float, default=4.0, help="softmax temperature T (default: 4.0)")
    p.add_argument("--alpha", type=float, default=0.7, help="weight of the soft (KL) term (default: 0.7)")


def add_train_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokenizer", required=True, metavar="DIR", help="folder holding the tokenizer to train with")
    _common(p, "--model-config")


def _config(args: argparse.Namespace, teacher: bool):
    from infertune.distill.trainer import TrainConfig

    return TrainConfig(
        data=args.data,
        out=args.out,
        teacher=args.teacher if teacher else None,
        tokenizer=None if teacher else args.tokenizer,
        student_config=args.student_config if teacher else args.model_config,
        temperature=args.temperature if teacher else 1.0,
        alpha=args.alpha if teacher else 0.0,
        steps=args.steps,
        batch=args.batch,
        seq_len=args.seq_len,
        lr=args.lr,
        weight_decay=args.weight_decay,
        seed=args.seed,
        save_every=args.save_every,
        resume=args.resume,
        stop_after=args.stop_after,
        val_fraction=args.val_fraction,
        val_data=args.val_data,
        eval_windows=args.eval_windows,
        speed_tokens=args.speed_tokens,
        device=args.device,
        progress=not args.no_progress,
    )


def _run(args: argparse.Namespace, teacher: bool) -> int:
    import torch

    from infertune.distill.trainer import format_report, run_training

    config = _config(args, teacher)  # (its values are checked before anything is loaded)
    check_writable("--json", args.json, make_parents=True)
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    report = run_training(config)
    print(format_report(report), flush=True)
    if "student_ppl" in report:
        print(f"wrote {args.out}", flush=True)
    emit_json(args.json, report, indent=2)
    return 0


def run(args: argparse.Namespace) -> int:
    return _run(args, teacher=True)


def run_train(args: argparse.Namespace) -> int:
    return _run(args, teacher=False)


TRAIN = SimpleNamespace(add_arguments=add_train_arguments, run=run_train)
