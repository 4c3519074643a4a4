"""The runner's side of the fused step: every decoder layer of a step in one call into the backend's kernels.

At batch 1 the eager PyTorch forward of a 24-layer model spends ~15 ms a step outside its matmuls: a dozen aten
dispatches, Python module calls and temporaries per layer. `FusedDecode` hands the whole stack of layers, as the
plain `FusedModel` of kernels/interface.py, to the backend's `DecodeKernels.fused_decoder` (on x86:
kernels/x86_fused.py, one C call per step), and per step decides from the attention metadata whether the step
may run there: decode-only steps of up to `max_rows` sequences, and, where the kernels allow
(`max_prefill_rows`), steps with prompt chunks of up to that many tokens in all (each token a row that attends to
its sequence's cached context and its chunk up to itself: fresh prompts, chunked prefills, prefix-cache hits, and
decodes beside them). Bigger steps keep the PyTorch path.

It takes over only where it computes what the PyTorch path computes (rounded the same way, to bf16 precision):
a Llama-family decoder in bf16 whose every projection the kernels can multiply (`QuantMethod.kernel_weights`),
a bf16 or INT8 paged KV cache, SiLU, full or sliding-window attention (each KV cache group's block tables: the
runner's groups, `kv_groups`); Qwen3's q / k norms; Phi-3 (a Llama decoder once loaded) where rotary turns whole heads
(partial_rotary_factor 1); Gemma 2 / 3 (the (1 + w) norms in fp32, four a layer, GeLU-tanh,
scaled embeddings, each layer's rotary table, Gemma 2's soft-capped scores); and
mixture-of-experts layers (Qwen2-MoE, Qwen3-MoE, Mixtral, DeepSeek: a bf16 or fp32 router, experts the grouped
kernel takes, a shared expert with its gate), whose routing the kernels hand back to the module's `route()` wherever
a tie at the top-k boundary decides a token's experts, as the per-module kernel path does; and DeepSeek's latent
attention (decode steps: the absorbed query over the cached latent rows, bf16 or INT8, csrc/mla.h). `FusedDecode.build` returns None, with the
reason logged, anywhere else.
"""

from __future__ import annotations

import logging

import torch

from infertune.config import GEMMA_ARCHITECTURES
from infertune.kernels.interface import (
    DecodeKernels,
    FusedDecoder,
    FusedLayer,
    FusedMla,
    FusedModel,
    FusedMoE,
    KernelLinear,
    TpAllReduce,
)
from infertune.layers.attention import AttentionMetadata
from infertune.layers.attention.mla import Int8MlaAttention, MlaAttention
from infertune.layers.attention.paged import Int8PagedAttention, TorchPagedAttention
from infertune.layers.moe import MoE

log = logging.getLogger(__name__)


class FusedDecode:
    def __init__(self, decoder: FusedDecoder, block_size: int, groups: tuple = ((None, 0),)) -> None:
        self.decoder = decoder
        # each KV cache group's window and first layer: what finds its metadata (AttentionMetadata.for_window, or
        # for_layer where the runner keys the groups by layer)
        self.groups = groups
        self.max_rows, self.max_prefill_rows = decoder.max_rows, decoder.max_prefill_rows
        self.block_size = block_size

    @classmethod
    def build(
        cls,
        model,
        kv_caches: list[torch.Tensor],
        attn,
        kernels: DecodeKernels | None,
        max_model_len: int,
        block_size: int,
        dtype: torch.dtype,
        step_rows: int = 0,
        kv_groups: tuple | None = None,
        tp=None,
        kv_int4: bool = False,
    ) -> FusedDecode | None:
        """The fused step for this model, or None where it cannot run (logged). step_rows: the most tokens a step
        can hold (the kernels may run whole prefill steps of up to that many). kv_groups: the runner's KV cache
        groups (scheduler_output.KVCacheGroup: each layer's window and block tables); None: one, without a window.
        tp: this rank's layers/parallel.py TensorParallel (None: one process); the step then all-reduces each
        row-parallel output through its shared-memory segment. kv_int4: the block tables may hold the int4 tier's
        entries (CacheConfig.kv_int4_after)."""
        spec = cls.describe(model, kv_caches, attn, kernels, dtype)
        if not isinstance(spec, str):
            spec.kv_int4 = kv_int4
        if not isinstance(spec, str) and tp is not None and tp.size > 1:
            if tp.shm is None:  # (ranks on more than one host, or gloo only: the step calls back tp's all-reduce)
                spec.tp_allreduce = TpAllReduce(0, 0, tp.rank, tp.size, 0, reduce=tp.all_reduce_from_fused_step)
            else:
                spec.tp_allreduce = TpAllReduce(tp.shm.address, tp.shm.seq_address, tp.rank, tp.size, tp.shm.max_numel)
            spec.embed_fn = model.model.embed_tokens  # (vocab-parallel: its lookup and all-reduce)
        groups: tuple = ((None, 0),)
        if not isinstance(spec, str) and kv_groups is not None:
            groups = tuple((g.window, g.layers[0]) for g in kv_groups)
            spec.kv_groups = len(kv_groups)
            for g, group in enumerate(kv_groups):
                for i in group.layers:
                    spec.layers[i].window, spec.layers[i].group = group.window or 0, g
        elif not isinstance(spec, str):
            cut = [w for w in getattr(model.config, "layer_windows", None) or () if w is not None and w < max_model_len]
            if cut:
                spec = f"sliding windows ({cut[0]} tokens) without the runner's KV cache groups"
        if not isinstance(spec, str):
            spec.max_context = -(-max_model_len // block_size) * block_size
            spec.step_rows = step_rows
            spec = kernels.fused_decoder(spec)
        if isinstance(spec, str):
            log.info("fused decode off: %s", spec)
            return None
        return cls(spec, block_size, groups)

    @staticmethod
    def describe(model, kv_caches, attn, kernels, dtype) -> FusedModel | str:
        """The model as the kernels' FusedModel, or why it is not one they could run."""
        if kernels is None:
            return "the backend has no kernels of its own"
        if dtype is not torch.bfloat16:
            return f"the model runs in {dtype}, the fused step in bf16"
        if type(attn) not in (TorchPagedAttention, Int8PagedAttention, MlaAttention, Int8MlaAttention) or (
            getattr(attn, "SCALE_BYTES", 4) != 4
        ):
            return f"attention backend {attn.name} (the fused step reads a bf16 or int8 paged cache)"
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(getattr(model, "model", None), "layers"):
            return f"{type(model).__name__} is not a Llama-family decoder"
        if cfg.num_attention_heads % cfg.num_key_value_heads:
            return f"{cfg.num_attention_heads} heads over {cfg.num_key_value_heads} KV heads"
        gemma = getattr(cfg, "architecture", None) in GEMMA_ARCHITECTURES
        if getattr(cfg, "hidden_act", "silu") not in (("gelu_pytorch_tanh",) if gemma else ("silu", None)):
            return f"hidden_act={cfg.hidden_act}"
        if getattr(cfg, "rotary_dim", None):  # (its table and kernel turn every dim of a head, pairing i with i + D/2)
            return f"partial rotary ({cfg.rotary_dim} of {cfg.head_dim} dims a head; the fused step turns them all)"
        decoder = model.model
        first = decoder.layers[0]
        eps = float(first.input_layernorm.eps)
        # Gemma: the rotary table of each attention kind (Gemma 3's sliding layers have their own base)
        tables = [t.cos_sin for t in decoder.rotary.tables] if gemma else [decoder.rotary.cos_sin]
        spec = FusedModel(
            hidden=cfg.hidden_size,
            n_heads=cfg.num_attention_heads,
            n_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim,
            inter=0,
            block_size=kv_caches[0].shape[2],
            eps=float(first.input_layernorm.eps),
            scale=first.self_attn.scale,
            cos_sin=tables[0],
            kv_int8=isinstance(attn, (Int8PagedAttention, Int8MlaAttention)),
            embed=decoder.embed_tokens.weight,
            final_norm=decoder.norm.weight,
            final_eps=float(decoder.norm.eps),
        )
        if gemma:  # GemmaRMSNorm everywhere, GeLU-tanh, the scaled embeddings, Gemma 2's soft-capped scores
            spec.act, spec.norm = "gelu_tanh", "gemma"
            spec.embed_scale = float(decoder.embed_tokens.scale)
            spec.attn_softcap = float(first.self_attn.softcap or 0.0)
        for i, (layer, cache) in enumerate(zip(decoder.layers, kv_caches)):
            attn_mod, mlp = layer.self_attn, layer.mlp
            lins = {}
            mla = FusedDecode._describe_mla(attn_mod, i) if cfg.mla is not None else None
            if isinstance(mla, str):
                return mla
            projections = [("o", attn_mod.o_proj)] if mla else [("qkv", attn_mod.qkv_proj), ("o", attn_mod.o_proj)]
            if not isinstance(mlp, MoE):
                projections += [("gate_up", mlp.gate_up_proj), ("down", mlp.down_proj)]
            for field, lin in projections:
                lins[field] = _kernel_weights(lin)
                if isinstance(lins[field], str):
                    return f"layer model.layers.{i} {lins[field]} in {field}"
            moe = FusedDecode._describe_moe(mlp, i) if isinstance(mlp, MoE) else None
            if isinstance(moe, str):
                return moe
            q_norm = getattr(attn_mod, "q_norm", None)
            if q_norm is not None and not (float(q_norm.eps) == float(attn_mod.k_norm.eps) == eps):
                return f"q / k norms with epsilon {q_norm.eps} beside the layers' {eps}"
            sandwich = (layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm) if gemma else ()
            if any(float(n.eps) != eps for n in (layer.post_attention_layernorm, *sandwich)):
                return f"norms of model.layers.{i} with an epsilon other than {eps}"
            for down in (lins.get("down"), moe and moe.shared_down):
                if down is not None:
                    spec.inter = max(spec.inter, down.in_features)
            spec.layers.append(
                FusedLayer(
                    input_norm=layer.input_layernorm.weight,
                    post_norm=layer.post_attention_layernorm.weight,
                    kv_cache=cache,
                    qkv=lins.get("qkv"),
                    o=lins["o"],
                    gate_up=lins.get("gate_up"),
                    down=lins.get("down"),
                    q_norm=q_norm.weight if q_norm is not None else None,
                    k_norm=attn_mod.k_norm.weight if q_norm is not None else None,
                    moe=moe,
                    pre_ff_norm=sandwich[0].weight if gemma else None,
                    post_ff_norm=sandwich[1].weight if gemma else None,
                    cos_sin=tables[layer.rope_kind] if gemma and layer.rope_kind else None,
                    mla=mla,
                )
            )
        return spec

    @staticmethod
    def _describe_mla(attn_mod, i: int) -> FusedMla | str:
        """A latent-attention layer (models/deepseek.py DeepseekAttention) as the kernels' FusedMla, or why not."""
        lins = {}
        names = ("q_a", "q_a_proj"), ("q_b", "q_b_proj"), ("kv_a", "kv_a_proj_with_mqa")
        for field, name in names if attn_mod.q_lora else (("q_b", "q_proj"), names[2]):
            lins[field] = _kernel_weights(getattr(attn_mod, name))
            if isinstance(lins[field], str):
                return f"layer model.layers.{i} {lins[field]} in {name}"
        up = attn_mod.kv_b_proj.weight.detach()
        if up.dtype is not torch.bfloat16:
            return f"layer model.layers.{i} keeps kv_b_proj in {up.dtype}"
        norm_eps = {float(attn_mod.kv_a_layernorm.eps)}
        if attn_mod.q_lora:
            norm_eps.add(float(attn_mod.q_a_layernorm.eps))
        if len(norm_eps) != 1:
            return f"latent norms of model.layers.{i} with two epsilons {sorted(norm_eps)}"
        return FusedMla(
            q_a=lins.get("q_a"),
            q_a_norm=attn_mod.q_a_layernorm.weight.detach() if attn_mod.q_lora else None,
            q_b=lins["q_b"],
            kv_a=lins["kv_a"],
            kv_a_norm=attn_mod.kv_a_layernorm.weight.detach(),
            kv_up=up,
            rank=attn_mod.rank,
            rope=attn_mod.rope_dim,
            nope=attn_mod.nope_dim,
            v_dim=attn_mod.v_dim,
            interleaved=bool(attn_mod.interleaved),
            latent_eps=norm_eps.pop(),
        )

    @staticmethod
    def _describe_moe(mlp: MoE, i: int) -> FusedMoE | str:
        """A MoE layer as the kernels' FusedMoE, or why they could not run it."""
        where = f"the MoE of model.layers.{i}"
        router, experts = mlp.gate, mlp.experts
        if router.weight.dtype not in (torch.bfloat16, torch.float32):
            return f"{where} routes in {router.weight.dtype} (the fused step takes bf16 and fp32 routers)"
        kernel_experts = experts.kernel_view()  # (expert parallel: this rank's block)
        if kernel_experts is None:
            return f"{where} keeps its experts as {experts.quant_method.name}, which the grouped kernel does not take"
        spec = FusedMoE(
            moe=mlp.moe,
            router=router.weight.detach(),
            correction_bias=(
                router.e_score_correction_bias.detach().float().contiguous()
                if router.e_score_correction_bias is not None
                else None
            ),
            experts=kernel_experts,
            route=router._route,
        )
        if mlp.shared_name is not None:
            shared = getattr(mlp, mlp.shared_name)
            for field, lin in (("shared_gate_up", shared.gate_up_proj), ("shared_down", shared.down_proj)):
                got = _kernel_weights(lin)
                if isinstance(got, str):
                    return f"{where}: its shared expert {got}"
                setattr(spec, field, got)
            if mlp.shared_expert_gate is not None:
                spec.shared_gate = mlp.shared_expert_gate.weight.detach()
        return spec

    def applicable(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """A decode-only step (one new token per sequence) of at most max_rows sequences, or, where the kernels take
        prompt rows, any step with prompt chunks (fresh prompts, later chunks of a chunked prefill, prompts after a
        prefix-cache hit; decodes beside them) of at most max_prefill_rows tokens in all."""
        if not meta.prefills:
            return meta.num_decode_tokens == num_tokens <= self.max_rows
        # (a chunk with earlier KV carries the slots of its whole context: its block table comes from them)
        return num_tokens <= self.max_prefill_rows and all(
            c.context_slots is not None or c.context_len == c.query_len for c in meta.prefills
        )

    def _step_tables(self, meta: AttentionMetadata, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token row of a step with prompt chunks: its sequence's block table and its context length (its
        position + 1). Decode rows (first) keep theirs; a chunk's table comes from the slots of its context (of the
        chunk's own tokens where it is a whole fresh prompt, which starts a block), so each row attends to the
        cached context (a prefix-cache hit, the earlier chunks) and its chunk up to itself. (A windowed KV cache group
        holds every block a row's window reaches.)"""
        bs, nd = self.block_size, meta.num_decode_tokens
        blocks = [
            (c.context_slots if c.context_slots is not None else meta.slot_mapping[c.query_start :])[
                : c.context_len : bs
            ]
            // bs
            for c in meta.prefills
        ]
        width = max([b.numel() for b in blocks] + ([meta.decode_block_tables.shape[1]] if nd else []))
        tables = torch.zeros(t, width, dtype=torch.int64)
        lens = torch.empty(t, dtype=torch.int64)
        if nd:
            tables[:nd, : meta.decode_block_tables.shape[1]] = meta.decode_block_tables
            lens[:nd] = meta.decode_context_lens
        for c, b in zip(meta.prefills, blocks):
            s, n = c.query_start, c.query_len
            tables[s : s + n, : b.numel()] = b
            lens[s : s + n] = torch.arange(c.context_len - n + 1, c.context_len + 1)
        return tables, lens

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm: a view of a buffer the next step overwrites.

        out_rows (int64, ascending, unique): the only rows the caller reads. Past the last layer's attention just
        those rows go on through o_proj and the MLP (a prompt's other rows need their K / V in every layer, not
        their last hidden state); the other rows of the result are then undefined."""
        t = input_ids.shape[0]
        if len(self.groups) == 1:
            tables, lens = self._step_tables(meta, t) if meta.prefills else self._decode_tables(meta)
            return self.decoder(input_ids, positions, meta.slot_mapping, tables, lens, out_rows)
        # each KV cache group's slots and block tables, stacked (the tables padded to one width)
        metas = [meta.for_layer(i) if meta.by_layer is not None else meta.for_window(w) for w, i in self.groups]
        got = [self._step_tables(m, t) if meta.prefills else self._decode_tables(m) for m in metas]
        width = max(tab.shape[1] for tab, _ in got)
        tables = torch.stack([torch.nn.functional.pad(tab, (0, width - tab.shape[1])) for tab, _ in got])
        slots = torch.stack([m.slot_mapping for m in metas])
        return self.decoder(input_ids, positions, slots, tables, got[0][1], out_rows)

    @staticmethod
    def _decode_tables(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        return meta.decode_block_tables, meta.decode_context_lens

    def step_timers(self, reset: bool = False) -> dict[str, float]:
        """This engine's fused step: seconds per part since the last reset, "calls" and "rows" (FusedDecoder's)."""
        return self.decoder.step_timers(reset)

    def take_allreduce(self) -> tuple[int, int, float] | None:
        """Tensor parallel: the all-reduces this engine's fused steps ran inside the kernels since the last take
        (pieces, bytes, seconds), those counts then zeroed; None where the decoder does not count them."""
        take = getattr(self.decoder, "take_allreduce", None)
        return take() if take is not None else None

    def count_experts(self, on: bool) -> bool:
        """Count the rows each MoE layer of the fused steps routes to each expert (`expert_load`); False where the
        decoder does not count (no MoE layer, or kernels that do not)."""
        count = getattr(self.decoder, "count_experts", None)
        return bool(count is not None and count(on))

    def expert_load(self, reset: bool = False) -> dict[int, torch.Tensor]:
        """Decoder layer index -> rows its MoE layer routed to each expert [E] in the fused steps counted."""
        load = getattr(self.decoder, "expert_load", None)
        return load(reset) if load is not None else {}


def _kernel_weights(lin) -> KernelLinear | str:
    """A linear layer as the kernels see it, or (a phrase) why they do not take it."""
    got = lin.quant_method.kernel_weights(lin)
    return got if got is not None else f"runs {lin.quant_method.name}, which the kernels do not"
