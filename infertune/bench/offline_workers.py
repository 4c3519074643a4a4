"""Workers of the offline benchmark: one (system, batch size) pair per process (the shared pieces: worker_protocol)."""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

from infertune.bench.offline_models import kv_bytes_per_token, log, read_model_config
from infertune.bench.peers import worker_llama_cpp
from infertune.bench.step_bytes import decode_step_weight_bytes, engine_tensors, moe_shape
from infertune.bench.worker_protocol import RESULT_MARKER, current_rss_mib, make_prompts, peak_rss_mib, warm_and_time


# --------------------------------------------------------------------------------------------------
# Workers: one (system, batch size) pair per process; the result is one JSON line on stdout
# --------------------------------------------------------------------------------------------------
def worker_infertune(args, model_dir: Path, batch: int) -> dict:
    # transformers is not imported here: the engine reads a plain tokenizer.json without it (engine/tokenizer.py), and
    # where it does need it, that import is part of its load time and of its memory.
    import infertune.executor.uniproc  # noqa: F401  (LLM imports torch-side modules lazily)
    from infertune import LLM, SamplingParams

    cfg = read_model_config(model_dir)
    max_len = args.input_len + args.output_len
    block = 16
    # Size the KV cache to the workload (plus one spare block per sequence); the default budget is a share
    # of free memory, which would inflate and randomise the RSS figure.
    kv_bytes = batch * (-(-max_len // block) + 1) * block * kv_bytes_per_token(cfg, args.dtype)
    options = dict(
        dtype=args.dtype,
        device="cpu",
        max_model_len=max_len,
        max_num_seqs=batch,
        kv_cache_memory_bytes=kv_bytes,
        block_size=block,
    )
    options["compile"] = "off" if args.worker == "infertune-eager" else args.compile
    system = args.worker.removesuffix("-torch")
    if system != args.worker:  # the same engine with torch's matmuls instead of infertune's decode kernels
        options["decode_kernels"] = "off"
    if system == "infertune-modules":  # the kernels under the per-module forward, without the fused step
        options["decode_kernels"] = "linear"
    if system == "infertune-bf16":  # the bf16 weights as loaded, not in the lossless 12-bit layout
        options["compress_weights"] = "off"
    if system == "infertune-tp2":  # tensor parallel over 2 worker processes, the CPUs split between them
        options["tensor_parallel_size"] = 2
    if system.startswith("infertune-w"):  # a quantized variant: infertune-w8a16, -w4a16, -w8a8 (-q8head: int8 head)
        options["quantization"] = system.split("-")[1]
        options["quantize_lm_head"] = system.endswith("-q8head")
    if args.max_num_batched_tokens:
        options["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.no_prefix_caching:
        options["enable_prefix_caching"] = False
    if args.kv_cache_dtype != "auto":
        options["kv_cache_dtype"] = args.kv_cache_dtype
    if args.speculative_config:
        options["speculative_config"] = args.speculative_config
    if args.kv_compression:
        options["kv_compression"] = args.kv_compression
    log(f"infertune b{batch}: loading LLM({model_dir.name!r}, {options})")
    t0 = time.perf_counter()
    llm = LLM(str(model_dir), **options)
    load_s = time.perf_counter() - t0
    rss_after_load = current_rss_mib()
    vocab = cfg["vocab_size"]
    # (ids only, as the vLLM peer runs: peer_vllm.py sets detokenize=False too)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)

    def once(run: int) -> dict:
        prompts = [{"prompt_token_ids": ids} for ids in make_prompts(args.seed, batch, run, args.input_len, vocab)]
        t_start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        t_end = time.perf_counter()
        for o in outs:
            if o.error:
                raise RuntimeError(f"infertune rejected a prompt: {o.error}")
            n = len(o.outputs[0].token_ids)
            if n != args.output_len:
                raise RuntimeError(
                    f"infertune produced {n} tokens, expected {args.output_len} "
                    f"(finish_reason {o.outputs[0].finish_reason})"
                )
        total = t_end - t_start
        ttft = max(o.metrics.first_token_time for o in outs) - t_start
        return dict(
            total_s=total,
            ttft_s=ttft,
            ttft_mean_request_s=statistics.fmean(o.metrics.ttft for o in outs),
            last_finish_s=max(o.metrics.finished_time for o in outs) - t_start,
            cached_prompt_tokens=sum(o.metrics.num_cached_tokens for o in outs),
            tokens=[o.outputs[0].token_ids for o in outs],
        )

    log(f"infertune b{batch}: loaded in {load_s:.1f} s")
    warmup_s, runs = warm_and_time(f"infertune b{batch}", once, args.repeats)
    try:
        runner = llm.engine.executor.runner
    except AttributeError:  # the model runs in worker processes (tensor parallel): their kernels are per rank
        runner = None
    kernels = getattr(runner, "decode_kernels", None)  # which ISA path ran (the every-CPU issue's reports say it)
    extra = {
        "kv_cache_bytes": kv_bytes,
        # the weights a batch-1 step reads as the engine holds them (12-bit codes, packed int8 / int4 and scales);
        # under tensor parallel each rank holds its share in another process: the parent counts the checkpoint's
        "step_weight_bytes": decode_step_weight_bytes(engine_tensors(runner.model), **moe_shape(cfg))
        if runner is not None
        else None,
        "engine_options": options,
        "compile_s": getattr(runner, "compile_seconds", None),
        "kernels": (kernels.name + (" + fused step" if getattr(runner, "fused", None) is not None else ""))
        if kernels is not None
        else ("torch's" if runner is not None else "per rank (worker processes)"),
    }
    if args.speculative_config:
        sched = llm.engine.scheduler
        extra["spec_decode"] = dict(
            num_drafts=sched.num_drafts,
            num_draft_tokens=sched.num_draft_tokens,
            num_accepted_tokens=sched.num_accepted_tokens,
        )
    return dict(load_s=load_s, warmup_s=warmup_s, rss_after_load_mib=rss_after_load, runs=runs, extra=extra)


def worker_hf(args, model_dir: Path, batch: int) -> dict:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    dtype = getattr(torch, args.dtype)
    log(f"hf b{batch}: loading AutoModelForCausalLM (dtype={args.dtype}, attn={args.hf_attn})")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=args.hf_attn).eval()
    load_s = time.perf_counter() - t0
    rss_after_load = current_rss_mib()
    vocab = model.config.vocab_size
    pad = model.generation_config.pad_token_id
    if pad is None:
        pad = model.generation_config.eos_token_id
        pad = pad[0] if isinstance(pad, list) else (pad if pad is not None else 0)

    def gen(input_ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
        # min_new_tokens = max_new_tokens masks EOS until the end: HF's equivalent of ignore_eos.
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad,
        )
        return out[:, input_ids.shape[1] :]

    def once(run: int) -> dict:
        ids = torch.tensor(make_prompts(args.seed, batch, run, args.input_len, vocab), dtype=torch.long)
        t0 = time.perf_counter()
        gen(ids, 1).tolist()
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        tokens = gen(ids, args.output_len).tolist()
        total = time.perf_counter() - t0
        if any(len(t) != args.output_len for t in tokens):
            raise RuntimeError(f"transformers produced {[len(t) for t in tokens]} tokens, expected {args.output_len}")
        return dict(total_s=total, ttft_s=ttft, tokens=tokens)

    log(f"hf b{batch}: loaded in {load_s:.1f} s")
    with torch.inference_mode():
        warmup_s, runs = warm_and_time(f"hf b{batch}", once, args.repeats)
    extra = {"transformers": transformers.__version__, "attn_implementation": args.hf_attn}
    return dict(load_s=load_s, warmup_s=warmup_s, rss_after_load_mib=rss_after_load, runs=runs, extra=extra)


def run_worker(args) -> int:
    model_dir = Path(args.model)
    if args.worker.startswith("llama.cpp"):  # no torch in this process: its RSS is llama.cpp's own
        result = worker_llama_cpp(args, model_dir, args.worker_batch)
        threads = args.threads
    else:
        import torch

        torch.set_num_threads(args.threads)
        fn = worker_hf if args.worker == "hf" else worker_infertune
        result = fn(args, model_dir, args.worker_batch)
        threads = torch.get_num_threads()
    result.update(
        system=args.worker,
        batch=args.worker_batch,
        peak_rss_mib=peak_rss_mib(),
        rss_end_mib=current_rss_mib(),
        torch_threads=threads,
    )
    sys.stdout.write(RESULT_MARKER + json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0
