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
    argv = ["distill", "--teacher", str(tmp_path / "no-teacher"), "--data", str(tmp_path / "no-data"), "--out", str(out)]
    assert main(argv + flags) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"infertune distill: error: {said}"
    assert not out.exists()
