"""`infertune ledger` says where its figures were measured (the CPU) and the command that reproduces them."""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest

from infertune.cli import main


@pytest.mark.skipif(not Path("/proc/cpuinfo").is_file(), reason="reads the CPU's name from /proc/cpuinfo (Linux)")
def test_ledger_names_the_cpu_and_the_command_in_markdown_and_json(tmp_path, monkeypatch, capsys):
    from infertune.tune import ledger

    # The steps themselves are measured elsewhere (test_tune.py); here, only what the report says around them.
    row = dict(
        step="eager",
        label="infertune eager",
        lossy=False,
        status="ok",
        output_tok_s=10.0,
        kv_cache_bytes=0,
        rss_growth_mib=1.0,
        ttft_p50_s=0.01,
        gain_vs_previous=None,
        cumulative_vs_hf=None,
    )
    workload = dict(requests=2, input_len=4, output_len=2, batch=1, dtype="float32", greedy=True, ignore_eos=True)
    monkeypatch.setattr(
        ledger,
        "build_ledger",
        lambda args, progress=True: dict(model="m", isolated=False, workload=workload, steps=[row]),
    )
    cpu = re.search(r"^model name\s*:\s*(.+)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).strip()
    argv = ["ledger", "--input-len", "4", "--output-len", "2", "--batch", "1", "--md", str(tmp_path / "l.md")]
    argv += ["--json", str(tmp_path / "l.json")]
    assert main(argv) == 0
    md = (tmp_path / "l.md").read_text()
    doc = json.loads((tmp_path / "l.json").read_text())
    assert doc["machine"]["cpu"] == cpu and doc["machine"]["cpus"] == os.cpu_count()
    assert doc["command"] == "infertune " + shlex.join(argv)
    assert f"Measured on: {cpu}, {os.cpu_count()} CPUs" in md
    assert f"Command: `infertune {shlex.join(argv)}`" in md
    assert md.strip() in capsys.readouterr().out
