"""A decode step of every decoder layer in one call into the backend's kernels (CPU: it_decode_layers).

At batch 1 the eager PyTorch forward of a 24-layer model spends ~15 ms a step outside its matmuls: a dozen aten
dispatches, Python module calls and temporaries per layer. `FusedDecode` hands the whole stack of layers to
one C function per step (norms, projections, rotary, the paged-KV write, attention, SiLU-and-multiply and the
residuals), with all scratch in one workspace allocated here once and the residual stream and output in reused
buffers, so the forward of a decode step allocates no tensor. Steps of fresh prompts only, of up to
`max_prefill_rows` tokens in all, run here too where every projection is bf16 and the CPU has the tile GEMM
(each token a row that attends to its own prompt up to itself). Longer prefills, mixed steps and steps of more
than `max_rows` sequences keep the PyTorch path.

It takes over only where it computes what the PyTorch path computes (rounded the same way, to bf16 precision):
a Llama-family decoder in bf16 whose projections are plain bf16 (DecodeKernelMethod), W8A16 or W4A16 (in the
kernels' layout), a bf16 or INT8 paged KV cache, head_dim a multiple of 16. `FusedDecode.build` returns None,
with the reason logged, anywhere else.
"""

from __future__ import annotations

import ctypes
import logging

import torch

from infertune.layers.attention import AttentionMetadata
from infertune.layers.attention.paged import Int8PagedAttention, TorchPagedAttention
from infertune.layers.linear import Bf16cMethod, DecodeKernelMethod, Linear
from infertune.quant.int4 import W4A16Method
from infertune.quant.int8 import W8A16Method, W8A8Method

log = logging.getLogger(__name__)


class FusedDecode:
    def __init__(self, model, kernels, lib, cmodel, layers, keep, max_rows: int, max_ctx: int,
                 max_prefill_rows: int = 0) -> None:
        self.model, self.kernels, self.lib = model, kernels, lib
        self.cmodel, self.layers, self._keep = cmodel, layers, keep
        self.max_rows = max_rows
        # Steps of fresh prompts only, of up to this many tokens in all, also run here (0: never): every token a
        # row that attends to its own prompt up to itself, through the same block table.
        self.max_prefill_rows = max_prefill_rows
        self.block_size = cmodel.block_size
        self.hidden = cmodel.hidden
        rows = max(max_rows, max_prefill_rows)
        nbytes = lib.it_decode_workspace_bytes(ctypes.byref(cmodel), rows, max_ctx)
        self.workspace = torch.empty(nbytes + 64, dtype=torch.uint8)  # the step's only scratch, reused
        base = self.workspace.data_ptr()
        self.step = kernels.ItStep(work=(base + 63) // 64 * 64, work_bytes=nbytes)
        # The residual stream and the final norm's output: reused every step (the next step overwrites them).
        self.x = torch.empty(rows, self.hidden, dtype=torch.bfloat16)
        self.out = torch.empty(rows, self.hidden, dtype=torch.bfloat16)
        self.embed = model.model.embed_tokens.weight
        norm = model.model.norm
        self.norm_weight, self.eps = norm.weight, float(norm.eps)

    @classmethod
    def build(cls, model, kv_caches: list[torch.Tensor], attn, kernels, max_model_len: int, block_size: int,
              dtype: torch.dtype, step_rows: int = 0) -> "FusedDecode | None":
        """The fused step for this model, or None where it cannot run (logged). step_rows: the most tokens a step
        can hold; where every projection is 12-bit, fresh prompts of up to that many tokens in all run fused."""
        reason = cls._unsupported(model, attn, kernels, dtype)
        if reason is not None:
            log.info("fused decode off: %s", reason)
            return None
        cfg = model.config
        lib = kernels.library()
        num_blocks = kv_caches[0].shape[1]
        rotary = model.model.rotary
        cmodel = kernels.ItModel(
            hidden=cfg.hidden_size, n_heads=cfg.num_attention_heads, n_kv_heads=cfg.num_key_value_heads,
            head_dim=cfg.head_dim, inter=cfg.intermediate_size, num_blocks=num_blocks, block_size=block_size,
            cos_sin=rotary.cos_sin.data_ptr(), eps=model.model.layers[0].input_layernorm.eps,
            scale=model.model.layers[0].self_attn.scale, nthreads=torch.get_num_threads(),
            n_layers=len(model.model.layers), kv_int8=int(isinstance(attn, Int8PagedAttention)))
        keep = [rotary.cos_sin, *kv_caches, model.model.norm.weight]  # tensors whose memory the C side points at
        layers = (kernels.ItLayer * len(model.model.layers))()
        for i, (layer, cache) in enumerate(zip(model.model.layers, kv_caches)):
            c = layers[i]
            c.input_norm = layer.input_layernorm.weight.data_ptr()
            c.post_norm = layer.post_attention_layernorm.weight.data_ptr()
            keep += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
            for field, lin in (("qkv", layer.self_attn.qkv_proj), ("o", layer.self_attn.o_proj),
                               ("gate_up", layer.mlp.gate_up_proj), ("down", layer.mlp.down_proj)):
                keep += _fill_lin(getattr(c, field), lin)
            c.kv_cache = cache.data_ptr()
        max_ctx = -(-max_model_len // block_size) * block_size
        # Short prompts too, where every projection is bf16 (plain or 12-bit: the prefill's tile GEMM) and the
        # cache is bf16 (an int8 cache would make a prompt attend to its own K/V quantized, which the PyTorch
        # path does not).
        linears = [m for m in model.model.modules() if isinstance(m, Linear)]
        bf16_only = all(isinstance(m.quant_method, DecodeKernelMethod) for m in linears)
        rows = kernels.bf16_max_rows()
        prefill_rows = rows if bf16_only and not cmodel.kv_int8 and rows > kernels.MAX_ROWS else 0
        # With every projection 12-bit, the tile GEMM (decoding as it multiplies, SiLU in the gate_up's epilogue)
        # beats torch's at every size: whole prefill steps run here, no per-module Python.
        if prefill_rows and all(isinstance(m.quant_method, Bf16cMethod) for m in linears):
            prefill_rows = max(prefill_rows, step_rows)
        cmodel.gate_up_fused = int(all(c.gate_up.kind == 3 and c.gate_up.inter > 0 for c in layers))
        return cls(model, kernels, lib, cmodel, layers, keep, kernels.MAX_ROWS, max_ctx, prefill_rows)

    @staticmethod
    def _unsupported(model, attn, kernels, dtype) -> str | None:
        if kernels is None or not hasattr(kernels, "ItModel"):
            return "the backend has no fused decode kernel"
        if dtype is not torch.bfloat16:
            return f"the model runs in {dtype}, the fused step in bf16"
        if type(attn) not in (TorchPagedAttention, Int8PagedAttention) or getattr(attn, "SCALE_BYTES", 4) != 4:
            return f"attention backend {attn.name} (the fused step reads a bf16 or int8 paged cache)"
        cfg = getattr(model, "config", None)
        if cfg is None or not hasattr(getattr(model, "model", None), "layers"):
            return f"{type(model).__name__} is not a Llama-family decoder"
        if cfg.head_dim % 16 or cfg.num_attention_heads % cfg.num_key_value_heads:
            return f"head_dim={cfg.head_dim} (needs a multiple of 16)"
        if getattr(cfg, "hidden_act", "silu") not in ("silu", None):
            return f"hidden_act={cfg.hidden_act}"
        for name, module in model.model.named_modules():
            if isinstance(module, Linear):
                method = module.quant_method
                plain = isinstance(method, DecodeKernelMethod)
                w8 = (isinstance(method, W8A16Method) and not isinstance(method, W8A8Method)
                      and method.kernels is not None)
                w4 = isinstance(method, W4A16Method) and method.own_layout
                if not (plain or w8 or w4):
                    return f"layer {name} runs {method.name}"
        return None

    def applicable(self, num_tokens: int, meta: AttentionMetadata) -> bool:
        """A decode-only step (one new token per sequence) of at most max_rows sequences, or a step of fresh prompts
        only (no cached context) of at most max_prefill_rows tokens in all."""
        if not meta.prefills:
            return meta.num_decode_tokens == num_tokens <= self.max_rows
        return (num_tokens <= self.max_prefill_rows and meta.num_decode_tokens == 0
                and all(c.context_slots is None and c.context_len == c.query_len for c in meta.prefills))

    def _prefill_tables(self, meta: AttentionMetadata, t: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Per token row of fresh prompts: its prompt's block table (from the slots of the prompt's first token in
        each block; a fresh prompt starts a block) and its context length (its position + 1)."""
        bs = self.block_size
        width = max(-(-c.query_len // bs) for c in meta.prefills)
        tables = torch.zeros(t, width, dtype=torch.int64)
        lens = torch.empty(t, dtype=torch.int64)
        for c in meta.prefills:
            s, n = c.query_start, c.query_len
            blocks = meta.slot_mapping[s : s + n : bs] // bs
            tables[s : s + n, : blocks.numel()] = blocks
            lens[s : s + n] = torch.arange(1, n + 1)
        return tables, lens

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                 out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm: a view of a buffer the next step overwrites.

        out_rows (int64, ascending, unique): the only rows the caller reads. Past the last layer's attention just
        those rows go on through o_proj and the MLP (a prompt's other rows need their K / V in every layer, not
        their last hidden state); the other rows of the result are then undefined."""
        t = input_ids.shape[0]
        x = torch.index_select(self.embed, 0, input_ids, out=self.x[:t])  # updated in place by the kernel
        if meta.prefills:
            tables, lens = self._prefill_tables(meta, t)
        else:
            tables, lens = meta.decode_block_tables, meta.decode_context_lens
        s = self.step
        s.T = input_ids.shape[0]
        s.positions, s.slots = positions.data_ptr(), meta.slot_mapping.data_ptr()
        s.block_tables, s.context_lens, s.max_blocks = tables.data_ptr(), lens.data_ptr(), tables.shape[1]
        if out_rows is not None:
            assert out_rows.dtype == torch.int64 and out_rows.is_contiguous()
            s.out_rows, s.n_out = out_rows.data_ptr(), out_rows.numel()
        else:
            s.out_rows, s.n_out = None, 0
        with self.kernels.profiled("fused_decode_layers"):
            rc = self.lib.it_decode_layers(ctypes.byref(self.cmodel), self.layers, ctypes.byref(s), x.data_ptr())
        if rc != 0:
            raise RuntimeError(f"it_decode_layers failed ({rc}): "
                               f"{'workspace too small' if rc == -1 else 'unsupported shapes'}")
        out = self.out[:t]
        with self.kernels.profiled("rms_norm"):
            self.lib.it_rmsnorm_mt(x.data_ptr(), self.norm_weight.data_ptr(), out.data_ptr(), t, self.hidden, self.eps,
                                   self.cmodel.nthreads)
        return out


def _fill_lin(c, lin: Linear) -> list[torch.Tensor]:
    """Point the C description of one linear layer at its tensors; returns them (to keep them alive)."""
    bias = lin.bias
    c.bias = bias.data_ptr() if bias is not None else None
    c.N, c.K = lin.out_features, lin.in_features
    if isinstance(lin.quant_method, Bf16cMethod):
        c.kind, c.w, c.inter = 3, ctypes.addressof(lin.quant_method.desc), lin.quant_method.inter
        return [b for _, b in lin.named_buffers() if _.startswith("bf16c_")] + ([bias] if bias is not None else [])
    if isinstance(lin.quant_method, DecodeKernelMethod):
        w = lin.weight
        assert w.is_contiguous() and w.dtype is torch.bfloat16
        c.kind, c.w = 0, w.data_ptr()
        return [w] + ([bias] if bias is not None else [])
    if isinstance(lin.quant_method, W4A16Method):
        q, s, z = lin.qweight, lin.w4_scale, lin.w4_zero
        c.kind, c.w, c.scale, c.zero, c.group = 2, q.data_ptr(), s.data_ptr(), z.data_ptr(), lin.quant_method.group_size
        return [q, s, z] + ([bias] if bias is not None else [])
    q, s = lin.qweight, lin.scales
    assert q.is_contiguous() and q.dtype is torch.int8 and s.is_contiguous()
    c.kind, c.w, c.scale, c.scale_is_f32 = 1, q.data_ptr(), s.data_ptr(), int(s.dtype is torch.float32)
    return [q, s] + ([bias] if bias is not None else [])


def use_kernels(model, kernels) -> int:
    """Give the model's RMSNorms, rotary and MLP activations the backend's elementwise kernels (prefills; decode
    steps in FusedDecode already run them). They round as the PyTorch formulas do. Returns how many modules."""
    if kernels is None or not hasattr(kernels, "rms_norm"):
        return 0
    n = 0
    for module in model.modules():
        if hasattr(module, "kernels") and module.kernels is None and not isinstance(module, Linear):
            module.kernels = kernels
            n += 1
    return n
