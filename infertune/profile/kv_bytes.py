"""The bytes one decode step reads from the KV cache, counted, against what the sequences' cache holds.

`profile` runs one extra decode step (a fresh batch of prompts, each prefilled, then one token decoded for all) under
a TorchDispatchMode that adds up the bytes every operator copies out of the cache storage (the paged attention's
index_select gathers of the block tables' rows; writes and views are not reads). The reference is exact
arithmetic: the tokens each sequence holds times the cache's bytes per token over the layers, which for MLA
(DeepSeek-V2 / V3) is the latent row, kv_lora_rank + qk_rope_head_dim values a token per layer, never the
decompressed K / V (the report gives that figure too, H x (qk_nope + qk_rope + v_head_dim) a token per layer).
A paged read touches whole blocks (every table padded to the longest), so the ratio sits a little above 1.

Reads inside native kernels (the fused C decode step) never reach the dispatcher: there the count says so instead
of reporting zero.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# Operators that only alias the cache (no bytes move) or write it.
_NOT_READS = frozenset(
    {"view", "select", "slice", "_unsafe_view", "unbind", "alias", "as_strided", "expand", "unsqueeze", "detach"}
    | {"index_copy_", "index_put_", "copy_", "fill_", "zero_"}
)


class CacheReadCounter(TorchDispatchMode):
    """Bytes that operators copy out of one storage (their outputs' sizes), and the operators that read it."""

    def __init__(self, storage: torch.Tensor) -> None:
        super().__init__()
        self.ptr = storage.untyped_storage().data_ptr()
        self.read_bytes = 0
        self.readers: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in _NOT_READS:
            return out
        reads = any(
            isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() == self.ptr for a in tree_leaves(args)
        )
        if reads:
            self.read_bytes += sum(t.nbytes for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            self.readers[name] = self.readers.get(name, 0) + 1
        return out


@dataclass(slots=True)
class KvReads:
    seqs: int
    context_tokens: int  # per sequence: the prompt and the token the step decodes
    bytes_per_token: int  # every layer's cache row(s) for one token
    layout: str  # "latent (MLA)" or "K and V"
    read_bytes: int | None  # counted; None where the step's reads ran inside native kernels
    context_bytes: int  # seqs x context_tokens x bytes_per_token
    block_bytes: int  # the block tables' whole blocks: what a paged read touches
    decompressed_bytes: int | None  # MLA: what decompressed K / V of the same tokens would take
    readers: dict[str, int]
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return None if self.read_bytes is None else self.read_bytes / self.context_bytes

    def to_dict(self) -> dict:
        return asdict(self) | {"read_over_context": self.ratio}


def measure_decode_kv_reads(llm, input_len: int, batch: int, prompts: list[list[int]]) -> KvReads:
    """Prefill `prompts` (batch of input_len tokens), then count the KV bytes of the decode step that follows."""
    from infertune.sampling_params import SamplingParams

    engine = llm.engine
    runner = engine.executor.runner
    arch = engine.config.model.arch
    elem = torch.empty((), dtype=runner.dtype).element_size()
    per_layer = runner.attn.kv_bytes_per_token(arch.num_key_value_heads, arch.head_dim, runner.dtype)
    bytes_per_token = arch.num_hidden_layers * per_layer
    ids = [f"infertune-kv-reads-{i}" for i in range(len(prompts))]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    for rid, p in zip(ids, prompts, strict=True):
        engine.add_request(rid, {"prompt_token_ids": p}, params)
    counter = CacheReadCounter(runner._kv_storage)
    # (the fused C step's latent attention counts the cache bytes it reads itself)
    kernel_count = getattr(getattr(runner.fused, "decoder", None), "kv_read_bytes", None)
    try:
        started: set[str] = set()
        for _ in range(4 * len(prompts) + 8):  # prefills (chunked, one after another) until each has its first token
            for out in engine.step():
                if out.outputs and out.outputs[0].token_ids:
                    started.add(out.request_id)
            if started >= set(ids):
                break
        assert started >= set(ids), "the prompts did not all prefill"
        kernel_before = kernel_count() if kernel_count else 0
        with torch.inference_mode(), counter:
            engine.step()  # every sequence decodes its second token: a decode-only step
        kernel_read = kernel_count() - kernel_before if kernel_count else 0
    finally:
        for rid in ids:
            engine.abort_request(rid)
    context = input_len + 1  # the prompt and the first generated token, whose row this step writes and reads
    block = runner.block_size
    mla = arch.mla
    decompressed = (
        len(prompts)
        * context
        * arch.num_hidden_layers
        * arch.num_attention_heads
        * (mla.qk_nope_head_dim + mla.qk_rope_head_dim + mla.v_head_dim)
        * elem
        if mla is not None
        else None
    )
    fused = runner.fused is not None and counter.read_bytes == 0
    uncounted = fused and not kernel_read
    return KvReads(
        seqs=len(prompts),
        context_tokens=context,
        bytes_per_token=bytes_per_token,
        layout="latent (MLA)" if mla is not None else "K and V",
        read_bytes=None if uncounted else (kernel_read if fused else counter.read_bytes),
        context_bytes=len(prompts) * context * bytes_per_token,
        block_bytes=len(prompts) * -(-context // block) * block * bytes_per_token,
        decompressed_bytes=decompressed,
        readers={"fused C step (latent attention, counted by the kernels)": 1}
        if fused and kernel_read
        else counter.readers,
        note="the fused C decode step read the cache inside its kernel (not counted; run with --decode-kernels "
        "linear or off to count it)"
        if uncounted
        else "",
    )


def format_kv_reads(r: dict) -> list[str]:
    if not r:
        return []
    mib = 2**20
    lines = [
        "",
        f"KV-cache reads of one decode step ({r['seqs']} sequences of {r['context_tokens']} tokens; cache rows "
        f"{r['layout']}, {r['bytes_per_token']} B a token over the layers):",
    ]
    if r["read_bytes"] is None:
        lines.append(f"  not counted: {r['note']}")
    else:
        lines.append(
            f"  read {r['read_bytes'] / mib:.3f} MiB = {r['read_over_context']:.3f}x the {r['context_bytes'] / mib:.3f} "
            f"MiB the sequences' tokens hold (whole blocks: {r['block_bytes'] / mib:.3f} MiB); by "
            + ", ".join(f"{k} x{v}" for k, v in r["readers"].items())
        )
    if r.get("decompressed_bytes"):
        lines.append(
            f"  decompressed K / V of the same tokens would be {r['decompressed_bytes'] / mib:.3f} MiB "
            f"({r['decompressed_bytes'] / r['context_bytes']:.1f}x the latent rows)"
        )
    return lines
