"""make_plan: one model on one device -> memory, KV, roofline by batch, cost and the P/D split, as a plain dict.

The dict is what `infertune plan --json` prints; render.py turns it into the human table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infertune.plan.catalog import Device
from infertune.plan.cost import pd_split, tokens_per_joule, usd_per_million_tokens
from infertune.plan.memory import (
    KVFormat,
    ModelSpec,
    WeightFormat,
    kv_bytes,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_shard_fraction,
    memory_budget,
    weight_bytes_per_card,
)
from infertune.plan.roofline import (
    BATCH_SWEEP,
    Efficiency,
    Roofline,
    calibrate_decode,
    calibrate_prefill,
    default_efficiency,
)


@dataclass
class PlanRequest:
    spec: ModelSpec
    device: Device
    tp: int = 1
    input_len: int = 1536
    output_len: int = 512
    context: int | None = None  # tokens per sequence for KV sizing; default input_len + output_len
    batch: int | None = None  # the batch to highlight (and for calibration / the decode side of the P/D split)
    weight_format: WeightFormat | None = None  # default: the checkpoint's (fp8 for an fp8 checkpoint), else bf16
    kv_format: KVFormat = field(default_factory=KVFormat)
    efficiency: Efficiency | None = None
    measured_decode_tps: float | None = None
    measured_prefill_tps: float | None = None
    memory_utilization: float = 0.90
    tokens_per_step: int = 2048  # the engine's max_num_batched_tokens: prefill chunk and activation reserve
    price_per_hour: float | None = None  # per card; overrides the catalog
    cards: int | None = 8  # for the P/D split; None or 0 skips it
    rate: float | None = None  # requests/s the P/D split must sustain


def _validate(req: PlanRequest) -> list[str]:
    warnings = []
    for name in ("input_len", "output_len", "tokens_per_step"):
        if getattr(req, name) < 1:
            raise ValueError(f"{name.replace('_', '-')} must be >= 1 (got {getattr(req, name)})")
    if req.context is None:
        req.context = req.input_len + req.output_len
    if req.context < req.input_len + req.output_len:
        raise ValueError(
            f"--context {req.context} is shorter than --input-len + --output-len "
            f"({req.input_len} + {req.output_len}); raise --context or shorten the workload"
        )
    if req.batch is not None and req.batch < 1:
        raise ValueError(f"--batch must be >= 1 (got {req.batch})")
    limit = req.spec.arch.max_position_embeddings
    if req.context > limit:
        warnings.append(f"context {req.context} exceeds the model's max_position_embeddings ({limit})")
    if req.weight_format is None:
        req.weight_format = req.spec.weight_format or WeightFormat()
        if req.spec.quant_method and req.spec.weight_format is None:
            warnings.append(
                f"config.json's quantization_config (quant_method={req.spec.quant_method!r}) is not modelled: "
                "weights are counted in bf16; pass --weight-dtype for another format"
            )
    if req.spec.checkpoint_dtype == "float32" and req.weight_format.name == "bf16":
        warnings.append(
            "the checkpoint is float32: the engine's dtype=auto keeps float32, twice these weight and KV bytes; "
            "this plan counts 16-bit, what `--dtype bfloat16` runs"
        )
    return warnings


def make_plan(req: PlanRequest) -> dict:
    warnings = _validate(req)
    spec, dev, tp, a = req.spec, req.device, req.tp, req.spec.arch
    roof = Roofline(spec, dev, req.weight_format, req.kv_format, tp, req.efficiency or default_efficiency(dev))
    avg_context = req.input_len + max(1, req.output_len // 2)
    calib_batch = req.batch or 1
    if req.measured_decode_tps is not None:
        roof = Roofline(
            spec,
            dev,
            req.weight_format,
            req.kv_format,
            tp,
            calibrate_decode(roof, req.measured_decode_tps, calib_batch, avg_context),
        )
    if req.measured_prefill_tps is not None:
        roof = Roofline(
            spec,
            dev,
            req.weight_format,
            req.kv_format,
            tp,
            calibrate_prefill(roof, req.measured_prefill_tps, req.input_len),
        )
    w = roof.weights
    mem = memory_budget(
        spec,
        req.weight_format,
        req.kv_format,
        dev.memory_bytes,
        req.context,
        tp,
        req.memory_utilization,
        req.tokens_per_step,
        batch_for_logits=min(256, req.batch or 256),
    )
    if not mem.fits:
        warnings.append(
            f"not even one {req.context}-token sequence fits on {dev.name} with --tp {tp}: "
            f"weights {mem.weights_bytes / 1e9:.2f} GB per card, KV budget {mem.kv_budget_bytes / 1e9:.2f} GB"
        )
    if tp > 1 and not (dev.interconnect and dev.interconnect.bandwidth_bytes_per_s):
        warnings.append(
            f"{dev.name} has no interconnect bandwidth in the catalog: tensor-parallel communication is not counted"
        )
    price = req.price_per_hour if req.price_per_hour is not None else (dev.price.usd_per_hour if dev.price else None)

    batches = sorted(set(BATCH_SWEEP) | ({req.batch} if req.batch else set()))
    rows = []
    for b in batches:
        gen = roof.generation(req.input_len, req.output_len, b)
        rows.append(
            {
                **gen,
                "fits": b <= mem.max_concurrent_sequences,
                "weight_bytes_read_per_card": roof.weight_bytes_per_card(b),
                "experts_touched_per_layer": w.experts_touched(b) if w.moe_layers else None,
                "kv_bytes_per_card": int(kv_bytes(spec, req.context, b, req.kv_format) * kv_shard_fraction(spec, tp)),
                "usd_per_million_output_tokens": usd_per_million_tokens(price, tp, gen["output_tokens_per_s"]),
                "output_tokens_per_joule": tokens_per_joule(gen["output_tokens_per_s"], dev.tdp_watts, tp),
            }
        )

    single = roof.prefill(req.input_len, 1)
    k = max(1, req.tokens_per_step // req.input_len)
    chunk = roof.prefill(req.input_len, k)
    pd = None
    if req.cards and req.cards // tp < 2:
        warnings.append(
            f"no prefill / decode split: --cards {req.cards} makes one instance of --tp {tp}; "
            f"pass --cards {2 * tp} or more for one"
        )
    elif req.cards:
        if req.cards % tp:
            raise ValueError(f"--cards {req.cards} is not a multiple of --tp {tp}")
        decode_batch = req.batch or max(1, min(256, mem.max_concurrent_sequences))
        pd = pd_split(
            req.cards // tp,
            roof.prefill_requests_per_s(req.input_len, req.tokens_per_step),
            roof.decode_requests_per_s(req.input_len, req.output_len, decode_batch),
            req.rate,
        ).to_dict()
        pd.update(cards=req.cards, cards_per_instance=tp, decode_batch=decode_batch)

    fp16_kv = kv_bytes_per_token(spec, KVFormat("bf16"))
    return {
        "model": {
            "name": spec.name,
            "architecture": a.architecture,
            "layers": a.num_hidden_layers,
            "hidden_size": a.hidden_size,
            "intermediate_size": a.intermediate_size,
            "heads": a.num_attention_heads,
            "kv_heads": a.num_key_value_heads,
            "head_dim": a.head_dim,
            "vocab_size": a.vocab_size,
            "tied_embeddings": a.tie_word_embeddings,
            "moe": None
            if a.moe is None
            else {
                "num_experts": a.moe.num_experts,
                "top_k": a.moe.top_k,
                "expert_intermediate_size": a.moe.intermediate_size,
                "shared_intermediate_size": a.moe.shared_intermediate_size,
                "moe_layers": len(a.moe.layers),
            },
            "mla": None
            if a.mla is None
            else {
                "q_lora_rank": a.mla.q_lora_rank,
                "kv_lora_rank": a.mla.kv_lora_rank,
                "qk_nope_head_dim": a.mla.qk_nope_head_dim,
                "qk_rope_head_dim": a.mla.qk_rope_head_dim,
                "v_head_dim": a.mla.v_head_dim,
            },
            "attention_bias": a.attention_bias,
            "sliding_window": a.sliding_window,
            "windowed_layers": spec.num_windowed_layers,
            "max_position_embeddings": a.max_position_embeddings,
        },
        "device": dev.to_dict(),
        "settings": {
            "tp": tp,
            "context": req.context,
            "input_len": req.input_len,
            "output_len": req.output_len,
            "batch": req.batch,
            "weight_dtype": req.weight_format.name,
            "group_size": req.weight_format.group_size,
            "fp8_block": list(req.weight_format.block or ()) if req.weight_format.name == "fp8" else None,
            "quantize_lm_head": req.weight_format.quantize_lm_head,
            "kv_dtype": req.kv_format.name,
            "kv_int8_scale_bytes": req.kv_format.scale_bytes if req.kv_format.name == "int8" else None,
            "kv_int4_after": req.kv_format.int4_after,
            "kv_compression": (req.kv_format.compression.source if req.kv_format.compression is not None else None),
            "memory_utilization": req.memory_utilization,
            "tokens_per_step": req.tokens_per_step,
            "price_usd_per_hour_per_card": price,
            "efficiency": {"bandwidth": roof.eff.bandwidth, "compute": roof.eff.compute, "source": roof.eff.source},
        },
        "weights": {
            "params": w.total_params,
            "params_active": w.params_active,
            "params_active_streamed": w.params_active_streamed,
            "params_routed_experts": w.params_routed_experts,
            "params_embedding": w.params_embedding,
            "params_lm_head": w.params_lm_head,
            "params_attention": w.params_attention,
            "params_mlp": w.params_mlp,
            "params_norms": w.params_norms,
            "bytes": w.total_bytes,
            "bytes_quant_scales": w.bytes_quant_scales,
            "bytes_per_card": weight_bytes_per_card(w, tp),
            "bytes_streamed_per_step": w.streamed_bytes_per_step,
            "bytes_expert": w.bytes_expert,
        },
        "kv": {
            "bytes_per_token": kv_bytes_per_token(spec, req.kv_format),
            "bytes_per_token_16bit": fp16_kv,
            "factor_vs_16bit": kv_bytes_per_token(spec, req.kv_format) / fp16_kv,
            "bytes_per_sequence": kv_bytes_per_sequence(spec, req.context, req.kv_format),
            "bytes_for_batch": kv_bytes(spec, req.context, req.batch, req.kv_format) if req.batch else None,
            "groups": _kv_groups(spec, req.context, req.kv_format),
        },
        "memory": {
            "device_bytes": mem.device_bytes,
            "usable_bytes": mem.usable_bytes,
            "weights_bytes_per_card": mem.weights_bytes,
            "activation_reserve_bytes": mem.activation_bytes,
            "kv_budget_bytes_per_card": mem.kv_budget_bytes,
            "kv_bytes_per_sequence_per_card": mem.kv_bytes_per_sequence,
            "max_concurrent_sequences": mem.max_concurrent_sequences,
            "kv_prefill_peak_bytes_per_card": mem.prefill_peak_bytes,
            **_engine_default_kv(dev, mem, tp),
        },
        "prefill": {
            "ttft_s": single.time_s,
            "bound": single.bound,
            "chunk_prompts": k,
            "tokens_per_s": chunk.tokens_per_s,
            "chunk_bound": chunk.bound,
        },
        "by_batch": rows,
        "pd_split": pd,
        "warnings": warnings,
    }


def _kv_groups(spec, context: int, kv) -> list[dict]:
    """Per kind of KV cache group (the layers attending within one window, in full, or compressed by one press: the
    engine's block tables, a kind cut into several equal groups where the kinds' layer counts differ), the tokens
    and pool bytes of KV one `context`-token sequence holds in it: a window's layers at most the window (the engine
    holds up to one block more), a compressed one what its press keeps of the prompt, each group in blocks of the
    largest group's pages."""
    from infertune.plan.memory import kv_bytes_per_token_per_layer, kv_group_tokens, kv_int4_bytes_per_token_per_layer

    per_layer = kv_bytes_per_token_per_layer(spec, kv)
    groups = kv_group_tokens(spec, context, kv)
    pages = max(len(g.layers) for g, _ in groups)
    out: dict = {}
    for g, tokens in groups:
        nbytes = tokens * pages * per_layer
        if kv.int4_after is not None and g.window is None:  # (the int4 tier: full layers' old tokens)
            old = max(0, tokens - kv.int4_after)
            nbytes -= old * pages * (per_layer - kv_int4_bytes_per_token_per_layer(spec))
        row = out.setdefault(
            (g.window, g.compressed and kv.pressed, tokens),
            {
                "window": g.window,
                "compressed": bool(g.compressed and kv.pressed),
                "layers": 0,
                "groups": 0,
                "pages_per_block": pages,
                "tokens_per_sequence": tokens,
                "bytes_per_sequence": 0,
            },
        )
        row["layers"] += len(g.layers)
        row["groups"] += 1
        row["bytes_per_sequence"] += nbytes
    return list(out.values())


def _engine_default_kv(dev, mem, tp: int) -> dict:
    """On a probed local device, what `serve` there takes without a KV byte budget: CacheConfig's
    kv_cache_memory_fraction of the memory free after loading (free when probed, less the weights), the ranks' shares
    of one host, at most SchedulerConfig's max_num_seqs full sequences (CacheConfig.default_kv_budget, the engine's rule); {} elsewhere."""
    if dev.free_memory_bytes is None:
        return {}
    from infertune.config import CacheConfig, SchedulerConfig

    cache, max_seqs = CacheConfig(), SchedulerConfig().max_num_seqs
    free_after = max(0, dev.free_memory_bytes - mem.weights_bytes * tp)
    per_card = cache.default_kv_budget(free_after, tp, max_seqs, mem.kv_bytes_per_sequence)
    seqs = per_card // mem.kv_bytes_per_sequence if mem.kv_bytes_per_sequence else 0
    return {
        "free_bytes": dev.free_memory_bytes,
        "engine_kv_memory_fraction": cache.kv_cache_memory_fraction,
        "engine_kv_bytes_per_card": per_card,
        "engine_max_concurrent_sequences": int(seqs),
        "engine_max_num_seqs": max_seqs,
    }
