"""Plain-text rendering of a plan dict (the default output of `infertune plan`)."""

from __future__ import annotations

import json


def _gb(n: float | None) -> str:
    """Decimal units, scaled to the size (1 GB = 1e9 bytes)."""
    if n is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def _opt(v: float | None, fmt: str) -> str:
    return "n/a" if v is None else format(v, fmt)


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))  # noqa: E731
    return [line(headers), "  ".join("-" * w for w in widths), *(line(r) for r in rows)]


def _moe_line(m: dict, w: dict, rows: list[dict]) -> list[str]:
    """The MoE summary: active parameters, and the experts (and weight bytes) a decode step touches by batch."""
    moe = m["moe"]
    if moe is None:
        return []
    first, last = rows[0], rows[-1]
    return [
        f"  MoE         {moe['num_experts']} experts, top-{moe['top_k']}, in {moe['moe_layers']} layers"
        + (f" (+ a shared expert of {moe['shared_intermediate_size']})" if moe["shared_intermediate_size"] else "")
        + f": {w['params_active']:,} params active a token ({w['params_active_streamed']:,} without the input "
        f"embedding); a decode step touches {first['experts_touched_per_layer']:.1f} experts a layer at batch "
        f"{first['batch']}, {last['experts_touched_per_layer']:.1f} at batch {last['batch']}"
    ]


def render_text(plan: dict) -> str:
    m, d, s, w, kv, mem, pre = (plan[k] for k in ("model", "device", "settings", "weights", "kv", "memory", "prefill"))
    tp, ctx = s["tp"], s["context"]
    eff = s["efficiency"]
    out = [
        f"infertune plan: {m['name']} ({m['architecture']}) on {d['display_name']}"
        + (f", tensor parallel {tp}" if tp > 1 else ""),
        f"  workload    {s['input_len']} input + {s['output_len']} output tokens; KV sized for {ctx}-token sequences",
        f"  weights     {w['params']:,} params in {s['weight_dtype']}"
        + (f" (group {s['group_size']})" if s["weight_dtype"] == "w4a16" else "")
        + (f" (blocks of {' x '.join(map(str, s['fp8_block']))})" if s["fp8_block"] else "")
        + f": {_gb(w['bytes'])} ({w['bytes']:,} B)"
        + (f", of which quant scales {_gb(w['bytes_quant_scales'])}" if w["bytes_quant_scales"] else "")
        + f"; {_gb(w['bytes_per_card'])} per card; {_gb(w['bytes_streamed_per_step'])} read per forward step"
        + (" that touches every expert" if m["moe"] else ""),
        *_moe_line(m, w, plan["by_batch"]),
        f"  KV cache    {kv['bytes_per_token']:,} B per token ({'16-bit' if s['kv_dtype'] == 'auto' else s['kv_dtype']}"
        + (f", {kv['factor_vs_16bit']:.4f} x 16-bit" if s["kv_dtype"] == "int8" else "")
        + (
            f"; tokens {s['kv_int4_after']} or more behind the newest in int4 (the int4 tier)"
            if s.get("kv_int4_after") is not None
            else ""
        )
        + (
            f"; compressed after each {s['input_len']}-token prompt by kv_compression {json.dumps(s['kv_compression'])}"
            if s.get("kv_compression") is not None
            else ""
        )
        + (f"; MLA latent of {m['mla']['kv_lora_rank']} + {m['mla']['qk_rope_head_dim']} a layer" if m["mla"] else "")
        + f"); {_gb(kv['bytes_per_sequence'])} per {ctx}-token sequence"
        + (f"; {_gb(kv['bytes_for_batch'])} for batch {s['batch']}" if kv["bytes_for_batch"] is not None else ""),
        *_kv_group_lines(kv, ctx),
        f"  memory      {_gb(mem['device_bytes'])} per card, {_gb(mem['usable_bytes'])} usable "
        f"({s['memory_utilization']:.0%}); weights {_gb(mem['weights_bytes_per_card'])}, activations "
        f"{_gb(mem['activation_reserve_bytes'])}, KV budget {_gb(mem['kv_budget_bytes_per_card'])}",
        f"              -> at most {mem['max_concurrent_sequences']:,} concurrent {ctx}-token sequences"
        + (
            f" (and room for one prompt held whole until its press runs: {_gb(mem['kv_prefill_peak_bytes_per_card'])})"
            if mem.get("kv_prefill_peak_bytes_per_card")
            else ""
        ),
        *_engine_kv_lines(mem, ctx),
        f"  roofline    {d['memory_bandwidth_bytes_per_s'] / 1e9:,.1f} GB/s x {eff['bandwidth']:.0%}, "
        f"{d['bf16_tflops']:,.3g} TFLOPS x {eff['compute']:.0%}  [{eff['source']}]",
        f"  prefill     TTFT of one {s['input_len']}-token prompt {pre['ttft_s'] * 1e3:,.1f} ms ({pre['bound']}-bound); "
        f"{pre['tokens_per_s']:,.0f} prompt tok/s in steps of {pre['chunk_prompts']} prompt(s)",
        "",
    ]
    headers = [
        "batch",
        "fits",
        "TTFT ms",
        "TPOT ms",
        "decode",
        "decode tok/s",
        "e2e out tok/s",
        "weights read/card",
        "KV/card",
        "$/M out tok",
        "out tok/J",
    ]
    rows = []
    for r in plan["by_batch"]:
        mark = "*" if r["batch"] == s["batch"] else ""
        rows.append(
            [
                f"{mark}{r['batch']}",
                "yes" if r["fits"] else "OOM",
                f"{r['ttft_s'] * 1e3:,.1f}",
                f"{r['tpot_s'] * 1e3:,.2f}",
                r["decode_bound"],
                f"{r['decode_tokens_per_s']:,.1f}",
                f"{r['output_tokens_per_s']:,.1f}",
                _gb(r["weight_bytes_read_per_card"]),
                _gb(r["kv_bytes_per_card"]),
                _opt(r["usd_per_million_output_tokens"], ",.3f"),
                _opt(r["output_tokens_per_joule"], ",.2f"),
            ]
        )
    out += _table(headers, rows)
    price = s["price_usd_per_hour_per_card"]
    out.append(
        f"  e2e = {s['input_len']}-token prefill of the whole batch, then {s['output_len'] - 1} decode steps; "
        + (f"$ at {price:g} USD/h per card" if price is not None else "no price: pass --price-per-hour")
        + ("" if d.get("tdp_watts") else "; no TDP in the catalog")
    )
    pd = plan["pd_split"]
    if pd:
        out += [
            "",
            f"  P/D split   {pd['cards']} cards ({pd['instances']} instances of {pd['cards_per_instance']}): "
            f"{pd['prefill_instances']} prefill + {pd['decode_instances']} decode -> {pd['requests_per_s']:,.2f} req/s "
            f"({pd['bottleneck']}-limited; decode batch {pd['decode_batch']})",
            f"              per instance: prefill {pd['prefill_requests_per_s_per_instance']:,.2f} req/s, decode "
            f"{pd['decode_requests_per_s_per_instance']:,.2f} req/s; ideal prefill share "
            f"{pd['ideal_prefill_share']:.1%}; colocated {pd['colocated_requests_per_s']:,.2f} req/s",
        ]
        if pd["rate"] is not None:
            out.append(
                f"              for {pd['rate']:g} req/s: {pd['prefill_instances_for_rate']} prefill + "
                f"{pd['decode_instances_for_rate']} decode instances"
            )
    out += [f"  warning: {msg}" for msg in plan["warnings"]]
    return "\n".join(out)


def _kv_group_lines(kv: dict, ctx: int) -> list[str]:
    """Where layers attend within sliding windows: each kind of layer group's tokens and bytes of KV a sequence."""
    groups = kv.get("groups") or []
    if all(g["window"] is None and not g.get("compressed") for g in groups):
        return []

    def kind(g: dict) -> str:
        if g["window"] is not None:
            return f"window {g['window']}"
        return "compressed" if g.get("compressed") else "full attention"

    parts = [
        f"{kind(g)}: {g['layers']} layers"
        f"{' in ' + str(g['groups']) + ' groups' if g.get('groups', 1) > 1 else ''} x "
        f"{g['tokens_per_sequence']:,} tokens = {_gb(g['bytes_per_sequence'])}"
        for g in groups
    ]
    lines = [f"  KV groups   per {ctx}-token sequence: " + "; ".join(parts)]
    pages = max((g.get("pages_per_block", 0) for g in groups), default=0)
    empty = [g for g in groups if g["layers"] < g.get("groups", 1) * pages]
    if empty:  # (a block is a page of each layer of the largest group: a group of fewer layers pays for the rest)
        lines.append(
            f"              each block holds {pages} layers' pages; "
            + ", ".join(f"{kind(g)} leaves {g.get('groups', 1) * pages - g['layers']} empty" for g in empty)
            + " (counted in the KV totals)"
        )
    return lines


def _engine_kv_lines(mem: dict, ctx: int) -> list[str]:
    """A probed local device: what `serve` here sizes by default, and the flag that gives the plan's budget instead."""
    if "engine_kv_bytes_per_card" not in mem:
        return []
    budget = max(0, mem["kv_budget_bytes_per_card"])
    return [
        f"  engine      `serve` here takes kv_cache_memory_fraction {mem['engine_kv_memory_fraction']:g} of the memory "
        f"free after loading ({_gb(mem['free_bytes'])} free now, less the weights),",
        f"              at most max_num_seqs={mem['engine_max_num_seqs']} sequences' worth: KV "
        f"{_gb(mem['engine_kv_bytes_per_card'])} -> {mem['engine_max_concurrent_sequences']:,} concurrent {ctx}-token "
        "sequences",
        f"              for this plan's budget: serve --kv-cache-memory-bytes {budget} --max-num-seqs "
        f"{max(1, mem['max_concurrent_sequences'])} --max-model-len {ctx}",
    ]
