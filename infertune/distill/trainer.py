"""Training loop shared by ``infertune distill`` (KD from a teacher) and ``infertune train`` (alpha = 0, no teacher).

Checkpoints go to ``OUT/checkpoints/step-NNNNNNN.pt`` (model, optimizer, step, loss history, torch / python RNG
states); the two newest are kept. ``resume=True`` continues from the newest. The final model is written to OUT with
``save_pretrained`` (safetensors) next to a copy of the tokenizer files, plus ``training_report.json``.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from infertune.config import ArchConfig
from infertune.distill.data import Corpus, build_corpus
from infertune.distill.loss import kd_loss
from infertune.files import check_writable_folder

MIN_LR_FRACTION = 0.1
WARMUP_FRACTION = 0.05
BETAS = (0.9, 0.95)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)

SMALL = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    hidden_act="silu",
    rope_theta=10000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    initializer_range=0.02,
    attention_bias=False,
    mlp_bias=False,
)


@dataclass
class TrainConfig:
    data: str
    out: str
    teacher: str | None = None  # None: plain training (alpha must be 0)
    tokenizer: str | None = None  # defaults to the teacher folder
    student_config: str = "small"  # "small" or a config.json path
    temperature: float = 4.0
    alpha: float = 0.7
    steps: int = 200
    batch: int = 8
    seq_len: int = 128
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 100
    resume: bool = False
    stop_after: int | None = None  # stop (with a checkpoint) after this step; None = run to `steps`
    val_fraction: float = 0.05
    val_data: str | None = None  # explicit held-out documents (else split --data by file hash)
    eval_windows: int = 64
    speed_tokens: int = 64  # greedy tokens per prompt for the tokens/s measure; 0 skips it
    device: str = "cpu"
    progress: bool = True
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        """A value no run can use is refused here, before the teacher, the data or a step (a negative --lr once
        failed inside the optimizer, --lr 0 trained nothing, --eval-windows 0 reported perplexity nan, a negative
        --val-fraction or --speed-tokens passed silently)."""
        at_least = dict(steps=1, batch=1, seq_len=2, eval_windows=1)
        for name, low in at_least.items():
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        for name in ("speed_tokens", "save_every", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr}")
        if not self.temperature > 0:
            raise ValueError(f"--temperature must be > 0, got {self.temperature}")
        if not 0.0 <= self.alpha <= 1.0:
            raise ValueError(f"--alpha must be in [0, 1], got {self.alpha}")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"--val-fraction must be in [0, 1), got {self.val_fraction}")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"--stop-after must be >= 1, got {self.stop_after}")
        try:  # (a device torch cannot use failed after the teacher loaded: an AssertionError traceback for cuda)
            torch.empty(0, device=self.device)
        except (RuntimeError, AssertionError) as e:
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            if reason.startswith("Expected one of"):
                reason = "not a torch device name (cpu, cuda, cuda:1, ...)"
            raise ValueError(f"--device {self.device}: {reason}") from None


def lr_at(step: int, total: int, peak: float) -> float:
    """Linear warm-up over the first 5 % of steps, then cosine decay to 0.1 x peak."""
    warmup = max(1, int(total * WARMUP_FRACTION))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (MIN_LR_FRACTION + (1 - MIN_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi * progress)))


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_teacher(path: str, device: str = "cpu"):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def student_config(
    spec: str, vocab_size: int, tokenizer, max_positions: int, teacher_config=None, flag: str = "--student-config"
):
    """``small`` (Llama, hidden 128, 4 layers, 4 heads, 2 KV heads, MLP 384, tied) or a config.json file; `flag` is
    the option that named it (``--model-config`` for ``train``, whose vocabulary is the tokenizer's)."""
    from transformers import AutoConfig, LlamaConfig

    special = dict(
        bos_token_id=tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    )
    if spec == "small":
        if teacher_config is not None:
            max_positions = max(max_positions, getattr(teacher_config, "max_position_embeddings", 0) or 0)
        return LlamaConfig(vocab_size=vocab_size, max_position_embeddings=max_positions, **SMALL, **special)
    path = Path(spec)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"{flag} {spec}: expected 'small' or a config.json file")
    cfg_dict = json.loads(path.read_text(encoding="utf-8"))
    model_type = cfg_dict.pop("model_type", "llama")
    cfg_dict.setdefault("vocab_size", vocab_size)
    for k, v in special.items():
        cfg_dict.setdefault(k, v)
    try:
        config = AutoConfig.for_model(model_type, **cfg_dict)
    except ValueError:  # (transformers lists every model type it knows: hundreds, on one line)
        raise ValueError(f"{flag} {spec}: model_type {model_type!r} is not one transformers knows") from None
    if config.vocab_size != vocab_size:
        whose = "the teacher's" if teacher_config is not None else "the tokenizer's"
        raise ValueError(f"{flag} {spec}: vocab_size {config.vocab_size} != {whose} {vocab_size}")
    return config


def build_student(config, seed: int):
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
        do_sample=False,
    )
    return model


def make_optimizer(model, cfg: TrainConfig) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=BETAS,
        eps=1e-8,
        foreach=False,
    )


def step_loss(student, teacher, batch: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    inputs, labels = batch[:, :-1], batch[:, 1:]
    logits = student(input_ids=inputs, use_cache=False).logits
    t_logits = None
    if teacher is not None and cfg.alpha > 0:
        with torch.no_grad():
            t_logits = teacher(input_ids=inputs, use_cache=False).logits
    return kd_loss(logits, t_logits, labels, temperature=cfg.temperature, alpha=cfg.alpha)


def _ckpt_dir(out: Path) -> Path:
    return out / "checkpoints"


def latest_checkpoint(out: Path) -> Path | None:
    found = sorted(_ckpt_dir(out).glob("step-*.pt"))
    return found[-1] if found else None


# The settings that decide a run's steps: a resumed run must keep them, or it is no longer the run its
# checkpoint began (the LR schedule follows --steps, the batches --batch / --seq-len / --seed / the data).
RUN_DEFINING = (
    "teacher",
    "tokenizer",
    "student_config",
    "data",
    "val_data",
    "val_fraction",
    "temperature",
    "alpha",
    "steps",
    "batch",
    "seq_len",
    "lr",
    "weight_decay",
    "grad_clip",
    "seed",
)
PATH_SETTINGS = ("teacher", "tokenizer", "data", "val_data")


def _setting(cfg: dict, name: str):
    value = cfg.get(name)
    if name in PATH_SETTINGS or (name == "student_config" and value != "small"):
        return None if value is None else str(Path(value).resolve())
    return value


def check_resumable(ckpt: dict, ckpt_path: Path, cfg: TrainConfig) -> None:
    """ValueError naming each run-defining setting where this run differs from the checkpoint's run."""
    before, now = ckpt.get("train_config") or {}, asdict(cfg)
    differ = [n for n in RUN_DEFINING if n in before and _setting(before, n) != _setting(now, n)]
    if differ:
        said = ", ".join(f"--{n.replace('_', '-')} {before[n]} (now {now[n]})" for n in differ)
        raise ValueError(
            f"--resume: {ckpt_path} was trained with {said}; resume with its settings, or drop --resume to start afresh"
        )


def save_checkpoint(
    out: Path, model, opt, step: int, losses: list[float], cfg: TrainConfig, train_seconds: float = 0.0
) -> Path:
    d = _ckpt_dir(out)
    d.mkdir(parents=True, exist_ok=True)
    path = d / f"step-{step:07d}.pt"
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "step": step,
            "losses": losses,
            "torch_rng": torch.get_rng_state(),
            "python_rng": random.getstate(),
            "config": model.config.to_dict(),
            "train_config": asdict(cfg),
            "train_seconds": train_seconds,
        },
        tmp,
    )
    tmp.replace(path)
    for old in sorted(d.glob("step-*.pt"))[:-2]:
        old.unlink()
    return path


@torch.no_grad()
def perplexity(model, windows: torch.Tensor, batch: int = 8) -> float:
    """exp(mean next-token cross-entropy) over held-out windows [n, L + 1]."""
    if windows.numel() == 0:
        return float("nan")
    model.eval()
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, windows.size(0), batch):
        chunk = windows[i : i + batch].to(device)
        logits = model(input_ids=chunk[:, :-1], use_cache=False).logits
        total += torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.size(-1)).double(), chunk[:, 1:].reshape(-1), reduction="sum"
        ).item()
        count += chunk[:, 1:].numel()
    return math.exp(total / count)


def greedy_speed(model_dir: str, prompts: list[list[int]], max_tokens: int, device: str) -> dict:
    """Greedy decoding tokens/s with infertune's engine on a saved folder."""
    from infertune import LLM, SamplingParams

    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    max_len = min(int(cfg.get("max_position_embeddings", 2048)), max(len(p) for p in prompts) + max_tokens)
    llm = LLM(str(model_dir), dtype="float32", device=device, max_model_len=max_len)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0.0, max_tokens=2))  # warm-up
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    dt = time.perf_counter() - t0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"tokens": n, "seconds": dt, "tokens_per_s": n / dt if dt > 0 else float("nan")}


def copy_tokenizer(src: str, out: Path, tokenizer) -> None:
    copied = False
    for name in TOKENIZER_FILES:
        if (Path(src) / name).is_file():
            shutil.copy2(Path(src) / name, out / name)
            copied = True
    if not copied:
        tokenizer.save_pretrained(out)


def run_training(cfg: TrainConfig, log=print) -> dict:
    """Train (or distil), write the HF folder to cfg.out, evaluate, and return the report dict."""
    if cfg.teacher is None and cfg.alpha != 0:
        raise ValueError("training without a teacher needs --alpha 0")
    out = Path(cfg.out)
    check_writable_folder("--out", out)  # (before the work: it was first written at the first checkpoint)
    tok_src = cfg.tokenizer or cfg.teacher
    if tok_src is None:
        raise ValueError("a tokenizer folder is needed (--tokenizer, or the teacher's)")
    if cfg.teacher is not None and not (Path(cfg.teacher) / "config.json").is_file():
        raise ValueError(f"--teacher {cfg.teacher}: not a Hugging Face model folder (no config.json)")
    tok_flag = "--tokenizer" if cfg.tokenizer else "--teacher"
    if not Path(tok_src).is_dir():  # (transformers would take the name for a Hub id and try the network)
        raise ValueError(f"{tok_flag} {tok_src}: no such folder")
    if not any((Path(tok_src) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"{tok_flag} {tok_src}: no tokenizer files in it ({', '.join(TOKENIZER_FILES[:2])}, ...)")
    try:
        tokenizer = load_tokenizer(tok_src)
    except (OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{tok_flag} {tok_src}: no tokenizer could be loaded from it ({reason})") from None
    teacher = load_teacher(cfg.teacher, cfg.device) if cfg.teacher else None
    vocab = teacher.config.vocab_size if teacher is not None else len(tokenizer)
    teacher_positions = getattr(teacher.config, "max_position_embeddings", None) if teacher is not None else None
    if teacher_positions and cfg.seq_len > teacher_positions:  # (its logits past them would be garbage, silently)
        raise ValueError(
            f"--seq-len {cfg.seq_len} exceeds the teacher's max_position_embeddings {teacher_positions}; "
            f"give --seq-len {teacher_positions} or less"
        )
    t0 = time.perf_counter()
    corpus: Corpus = build_corpus(cfg.data, tokenizer, cfg.seq_len, cfg.val_fraction, cfg.val_data)
    log(
        f"[data] {corpus.train.numel():,} train tokens ({corpus.n_train_docs} docs), {corpus.val.numel():,} "
        f"held-out tokens ({corpus.n_val_docs} docs, split {corpus.split}), {time.perf_counter() - t0:.1f}s"
    )

    flag = "--student-config" if teacher is not None else "--model-config"
    config = student_config(
        cfg.student_config,
        vocab,
        tokenizer,
        max(cfg.seq_len, 1024),
        teacher.config if teacher is not None else None,
        flag=flag,
    )
    if config.max_position_embeddings < cfg.seq_len:
        raise ValueError(
            f"--seq-len {cfg.seq_len} exceeds the student's max_position_embeddings {config.max_position_embeddings}"
        )
    student = build_student(config, cfg.seed).to(cfg.device)
    # The folder this run writes must be one infertune serves: said now, not after the training (the report's
    # speed measure loaded it with infertune, and failed, once every step had run).
    ArchConfig.from_dict(
        dict(config.to_dict(), architectures=[type(student).__name__]), where=f"{flag} {cfg.student_config}"
    )
    opt = make_optimizer(student, cfg)
    start, losses, seconds_before = 0, [], 0.0  # seconds_before: training time of the runs this one resumes
    if not cfg.resume:  # a fresh run: checkpoints of an earlier run in this folder must not be resumed from later
        earlier = sorted(_ckpt_dir(out).glob("step-*.pt"))
        if earlier or (out / "config.json").is_file():  # (said: it was replaced without a word)
            log(
                f"[out] {out} holds an earlier run ({len(earlier)} checkpoint(s)"
                f"{', a saved model' if (out / 'config.json').is_file() else ''}): replacing it, its checkpoints "
                "deleted now and its model overwritten at the end (--resume continues it instead)"
            )
        for old in earlier:
            old.unlink()
    if cfg.resume:
        ckpt_path = latest_checkpoint(out)
        if ckpt_path is None:
            log(f"[resume] no checkpoint under {_ckpt_dir(out)}; starting at step 0")
        else:
            ckpt = torch.load(ckpt_path, map_location=cfg.device, weights_only=False)
            check_resumable(ckpt, ckpt_path, cfg)
            try:
                student.load_state_dict(ckpt["model"])
            except RuntimeError:  # (the same config.json path, edited since: shapes that no longer fit)
                raise ValueError(
                    f"--resume: {ckpt_path} holds a different model than {cfg.student_config} builds now "
                    "(its weights do not fit); resume with the config it was trained with, or drop --resume"
                ) from None
            opt.load_state_dict(ckpt["optimizer"])
            start, losses = int(ckpt["step"]), list(ckpt["losses"])
            seconds_before = float(ckpt.get("train_seconds", 0.0))
            torch.set_rng_state(ckpt["torch_rng"])
            random.setstate(ckpt["python_rng"])
            log(f"[resume] {ckpt_path.name}: continuing at step {start}/{cfg.steps}")
    n_params = sum(p.numel() for p in student.parameters())
    log(
        f"[model] {'student' if teacher is not None else 'model'} {config.model_type}, {n_params:,} parameters; "
        f"{'teacher ' + cfg.teacher + f', T={cfg.temperature}, alpha={cfg.alpha}' if teacher is not None else 'no teacher (cross-entropy)'}"
    )

    end = cfg.steps if cfg.stop_after is None else min(cfg.steps, cfg.stop_after)
    tokens_per_step = cfg.batch * cfg.seq_len
    student.train()
    from tqdm import tqdm

    bar = tqdm(
        total=cfg.steps,
        initial=start,
        desc="distill" if teacher is not None else "train",
        unit="step",
        dynamic_ncols=True,
        mininterval=1.0,
        disable=not cfg.progress,
    )
    t_train = time.perf_counter()
    for step in range(start, end):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg.steps, cfg.lr)
        batch = corpus.batch(step, cfg.batch, cfg.seed).to(cfg.device)
        loss = step_loss(student, teacher, batch, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(student.parameters(), cfg.grad_clip, foreach=False)
        opt.step()
        losses.append(loss.item())
        elapsed = time.perf_counter() - t_train
        bar.update(1)
        bar.set_postfix(
            loss=f"{losses[-1]:.3f}", tok_s=f"{(step + 1 - start) * tokens_per_step / elapsed:,.0f}", refresh=False
        )
        done = step + 1
        if (cfg.save_every > 0 and done % cfg.save_every == 0) or done == end:
            save_checkpoint(out, student, opt, done, losses, cfg, seconds_before + time.perf_counter() - t_train)
    bar.close()
    train_seconds = seconds_before + time.perf_counter() - t_train  # over every run that led here
    student.eval()
    report = {
        "steps_done": len(losses),
        "steps": cfg.steps,
        "losses": losses,
        "train_seconds": train_seconds,
        "student_parameters": n_params,
        "train_config": asdict(cfg),
    }
    if len(losses) < cfg.steps:
        log(f"[stop] stopped after step {len(losses)}/{cfg.steps}; continue with --resume")
        return report

    # HF folder ---------------------------------------------------------------------------
    out.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(out, safe_serialization=True)
    copy_tokenizer(tok_src, out, tokenizer)

    # evaluation --------------------------------------------------------------------------
    windows = corpus.val_windows(cfg.eval_windows)
    report["student_ppl"] = perplexity(student, windows)
    report["teacher_ppl"] = perplexity(teacher, windows) if teacher is not None else None
    report["uniform_ppl"] = float(vocab)
    report["eval_tokens"] = int(windows[:, 1:].numel())
    if cfg.speed_tokens > 0 and windows.size(0) > 0:
        prompts = [w[:16].tolist() for w in windows[:4]]
        report["student_speed"] = greedy_speed(str(out), prompts, cfg.speed_tokens, cfg.device)
        if teacher is not None:
            try:
                report["teacher_speed"] = greedy_speed(cfg.teacher, prompts, cfg.speed_tokens, cfg.device)
            except Exception as e:  # a teacher architecture infertune does not serve
                report["teacher_speed"] = {"error": f"{type(e).__name__}: {e}"}
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def format_report(report: dict) -> str:
    lines = [
        f"trained {report['steps_done']} steps in {report['train_seconds']:.1f}s; final loss {report['losses'][-1]:.4f}"
        if report["losses"]
        else "no steps run"
    ]
    if "student_ppl" in report:
        lines.append(
            f"held-out perplexity on {report['eval_tokens']:,} tokens: student {report['student_ppl']:.2f}"
            + (f", teacher {report['teacher_ppl']:.2f}" if report.get("teacher_ppl") is not None else "")
            + f" (uniform {report['uniform_ppl']:.0f})"
        )
    for who in ("student", "teacher"):
        sp = report.get(f"{who}_speed")
        if sp and "tokens_per_s" in sp:
            lines.append(
                f"{who} greedy generation (infertune): {sp['tokens_per_s']:.1f} tokens/s "
                f"({sp['tokens']} tokens in {sp['seconds']:.2f}s)"
            )
        elif sp:
            lines.append(f"{who} greedy generation: not measured ({sp['error']})")
    return "\n".join(lines)
