"""`infertune distill` / `infertune train` as a user meets them: bad flags are one-line errors before any loading."""

from __future__ import annotations

import pytest

from infertune.cli import main


@pytest.mark.parametrize(
    "flags, said",
    [
        (["--lr", "0"], "--lr must be > 0, got 0.0"),
        (["--lr", "-1"], "--lr must be > 0, got -1.0"),
        (["--eval-windows", "0"], "--eval-windows must be >= 1, got 0"),
        (["--speed-tokens", "-3"], "--speed-tokens must be >= 0, got -3"),
        (["--save-every", "-1"], "--save-every must be >= 0, got -1"),
        (["--weight-decay", "-0.1"], "--weight-decay must be >= 0, got -0.1"),
        (["--val-fraction", "-1"], "--val-fraction must be in [0, 1), got -1.0"),
        (["--val-fraction", "1"], "--val-fraction must be in [0, 1), got 1.0"),
        (["--stop-after", "0"], "--stop-after must be >= 1, got 0"),
        (["--temperature", "0"], "--temperature must be > 0, got 0.0"),
        (["--temperature", "-2"], "--temperature must be > 0, got -2.0"),
        (["--threads", "0"], "--threads must be >= 1, got 0"),
        (["--steps", "0"], "--steps must be >= 1, got 0"),
        (["--batch", "-1"], "--batch must be >= 1, got -1"),
    ],
)
def test_a_value_no_run_can_use_is_refused_before_anything_loads(tmp_path, capsys, flags, said):
    # The teacher and the data do not exist: a check made after loading them would report those instead.
    out = tmp_path / "out"
    argv = [
        "distill",
        "--teacher",
        str(tmp_path / "no-teacher"),
        "--data",
        str(tmp_path / "no-data"),
        "--out",
        str(out),
    ]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"infertune distill: error: {said}"
    assert not out.exists()


def test_a_missing_teacher_or_tokenizer_folder_is_a_one_line_error(tmp_path, capsys):
    """(transformers took the missing folder for a Hub id: a traceback about the network, after a wait)"""
    data = tmp_path / "data.txt"
    data.write_text("some text\n" * 50)
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("not a model")
    common = ["--data", str(data), "--out", str(tmp_path / "out"), "--steps", "1"]
    cases = [
        (
            ["distill", "--teacher", str(tmp_path / "missing")],
            f"--teacher {tmp_path / 'missing'}: not a Hugging Face model folder (no config.json)",
        ),
        (["distill", "--teacher", str(notes)], f"--teacher {notes}: not a Hugging Face model folder (no config.json)"),
        (["train", "--tokenizer", str(tmp_path / "missing")], f"--tokenizer {tmp_path / 'missing'}: no such folder"),
        (["train", "--tokenizer", str(notes)], f"--tokenizer {notes}: no tokenizer files in it"),
    ]
    for argv, said in cases:
        assert main(argv + common) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"infertune {argv[0]}: error: {said}") and "\n" not in err, err
    assert not (tmp_path / "out").exists()


def test_an_out_folder_that_cannot_be_written_is_refused_before_the_work(tmp_path, capsys):
    """(it was first written at the first checkpoint: a NotADirectoryError traceback, or an error after the
    teacher, the data and the student were loaded)"""
    import sys

    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    cases = [(a_file, "is a file; give a folder"), (a_file / "sub", f"{a_file} is a file; give a folder")]
    if sys.platform == "linux":  # (/proc refuses new files even to root, where chmod does not)
        cases.append(
            (__import__("pathlib").Path("/proc/infertune-out"), "/proc is not writable (No such file or directory)")
        )
    for out, said in cases:
        argv = ["distill", "--teacher", str(tmp_path / "missing"), "--data", str(tmp_path / "missing.txt")]
        assert main(argv + ["--out", str(out)]) == 2
        assert capsys.readouterr().err.strip() == f"infertune distill: error: --out {out}: {said}"


def test_resume_refuses_settings_that_differ_from_the_checkpoints_run(tmp_path):
    """(a resumed run took the new --seq-len / --steps silently, mixing two runs; a changed model was a multi-line
    load_state_dict error)"""
    import json

    from infertune.distill.trainer import TrainConfig, run_training
    from tests.conftest import make_checkpoint

    teacher = make_checkpoint(tmp_path / "teacher", "llama")
    data = tmp_path / "data.txt"
    data.write_text("def add(a, b):\n    return a + b\n" * 40)
    student = tmp_path / "student.json"
    student.write_text(
        json.dumps(
            dict(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=1,
                max_position_embeddings=64,
            )
        )
    )
    out = tmp_path / "out"

    def cfg(**kw):
        base = dict(
            data=str(data),
            out=str(out),
            teacher=str(teacher),
            student_config=str(student),
            steps=4,
            batch=2,
            seq_len=16,
            eval_windows=1,
            speed_tokens=0,
            progress=False,
        )
        return TrainConfig(**{**base, **kw})

    run_training(cfg(stop_after=2), log=lambda *_: None)
    ckpt = out / "checkpoints" / "step-0000002.pt"
    before = ckpt.read_bytes()
    with pytest.raises(ValueError, match=r"was trained with --steps 4 \(now 3\), --seq-len 16 \(now 8\)"):
        run_training(cfg(resume=True, steps=3, seq_len=8), log=lambda *_: None)
    student.write_text(json.dumps({**json.loads(student.read_text()), "hidden_size": 48}))
    with pytest.raises(ValueError, match="holds a different model than .* builds now"):
        run_training(cfg(resume=True), log=lambda *_: None)
    assert ckpt.read_bytes() == before and not (out / "config.json").exists()


def test_a_student_infertune_cannot_serve_is_refused_before_training(tmp_path):
    """(a GPT-2 student trained every step and saved, then failed the report's speed measure in infertune; in
    `train` the errors named --student-config and "the teacher's" vocabulary, flags and a model it does not have)"""
    import json

    from transformers import AutoConfig

    from infertune.config import SUPPORTED_ARCHITECTURES
    from infertune.distill.trainer import TrainConfig, run_training
    from tests.conftest import make_checkpoint

    teacher = make_checkpoint(tmp_path / "teacher", "llama")
    vocab = json.loads((teacher / "config.json").read_text())["vocab_size"]
    data = tmp_path / "data.txt"
    data.write_text("def add(a, b):\n    return a + b\n" * 40)
    gpt2 = dict(model_type="gpt2", n_embd=32, n_layer=1, n_head=2, n_positions=64, vocab_size=vocab)
    assert AutoConfig.for_model(**gpt2).architectures is None  # (transformers builds it: only infertune cannot run it)
    assert "GPT2LMHeadModel" not in SUPPORTED_ARCHITECTURES
    (tmp_path / "gpt2.json").write_text(json.dumps(gpt2))
    (tmp_path / "bad_vocab.json").write_text(json.dumps(dict(hidden_size=32, num_attention_heads=2, vocab_size=7)))
    out = tmp_path / "out"
    base = dict(data=str(data), out=str(out), steps=2, batch=2, seq_len=16, progress=False, speed_tokens=0)
    with pytest.raises(ValueError, match=r"^--student-config \S+gpt2.json: architecture 'GPT2LMHeadModel' is not"):
        run_training(TrainConfig(teacher=str(teacher), student_config=str(tmp_path / "gpt2.json"), **base))
    with pytest.raises(ValueError, match=r"^--model-config \S+gpt2.json: architecture 'GPT2LMHeadModel' is not"):
        run_training(TrainConfig(tokenizer=str(teacher), alpha=0.0, student_config=str(tmp_path / "gpt2.json"), **base))
    with pytest.raises(
        ValueError, match=rf"^--model-config \S+bad_vocab.json: vocab_size 7 != the tokenizer's {vocab}"
    ):
        run_training(
            TrainConfig(tokenizer=str(teacher), alpha=0.0, student_config=str(tmp_path / "bad_vocab.json"), **base)
        )
    assert not (out / "checkpoints").exists() and not (out / "config.json").exists()


def test_json_bare_prints_the_report_alone_and_json_out_writes_it(tmp_path, capsys):
    """--json as every other command takes it (distill / train had none)."""
    import json

    from tests.conftest import make_checkpoint

    tok = make_checkpoint(tmp_path / "tok", "llama")
    data = tmp_path / "data.txt"
    data.write_text("def add(a, b):\n    return a + b\n" * 40)
    small = tmp_path / "small.json"
    small.write_text(json.dumps(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)))
    argv = ["train", "--tokenizer", str(tok), "--data", str(data), "--model-config", str(small), "--steps", "2"]
    argv += ["--batch", "2", "--seq-len", "16", "--eval-windows", "1", "--speed-tokens", "0", "--no-progress"]
    assert main(argv + ["--out", str(tmp_path / "a"), "--json"]) == 0
    got = capsys.readouterr()
    report = json.loads(got.out)  # stdout holds the JSON alone
    assert report == json.loads((tmp_path / "a" / "training_report.json").read_text())
    assert "held-out perplexity" in got.err and report["steps_done"] == 2
    assert main(argv + ["--out", str(tmp_path / "b"), "--json", str(tmp_path / "j" / "r.json")]) == 0
    assert "held-out perplexity" in capsys.readouterr().out
    assert json.loads((tmp_path / "j" / "r.json").read_text())["losses"] == report["losses"]


def test_a_fresh_run_into_an_earlier_runs_folder_says_it_replaces_it(tmp_path):
    """(the earlier run's checkpoints were deleted and its model overwritten without a word)"""
    import json

    from infertune.distill.trainer import TrainConfig, run_training
    from tests.conftest import make_checkpoint

    tok = make_checkpoint(tmp_path / "tok", "llama")
    data = tmp_path / "data.txt"
    data.write_text("def add(a, b):\n    return a + b\n" * 40)
    small = tmp_path / "small.json"
    small.write_text(json.dumps(dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)))
    out = tmp_path / "out"
    base = dict(data=str(data), out=str(out), tokenizer=str(tok), alpha=0.0, student_config=str(small), steps=2)
    base.update(batch=2, seq_len=16, eval_windows=1, speed_tokens=0, progress=False)
    said: list[str] = []
    run_training(TrainConfig(**base, stop_after=1), log=said.append)
    assert not any(m.startswith("[out]") for m in said)
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step-0000001.pt"]
    said.clear()
    run_training(TrainConfig(**base), log=said.append)
    assert [m for m in said if m.startswith("[out]")] == [
        f"[out] {out} holds an earlier run (1 checkpoint(s)): replacing it, its checkpoints deleted now and its "
        "model overwritten at the end (--resume continues it instead)"
    ]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000002.pt"]
    said.clear()
    run_training(TrainConfig(**base), log=said.append)
    assert any(m.startswith(f"[out] {out} holds an earlier run (1 checkpoint(s), a saved model)") for m in said)


def test_held_out_text_shorter_than_one_window_is_refused_before_training(tmp_path):
    """(perplexity was reported as nan after the whole run; an empty --val-data was called --data)"""
    from infertune.distill.data import build_corpus
    from tests.conftest import make_tokenizer

    tok = make_tokenizer()  # byte-level: one token per byte, so the counts below are exact
    data = tmp_path / "train.txt"
    data.write_text("x = 1\n" * 100)
    short = tmp_path / "val.txt"
    short.write_text("y = 2\n")  # 6 bytes + the EOS separator = 7 tokens < 16 + 1
    empty = tmp_path / "empty.txt"
    empty.write_text("  \n")
    with pytest.raises(ValueError, match=r"^--val-data \S+val.txt: 7 held-out tokens, fewer than one window of "):
        build_corpus(data, tok, 16, val_data=short)
    with pytest.raises(ValueError, match=r"^--val-data \S+empty.txt: no non-empty text$"):
        build_corpus(data, tok, 16, val_data=empty)
    assert build_corpus(data, tok, 6, val_data=short).val_windows().shape == (1, 7)


def test_a_device_torch_cannot_use_is_a_one_line_error_before_anything_loads(tmp_path, capsys):
    """(it failed after the teacher loaded: a ValueError listing torch's device types, or for --device cuda on a
    machine without CUDA an AssertionError traceback)"""
    import torch

    devices = ["bogus"] + ([] if torch.cuda.is_available() else ["cuda"])
    for device in devices:
        argv = ["distill", "--teacher", str(tmp_path / "missing"), "--data", str(tmp_path / "missing.txt")]
        assert main(argv + ["--out", str(tmp_path / "out"), "--device", device]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"infertune distill: error: --device {device}: ") and "\n" not in err, err
