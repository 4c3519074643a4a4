"""vLLM side of `infertune bench throughput --baseline vllm`; runs under vLLM's own interpreter (stdlib + vllm only).

Usage: VLLM_PYTHON peer_vllm.py JOB.json. The job holds the model folder, the workload and the token-id prompts
(run "-1" is the warm-up). Prints one line: the result marker and a JSON object with the same fields as
infertune's workers (load_s, warmup_s, rss_after_load_mib, runs [{total_s, ttft_s, tokens}], peak_rss_mib, ...).

TTFT is a separate generate with max_tokens=1 on the same prompts (vLLM's offline LLM.generate reports no
per-token times), as the HF worker does.
"""

import json
import sys
import time

RESULT_MARKER = "@@BENCH_RESULT@@ "


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main(job_path: str) -> int:
    job = json.load(open(job_path))
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    max_len = job["input_len"] + job["output_len"]
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        max_model_len=max_len,
        max_num_seqs=job["batch"],
        enable_prefix_caching=False,
        seed=0,
        skip_tokenizer_init=True,
    )
    load_s = time.perf_counter() - t0
    rss_after_load = _status_mib("VmRSS")
    full = SamplingParams(temperature=0.0, max_tokens=job["output_len"], ignore_eos=True, detokenize=False)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)

    def once(run: str) -> dict:
        prompts = [{"prompt_token_ids": ids} for ids in job["prompts"][run]]
        t = time.perf_counter()
        llm.generate(prompts, first, use_tqdm=False)
        ttft = time.perf_counter() - t
        # Fresh prompts for the full run would be fairer to caches; prefix caching is off, so reuse them.
        t = time.perf_counter()
        outs = llm.generate(prompts, full, use_tqdm=False)
        total = time.perf_counter() - t
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        if any(len(x) != job["output_len"] for x in tokens):
            raise RuntimeError(f"vLLM produced {[len(x) for x in tokens]} tokens, expected {job['output_len']}")
        return dict(total_s=total, ttft_s=ttft, tokens=tokens)

    t = time.perf_counter()
    once("-1")
    warmup_s = time.perf_counter() - t
    runs = [once(str(r)) for r in range(job["repeats"])]
    import vllm

    result = dict(
        system="vllm",
        batch=job["batch"],
        load_s=load_s,
        warmup_s=warmup_s,
        rss_after_load_mib=rss_after_load,
        runs=runs,
        peak_rss_mib=_status_mib("VmHWM"),
        rss_end_mib=_status_mib("VmRSS"),
        torch_threads=job["threads"],
        extra={"vllm": vllm.__version__},
    )
    sys.stdout.write(RESULT_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
