"""The fused step on x86 (and on Arm): every decoder layer of a step in one call to it_decode_layers (csrc/fused_step.h,
over the AVX-512 library's parts, the AVX2 library's, csrc/x86/avx2/fused.c, or the NEON library's, csrc/arm/neon/
fused.c, which kernels/arm.py hands in as the AVX2 library's stand-in).

At batch 1 the eager PyTorch forward of a 24-layer model spends ~15 ms a step outside its matmuls: a dozen aten
dispatches, Python module calls and temporaries per layer. Here the whole stack (norms, projections, rotary, the
paged-KV write, attention, SiLU-and-multiply and the residuals) runs in one C function per step, with all scratch
in one workspace allocated once and the residual stream and output in reused buffers, so a step allocates no
tensor. Which steps may run here is decided from the model alone (`build`); the runner (runner/fused_decode.py)
decides per step from its attention metadata.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from infertune.kernels import cpu
from infertune.kernels.interface import FusedMla, FusedModel, FusedMoE, KernelLinear

if TYPE_CHECKING:
    from infertune.config import MoeArch


class X86FusedDecoder:
    def __init__(
        self,
        model: FusedModel,
        cmodel,
        layers,
        keep,
        max_rows: int,
        max_prefill_rows: int,
        lib,
        final_norm: int,
        moe_shapes: Iterable[tuple[int, int, int]] = (),
    ) -> None:
        """moe_shapes: (top_k, experts, expert width) of each MoE layer, for the experts' part of the workspace."""
        self.cmodel, self.layers, self._keep = cmodel, layers, keep
        self.max_rows, self.max_prefill_rows = max_rows, max_prefill_rows
        self.lib = lib
        self.hidden = model.hidden
        rows = max(max_rows, max_prefill_rows)
        self.max_context = model.max_context
        nbytes = self.lib.it_decode_workspace_bytes(ctypes.byref(cmodel), rows, model.max_context)
        # the routed experts' scratch, past that (csrc/moe.h it_moe_experts_ws_bytes): the most any MoE layer needs
        nbytes += max(
            (self.lib.it_moe_experts_ws_bytes(rows, k, e, self.hidden, i, cmodel.nthreads) for k, e, i in moe_shapes),
            default=0,
        )
        self.workspace = torch.empty(nbytes + 64, dtype=torch.uint8)  # the step's only scratch, reused
        # This decoder's own counters (one per engine: the library keeps none), written by each step it runs
        self.stats = cpu.ItStepStats()
        self.step = cpu.ItStep(
            work=(self.workspace.data_ptr() + 63) // 64 * 64, work_bytes=nbytes, stats=ctypes.addressof(self.stats)
        )
        # MoE layers: where their router logits go, and the PyTorch routing a tie at the top-k boundary hands back to
        self.routes = {
            i: (layer.moe.route, layer.moe.moe.num_experts, layer.moe.router.dtype)
            for i, layer in enumerate(model.layers)
            if layer.moe
        }
        # (fp32 wide: an fp32 router's logits; a bf16 router's are a bf16 view of its first half)
        self.router_logits = torch.empty(rows, max(cmodel.moe_experts, 1), dtype=torch.float32)
        self.step.router_logits = self.router_logits.data_ptr()
        self.tied_rows = torch.empty(rows, dtype=torch.int64)  # (a hand-back's tied rows, written by the step)
        self.step.tied_rows = self.tied_rows.data_ptr()
        self.handbacks = 0  # steps' layers routed by route() (ties), since the decoder was built
        self.handback_rows = 0  # the tied rows those hand-backs sent to route() (the others kept the step's routing)
        # the rows each MoE layer sent to each expert (it_step.expert_load), where counting is on (count_experts)
        self._expert_load = torch.zeros(len(model.layers), max(cmodel.moe_experts, 1), dtype=torch.int64)
        # The residual stream and the final norm's output: reused every step (the next step overwrites them).
        self.x = torch.empty(rows, self.hidden, dtype=torch.bfloat16)
        self.out = torch.empty(rows, self.hidden, dtype=torch.bfloat16)
        # the final norm as the C side reads it (a pointer into keep: Gemma's fp32 factors, else the bf16 weight)
        self.embed, self.final_norm, self.final_eps = model.embed, final_norm, model.final_eps
        self.embed_scale, self.embed_fn = model.embed_scale, model.embed_fn
        tp = model.tp_allreduce
        self._tp_error: BaseException | None = None  # (the called-back all-reduce's, raised after the step)
        if tp is not None and tp.size > 1:  # (the all-reduce's segment and sequence number: csrc/abi.h it_step)
            self.step.tp_shm, self.step.tp_seq = tp.address or None, tp.seq_address or None
            self.step.tp_rank, self.step.tp_size, self.step.tp_max_numel = tp.rank, tp.size, tp.max_numel
            if not tp.address:  # no segment: the step calls back the engine's all-reduce (gloo)
                self._tp_reduce = cpu.TP_REDUCE_FN(functools.partial(_called_back_reduce, self, tp.reduce))
                self.step.tp_reduce_fn = ctypes.cast(self._tp_reduce, ctypes.c_void_p).value
        self.final_norm_fn = lib.it_rmsnorm_f32w if cmodel.norm_f32 else lib.it_rmsnorm_mt

    @classmethod
    def build(cls, model: FusedModel, amx: bool, avx2_lib=None) -> X86FusedDecoder | str:
        """avx2_lib: the AVX2 library (Avx2Kernels'), whose parts run bf16 / int8 / int4 projections (no 12-bit
        weights) and attention with P in fp32; else the process's AVX-512 library."""
        if model.head_dim % 16:
            return f"head_dim={model.head_dim} (the fused step needs a multiple of 16)"
        if model.kv_groups > cpu.MAX_KV_GROUPS:
            return f"{model.kv_groups} KV cache groups (the fused step reads {cpu.MAX_KV_GROUPS} at most)"
        tp = model.tp_allreduce
        if tp is not None and tp.size > 1:
            if any(lin is not None and lin.bias is not None for layer in model.layers for lin in (layer.o, layer.down)):
                return "a row-parallel projection with a bias (added on one rank) under tensor parallel"
        if model.act not in _ACTS or model.norm not in ("llama", "gemma"):
            return f"activation {model.act} / {model.norm} norms"
        mlas = [layer.mla for layer in model.layers if layer.mla is not None]
        if mlas:
            dims = {(a.rank, a.rope, a.nope, a.v_dim, a.q_a.out_features if a.q_a else 0) for a in mlas}
            if len(dims) > 1:
                return "latent-attention layers of different shapes"
            if model.n_kv_heads != 1 or model.head_dim != mlas[0].rank + mlas[0].rope or model.attn_softcap:
                return "latent attention with its cache rows unlike the model's KV heads"
            if any(layer.window for layer in model.layers):
                return "latent attention under a sliding window"
            if mlas[0].rank % 16:
                return f"a latent of {mlas[0].rank} values (the fused step takes multiples of 16)"
        norms = [t for layer in model.layers for t in _layer_norms(layer) if t is not None]
        norms += [t for a in mlas for t in (a.q_a_norm, a.kv_a_norm, a.kv_up) if t is not None]
        if model.embed.dtype is not torch.bfloat16 or any(t.dtype is not torch.bfloat16 for t in norms):
            return "the fused step runs bf16 weights and norms"
        cmodel = cpu.ItModel(
            hidden=model.hidden,
            n_heads=model.n_heads,
            n_kv_heads=model.n_kv_heads,
            head_dim=model.head_dim,
            inter=model.inter,
            num_blocks=model.layers[0].kv_cache.shape[1],
            block_size=model.block_size,
            cos_sin=model.cos_sin.data_ptr(),
            eps=model.eps,
            scale=model.scale,
            nthreads=torch.get_num_threads(),
            n_layers=len(model.layers),
            kv_int8=int(model.kv_int8),
            act=_ACTS[model.act],
            norm_f32=int(model.norm == "gemma"),
            softcap=model.attn_softcap,
        )
        if mlas:
            a = mlas[0]
            cmodel.mla_rank, cmodel.mla_rope, cmodel.mla_nope, cmodel.mla_v = a.rank, a.rope, a.nope, a.v_dim
            cmodel.mla_q_rank = a.q_a.out_features if a.q_a else 0
        keep = [model.cos_sin]  # tensors whose memory the C side points at

        def norm(w: torch.Tensor | None) -> int | None:
            """A norm's weight as the C side reads it: the bf16 w, or Gemma's fp32 factors 1 + w (it_model.norm_f32)"""
            if w is None:
                return None
            if model.norm == "gemma":
                w = (1.0 + w.float()).contiguous()
            keep.append(w)
            return w.data_ptr()

        layers = (cpu.ItLayer * len(model.layers))()
        gate_ups = []  # every gated MLP's gate_up: the dense layers' and the shared experts'
        moe_shapes: set[tuple[int, int, int]] = set()  # (top_k, experts, expert width) of the MoE layers
        expert_kinds: set[str] = set()  # the routed experts' weight kinds
        for c, layer in zip(layers, model.layers):
            c.input_norm, c.post_norm, c.q_norm, c.k_norm, c.pre_ff_norm, c.post_ff_norm = map(
                norm, _layer_norms(layer)
            )
            c.kv_cache = layer.kv_cache.data_ptr()
            c.window, c.group = layer.window, layer.group
            keep.append(layer.kv_cache)
            if layer.cos_sin is not None:
                if layer.cos_sin.shape != model.cos_sin.shape or not layer.cos_sin.is_contiguous():
                    return "a layer's rotary table unlike the model's"
                c.cos_sin = layer.cos_sin.data_ptr()
                keep.append(layer.cos_sin)
            for name in ("qkv", "o", "gate_up", "down"):
                if getattr(layer, name) is not None:
                    keep += _fill_lin(getattr(c, name), getattr(layer, name))
            if layer.gate_up is not None:
                gate_ups.append(c.gate_up)
            if layer.mla is not None:
                c.mla = ctypes.addressof(_mla_layer(layer.mla, keep))
            if layer.moe is not None:
                cmoe = _moe_layer(layer.moe, keep, avx2_lib)
                if isinstance(cmoe, str):
                    return cmoe
                c.moe = ctypes.addressof(cmoe)
                moe_shapes.add((layer.moe.moe.top_k, layer.moe.moe.num_experts, cmoe.down.K))
                expert_kinds |= {layer.moe.experts.gate_up.kind, layer.moe.experts.down.kind}
                cmodel.moe_experts = max(cmodel.moe_experts, layer.moe.moe.num_experts)
                cmodel.moe_top_k = max(cmodel.moe_top_k, layer.moe.moe.top_k)
                if cmoe.shared_down.N:
                    gate_ups.append(cmoe.shared_gate_up)
        lins = [
            lin
            for layer in model.layers
            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)
            + ((layer.moe.shared_gate_up, layer.moe.shared_down) if layer.moe is not None else ())
            + ((layer.mla.q_a, layer.mla.q_b, layer.mla.kv_a) if layer.mla is not None else ())
            if lin is not None
        ]
        kinds = {lin.kind for lin in lins}
        # (MoE models: prompts too where the experts are bf16 (plain or 12-bit), W8A8 or packed W8A16 / W4A16, see
        # below; else decode steps only. A windowed layer's prompt rows each attend on their own, to their window: attention_rows. Latent
        # attention: decode steps only, prompts decompress on the PyTorch path, where a long one's attention is
        # cheaper than absorbed.)
        moe_prompts = avx2_lib is None and expert_kinds <= {"bf16", "bf16c", "w8a8", "w8p", "w4p"}
        decode_only = (cmodel.moe_experts > 0 and not moe_prompts) or bool(mlas)
        if avx2_lib is not None:
            if "bf16c" in kinds:
                return "12-bit weights (the AVX2 library has no decoder for them)"
            # Short prompts too with bf16 weights as loaded and a bf16 cache, as without AMX below: the FMA GEMM
            # (csrc/x86/avx2/gemm.c) and each prompt row's attention on its own
            # (W8A8 too: its int8 GEMM, csrc/x86/avx2/gemm_i8.c, at any row count)
            prefill_rows = (
                cpu.AVX2_FUSED_PREFILL_ROWS
                if kinds <= {"bf16", "w8a8"} and not model.kv_int8 and not decode_only
                else 0
            )
            return cls(
                model, cmodel, layers, keep, cpu.MAX_ROWS, prefill_rows, avx2_lib, norm(model.final_norm), moe_shapes
            )
        # Short prompts too, where every projection is bf16 (plain or 12-bit: the prefill's tile GEMM, AMX only) and
        # the cache is bf16 (an int8 cache would make a prompt attend to its own K/V quantized, which the PyTorch
        # path does not). With every projection 12-bit the tile GEMM (decoding as it multiplies, SiLU in the
        # gate_up's epilogue) beats torch's at every size: whole prefill steps run here.
        # Without AMX the same short prompts with bf16 weights (as loaded: the VDPBF16PS GEMM, csrc/x86/avx512/
        # gemm_dpbf16.c; 12-bit: the same sums from the decoded tiles, bf16c_noamx.c, whole prefill steps), each
        # prompt row's attention on its own (P in fp32, as the decode rows' AVX-512 attention).
        # MoE models with bf16 experts (plain or 12-bit), on AMX: whole prefill steps too (as many rows as the dense
        # linears allow: all of a step's where every projection is 12-bit), the router's logits from the tile GEMM (the
        # per-module path's prompts take torch's matmul for them past 16 rows: the two round alike but sum in another
        # order, so a near-tie may pick another expert; a tie at the top-k boundary hands back to route() as in
        # decode steps), the experts through the grouped kernel, each expert's rows one tile GEMM. Measured on a
        # Xeon with AMX, the MoE preset's 16 x 128-token prompts: benchmarks/BENCHMARKS.md. W8A8 / packed W8A16
        # experts too on AMX (their int8 tiles, gemm_i8_amx.c: the MoE preset's W8A16 TTFT at 16 1.58 -> 0.70 s), and
        # packed W4A16 ones (the tile GEMM on their nibbles rebuilt in bf16, gemm_w4p.c). Without AMX too (the
        # VDPBF16PS GEMMs, 12-bit from the decoded tiles; the VNNI ones of W8A8 / packed W8A16 / W4A16), as many rows
        # as the dense linears take below: forced onto the AVX-512 path on a Xeon (not a Zen), the MoE preset's prompts
        # against the per-module path (torch's SDPA) 0.95x the time at 16 x 128 tokens, 0.87x at 1 x 128, level at
        # 1 x 1024 (2026-12-07).
        prefill_rows = 0
        if decode_only:
            pass
        elif amx and kinds <= {"bf16", "bf16c", "w8a8", "w8p", "w4p", "w8", "w4"} and not model.kv_int8:
            # (W8A8 / packed W8A16: AMX-INT8 tiles on the packed weight at any row count, gemm_i8_amx.c; packed
            # W4A16: the 12-bit weights' tile GEMM on its nibbles rebuilt in bf16 chunk by chunk, gemm_w4p.c; W4A16
            # in rows: the same tile GEMM on rows rebuilt into its tiles, gemv_quant.c linear_w4_tiles; W8A16 in
            # rows: linear_bf16's tile GEMM on 32 rows rebuilt at a time, quant_amx.c, up to 128 rows)
            prefill_rows = cpu.AMX_GEMM_MAX_ROWS
            # W4A16 in rows at any size too: its tile GEMM rebuilds each chunk once a block of rows (at 512-2048
            # rows about level with dequantizing the layer for a bf16 GEMM, bench_quant_rows.py, before it moved to
            # the 12-bit weights' tile GEMM), and the step stays fused (its attention, norms and rotary): 16 x
            # 128-token W4A16 prompts 0.88x the time on a Xeon with AMX (2026-12-06; docs/kernels.md). (W8A16
            # packs as w8p with AMX.)
            if kinds <= {"bf16c", "w8a8", "w8p", "w4p", "w4"}:
                prefill_rows = max(prefill_rows, model.step_rows)
        elif (
            not amx
            and kinds <= {"bf16", "bf16c", "w8", "w4", "w8a8", "w8p", "w4p"}
            and not model.kv_int8
            and cpu.bf16_max_rows() > cpu.MAX_ROWS
        ):
            # (W8A16 / W4A16 too: past 16 rows their kernels rebuild the weights in bf16 a slab at a time for the
            # same GEMM, gemv_quant.c linear_q_gemm, as the per-module path's linear_w8 / linear_w4 calls do)
            prefill_rows = cpu.bf16_max_rows()
            if (
                kinds <= {"bf16c", "w8", "w4", "w8a8", "w8p", "w4p"}
            ):  # (W8A8 / packed W8A16: their VNNI GEMMs, gemm_i8.c / gemm_w8p.c, at any row count)  # (as on AMX: the 12-bit slab GEMM, and the quantized one, take any
                # row count; measured on a Zen 4, 16 x 128-token prompts 2.03 -> 1.73 s with 12-bit weights, one
                # 2000-token prompt 2.90 -> 2.52 s, against the per-module path, whose attention is torch's SDPA)
                prefill_rows = max(prefill_rows, model.step_rows)
        cmodel.gate_up_fused = int(all(g.kind == cpu.WeightKind.BF16C and g.inter > 0 for g in gate_ups))
        return cls(
            model, cmodel, layers, keep, cpu.MAX_ROWS, prefill_rows, cpu.library(), norm(model.final_norm), moe_shapes
        )

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        out_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        t = input_ids.shape[0]
        if self.embed_fn is not None:  # (a vocab-parallel embedding: its module, all-reduce included)
            x = self.x[:t]
            x.copy_(self.embed_fn(input_ids))
        else:
            x = torch.index_select(self.embed, 0, input_ids, out=self.x[:t])  # updated in place by the kernel
            if self.embed_scale != 1.0:  # (Gemma: times sqrt(hidden) as a bf16 value, rounded once, as the module)
                x.mul_(self.embed_scale)
        s = self.step
        s.T = t
        s.n_groups = 0
        if block_tables.dim() == 3:  # KV cache groups: [G, T] slots, [G, T, max_blocks] tables (contiguous)
            assert slot_mapping.is_contiguous() and block_tables.is_contiguous()
            s.n_groups = block_tables.shape[0]
            for g in range(s.n_groups):
                s.group_slots[g], s.group_tables[g] = slot_mapping[g].data_ptr(), block_tables[g].data_ptr()
            slot_mapping, block_tables = slot_mapping[0], block_tables[0]
        s.positions, s.slots = positions.data_ptr(), slot_mapping.data_ptr()
        s.block_tables, s.context_lens, s.max_blocks = (
            block_tables.data_ptr(),
            context_lens.data_ptr(),
            block_tables.shape[1],
        )
        if out_rows is not None:
            assert out_rows.dtype == torch.int64 and out_rows.is_contiguous()
            s.out_rows, s.n_out = out_rows.data_ptr(), out_rows.numel()
        else:
            s.out_rows, s.n_out = None, 0
        s.first_layer, s.route_weights, s.route_ids = 0, None, None
        with cpu.profiled("fused_decode_layers"):
            rc = self.lib.it_decode_layers(ctypes.byref(self.cmodel), self.layers, ctypes.byref(s), x.data_ptr())
            while rc == 1:  # a MoE layer's tie at the top-k boundary: route() picks as the per-module path does
                self.handbacks += 1
                self.handback_rows += s.route_rows
                route, experts, dtype = self.routes[s.handed_back]
                # (the step writes the tied rows' logits as rows of its own experts, [route_rows, experts], packed,
                # in the router's dtype; their row indices in tied_rows; the other rows keep the step's routing)
                flat = self.router_logits.view(-1).view(dtype)
                logits = flat[: s.route_rows * experts].view(s.route_rows, experts)
                routing = route(logits)
                weights, ids = routing.weights.float().contiguous(), routing.ids.to(torch.int64).contiguous()
                s.first_layer = s.handed_back
                s.route_weights, s.route_ids = weights.data_ptr(), ids.data_ptr()
                rc = self.lib.it_decode_layers(ctypes.byref(self.cmodel), self.layers, ctypes.byref(s), x.data_ptr())
        if self._tp_error is not None:
            err, self._tp_error = self._tp_error, None
            raise RuntimeError("the tensor-parallel all-reduce failed inside the fused step") from err
        if rc != 0:
            raise RuntimeError(
                f"it_decode_layers failed ({rc}): {'workspace too small' if rc == -1 else 'unsupported shapes'}"
            )
        out = self.out[:t]
        with cpu.profiled("rms_norm"):
            self.final_norm_fn(
                x.data_ptr(),
                self.final_norm,
                out.data_ptr(),
                t,
                self.hidden,
                self.final_eps,
                self.cmodel.nthreads,
            )
        return out

    def step_timers(self, reset: bool = False) -> dict[str, float]:
        return cpu.fused_step_timers(self.stats, reset)

    def kv_read_bytes(self) -> int:
        """The cache bytes this decoder's latent attention read since it was built (or its timers' last reset):
        counted by the kernels as they read (other attention does not count: 0)."""
        return int(self.stats.kv_read_bytes)

    def take_allreduce(self) -> tuple[int, int, float]:
        """Tensor parallel: the all-reduces the step ran in C since the last take (pieces, bytes, seconds)."""
        return cpu.take_fused_allreduce(self.stats)

    def count_experts(self, on: bool) -> bool:
        """Count the rows each MoE layer routes to each expert from the next step on (or stop counting); False where
        the model has no MoE layer (nothing to count)."""
        self.step.expert_load = self._expert_load.data_ptr() if on and self.routes else None
        return bool(self.routes)

    def expert_load(self, reset: bool = False) -> dict[int, torch.Tensor]:
        """Layer index -> rows routed to each expert [E] since counting began (or the last reset)."""
        got = {i: self._expert_load[i, :experts].clone() for i, (_, experts, _) in self.routes.items()}
        if reset:
            self._expert_load.zero_()
        return got


_ACTS = {"silu": cpu.ACT_SILU, "gelu_tanh": cpu.ACT_GELU_TANH}


def _called_back_reduce(decoder: X86FusedDecoder, reduce, ptr: int, n: int) -> int:
    """it_step.tp_reduce_fn: the step's n bf16 partial sums at ptr, summed over the ranks in place by `reduce` (the
    engine's all-reduce). An exception cannot cross the C step: it is kept (later calls do nothing) and raised once
    the step returns."""
    if decoder._tp_error is not None:
        return 1
    try:
        reduce(torch.frombuffer((ctypes.c_uint16 * n).from_address(ptr), dtype=torch.bfloat16))
    except BaseException as e:  # (KeyboardInterrupt too: it must not unwind through C)
        decoder._tp_error = e
        return 1
    return 0


def _layer_norms(layer) -> tuple:
    """A layer's norm weights, in it_layer's order: input, post, q, k, pre- and post-feedforward (None: absent)."""
    return layer.input_norm, layer.post_norm, layer.q_norm, layer.k_norm, layer.pre_ff_norm, layer.post_ff_norm


def _fill_lin(c, lin: KernelLinear) -> list[torch.Tensor]:
    """Point the C description of one linear layer at its tensors; returns them (to keep them alive)."""
    c.kind = cpu.WeightKind[lin.kind.upper()]  # csrc/abi.h it_kind (check_abi holds the two to each other)
    c.bias = lin.bias.data_ptr() if lin.bias is not None else None
    c.N, c.K = lin.out_features, lin.in_features
    keep = [lin.bias] if lin.bias is not None else []
    if lin.kind == "bf16c":
        w = lin.compressed
        c.w, c.inter = ctypes.addressof(w.desc), w.inter
        return keep + list(w.buffers.values()) + [w]  # (w holds the C description itself)
    if lin.kind == "bf16":
        assert lin.weight.is_contiguous() and lin.weight.dtype is torch.bfloat16
        c.w = lin.weight.data_ptr()
        return keep + [lin.weight]
    q, s = lin.qweight, lin.scales
    assert q.is_contiguous() and s.is_contiguous()
    c.w, c.scale = q.data_ptr(), s.data_ptr()
    if lin.kind in ("w4", "w4p"):  # (w4p: pack_w4p's words, its blocked fp32 scale and zero)
        c.zero, c.group = lin.zero.data_ptr(), lin.group_size
        return keep + [q, s, lin.zero]
    if lin.kind in ("w8a8", "w8p"):  # (pack_w8a8's words, fp32 scales; W8A8's static scale, if any, in `zero`)
        assert q.dtype is torch.int32 and s.dtype is torch.float32
        if lin.input_scale is not None:
            c.zero = lin.input_scale.data_ptr()
            keep.append(lin.input_scale)
        return keep + [q, s]
    assert q.dtype is torch.int8
    c.scale_is_f32 = int(s.dtype is torch.float32)
    return keep + [q, s]


def _mla_layer(mla: FusedMla, keep: list) -> cpu.ItMlaLayer:
    """The C description of a latent-attention layer (csrc/abi.h it_mla_layer); its tensors (and itself) go into
    keep."""
    c = cpu.ItMlaLayer(latent_eps=mla.latent_eps, interleaved=int(mla.interleaved))
    if mla.q_a is not None:
        keep += _fill_lin(c.q_a, mla.q_a)
        c.q_a_norm = mla.q_a_norm.data_ptr()
        keep.append(mla.q_a_norm)
    keep += _fill_lin(c.q_b, mla.q_b) + _fill_lin(c.kv_a, mla.kv_a)
    up = mla.kv_up.contiguous()
    c.kv_a_norm, c.kv_up = mla.kv_a_norm.data_ptr(), up.data_ptr()
    keep += [mla.kv_a_norm, up, c]
    return c


def _moe_layer(moe: FusedMoE, keep: list, lib=None) -> cpu.ItMoeLayer | str:
    """The C description of a MoE layer (csrc/abi.h it_moe_layer); its tensors (and itself) go into keep. lib: the
    library the step runs on (None: the process's), whose W8A8 packing the experts' are."""
    rule = moe_rule(moe.moe, lib)
    if rule is None:
        return f"the routing rule {moe.moe.scoring} / {moe.moe.topk_method} (the kernels' router does not know it)"
    if moe.moe.top_k > 64:
        return f"top_k={moe.moe.top_k} (the grouped experts take up to 64)"
    if moe.moe.num_experts > cpu.MOE_MAX_EXPERTS:
        return f"{moe.moe.num_experts} experts (the kernels' router takes up to {cpu.MOE_MAX_EXPERTS})"
    e = moe.experts.num_experts
    lins = [expert_lin(lin, e, lib) for lin in (moe.experts.gate_up, moe.experts.down)]
    for lin in lins:
        if isinstance(lin, str):
            return f"{lin} (the grouped experts' kernel does not take them)"
    router = moe.router.contiguous()
    c = cpu.ItMoeLayer(rule=rule, gate_up=lins[0], down=lins[1])
    if router.dtype is torch.float32:  # (DeepSeek's: logits in fp32)
        c.router_f32 = router.data_ptr()
    elif router.dtype is torch.bfloat16:
        c.router = router.data_ptr()
    else:
        return f"a router in {router.dtype}"
    if moe.experts.total:  # expert parallel: gate_up / down hold this rank's block of the router's experts
        first, total = moe.experts.first, moe.experts.total
        if total != moe.moe.num_experts or first < 0 or first + e > total:
            return f"experts {first} .. {first + e - 1} of {total} (the router has {moe.moe.num_experts})"
        c.expert_offset, c.local_experts = first, e
    keep += [router, moe.experts, *lins]
    if moe.correction_bias is not None:
        c.bias = moe.correction_bias.data_ptr()
        keep.append(moe.correction_bias)
    if moe.shared_down is not None:
        keep += _fill_lin(c.shared_gate_up, moe.shared_gate_up) + _fill_lin(c.shared_down, moe.shared_down)
        if moe.shared_gate is not None:
            gate = moe.shared_gate.contiguous()
            c.shared_gate = gate.data_ptr()
            keep.append(gate)
    keep.append(c)
    return c


def moe_rule(moe: MoeArch, lib=None) -> cpu.ItMoe | None:
    """A MoeArch's routing rule for it_moe_route (None for a rule the C side does not know: route() raises on it);
    ties at the top-k boundary settled as torch.topk settles them where lib's copy of that rule matches this torch
    (cpu.torch_topk_ties), else handed back."""
    return _moe_rule(moe, cpu.torch_topk_ties(lib))


@functools.lru_cache(maxsize=64)
def _moe_rule(moe: MoeArch, torch_ties: bool) -> cpu.ItMoe | None:
    if moe.scoring not in cpu.MOE_SCORING or moe.topk_method not in cpu.MOE_TOPK_METHOD:
        return None
    return cpu.ItMoe(
        num_experts=moe.num_experts,
        top_k=moe.top_k,
        scoring=cpu.MOE_SCORING[moe.scoring],
        topk_method=cpu.MOE_TOPK_METHOD[moe.topk_method],
        n_group=moe.n_group,
        topk_group=moe.topk_group,
        norm_topk_prob=int(moe.norm_topk_prob),
        routed_scaling_factor=moe.routed_scaling_factor,
        torch_ties=int(torch_ties),
    )


_EXPERT_KINDS = {
    "bf16": cpu.WeightKind.BF16,
    "w8": cpu.WeightKind.W8,
    "w4": cpu.WeightKind.W4,
    "w8a8": cpu.WeightKind.W8A8,
    "w8p": cpu.WeightKind.W8P,
    "w4p": cpu.WeightKind.W4P,
}


def expert_lin(lin: KernelLinear, num_experts: int, lib=None) -> cpu.ItLin | str:
    """Expert 0's it_lin of a stacked expert projection (cpu.expert_lin), or why the kernels do not take it. 12-bit
    experts: an it_lin whose w points at their num_experts bf16c descriptions (held by the returned ItLin)."""
    if lin.kind == "bf16c" and lin.bias is None and lin.compressed_experts is not None:
        weights = lin.compressed_experts
        if len(weights) != num_experts or not all(hasattr(w, "desc") for w in weights):
            return "12-bit experts in a layout these kernels did not pack"
        inter = {w.inter for w in weights}
        if len(inter) != 1 or not cpu.bf16c_supported(lin.out_features, lin.in_features):
            return f"12-bit experts of shape [{lin.out_features}, {lin.in_features}] packed unlike each other"
        descs = (cpu.Bf16c * num_experts)(*(w.desc for w in weights))
        c = cpu.ItLin(kind=cpu.WeightKind.BF16C, w=ctypes.addressof(descs), N=lin.out_features, K=lin.in_features)
        c.inter = inter.pop()
        c._keep = (descs, weights)  # (the descriptions, and the weights whose buffers they point at)
        return c
    kind = _EXPERT_KINDS.get(lin.kind)
    if kind is None or lin.bias is not None:
        return f"{lin.kind} experts{' with a bias' if lin.bias is not None else ''}"
    w = lin.weight if kind == cpu.WeightKind.BF16 else lin.qweight
    n, k = lin.out_features, lin.in_features
    return cpu.expert_lin(kind, num_experts, n, k, w, lin.scales, lin.zero, lin.group_size, lib=lib)
