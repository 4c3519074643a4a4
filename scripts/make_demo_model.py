#!/usr/bin/env python3
"""Build infertune's built-in demo model from scratch, deterministically.

The demo model is a tiny Llama-architecture causal LM (about 1.3 M parameters,
about 5 MB in float32) trained on CPU for a few minutes on the Python source of
the standard library of the interpreter running this script. It exists so that
the engine, its tests and its benchmarks have a real Hugging Face-format model
(config.json + model.safetensors + tokenizer.json + chat template) that
needs no download. It is a test fixture that writes Python-looking text, not a
useful assistant.

Steps:
  1. collect the stdlib *.py files (sorted, test directories excluded) and
     split off a fixed ~2 % of files (chosen by a hash of their path) for
     validation;
  2. train a byte-level BPE tokenizer (vocab 4096) on the training split with
     the ``tokenizers`` library and wrap it as a PreTrainedTokenizerFast with
     a chat template;
  3. train a LlamaForCausalLM from scratch with plain PyTorch (AdamW,
     warm-up + cosine decay) on one CPU thread for a fixed number of steps;
  4. save everything with ``save_pretrained``, measure held-out perplexity,
     print greedy samples, and write a README.md model card next to the files.

Usage (from the repository root)::

    python scripts/make_demo_model.py            # writes infertune/assets/demo-model
    python scripts/make_demo_model.py --out /tmp/demo --steps 20   # quick smoke run

With the same Python standard library, the same library versions and the same
CPU, reruns produce the same tokenizer and the same weights.
"""

from __future__ import annotations

import os

# Pin every thread pool to a single thread *before* importing torch/tokenizers:
# the script must leave the machine's other core free, and a single thread
# keeps floating-point reductions in a fixed order (reproducible weights).
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"
os.environ["RAYON_RS_NUM_CPUS"] = "1"
os.environ["OMP_NUM_THREADS"] = "1"
os.environ["MKL_NUM_THREADS"] = "1"

import argparse
import hashlib
import json
import math
import platform
import sys
import sysconfig
import time
import tokenize
from pathlib import Path

import tokenizers
import torch
import torch.nn.functional as F
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from tqdm import tqdm
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

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
LR = 3e-3
MIN_LR_FRACTION = 0.1  # cosine decays to LR * 0.1
WARMUP_FRACTION = 0.05
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0
# Measured on the reference machine (2-core x86_64 VM, 1 torch thread): ~0.63 s/step
# (batch 16 x 256) on an otherwise idle core, so DEFAULT_STEPS takes ~9 minutes
# (longer if the core is shared). Hard-coded so reruns do the same work.
DEFAULT_STEPS = 850

MAX_VAL_SEQS = 300
EVAL_BATCH = 16
SAMPLE_PROMPTS = ["def ", "import "]
EXTRA_SAMPLE_PROMPTS = ["class ", "def __init__(self"]  # shown in the README only
SAMPLE_NEW_TOKENS = 40

MODEL_KW = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_act="silu",
    max_position_embeddings=1024,
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
)

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
    "config.json", "generation_config.json", "model.safetensors", "model.safetensors.index.json",
    "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json", "README.md",
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
        model_max_length=MODEL_KW["max_position_embeddings"],
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


# --------------------------------------------------------------------------- #
# Training / evaluation
# --------------------------------------------------------------------------- #
def lr_at(step: int, total: int) -> float:
    warmup = max(1, int(total * WARMUP_FRACTION))
    if step < warmup:
        return LR * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return LR * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model: LlamaForCausalLM, stream: torch.Tensor, steps: int, seed: int):
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=LR,
        betas=BETAS,
        eps=1e-8,
        foreach=False,
    )
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(SEQ_LEN + 1)
    model.train()
    losses: list[float] = []
    bar = tqdm(range(steps), desc="train", unit="step", dynamic_ncols=True, mininterval=1.0)
    for step in bar:
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps)
        starts = torch.randint(0, stream.numel() - SEQ_LEN - 1, (BATCH_SIZE,), generator=gen)
        batch = stream[starts[:, None] + offsets]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        logits = model(input_ids=inputs, use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP, foreach=False)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{opt.param_groups[0]['lr']:.2e}", refresh=False)
    bar.close()
    model.eval()
    return losses


@torch.no_grad()
def evaluate(model: LlamaForCausalLM, stream: torch.Tensor) -> tuple[float, int, int]:
    """Mean next-token cross-entropy (nats) over non-overlapping windows."""
    n_seqs = min(MAX_VAL_SEQS, (stream.numel() - 1) // SEQ_LEN)
    if n_seqs == 0:
        raise RuntimeError("validation split is too small")
    windows = torch.stack([stream[i * SEQ_LEN : i * SEQ_LEN + SEQ_LEN + 1] for i in range(n_seqs)])
    total, count = 0.0, 0
    for i in range(0, n_seqs, EVAL_BATCH):
        chunk = windows[i : i + EVAL_BATCH]
        logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
        total += F.cross_entropy(
            logits.reshape(-1, logits.size(-1)).double(), chunk[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += chunk[:, 1:].numel()
    return total / count, n_seqs, count


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


def write_readme(out: Path, info: dict) -> None:
    files = "\n".join(f"| `{name}` | {size:,} |" for name, size in info["files"])
    samples = "\n\n".join(
        f"Prompt `{json.dumps(p)}`:\n\n```text\n{s}\n```" for p, s in info["samples"].items()
    )
    text = f"""# infertune demo model

A tiny Llama-architecture causal language model that ships inside the
`infertune` package as its built-in default model, so that the engine, its
tests and its benchmarks have a real Hugging Face-format checkpoint without
any download. It was trained from scratch for a few minutes on one CPU thread
and writes Python-looking text. It is a **test fixture**, not a useful
language model or assistant: do not expect correct code or answers.

## Architecture

`LlamaForCausalLM` (transformers {info["transformers"]}), float32, {info["n_params"]:,} parameters
(tied input/output embeddings): hidden size 128, 4 layers, 4 attention heads,
2 key-value heads (GQA, head dim 32), MLP intermediate size 384 (SiLU),
vocabulary 4096, RoPE theta 10000, RMSNorm eps 1e-5, max positions 1024.
`bos_token_id` = `eos_token_id` = `pad_token_id` = {info["eot_id"]} (`<|endoftext|>`).

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
model saw them in training.

* training split: {info["n_train_files"]} files, {_fmt_bytes(info["train_bytes"])}, {info["train_tokens"]:,} tokens
* validation split: {info["n_val_files"]} files, {_fmt_bytes(info["val_bytes"])}, {info["val_tokens"]:,} tokens

The Python standard library is distributed under the **Python Software
Foundation License Version 2** (PSF-2.0; see `LICENSE.txt` in the Python
installation, "Copyright (c) 2001 Python Software Foundation; All Rights
Reserved"). This model is a derivative trained on that code and may
reproduce fragments of it.

## Training recipe

Plain PyTorch {info["torch"]} on CPU, `torch.set_num_threads(1)`, seed {info["seed"]}.
AdamW (betas {BETAS}, weight decay {WEIGHT_DECAY} on matrices), peak LR {LR},
linear warm-up over the first {int(WARMUP_FRACTION * 100)} % of steps then cosine decay to
{MIN_LR_FRACTION:g}x, gradient clipping {GRAD_CLIP}, {info["steps"]} steps of
{BATCH_SIZE} random windows of {SEQ_LEN} tokens from the packed training stream
(documents joined by `<|endoftext|>`), i.e. {info["steps"] * BATCH_SIZE * SEQ_LEN:,} training tokens.
Training took {info["train_seconds"] / 60:.1f} min wall-clock ({info["train_cpu_seconds"] / 60:.1f} min of CPU time) on
{info["machine"]}; final train loss
{info["final_loss"]:.3f} (mean of the last 20 steps: {info["final_loss_avg"]:.3f}).

## Evaluation

Held-out perplexity on {info["val_seqs"]} non-overlapping {SEQ_LEN}-token windows
({info["val_count"]:,} predicted tokens) of the validation split:

| | cross-entropy (nats/token) | perplexity |
|---|---|---|
| this model | {info["val_ce"]:.3f} | **{info["val_ppl"]:.1f}** |
| uniform baseline | ln(4096) = {math.log(VOCAB_SIZE):.3f} | 4096 |

## Greedy samples

`model.generate(..., max_new_tokens={SAMPLE_NEW_TOKENS}, do_sample=False)` on the reloaded
model. A prompt that ends in a space ends in a lone `Ġ` (space) token, a split the
byte-level pre-tokenizer rarely produces before a word (it attaches the space to
the next word), so such continuations often start with a second space.

{samples}

## Files

| file | bytes |
|---|---|
{files}

Total (excluding this README): {_fmt_bytes(info["total_bytes"])}.

## Regenerate

From the repository root:

```bash
{info["command"]}
```

The script is deterministic: with the same Python standard library, the same
versions of torch / transformers / tokenizers and the same CPU kind, it
produces the same tokenizer and the same weights. (Different CPUs or library
versions may change floating-point rounding and hence the weights slightly.)
"""
    (out / "README.md").write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------- #
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"output folder (default: {DEFAULT_OUT.relative_to(REPO_ROOT)})")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help=f"training steps (default: {DEFAULT_STEPS})")
    ap.add_argument("--seed", type=int, default=0, help="seed for init and batch sampling (default: 0)")
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    torch.use_deterministic_algorithms(True)
    transformers.logging.set_verbosity_error()

    # 1. corpus -----------------------------------------------------------------
    stdlib, train_docs, val_docs = collect_corpus()
    train_texts = [t for _, t in train_docs]
    val_texts = [t for _, t in val_docs]
    train_bytes = sum(len(t.encode("utf-8")) for t in train_texts)
    val_bytes = sum(len(t.encode("utf-8")) for t in val_texts)
    print(f"corpus: {stdlib}: {len(train_docs)} train files ({train_bytes / 1e6:.2f} MB), "
          f"{len(val_docs)} val files ({val_bytes / 1e6:.2f} MB)", flush=True)

    # 2. tokenizer ----------------------------------------------------------------
    t0 = time.perf_counter()
    tok = train_tokenizer(train_texts)
    eot_id = tok.token_to_id(EOT)
    train_stream = encode_stream(tok, train_texts, eot_id)
    val_stream = encode_stream(tok, val_texts, eot_id)
    print(f"tokenizer: vocab {tok.get_vocab_size()}, {train_stream.numel():,} train tokens, "
          f"{val_stream.numel():,} val tokens ({train_bytes / train_stream.numel():.2f} bytes/token), "
          f"{time.perf_counter() - t0:.0f}s", flush=True)
    probe = "def f(x):\n\treturn 'héllo wörld ✓ 🐍' + \"\\n\"  \r\n   # ünïcode\x00\n"
    assert tok.decode(tok.encode(probe).ids, skip_special_tokens=False) == probe, "byte-level round trip failed"
    hf_tok = wrap_tokenizer(tok)

    # 3. model ------------------------------------------------------------------------
    torch.manual_seed(args.seed)
    config = LlamaConfig(**MODEL_KW, bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id)
    model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(
        bos_token_id=eot_id, eos_token_id=eot_id, pad_token_id=eot_id, do_sample=False,
    )
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: LlamaForCausalLM, {n_params:,} parameters; training {args.steps} steps x "
          f"{BATCH_SIZE} x {SEQ_LEN} tokens on 1 thread", flush=True)

    t0, c0 = time.perf_counter(), time.process_time()
    losses = train(model, train_stream, args.steps, args.seed)
    train_seconds = time.perf_counter() - t0
    train_cpu_seconds = time.process_time() - c0
    final_avg = sum(losses[-20:]) / len(losses[-20:])
    print(f"trained in {train_seconds:.0f}s wall, {train_cpu_seconds:.0f}s CPU "
          f"({train_seconds / max(1, args.steps):.2f} s/step); "
          f"final loss {losses[-1]:.3f} (last-20 mean {final_avg:.3f})", flush=True)

    # 4. save ---------------------------------------------------------------------------
    out: Path = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for name in STALE_FILES:  # no leftovers from an earlier recipe; other files are left alone
        (out / name).unlink(missing_ok=True)
    model.save_pretrained(out)
    hf_tok.save_pretrained(out)
    # Portability: transformers 5 records tokenizer_class "TokenizersBackend", the extra
    # special tokens as "extra_special_tokens" and the chat template only in
    # chat_template.jinja, none of which transformers 4.x reads. Add the 4.x spellings
    # ("PreTrainedTokenizerFast" is the same class under its 4.x name; 5.x accepts it).
    cfg_path = out / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_cfg.setdefault("additional_special_tokens", SPECIAL_TOKENS[1:])
    tok_cfg.setdefault("chat_template", CHAT_TEMPLATE)
    cfg_path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    # reload exactly as a user would, and check the round trips
    tok2 = AutoTokenizer.from_pretrained(out)
    model2 = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert tok2("def main():").input_ids == tok.encode("def main():").ids, "reloaded tokenizer adds tokens"
    assert tok2.decode(tok2(probe).input_ids) == probe, "reloaded tokenizer does not round-trip"
    chat = tok2.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}],
        tokenize=False, add_generation_prompt=True,
    )
    assert chat == "<|system|>\nS<|end|>\n<|user|>\nU<|end|>\n<|assistant|>\nA<|end|>\n<|assistant|>\n", repr(chat)
    chat_ids = tok2.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    if isinstance(chat_ids, dict) or hasattr(chat_ids, "keys"):
        chat_ids = chat_ids["input_ids"]
    assert chat_ids[0] == tok.token_to_id("<|user|>"), chat_ids
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert torch.equal(a, b), "reloaded weights differ"

    # 5. evaluate + samples -------------------------------------------------------------------
    val_ce, val_seqs, val_count = evaluate(model2, val_stream)
    val_ppl = math.exp(val_ce)
    print(f"held-out: cross-entropy {val_ce:.4f} nats/token, perplexity {val_ppl:.2f} "
          f"(uniform baseline: ln({VOCAB_SIZE}) = {math.log(VOCAB_SIZE):.4f}, perplexity {VOCAB_SIZE}) "
          f"on {val_seqs} x {SEQ_LEN} tokens", flush=True)
    samples = {}
    for prompt in SAMPLE_PROMPTS + EXTRA_SAMPLE_PROMPTS:
        samples[prompt] = greedy(model2, tok2, prompt)
        if prompt in SAMPLE_PROMPTS:
            print(f"--- greedy sample, prompt {prompt!r}:\n{samples[prompt]}\n---", flush=True)

    for name in os.listdir(out):  # safetensors writes 0600; package data should be world-readable
        if (out / name).is_file():
            os.chmod(out / name, 0o644)
    files = sorted((p.name, p.stat().st_size) for p in out.iterdir() if p.is_file())
    total_bytes = sum(s for _, s in files)
    cmd_args = ["python", "scripts/make_demo_model.py"]
    if out != DEFAULT_OUT.resolve():
        cmd_args += ["--out", str(args.out)]
    if args.steps != DEFAULT_STEPS:
        cmd_args += ["--steps", str(args.steps)]
    if args.seed != 0:
        cmd_args += ["--seed", str(args.seed)]
    write_readme(out, dict(
        transformers=transformers.__version__, tokenizers=tokenizers.__version__, torch=torch.__version__,
        python=platform.python_version(), machine=_cpu_name(), train_cpu_seconds=train_cpu_seconds,
        n_params=n_params, eot_id=eot_id, seed=args.seed, steps=args.steps,
        n_train_files=len(train_docs), n_val_files=len(val_docs), train_bytes=train_bytes, val_bytes=val_bytes,
        train_tokens=train_stream.numel(), val_tokens=val_stream.numel(),
        train_seconds=train_seconds, final_loss=losses[-1], final_loss_avg=final_avg,
        val_ce=val_ce, val_ppl=val_ppl, val_seqs=val_seqs, val_count=val_count,
        samples=samples, files=files, total_bytes=total_bytes, command=" ".join(cmd_args),
    ))
    total_with_readme = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    sha = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    print(f"wrote {out} ({total_with_readme / 1e6:.2f} MB, {len(files) + 1} files); "
          f"model.safetensors sha256 {sha[:16]}; total {time.perf_counter() - t_start:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
