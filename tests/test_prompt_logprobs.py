"""Prompt logprobs (SamplingParams.prompt_logprobs, the server's echo): each prompt token's logprob against HF
transformers' own, with prefix caching, chunked prefill, preemption, the fused CPU step and a worker process; and
the real client that reads them, lm-evaluation-harness's `local-completions`, against its own `hf` backend on the
same checkpoint."""

from __future__ import annotations

import json

import httpx
import pytest
import torch
from conftest import hf_model, make_checkpoint
from server_utils import ServerThread

from infertune import LLM, SamplingParams
from infertune.sampling_params import ParamError


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("plp") / "m", "llama")


def _hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), dim=-1)


def _check_against_hf(out, ref, k: int, tol: float) -> None:
    ids = out.prompt_token_ids
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
    for p in range(1, len(ids)):
        e = out.prompt_logprobs[p]
        assert e.token_id == ids[p] and abs(e.logprob - ref[p - 1, ids[p]].item()) < tol, (p, e.logprob)
        assert len(e.top) == k
        best = ref[p - 1].topk(k).indices.tolist()
        assert [t for t, _ in e.top][:1] == best[:1]  # (past the first, near-ties may swap)
        assert all(abs(v - ref[p - 1, t].item()) < tol for t, v in e.top)


PROMPTS = [list(range(3, 3 + n)) for n in (1, 2, 7, 16, 33)]  # lengths around the block size (4 here) and one token


@pytest.mark.parametrize(
    "options",
    [
        dict(),  # prefix caching on: the second run hits the cache, and must still score every token
        dict(max_num_batched_tokens=8),  # chunked prefill: a prompt scored over several steps
        # 512 bytes of fp32 KV a token in this model: 16 blocks of 4, fewer than the batch needs (preemption)
        dict(kv_cache_memory_bytes=512 * 64),
        dict(distributed_executor_backend="mp"),
    ],
    ids=["prefix-cache", "chunked", "preempted", "worker-process"],
)
def test_prompt_logprobs_are_hf_transformers_logprobs(ckpt, options):
    hf = hf_model(ckpt)
    llm = LLM(str(ckpt), dtype="float32", max_model_len=64, block_size=4, **options)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, prompt_logprobs=3)
    for _ in range(2):  # the second time, every prompt's full blocks are in the prefix cache
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for out in outs:
            _check_against_hf(out, _hf_prompt_logprobs(hf, out.prompt_token_ids), 3, 1e-4)
            assert len(out.outputs[0].token_ids) == 12
    if options.get("kv_cache_memory_bytes"):
        assert llm.engine.scheduler.num_preemptions > 0


def test_max_tokens_zero_scores_the_prompt_alone(ckpt):
    llm = LLM(str(ckpt), dtype="float32", max_model_len=64)
    out = llm.generate([{"prompt_token_ids": [5, 9, 11, 4]}], SamplingParams(max_tokens=0, prompt_logprobs=0))[0]
    c = out.outputs[0]
    assert c.token_ids == [] and c.text == "" and c.finish_reason == "length"
    assert [e.top for e in out.prompt_logprobs[1:]] == [[], [], []]
    with pytest.raises(ParamError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ParamError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_n_samples_score_the_prompt_once(ckpt):
    llm = LLM(str(ckpt), dtype="float32", max_model_len=64)
    out = llm.generate([{"prompt_token_ids": [5, 9, 11, 4]}], SamplingParams(n=3, max_tokens=2, prompt_logprobs=1))[0]
    assert len(out.outputs) == 3 and out.prompt_logprobs[0] is None and all(out.prompt_logprobs[1:])


def test_the_fused_step_scores_prompts_too(tmp_path):
    """bf16 through the CPU kernels' fused step (where it runs fresh prompts): the scored rows go on through the last
    layer, so the prompt logprobs are as close to HF in fp32 as those of the PyTorch path."""
    from infertune.kernels import cpu

    if not cpu.available():
        pytest.skip(f"CPU kernels: {cpu.unavailable_reason()}")
    model = make_checkpoint(
        tmp_path / "m", "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, dtype=torch.bfloat16
    )
    hf = hf_model(model).float()
    prompt = list(range(3, 40))
    worst = {}
    for mode in ("auto", "off"):
        llm = LLM(str(model), dtype="bfloat16", max_model_len=64, decode_kernels=mode)
        runs = []
        if mode == "auto" and llm.engine.executor.runner.fused is not None:
            llm.engine.executor.runner.fused = _Spy(llm.engine.executor.runner.fused, runs)
        out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=1, prompt_logprobs=1))[0]
        ref = _hf_prompt_logprobs(hf, prompt)
        worst[mode] = max(
            abs(out.prompt_logprobs[p].logprob - ref[p - 1, prompt[p]].item()) for p in range(1, len(prompt))
        )
        if mode == "auto" and runs:
            assert runs[0] == len(prompt)  # the prompt's step ran fused, every scored row read
    assert worst["auto"] <= 1.5 * worst["off"] + 0.02, worst


class _Spy:
    def __init__(self, fused, runs):
        self.fused, self.runs = fused, runs

    def applicable(self, *a):
        return self.fused.applicable(*a)

    def __call__(self, ids, positions, meta, rows=None):
        self.runs.append(rows.numel() if rows is not None else ids.shape[0])
        return self.fused(ids, positions, meta, rows)


def test_echo_through_the_server(ckpt):
    hf = hf_model(ckpt)
    with ServerThread(ckpt) as s:
        ids = [7, 3, 12, 40, 9]
        body = {"prompt": ids, "max_tokens": 2, "echo": True, "logprobs": 2, "temperature": 0, "ignore_eos": True}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
        lp = r["logprobs"]
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None and len(lp["tokens"]) == 7
        ref = _hf_prompt_logprobs(hf, ids)
        for p in range(1, 5):
            assert abs(lp["token_logprobs"][p] - ref[p - 1, ids[p]].item()) < 1e-4
        assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
        # max_tokens=0: the prompt alone, scored
        r0 = httpx.post(s.url + "/v1/completions", json={**body, "max_tokens": 0}, timeout=30).json()
        assert r0["usage"]["completion_tokens"] == 0 and len(r0["choices"][0]["logprobs"]["tokens"]) == 5
        assert r0["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:5]
        # without echo max_tokens=0 stays a 400
        bad = httpx.post(s.url + "/v1/completions", json={"prompt": ids, "max_tokens": 0}, timeout=30)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "max_tokens"
        # streamed: the prompt and its logprobs come first, then the same tokens as the response
        chunks = []
        with httpx.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as st:
            for line in st.iter_lines():
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0])
        assert "".join(c["text"] for c in chunks) == r["text"]
        streamed = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["token_logprobs"]]
        assert streamed == lp["token_logprobs"]
        offsets = [x for c in chunks if c["logprobs"] for x in c["logprobs"]["text_offset"]]
        assert offsets == lp["text_offset"]


def _lm_eval_tasks(tmp_path) -> str:
    """Two tiny local tasks: log-likelihood (multiple choice) and generate_until, on a JSONL file."""
    docs = [
        {"question": f"Item {i}: the code", "choices": ["def f():", "return x", "import os"], "gold": i % 3}
        for i in range(6)
    ]
    data = tmp_path / "docs.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    common = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
    (tmp_path / "tiny_ll.yaml").write_text(
        "task: tiny_ll\n" + common + "output_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: gold\nmetric_list:\n  - metric: acc\n"
    )
    (tmp_path / "tiny_gen.yaml").write_text(
        "task: tiny_gen\n" + common + "output_type: generate_until\ndoc_to_text: '{{question}}'\n"
        "doc_to_target: '{{choices[0]}}'\ngeneration_kwargs:\n  until: ['\\n\\n']\n  max_gen_toks: 8\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n"
    )
    return str(tmp_path)


def test_lm_eval_local_completions_matches_its_hf_backend(ckpt, tmp_path, monkeypatch):
    """lm-evaluation-harness scores the same docs through infertune's server (local-completions: echo + logprobs
    for log-likelihoods, plain completions for generate_until) and through transformers itself (its hf backend):
    every log-likelihood within 1e-3, every greedy completion identical."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    tasks = TaskManager(include_path=_lm_eval_tasks(tmp_path))
    names = ["tiny_ll", "tiny_gen"]

    def samples(model: str, args: str) -> dict:
        res = lm_eval.simple_evaluate(
            model=model,
            model_args=args,
            tasks=names,
            task_manager=tasks,
            log_samples=True,
            batch_size=1,
            random_seed=0,
            numpy_random_seed=0,
            torch_random_seed=0,
        )
        return {t: sorted(res["samples"][t], key=lambda s: s["doc_id"]) for t in names}

    ref = samples("hf", f"pretrained={ckpt},dtype=float32,device=cpu")
    with ServerThread(ckpt, max_model_len=128) as s:
        mine = samples(
            "local-completions",
            f"base_url={s.url}/v1/completions,model=tiny,tokenizer_backend=huggingface,"
            f"tokenizer={ckpt},tokenized_requests=True,num_concurrent=1,max_retries=1",
        )
    lls = [(a, b) for x, y in zip(ref["tiny_ll"], mine["tiny_ll"]) for a, b in zip(x["resps"], y["resps"])]
    assert len(lls) == 18
    for (ref_ll, ref_greedy), (ll, greedy) in ((a[0], b[0]) for a, b in lls):
        assert abs(float(ref_ll) - float(ll)) < 1e-3 and bool(ref_greedy) == bool(greedy)
    gens = [(x["resps"][0][0], y["resps"][0][0]) for x, y in zip(ref["tiny_gen"], mine["tiny_gen"])]
    assert len(gens) == 6 and all(a == b for a, b in gens), gens
