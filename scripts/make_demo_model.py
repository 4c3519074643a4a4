#!/usr/bin/env python3
"""Build infertune's built-in demo model from scratch, deterministically: a teacher, then a distilled student.

The built-in model is a small Llama-architecture causal LM (about 1.3 M parameters, about 5 MB in float32)
that ships inside the package, so that the demo, the server's default, the benchmarks and the quantization
accuracy checks run on a model that has learned something, with no download. It writes Python-looking text.

Steps (each one the public tool a user would run):
  1. collect the *.py files of the running interpreter's standard library (sorted, tests excluded) and hold out
     a fixed ~2 % of whole files (chosen by a hash of their path) for validation; both splits are written under
     --work as plain files;
  2. train a byte-level BPE tokenizer (vocab 4096) on the training split with the ``tokenizers`` library and
     wrap it as a PreTrainedTokenizerFast with a chat template;
  3. ``infertune train``: a 5.8 M-parameter teacher (hidden 256, 6 layers) from scratch with cross-entropy;
  4. ``infertune distill``: the 1.3 M-parameter student (``--student-config small``) from that teacher with
     loss = 0.7 * T^2 * KL(teacher/T || student/T) + 0.3 * cross-entropy, T = 4;
  5. copy the student into infertune/assets/demo-model, check it reloads in transformers and infertune with the
     same greedy tokens, and write its model card (README.md) with the measured numbers.

Usage (from the repository root)::

    python scripts/make_demo_model.py                       # writes infertune/assets/demo-model (~1 h here)
    python scripts/make_demo_model.py --out /tmp/demo --teacher-steps 4 --student-steps 4   # smoke run

With the same Python standard library, the same library versions, the same thread count and the same CPU kind,
reruns produce the same tokenizer and the same weights.
"""

from __future__ import annotations

import os

# Pin the tokenizer's thread pool before importing tokenizers (a fixed merge order); torch uses THREADS threads,
# set explicitly here and in the training commands (a fixed thread count keeps reductions in a fixed order).
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["RAYON_RS_NUM_CPUS"] = "1"

import argparse
import hashlib
import json
import math
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
import tokenize
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "infertune" / "assets" / "demo-model"

# --------------------------------------------------------------------------- #
# Fixed recipe. Changing any of these changes the produced model.
# --------------------------------------------------------------------------- #
VOCAB_SIZE = 4096
EOT = "<|endoftext|>"
SPECIAL_TOKENS = [EOT, "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

MAX_CORPUS_BYTES = 24_000_000  # cap on the training text (stdlib is ~11 MB, so all of it)
VAL_FRACTION = 0.02  # ~2 % of the text (whole files, chosen by path hash) is held out

SEQ_LEN = 256
BATCH_SIZE = 16
THREADS = 2
# Measured on the reference machine (2-core x86_64 VM, 2 torch threads, otherwise idle): the teacher takes
# ~1.3 s/step and distillation ~0.8 s/step at batch 16 x 256. Hard-coded so reruns do the same work.
TEACHER_STEPS = 1200
TEACHER_LR = 2e-3
STUDENT_STEPS = 1500
STUDENT_LR = 3e-3
TEMPERATURE = 4.0
ALPHA = 0.7

MAX_VAL_SEQS = 10_000  # every held-out window
SAMPLE_PROMPTS = ["def ", "import "]
EXTRA_SAMPLE_PROMPTS = ["class ", "def __init__(self"]  # shown in the README only
SAMPLE_NEW_TOKENS = 40

# The teacher; the student is `infertune distill --student-config small` (hidden 128, 4 layers, 4 heads, 2 KV
# heads, MLP 384, tied embeddings).
TEACHER_KW = dict(
    model_type="llama",
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    hidden_act="silu",
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
)
MAX_POSITIONS = 1024

# Renders system/user/assistant messages as
#   <|role|>\n{content}<|end|>\n
# and appends "<|assistant|>\n" when add_generation_prompt is true.
# Content may be a plain string or a list of {"type": "text", "text": ...} parts.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('Only system, user and assistant roles are supported, got: ' + message['role']) -}}"
    "{%- endif -%}"
    "{%- if message['content'] is string -%}"
    "{%- set content = message['content'] -%}"
    "{%- else -%}"
    "{%- set content = namespace(text='') -%}"
    "{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'text' -%}{%- set content.text = content.text + part['text'] -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- set content = content.text -%}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' + content + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

# Files save_pretrained may write (in this or other transformers versions);
# removed from --out before saving so the folder holds exactly one model.
STALE_FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "README.md",
]

# Directories (path components) that hold tests, IDLE, or non-stdlib code.
EXCLUDED_DIRS = {"test", "tests", "idle_test", "idlelib", "site-packages", "dist-packages", "__pycache__"}


# --------------------------------------------------------------------------- #
# Corpus
# --------------------------------------------------------------------------- #
def _excluded(rel: Path) -> bool:
    parts = rel.parts
    if any(p in EXCLUDED_DIRS for p in parts[:-1]):
        return True
    if parts[0].startswith("config-"):  # build/Makefile helpers, not library code
        return True
    if rel.name.startswith("_sysconfigdata"):  # machine-specific build paths
        return True
    return False


def _read_source(path: Path) -> str:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        with tokenize.open(path) as fh:  # honours PEP 263 coding cookies
            text = fh.read()
    return text.replace("\r\n", "\n")


def _path_hash(rel: str) -> int:
    return int.from_bytes(hashlib.sha256(rel.encode("utf-8")).digest()[:8], "big")


def collect_corpus():
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p.relative_to(stdlib).as_posix(), p)
        for p in stdlib.rglob("*.py")
        if p.is_file() and not _excluded(p.relative_to(stdlib))
    )
    docs = [(rel, _read_source(path)) for rel, path in files]
    docs = [(rel, text) for rel, text in docs if text.strip()]
    # Validation: walk the files in order of sha256(relative path) (a fixed pseudo-random
    # order, spread over the whole library), holding out each file that still fits in
    # VAL_FRACTION of the total text.
    budget = VAL_FRACTION * sum(len(text.encode("utf-8")) for _, text in docs)
    val_names, val_bytes = set(), 0
    for rel, text in sorted(docs, key=lambda d: _path_hash(d[0])):
        size = len(text.encode("utf-8"))
        if val_bytes + size <= budget:
            val_names.add(rel)
            val_bytes += size
    train, val = [], []
    train_bytes = 0
    for rel, text in docs:  # sorted path order
        if rel in val_names:
            val.append((rel, text))
        elif train_bytes < MAX_CORPUS_BYTES:
            train.append((rel, text))
            train_bytes += len(text.encode("utf-8"))
    return stdlib, train, val


# --------------------------------------------------------------------------- #
# Tokenizer
# --------------------------------------------------------------------------- #
def train_tokenizer(texts: list[str]) -> Tokenizer:
    tok = Tokenizer(models.BPE())  # no unk token: byte-level covers every input
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)  # adds no BOS/EOS
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOT,
        eos_token=EOT,
        pad_token=EOT,
        unk_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
        model_max_length=MAX_POSITIONS,
        padding_side="left",
        model_input_names=["input_ids", "attention_mask"],  # no token_type_ids
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def encode_stream(tok: Tokenizer, texts: list[str], eot_id: int) -> torch.Tensor:
    """Token ids of all documents, each followed by <|endoftext|>."""
    ids: list[int] = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(eot_id)
    return torch.tensor(ids, dtype=torch.long)


@torch.no_grad()
def greedy(model, tokenizer, prompt: str) -> str:
    enc = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=SAMPLE_NEW_TOKENS, do_sample=False)
    return tokenizer.decode(out[0], skip_special_tokens=False)


# --------------------------------------------------------------------------- #
# README
# --------------------------------------------------------------------------- #
def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip() + f", {platform.machine()}"
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def _fmt_bytes(n: int) -> str:
    return f"{n / 1e6:.2f} MB ({n:,} bytes)"


def _row(name: str, rep: dict, key: str) -> str:
    speed = rep.get(f"{key}_speed") or {}
    tps = f"{speed['tokens_per_s']:.0f}" if "tokens_per_s" in speed else "n/a"
    return (
        f"| {name} | {rep[key + '_params']:,} | {rep[key + '_ppl']:.2f} | {math.log(rep[key + '_ppl']):.3f} | {tps} |"
    )


def write_readme(out: Path, info: dict) -> None:
    files = "\n".join(f"| `{name}` | {size:,} |" for name, size in info["files"])
    samples = "\n\n".join(f"Prompt `{json.dumps(p)}`:\n\n```text\n{s}\n```" for p, s in info["samples"].items())
    t, st = info["teacher"], info["student"]
    text = f"""# infertune demo model

A small Llama-architecture causal language model that ships inside the
`infertune` package as its built-in default model, so that the demo, the
server's default, the benchmarks and the quantization accuracy checks have a
real Hugging Face-format checkpoint without any download. It is a **student
distilled** by `infertune distill` from a larger teacher that `infertune train`
trained from scratch, both on CPU on this machine, on the Python standard
library. It writes Python-looking text. It is a demo and test model, not a
useful language model or assistant: do not expect correct code or answers.

## Architecture

`LlamaForCausalLM` (transformers {info["transformers"]}), float32, {info["n_params"]:,} parameters
(tied input/output embeddings): hidden size 128, 4 layers, 4 attention heads,
2 key-value heads (GQA, head dim 32), MLP intermediate size 384 (SiLU),
vocabulary 4096, RoPE theta 10000, RMSNorm eps 1e-5, max positions {MAX_POSITIONS}.
`bos_token_id` = `eos_token_id` = `pad_token_id` = {info["eot_id"]} (`<|endoftext|>`).

The teacher (not shipped; rebuilt by the command below): the same tokenizer,
hidden size 256, 6 layers, 8 heads, 4 key-value heads, MLP 768, tied
embeddings, {t["student_parameters"]:,} parameters.

## Tokenizer

Byte-level BPE trained with `tokenizers` {info["tokenizers"]} on the training
split (ByteLevel pre-tokenizer and decoder, so any UTF-8 text round-trips
exactly), vocabulary 4096. Special tokens: `<|endoftext|>` (id {info["eot_id"]}; bos, eos
and pad), `<|system|>`, `<|user|>`, `<|assistant|>`, `<|end|>`. No BOS/EOS is
added automatically when encoding. The chat template renders each message as
`<|role|>\\n{{content}}<|end|>\\n` (roles: system, user, assistant) and
`add_generation_prompt=True` appends `<|assistant|>\\n`.

## Training data and licence

The `*.py` files of the Python {info["python"]} standard library found at
`sysconfig.get_paths()["stdlib"]` on the build machine, in sorted path order,
excluding `test/`, `tests/`, `idle_test/`, `idlelib/`, `site-packages/`,
`config-*/` and `_sysconfigdata*` (machine-specific). Whole files, taken in order of `sha256(relative path)` while they fit
in 2 % of the text, are held out for validation; neither the tokenizer nor the
models saw them in training.

* training split: {info["n_train_files"]} files, {_fmt_bytes(info["train_bytes"])}, {info["train_tokens"]:,} tokens
* validation split: {info["n_val_files"]} files, {_fmt_bytes(info["val_bytes"])}, {info["val_tokens"]:,} tokens

The Python standard library is distributed under the **Python Software
Foundation License Version 2** (PSF-2.0; see `LICENSE.txt` in the Python
installation, "Copyright (c) 2001 Python Software Foundation; All Rights
Reserved"). This model is a derivative trained on that code and may
reproduce fragments of it.

## Training recipe

PyTorch {info["torch"]} on CPU, {THREADS} threads, seed {info["seed"]}; AdamW (betas (0.9, 0.95), weight decay 0.1 on
matrices), linear warm-up over the first 5 % of steps then cosine decay to 0.1x, gradient clipping 1.0,
batches of {BATCH_SIZE} random windows of {SEQ_LEN} tokens from the packed training stream (documents joined by
`<|endoftext|>`).

1. Teacher: `infertune train`, cross-entropy, {t["steps_done"]} steps at peak LR {TEACHER_LR:g}
   ({t["steps_done"] * BATCH_SIZE * SEQ_LEN:,} tokens), {t["train_seconds"] / 60:.1f} min.
2. Student: `infertune distill`, loss = {ALPHA:g} * T^2 * KL(softmax(teacher/T) || softmax(student/T)) +
   {1 - ALPHA:g} * cross-entropy with T = {TEMPERATURE:g}, {st["steps_done"]} steps at peak LR {STUDENT_LR:g}
   ({st["steps_done"] * BATCH_SIZE * SEQ_LEN:,} tokens), {st["train_seconds"] / 60:.1f} min.

The whole command took {info["total_seconds"] / 60:.1f} min wall-clock on {info["machine"]}.

## Evaluation

Held-out perplexity on {st["eval_tokens"]:,} predicted tokens ({SEQ_LEN}-token non-overlapping windows of the
validation split); generation speed is greedy decoding with infertune on this CPU (4 prompts x 64 tokens,
batch 4):

| model | parameters | perplexity | cross-entropy (nats/token) | tokens/s |
|---|---|---|---|---|
{_row("teacher", info["table"], "teacher")}
{_row("**student (this model)**", info["table"], "student")}
| uniform baseline | | 4096 | {math.log(VOCAB_SIZE):.3f} | |

## Greedy samples

`model.generate(..., max_new_tokens={SAMPLE_NEW_TOKENS}, do_sample=False)` with transformers on the shipped
files (infertune gives the same tokens; the build checks it). A prompt that ends in a space ends in a lone `Ġ`
(space) token, a split the byte-level pre-tokenizer rarely produces before a word, so such continuations often
start with a second space.

{samples}

## Files

| file | bytes |
|---|---|
{files}

Total (excluding this README): {_fmt_bytes(info["total_bytes"])}.

## Regenerate

From the repository root (intermediate files, the teacher included, go to `--work`):

```bash
{info["command"]}
```

The two training steps it runs, spelled out:

```bash
{info["train_command"]}
{info["distill_command"]}
```

The script is deterministic: with the same Python standard library, the same
versions of torch / transformers / tokenizers, the same thread count and the same CPU kind, it
produces the same tokenizer and the same weights. (Different CPUs or library
versions may change floating-point rounding and hence the weights slightly.)
"""
    (out / "README.md").write_text(text, encoding="utf-8")


def _run_tool(argv: list[str]) -> dict:
    """Run an `infertune` subcommand in a child process (as a user would) and return its training report."""
    print("$ infertune " + " ".join(argv), flush=True)
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    subprocess.run([sys.executable, "-m", "infertune", *argv], check=True, env=env)
    out = Path(argv[argv.index("--out") + 1])
    return json.loads((out / "training_report.json").read_text(encoding="utf-8"))


def _shell(argv: list[str]) -> str:
    return "infertune " + " ".join(shlex.quote(a) for a in argv)


# --------------------------------------------------------------------------- #
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT.relative_to(REPO_ROOT)})"
    )
    ap.add_argument(
        "--work",
        type=Path,
        default=REPO_ROOT / "build" / "demo-model",
        help="folder for the corpus, tokenizer, teacher and checkpoints (default: build/demo-model)",
    )
    ap.add_argument(
        "--teacher-steps", type=int, default=TEACHER_STEPS, help=f"teacher steps (default: {TEACHER_STEPS})"
    )
    ap.add_argument(
        "--student-steps", type=int, default=STUDENT_STEPS, help=f"student steps (default: {STUDENT_STEPS})"
    )
    ap.add_argument("--seed", type=int, default=0, help="seed for init and batch sampling (default: 0)")
    ap.add_argument("--resume", action="store_true", help="continue interrupted training from --work's checkpoints")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    torch.set_num_threads(THREADS)
    transformers.logging.set_verbosity_error()
    work: Path = args.work.resolve()
    out: Path = args.out.resolve()

    # 1. corpus -----------------------------------------------------------------
    stdlib, train_docs, val_docs = collect_corpus()
    train_texts = [t for _, t in train_docs]
    val_texts = [t for _, t in val_docs]
    train_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    val_bytes = sum(len(t.encode("utf-8")) for t in val_texts)
    print(
        f"corpus: {stdlib}: {len(train_docs)} train files ({train_bytes / 1e6:.2f} MB), "
        f"{len(val_docs)} val files ({val_bytes / 1e6:.2f} MB)",
        flush=True,
    )
    for split, docs in (("train", train_docs), ("val", val_docs)):
        root = work / "corpus" / split
        if root.exists():
            shutil.rmtree(root)
        for rel, text in docs:
            dest = root / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(text, encoding="utf-8")

    # 2. tokenizer ----------------------------------------------------------------
    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts)
    eot_id = tok.token_to_id(EOT)
    train_tokens = encode_stream(tok, train_texts, eot_id).numel()
    val_tokens = encode_stream(tok, val_texts, eot_id).numel()
    print(
        f"tokenizer: vocab {tok.get_vocab_size()}, {train_tokens:,} train tokens, {val_tokens:,} val tokens "
        f"({train_bytes / train_tokens:.2f} bytes/token), {time.perf_counter() - t0:.0f}s",
        flush=True,
    )
    probe = "def f(x):\n\treturn 'héllo wörld ✓ 🐍' + \"\\n\"  \r\n   # ünïcode\x00\n"
    assert tok.decode(tok.encode(probe).ids, skip_special_tokens=False) == probe, "byte-level round trip failed"
    tok_dir = work / "tokenizer"
    tok_dir.mkdir(parents=True, exist_ok=True)
    wrap_tokenizer(tok).save_pretrained(tok_dir)
    # Portability: transformers 5 records tokenizer_class "TokenizersBackend", the extra special tokens as
    # "extra_special_tokens" and the chat template only in chat_template.jinja, none of which transformers 4.x
    # reads. Add the 4.x spellings ("PreTrainedTokenizerFast" is the same class under its 4.x name).
    cfg_path = tok_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg.setdefault("additional_special_tokens", SPECIAL_TOKENS[1:])
    tok_cfg.setdefault("chat_template", CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    teacher_cfg = work / "teacher-config.json"
    teacher_cfg.write_text(json.dumps(TEACHER_KW, indent=2) + "\n", encoding="utf-8")

    # 3. teacher, 4. student --------------------------------------------------------------
    common = [
        "--data",
        str(work / "corpus" / "train"),
        "--val-data",
        str(work / "corpus" / "val"),
        "--batch",
        str(BATCH_SIZE),
        "--seq-len",
        str(SEQ_LEN),
        "--seed",
        str(args.seed),
        "--eval-windows",
        str(MAX_VAL_SEQS),
        "--threads",
        str(THREADS),
        "--save-every",
        "100",
    ]
    resume = ["--resume"] if args.resume else []
    train_argv = [
        "train",
        "--tokenizer",
        str(tok_dir),
        "--model-config",
        str(teacher_cfg),
        *common,
        "--steps",
        str(args.teacher_steps),
        "--lr",
        str(TEACHER_LR),
        "--out",
        str(work / "teacher"),
        *resume,
    ]
    teacher_rep = _run_tool(train_argv)
    distill_argv = [
        "distill",
        "--teacher",
        str(work / "teacher"),
        "--student-config",
        "small",
        *common,
        "--temperature",
        str(TEMPERATURE),
        "--alpha",
        str(ALPHA),
        "--steps",
        str(args.student_steps),
        "--lr",
        str(STUDENT_LR),
        "--out",
        str(work / "student"),
        *resume,
    ]
    student_rep = _run_tool(distill_argv)

    # 5. ship the student ---------------------------------------------------------------------
    out.mkdir(parents=True, exist_ok=True)
    for name in STALE_FILES:  # no leftovers from an earlier recipe; other files are left alone
        (out / name).unlink(missing_ok=True)
    for p in sorted((work / "student").iterdir()):
        if p.is_file() and p.name != "training_report.json":
            shutil.copy2(p, out / p.name)

    # reload exactly as a user would, and check the round trips
    tok2 = AutoTokenizer.from_pretrained(out)
    model2 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert tok2("def main():").input_ids == tok.encode("def main():").ids, "reloaded tokenizer adds tokens"
    assert tok2.decode(tok2(probe).input_ids) == probe, "reloaded tokenizer does not round-trip"
    chat = tok2.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert chat == "<|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\nA<|end|>\n<|assistant|>\n", repr(chat)
    n_params = sum(p.numel() for p in model2.parameters())

    from infertune import LLM, SamplingParams

    llm = LLM(str(out), dtype="float32")
    samples = {}
    for prompt in SAMPLE_PROMPTS + EXTRA_SAMPLE_PROMPTS:
        samples[prompt] = greedy(model2, tok2, prompt)
        ours = (
            llm.generate(
                prompt, SamplingParams(temperature=0, max_tokens=SAMPLE_NEW_TOKENS, ignore_eos=True), use_tqdm=False
            )[0]
            .outputs[0]
            .token_ids
        )
        hf_ids = tok2(prompt).input_ids
        ref = model2.generate(
            torch.tensor([hf_ids]), max_new_tokens=SAMPLE_NEW_TOKENS, do_sample=False, min_new_tokens=SAMPLE_NEW_TOKENS
        )[0, len(hf_ids) :].tolist()
        assert list(ours) == ref, f"infertune and transformers disagree on {prompt!r}"
        if prompt in SAMPLE_PROMPTS:
            print(f"--- greedy sample, prompt {prompt!r}:\n{samples[prompt]}\n---", flush=True)

    for name in os.listdir(out):  # safetensors writes 0600; package data should be world-readable
        if (out / name).is_file():
            os.chmod(out / name, 0o644)
    (out / "README.md").unlink(missing_ok=True)
    files = sorted((p.name, p.stat().st_size) for p in out.iterdir() if p.is_file())
    total_bytes = sum(s for _, s in files)
    cmd_args = ["python", "scripts/make_demo_model.py"]
    if out != DEFAULT_OUT.resolve():
        cmd_args += ["--out", str(args.out)]
    if args.teacher_steps != TEACHER_STEPS:
        cmd_args += ["--teacher-steps", str(args.teacher_steps)]
    if args.student_steps != STUDENT_STEPS:
        cmd_args += ["--student-steps", str(args.student_steps)]
    if args.seed != 0:
        cmd_args += ["--seed", str(args.seed)]
    table = {
        "teacher_params": teacher_rep["student_parameters"],
        "teacher_ppl": student_rep["teacher_ppl"],
        "teacher_speed": student_rep.get("teacher_speed"),
        "student_params": student_rep["student_parameters"],
        "student_ppl": student_rep["student_ppl"],
        "student_speed": student_rep.get("student_speed"),
    }

    def rel(p):
        return os.path.relpath(p, REPO_ROOT) if str(p).startswith(str(REPO_ROOT)) else str(p)

    write_readme(
        out,
        dict(
            transformers=transformers.__version__,
            tokenizers=tokenizers.__version__,
            torch=torch.__version__,
            python=platform.python_version(),
            machine=_cpu_name(),
            n_params=n_params,
            eot_id=eot_id,
            seed=args.seed,
            n_train_files=len(train_docs),
            n_val_files=len(val_docs),
            train_bytes=train_bytes,
            val_bytes=val_bytes,
            train_tokens=train_tokens,
            val_tokens=val_tokens,
            teacher=teacher_rep,
            student=student_rep,
            table=table,
            samples=samples,
            files=files,
            total_bytes=total_bytes,
            command=" ".join(cmd_args),
            total_seconds=time.perf_counter() - t_start,
            train_command=_shell([rel(a) for a in train_argv]),
            distill_command=_shell([rel(a) for a in distill_argv]),
        ),
    )
    sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    print(
        f"held-out perplexity: teacher {table['teacher_ppl']:.2f}, student {table['student_ppl']:.2f} "
        f"(uniform {VOCAB_SIZE})",
        flush=True,
    )
    print(
        f"wrote {out} ({(total_bytes + (out / 'README.md').stat().st_size) / 1e6:.2f} MB); "
        f"model.safetensors sha256 {sha[:16]}; total {time.perf_counter() - t_start:.0f}s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
