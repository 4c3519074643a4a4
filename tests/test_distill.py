"""infertune.distill: the KD loss by hand, a few KD steps, the HF output folder, and exact resume."""

from __future__ import annotations

import math

import pytest
import torch

from infertune.distill.loss import kd_loss
from tests.conftest import make_checkpoint


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread for this module's training steps, restored after it (set at import, it held for the whole
    session: every later in-process engine then ran one thread while worker processes ran two, and fp32 results
    that depend on the thread count told the executors apart)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TEXT = [
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, x):\n        self.items.append(x)\n",
    "import os\nimport sys\n\nprint(os.getcwd(), sys.argv)\n",
    "for i in range(10):\n    if i % 2 == 0:\n        print(i)\n",
    "The quick brown fox jumps over the lazy dog. " * 6,
]


def _hand_kd(s, t, y, T, alpha, ignore=-100):
    """KL and CE with explicit Python sums over the vocabulary, then averaged over non-ignored tokens."""
    kls, ces = [], []
    for i in range(len(y)):
        if y[i] == ignore:
            continue
        zs = [v / T for v in s[i]]
        zt = [v / T for v in t[i]]
        ns = sum(math.exp(v) for v in zs)
        nt = sum(math.exp(v) for v in zt)
        ps = [math.exp(v) / ns for v in zs]
        pt = [math.exp(v) / nt for v in zt]
        kls.append(sum(pt[j] * (math.log(pt[j]) - math.log(ps[j])) for j in range(len(pt))))
        n1 = sum(math.exp(v) for v in s[i])
        ces.append(-(s[i][y[i]] - math.log(n1)))
    kl, ce = sum(kls) / len(kls), sum(ces) / len(ces)
    return alpha * T * T * kl + (1 - alpha) * ce


@pytest.mark.parametrize("T,alpha", [(4.0, 0.7), (2.0, 1.0), (4.0, 0.0), (1.0, 0.5)])
def test_kd_loss_matches_hand_computation(T, alpha):
    s = [[1.0, -0.5, 2.0, 0.3], [0.2, 0.1, -1.0, 3.0], [0.0, 0.0, 0.0, 0.0], [-2.0, 1.5, 0.5, 0.25]]
    t = [[0.5, 0.5, 1.0, -1.0], [2.0, -0.3, 0.0, 1.0], [1.0, 2.0, 3.0, 4.0], [0.0, 0.0, 0.0, 9.0]]
    y = [2, 0, -100, 3]  # one padding position, ignored by both terms
    got = kd_loss(
        torch.tensor(s, dtype=torch.float64).view(2, 2, 4),
        torch.tensor(t, dtype=torch.float64).view(2, 2, 4),
        torch.tensor(y).view(2, 2),
        temperature=T,
        alpha=alpha,
    )
    assert got.item() == pytest.approx(_hand_kd(s, t, y, T, alpha), rel=1e-6, abs=1e-6)
    if alpha == 0.0:  # pure cross-entropy, no teacher needed
        ce = kd_loss(torch.tensor(s).view(2, 2, 4), None, torch.tensor(y).view(2, 2), temperature=T, alpha=0.0)
        assert ce.item() == pytest.approx(_hand_kd(s, t, y, T, 0.0), rel=1e-5)


def test_kd_loss_is_zero_kl_for_identical_logits():
    x = torch.randn(3, 5)
    assert kd_loss(x, x.clone(), torch.tensor([0, 1, 2]), temperature=4.0, alpha=1.0).abs().item() < 1e-6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    teacher = make_checkpoint(root / "teacher", "llama")
    data = root / "data"
    data.mkdir()
    for i, text in enumerate(TEXT * 4):
        (data / f"doc{i:02d}.py").write_text(text)
    return root, teacher, data


def _cfg(root, teacher, data, out, **kw):
    from infertune.distill.trainer import TrainConfig

    base = dict(
        data=str(data),
        out=str(out),
        teacher=str(teacher),
        student_config="small",
        steps=6,
        batch=4,
        seq_len=32,
        lr=3e-3,
        save_every=3,
        eval_windows=4,
        speed_tokens=0,
        progress=False,
        val_fraction=0.2,
    )
    base.update(kw)
    return TrainConfig(**base)


def test_kd_steps_reduce_loss_on_fixed_batch(setup):
    from infertune.distill.data import build_corpus
    from infertune.distill.trainer import (
        build_student,
        load_teacher,
        load_tokenizer,
        make_optimizer,
        step_loss,
        student_config,
    )

    root, teacher_dir, data = setup
    cfg = _cfg(root, teacher_dir, data, root / "unused", lr=1e-2)
    tok = load_tokenizer(str(teacher_dir))
    teacher = load_teacher(str(teacher_dir))
    corpus = build_corpus(data, tok, cfg.seq_len, cfg.val_fraction)
    student = build_student(student_config("small", teacher.config.vocab_size, tok, 256), seed=0)
    opt = make_optimizer(student, cfg)
    batch = corpus.batch(0, 4, seed=123)
    with torch.no_grad():
        before = step_loss(student, teacher, batch, cfg).item()
    for _ in range(5):
        loss = step_loss(student, teacher, batch, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = step_loss(student, teacher, batch, cfg).item()
    assert after < before * 0.9, (before, after)


def test_distill_output_loads_in_infertune_and_hf_and_resume_is_exact(setup):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from infertune import LLM, SamplingParams
    from infertune.distill.trainer import run_training

    root, teacher_dir, data = setup
    full = run_training(_cfg(root, teacher_dir, data, root / "full"), log=lambda *_: None)
    out = root / "full"
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()
    assert full["student_ppl"] > 0 and full["teacher_ppl"] > 0 and len(full["losses"]) == 6

    # interrupted after step 3 (checkpoint), then resumed: the losses of steps 4..6 match the uninterrupted run
    part = run_training(_cfg(root, teacher_dir, data, root / "resumed", stop_after=3), log=lambda *_: None)
    assert len(part["losses"]) == 3 and "student_ppl" not in part
    assert (root / "resumed" / "checkpoints" / "step-0000003.pt").is_file()
    resumed = run_training(_cfg(root, teacher_dir, data, root / "resumed", resume=True), log=lambda *_: None)
    assert len(resumed["losses"]) == 6
    # the reported training time spans both runs (the resumed run alone trained only 3 steps)
    assert resumed["train_seconds"] > part["train_seconds"] > 0
    for a, b in zip(full["losses"], resumed["losses"]):
        assert abs(a - b) <= 1e-6, (full["losses"], resumed["losses"])

    # the folder loads with transformers and with infertune, and greedy decoding agrees
    tok = AutoTokenizer.from_pretrained(out)
    prompt = tok("def add(a, b):", add_special_tokens=False)["input_ids"]
    hf = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(8):
            ids = torch.cat([ids, hf(input_ids=ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    hf_tokens = ids[0, len(prompt) :].tolist()
    llm = LLM(str(out), dtype="float32", device="cpu", max_model_len=64)
    got = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert list(got[0].outputs[0].token_ids) == hf_tokens


def test_a_seq_len_past_the_teachers_positions_is_refused(setup):
    from infertune.distill.trainer import run_training

    root, teacher_dir, data = setup  # (the tiny teacher has 256 positions)
    with pytest.raises(ValueError, match="exceeds the teacher's max_position_embeddings 256"):
        run_training(_cfg(root, teacher_dir, data, root / "long", seq_len=1000), log=lambda *_: None)
