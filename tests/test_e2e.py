"""End to end on the built-in demo model: the CLI, a golden greedy text (checked against HF transformers too), chat."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from infertune import LLM, SamplingParams
from infertune.config import default_model_path

PROMPT = "def __init__(self"
# Greedy, fp32, 24 tokens. Regenerating the demo model changes it; HF transformers must agree either way.
GOLDEN = ", name):\n        return self.name == 'name'\n\n    def __init__(self, name):\n        self."


@pytest.fixture(scope="module")
def demo():
    return LLM(dtype="float32", max_model_len=256)


def test_golden_greedy_text_matches_hf(demo):
    from transformers import AutoModelForCausalLM

    out = demo.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24))[0]
    assert out.outputs[0].text == GOLDEN
    hf = AutoModelForCausalLM.from_pretrained(default_model_path(), dtype=torch.float32).eval()
    ids = torch.tensor([out.prompt_token_ids])
    ref = hf.generate(ids, max_new_tokens=24, do_sample=False)[0, ids.shape[1] :].tolist()
    assert out.outputs[0].token_ids == ref


def test_chat_uses_the_template(demo):
    messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A class please."}]
    out = demo.chat(messages, SamplingParams(temperature=0, max_tokens=8))[0]
    rendered = demo.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered.endswith("<|assistant|>\n")
    assert out.prompt == rendered
    assert out.prompt_token_ids == demo.tokenizer.encode(rendered, add_special_tokens=False)
    assert len(out.outputs[0].token_ids) >= 1


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "infertune.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_generate_prints_text_and_stats():
    r = run_cli("generate", PROMPT, "--max-tokens", "24", "--dtype", "float32", "--no-token-healing")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == GOLDEN
    stats = r.stderr.strip().splitlines()[-1]
    assert re.search(r"prompt 5 tok \| output 24 tok \(length\) \| TTFT [\d.]+ ms \| decode [\d.]+ tok/s", stats)
    assert "token healing" not in stats


def test_cli_heals_the_demo_models_prompts_by_default(demo):
    """On the built-in model `generate` heals the prompt's last token unless told not to: the printed text is the
    offline API's healed output (which test_token_healing.py holds to HF), one prompt token fewer."""
    healed = demo.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, token_healing=True))[0].outputs[0]
    assert healed.text != GOLDEN  # (healing this prompt changes the output: the test can tell the two apart)
    r = run_cli("generate", PROMPT, "--max-tokens", "24", "--dtype", "float32")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == healed.text
    stats = r.stderr.strip().splitlines()[-1]
    assert "prompt 4 tok | output 24 tok" in stats and "token healing (--no-token-healing: off)" in stats


def test_cli_chat_and_errors():
    r = run_cli("generate", "--chat", "hello", "--max-tokens", "4")
    assert r.returncode == 0, r.stderr
    bad = run_cli("generate", "x", "--model", "/no/such/folder")
    assert bad.returncode == 2 and "/no/such/folder" in bad.stderr and "Traceback" not in bad.stderr
    bad = run_cli("generate", "x", "--temperature", "-1")
    assert bad.returncode == 2 and "temperature" in bad.stderr and "Traceback" not in bad.stderr


def test_builtin_model_has_learned_something():
    """Held-out perplexity (Python stdlib files the model never saw) far below the uniform 4096."""
    from infertune.evaluate import compare

    report = compare(None, engine_options={"dtype": "float32"})  # the whole held-out split, ~66k tokens
    assert report.num_tokens >= 60000
    # measured 12.05 for the distilled student (16.27 for the model of the same size it replaced, trained without a
    # teacher); uniform would be 4096
    assert report.perplexity < 13.5, report.perplexity
