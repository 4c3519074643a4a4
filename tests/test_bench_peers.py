"""The peers of `bench throughput`: GGUF export (checked by reading the file back and by rotary algebra), skipped
peers, the side-by-side table with an infertune-eager row (tiny model, no timing asserted), and the worker
protocol (prompts, result line) the peers share with infertune's workers."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from conftest import make_checkpoint

from infertune.bench import peers


def _rope_neox(x, pos, theta=10000.0):  # HF: rotate-half over the two halves of each head
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos * inv
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([x1 * ang.cos() - x2 * ang.sin(), x2 * ang.cos() + x1 * ang.sin()], -1)


def _rope_gptj(x, pos, theta=10000.0):  # llama.cpp's LLM_ARCH_LLAMA: rotate adjacent pairs (2i, 2i + 1)
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = pos * inv
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * ang.cos() - b * ang.sin()
    out[..., 1::2] = b * ang.cos() + a * ang.sin()
    return out


def test_row_permutation_turns_rotate_half_into_pairwise_rotary():
    """q = W x rotated HF-style equals llama.cpp's pairwise rotary of (permuted W) x, up to the same row order:
    so the attention scores q.k, which are invariant under a shared permutation of q and k rows, agree."""
    g = torch.Generator().manual_seed(0)
    n_head, d, hidden = 3, 8, 12
    w = torch.randn(n_head * d, hidden, generator=g, dtype=torch.float64)
    wk = torch.randn(n_head * d, hidden, generator=g, dtype=torch.float64)
    x, y = torch.randn(hidden, generator=g, dtype=torch.float64), torch.randn(hidden, generator=g, dtype=torch.float64)
    pq, pk = 5.0, 2.0
    hf_q = _rope_neox((w @ x).view(n_head, d), pq)
    hf_k = _rope_neox((wk @ y).view(n_head, d), pk)
    cpp_q = _rope_gptj((peers._permute_rows(w, n_head) @ x).view(n_head, d), pq)
    cpp_k = _rope_gptj((peers._permute_rows(wk, n_head) @ y).view(n_head, d), pk)
    torch.testing.assert_close((hf_q * hf_k).sum(-1), (cpp_q * cpp_k).sum(-1))  # per-head scores
    assert not torch.allclose(peers._permute_rows(w, n_head), w)  # the permutation is not the identity


def test_gguf_export_reads_back(tmp_path):
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    src = make_checkpoint(tmp_path / "m", "llama", tie_word_embeddings=True, dtype=torch.bfloat16)
    out = peers.export_gguf(src, tmp_path / "m.gguf", "bfloat16")
    reader = gguf.GGUFReader(str(out))
    tensors = {t.name: t for t in reader.tensors}
    cfg = json.loads((src / "config.json").read_text())
    hf = load_file(str(src / "model.safetensors"))
    assert "output.weight" not in tensors  # tied: llama.cpp reuses token_embd
    assert len(tensors) == 1 + 1 + 9 * cfg["num_hidden_layers"]

    def back(name):
        t = tensors[name]
        arr = torch.from_numpy(t.data.copy())
        if t.tensor_type == gguf.GGMLQuantizationType.BF16:
            arr = arr.view(torch.int16).view(torch.bfloat16)
        return arr.reshape([int(n) for n in reversed(t.shape.tolist())]) if arr.dim() == 1 and len(t.shape) > 1 else arr

    assert torch.equal(back("token_embd.weight").float(), hf["model.embed_tokens.weight"].float())
    q = back("blk.1.attn_q.weight").float()
    assert torch.equal(
        q, peers._permute_rows(hf["model.layers.1.self_attn.q_proj.weight"].float(), cfg["num_attention_heads"])
    )
    k = back("blk.0.attn_k.weight").float()
    assert torch.equal(
        k, peers._permute_rows(hf["model.layers.0.self_attn.k_proj.weight"].float(), cfg["num_key_value_heads"])
    )
    assert torch.equal(back("blk.0.ffn_down.weight").float(), hf["model.layers.0.mlp.down_proj.weight"].float())
    assert back("blk.0.attn_norm.weight").dtype == torch.float32
    fields = reader.fields
    assert int(fields["llama.attention.head_count_kv"].parts[-1][0]) == cfg["num_key_value_heads"]
    assert int(fields["llama.block_count"].parts[-1][0]) == cfg["num_hidden_layers"]


def test_gguf_export_refuses_other_architectures(tmp_path):
    pytest.importorskip("gguf")
    src = make_checkpoint(tmp_path / "q", "qwen2")
    with pytest.raises(
        peers.PeerUnavailable,
        match="covers LlamaForCausalLM, Qwen3MoeForCausalLM and DeepseekV2 / V3ForCausalLM, not .*Qwen2ForCausalLM",
    ):
        peers.export_gguf(src, tmp_path / "q.gguf")


def test_bench_reports_missing_peers_as_skipped_and_compares_eager(tmp_path, monkeypatch, capsys):
    """Peers that are not installed are reported as skipped; with --plot (where matplotlib is installed) the chart
    is written and draws exactly the JSON's medians."""
    from infertune.bench import offline

    try:
        import matplotlib  # noqa: F401

        has_matplotlib = True
    except ImportError:
        has_matplotlib = False

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as if llama-cpp-python were not installed
    monkeypatch.delenv("INFERTUNE_VLLM_PYTHON", raising=False)
    model = make_checkpoint(tmp_path / "m", "llama", dtype=torch.bfloat16)
    rc = offline.main(
        [
            "--model",
            str(model),
            "--input-len",
            "6",
            "--output-len",
            "3",
            "--batch",
            "1",
            "--repeats",
            "1",
            "--probe-gib",
            "0",
            "--systems",
            "infertune-eager",
            "--baseline",
            "llama.cpp",
            "--baseline",
            "vllm",
            "--json",
            str(tmp_path / "r.json"),
            *(["--plot", str(tmp_path / "r.png")] if has_matplotlib else []),
        ]
    )
    assert rc == 0  # a peer that is not installed is skipped, not a failure
    doc = json.loads((tmp_path / "r.json").read_text())
    if has_matplotlib:  # the plot draws the medians of the JSON, skipped peers left out
        assert (tmp_path / "r.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        labels, batches, series = offline.plot_series(doc["results"])
        eager = next(r for r in doc["results"] if r["system"] == "infertune-eager")
        assert labels == ["infertune (compile off)"] and batches == [1]
        assert {k: v[1] for k, v in series.items()} == {k: [eager["median"][k]] for k, _ in offline.PLOT_METRICS}
    by = {r["system"]: r for r in doc["results"]}
    assert "llama-cpp-python is not installed" in by["llama.cpp"]["skipped"]
    assert "--vllm-python" in by["vllm"]["skipped"]
    eager = by["infertune-eager"]
    assert eager["extra"]["engine_options"]["compile"] == "off" and eager["extra"]["compile_s"] is None
    assert all(r["ttft_s"] <= r["total_s"] for r in eager["runs"])
    out = capsys.readouterr().out
    assert "| llama.cpp BF16 | 1 | skipped:" in out and "infertune (compile off)" in out


def test_rounds_alternate_the_order_and_report_each_rounds_ratios(tmp_path, capsys):
    """--rounds 2: every worker runs twice, the systems in reverse order in the second round; the medians are
    those of both rounds' runs together, and each round's ratio is that round's medians divided."""
    import statistics

    from infertune.bench import offline

    model = make_checkpoint(tmp_path / "m", "llama", dtype=torch.bfloat16)
    rc = offline.main(
        [
            "--model",
            str(model),
            "--input-len",
            "6",
            "--output-len",
            "3",
            "--batch",
            "1",
            "--repeats",
            "2",
            "--rounds",
            "2",
            "--probe-gib",
            "0",
            "--systems",
            "infertune,infertune-bf16",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    started = [line.split("starting worker ")[1] for line in captured.err.splitlines() if "starting worker" in line]
    assert started == [
        "infertune b1 (round 1/2)",
        "infertune-bf16 b1 (round 1/2)",
        "infertune-bf16 b1 (round 2/2)",
        "infertune b1 (round 2/2)",
    ]
    doc = json.loads((tmp_path / "r.json").read_text())
    assert doc["workload"]["rounds"] == 2
    by = {r["system"]: r for r in doc["results"]}
    for r in by.values():
        assert [run["round"] for run in r["runs"]] == [0, 0, 1, 1] and len(r["rounds"]) == 2
        assert r["median"]["ttft_s"] == statistics.median(run["ttft_s"] for run in r["runs"])
        for i in (0, 1):
            assert r["rounds"][i]["ttft_s"] == statistics.median(
                run["ttft_s"] for run in r["runs"] if run["round"] == i
            )
    (row,) = [x for x in doc["ratios"] if x["system"] == "infertune" and x["peer"] == "infertune-bf16"]
    a, b = by["infertune"], by["infertune-bf16"]
    assert row["per_round"]["ttft_s"] == [a["rounds"][i]["ttft_s"] / b["rounds"][i]["ttft_s"] for i in (0, 1)]
    assert "Each round's ratios (2 rounds" in captured.out


def test_plot_series_takes_each_systems_medians_and_leaves_out_what_did_not_run():
    """The data of bench throughput --plot: systems in run order, a value per batch size where the system ran at
    that size (None where not), skipped and failed entries left out."""
    from infertune.bench import offline

    def ran(system, batch, tok):
        return dict(system=system, batch=batch, median=dict(output_tok_s=tok, decode_tok_s=2 * tok, ttft_s=1 / tok))

    results = [
        ran("infertune", 1, 40.0),
        ran("hf", 1, 10.0),
        dict(system="vllm", batch=1, skipped="not installed"),
        ran("infertune", 16, 300.0),
        dict(system="hf", batch=16, error="out of memory"),
    ]
    labels, batches, series = offline.plot_series(results)
    assert labels == ["infertune", "HF transformers"] and batches == [1, 16]
    assert series["output_tok_s"] == {1: [40.0, 10.0], 16: [300.0, None]}
    assert series["decode_tok_s"][16] == [600.0, None] and series["ttft_s"][1] == [1 / 40.0, 1 / 10.0]


def test_random_presets_build_their_family_and_vocabulary(tmp_path, monkeypatch):
    """--random-config presets: a Qwen2-family preset builds Qwen2ForCausalLM (q/k/v biases) with a padded
    byte-level vocabulary of the preset's size, and infertune's logits match HF transformers on it."""
    from conftest import hf_model

    from infertune import LLM
    from infertune.bench import offline_models

    monkeypatch.setitem(
        offline_models.PRESETS,
        "tiny-qwen2",
        dict(
            family="qwen2",
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=128,
            vocab_size=70000,
        ),
    )
    out = offline_models.ensure_model("tiny-qwen2", tmp_path)
    assert out.name.startswith("qwen2-tiny-qwen2-")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["vocab_size"] == 70000
    assert offline_models.ensure_model("tiny-qwen2", tmp_path) == out  # cached: built once
    ids = [5, 300, 69999, 12]
    llm = LLM(str(out), dtype="float32", max_model_len=32)
    assert len(llm.tokenizer) == 70000 and llm.tokenizer.decode([69999])  # every id decodes to real bytes
    ours = llm.engine.executor.runner.prompt_logits(ids, [0, 1])
    with torch.no_grad():
        ref = hf_model(out)(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_vllm_peer_gets_the_workers_prompts_and_reads_its_marked_line(tmp_path, monkeypatch):
    """spawn_vllm hands vLLM's interpreter the prompts every worker uses (worker_protocol.make_prompts, warm-up run
    -1 included) and takes its result from the line that carries the shared marker."""
    import argparse

    from infertune.bench.worker_protocol import RESULT_MARKER, make_prompts

    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 50}))
    fake = tmp_path / "python"  # stands in for the vLLM venv's interpreter: echoes the job back
    fake.write_text(
        f"#!{sys.executable}\nimport json, sys\njob = json.load(open(sys.argv[2]))\nprint('noise')\n"
        f"print({RESULT_MARKER!r} + json.dumps(dict(system='vllm', job=job)))\n"
    )
    fake.chmod(0o755)
    monkeypatch.setenv("LD_PRELOAD", "")
    args = argparse.Namespace(
        vllm_python=str(fake),
        dtype="float32",
        input_len=3,
        output_len=2,
        repeats=2,
        threads=1,
        seed=7,
        worker_timeout=60,
    )
    res = peers.spawn_vllm(args, model, 2)
    assert res["job"]["prompts"] == {str(r): make_prompts(7, 2, r, 3, 50) for r in (-1, 0, 1)}
    assert res["job"]["batch"] == 2 and res["worker_wall_s"] > 0


def test_llama_cpp_worker_process_reports_through_the_shared_marker(tmp_path, monkeypatch, capsys):
    """run_worker hands a llama.cpp pair to peers.worker_llama_cpp (no torch there) and prints its result line."""
    import argparse

    from infertune.bench import offline_workers
    from infertune.bench.worker_protocol import RESULT_MARKER

    seen = []

    def fake_worker(args, model_dir, batch):
        seen.append((args.worker, model_dir, batch))
        return dict(load_s=0.1, warmup_s=0.2, rss_after_load_mib=1.0, runs=[], extra={})

    monkeypatch.setattr(offline_workers, "worker_llama_cpp", fake_worker)
    args = argparse.Namespace(model=str(tmp_path), worker="llama.cpp-q8_0", worker_batch=3, threads=2)
    assert offline_workers.run_worker(args) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(RESULT_MARKER)
    result = json.loads(line[len(RESULT_MARKER) :])
    assert seen == [("llama.cpp-q8_0", tmp_path, 3)]
    assert (result["system"], result["batch"], result["torch_threads"]) == ("llama.cpp-q8_0", 3, 2)
    assert result["peak_rss_mib"] > 0 and result["rss_end_mib"] > 0
