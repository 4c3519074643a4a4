"""The kernels' contract (infertune/kernels/interface.py): the x86 kernels satisfy it member for member, and the
engine runs on a second implementation of it written here in plain PyTorch (with storage layouts of its own and
a fused step of its own) as accurately, against HF transformers, as on torch's operators. So a new ISA's kernels
(AVX2, Arm) plug in at this one seam, and no layer, quant method or runner knows the x86 layouts."""

from __future__ import annotations

import inspect
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from infertune.kernels import cpu
from infertune.kernels.interface import DecodeKernels, FusedModel, FusedMoE, KernelLinear, MoeRouting


def _protocol_members() -> list[str]:
    return [n for n in dir(DecodeKernels) if not n.startswith("_") and n not in ("fused_parts", "name")]


@pytest.mark.skipif(not cpu.available(), reason=f"x86 kernels: {cpu.unavailable_reason()}")
def test_x86_kernels_satisfy_the_contract():
    from infertune.backends.cpu import CPUBackend
    from infertune.kernels.x86 import X86Kernels

    k = CPUBackend().decode_kernels()
    assert isinstance(k, X86Kernels) and isinstance(k, DecodeKernels)
    for name in _protocol_members():
        want = inspect.signature(getattr(DecodeKernels, name))
        got = inspect.signature(getattr(X86Kernels, name))
        assert list(got.parameters) == list(want.parameters), (name, got, want)
    assert isinstance(k.name, str) and "x86" in k.name and k.fused_parts == cpu.FUSED_PARTS


def test_the_avx2_kernels_satisfy_the_contract():
    """The AVX2 + FMA variant (forced on here where the CPU has AVX2): member for member; the bf16 FMA GEMM takes every
    step size, the int8 / int4 GEMVs up to 16 rows; no 12-bit weights (its fused step: tests/test_cpu_isa.py)."""
    from infertune.kernels.x86 import Avx2Kernels

    lib = cpu.load_variant("avx2")
    if isinstance(lib, str):
        pytest.skip(lib)
    k = Avx2Kernels(lib)
    assert isinstance(k, DecodeKernels)
    for name in _protocol_members():
        want = inspect.signature(getattr(DecodeKernels, name))
        got = inspect.signature(getattr(Avx2Kernels, name))
        assert list(got.parameters) == list(want.parameters), (name, got, want)
    assert "avx2" in k.name and k.fused_parts == cpu.FUSED_PARTS
    assert not k.can_compress(64, 64) and k.max_rows("bf16c") == 0
    assert (
        k.max_rows("bf16") == cpu.AVX2_GEMM_MAX_ROWS and k.max_rows("w8") == k.max_rows("w4") == cpu.AVX2_QUANT_MAX_ROWS
    )


def test_a_backend_without_kernels_says_why():
    from infertune.backends.base import Backend

    assert Backend.decode_kernels(None) is None
    assert "no kernels" in Backend.kernels_unavailable_reason(None)


# ---- a second implementation, in plain PyTorch ---------------------------------------------------------------


def _rms(x, w, eps, gemma=False):
    """Llama's RMSNorm (w times the normalised x rounded), or Gemma's ((1 + w) in fp32, rounded once)."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return (normed * (1.0 + w.float())).to(x.dtype) if gemma else w * normed.to(x.dtype)


class TorchCompressed:
    """'Compressed' as an int16 view with the gate and up halves swapped: a layout nobody above the seam knows."""

    def __init__(self, w: torch.Tensor, gate_up: bool) -> None:
        self.out_features, self.in_features = w.shape
        self.gate_up = gate_up
        self.buffers = {"bits": w.flip(0).contiguous().view(torch.int16)}

    def dense(self):
        return self.buffers["bits"].view(torch.bfloat16).flip(0)

    def linear(self, x, bias=None):
        return F.linear(x, self.dense(), bias)

    def silu_and_mul(self, x):
        if not self.gate_up:
            return None
        gate, up = self.linear(x).chunk(2, dim=-1)
        return F.silu(gate).mul_(up)


class TorchFused:
    """A fused step from the FusedModel alone (nothing but its tensors and sizes): proves the model description
    carries all a step needs."""

    max_rows, max_prefill_rows = 16, 64

    def __init__(self, model: FusedModel, kernels: TorchKernels) -> None:
        self.m, self.k = model, kernels
        self.steps = self.rows = 0  # (this decoder's own, as FusedDecoder.step_timers asks)

    def step_timers(self, reset=False):
        got = {"step": 0.0, "calls": float(self.steps), "rows": float(self.rows)}
        if reset:
            self.steps = self.rows = 0
        return got

    def _linear(self, lin: KernelLinear, x):
        k = self.k
        if lin.kind == "bf16":
            return k.linear_bf16(x, lin.weight, lin.bias)
        if lin.kind == "bf16c":
            return lin.compressed.linear(x, lin.bias)
        if lin.kind == "w8":
            return k.linear_w8(x, lin.qweight, lin.scales, lin.bias)
        if lin.kind == "w8a8":
            return k.linear_w8a8(x, lin.qweight, lin.scales, lin.input_scale, lin.bias)
        if lin.kind == "w8p":
            return k.linear_w8p(x, lin.qweight, lin.scales, lin.bias)
        if lin.kind == "w4p":
            return k.linear_w4p(x, lin.qweight, lin.scales, lin.zero, lin.group_size, lin.out_features, lin.bias)
        return k.linear_w4(x, lin.qweight, lin.scales, lin.zero, lin.group_size, lin.bias)

    def __call__(self, input_ids, positions, slot_mapping, block_tables, context_lens, out_rows=None):
        m = self.m
        self.k.calls["fused_step"] += 1
        self.steps, self.rows = self.steps + 1, self.rows + input_ids.shape[0]
        t, hq, hkv, d, bs = input_ids.shape[0], m.n_heads, m.n_kv_heads, m.head_dim, m.block_size
        gemma = m.norm == "gemma"
        x = m.embed[input_ids] * m.embed_scale

        def rms(x, w):
            return _rms(x, w, m.eps, gemma)

        for layer in m.layers:
            table = layer.cos_sin if layer.cos_sin is not None else m.cos_sin  # (Gemma 3: each layer kind its own)
            cos, sin = table[positions].unsqueeze(1).chunk(2, dim=-1)
            qkv = self._linear(layer.qkv, rms(x, layer.input_norm)).view(t, hq + 2 * hkv, d)
            if layer.q_norm is not None:  # Qwen3, Gemma 3: each head of q and k RMS-normalised
                qkv[:, :hq] = rms(qkv[:, :hq], layer.q_norm)
                qkv[:, hq : hq + hkv] = rms(qkv[:, hq : hq + hkv], layer.k_norm)
            x1, x2 = qkv[:, : hq + hkv].float().chunk(2, dim=-1)
            qkv[:, : hq + hkv] = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(qkv.dtype)
            cache = layer.kv_cache
            # (KV cache groups: slots and tables stacked by group, each layer reading its own)
            grouped = block_tables.dim() == 3
            sm, bt = (slot_mapping[layer.group], block_tables[layer.group]) if grouped else (slot_mapping, block_tables)
            cache[0].view(-1, hkv, d)[sm] = qkv[:, hq : hq + hkv]
            cache[1].view(-1, hkv, d)[sm] = qkv[:, hq + hkv :]
            o = torch.empty(t, hq, d, dtype=x.dtype)
            for r in range(t):
                n = int(context_lens[r])
                pos = torch.arange(max(0, n - layer.window) if layer.window else 0, n)  # a window: the last keys
                slots = bt[r][pos // bs] * bs + pos % bs
                keys = cache[0].view(-1, hkv, d)[slots].float().repeat_interleave(hq // hkv, dim=1)
                vals = cache[1].view(-1, hkv, d)[slots].float().repeat_interleave(hq // hkv, dim=1)
                att = torch.einsum("hd,nhd->hn", qkv[r, :hq].float(), keys) * m.scale
                if m.attn_softcap:  # Gemma 2
                    att = torch.tanh(att / m.attn_softcap) * m.attn_softcap
                o[r] = torch.einsum("hn,nhd->hd", att.softmax(-1), vals).to(x.dtype)
            attn_out = self._linear(layer.o, o.view(t, hq * d))
            if layer.pre_ff_norm is None:
                x = x + attn_out
                h = rms(x, layer.post_norm)
            else:  # Gemma's sandwich: each branch normed before its residual add
                x = x + rms(attn_out, layer.post_norm)
                h = rms(x, layer.pre_ff_norm)
            mlp = self._moe(layer.moe, h) if layer.moe is not None else self._mlp(layer.gate_up, layer.down, h)
            x = x + (mlp if layer.post_ff_norm is None else rms(mlp, layer.post_ff_norm))
        return _rms(x, m.final_norm, m.final_eps, gemma)

    def _mlp(self, gate_up: KernelLinear, down: KernelLinear, h):
        if self.m.act == "gelu_tanh":  # Gemma
            gate, up = self._linear(gate_up, h).chunk(2, dim=-1)
            return self._linear(down, F.gelu(gate, approximate="tanh") * up)
        act = gate_up.compressed.silu_and_mul(h) if gate_up.kind == "bf16c" else None
        if act is None:
            act = self.k.silu_and_mul(self._linear(gate_up, h))
        return self._linear(down, act)

    def _moe(self, moe: FusedMoE, h):
        """The router's logits, the routing (the kernels', or the module's where they hand it back), the experts,
        and the shared expert scaled by its gate."""
        logits = self.k.linear_bf16(h, moe.router)
        routing = self.k.moe_route(logits, moe.moe, moe.correction_bias) or moe.route(logits)
        out = self.k.moe_experts(h, moe.experts, routing)
        if moe.shared_down is not None:
            shared = self._mlp(moe.shared_gate_up, moe.shared_down, h)
            if moe.shared_gate is not None:
                shared = torch.sigmoid(F.linear(h, moe.shared_gate)) * shared
            out = out + shared
        return out


class TorchKernels:
    """DecodeKernels in PyTorch, with int4 stored one byte a weight in a [K, N] layout of its own."""

    name = "torch reference"
    fused_parts = ("step",)

    def __init__(self, fused: bool = True) -> None:
        self.calls: Counter = Counter()
        self.logit_dtypes: set = set()
        self.fused = fused

    def max_rows(self, kind, *, moe=False):
        return 16

    def linear_bf16(self, x, weight, bias=None):
        self.calls["linear_bf16"] += 1
        return F.linear(x, weight, bias)

    def linear_w8(self, x, qweight, scales, bias=None):
        self.calls["linear_w8"] += 1
        return F.linear(x, self.dequant_w8(qweight, scales), bias)

    def dequant_w8(self, qweight, scales):
        return (qweight.float() * scales.float().unsqueeze(1)).bfloat16()

    def pack_w8a8(self, q):
        return q.t().contiguous().view(torch.uint8)  # [K, N] bytes: a layout of its own

    def unpack_w8a8(self, packed, out_features, in_features):
        return packed.view(torch.int8).t()

    def linear_w8a8(self, x, packed, scales, input_scale=None, bias=None):
        self.calls["linear_w8a8"] += 1
        qweight = self.unpack_w8a8(packed, scales.numel(), x.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]).float()
        if input_scale is None:
            s = (x2.abs().amax(dim=1, keepdim=True) / 127.0).clamp(min=1e-12)
        else:
            s = input_scale
        xq = torch.round(x2 / s).clamp(-127, 127)
        acc = (xq.double() @ qweight.double().t()).float()  # exact: integers far below 2^53
        y = (acc * s * scales).to(x.dtype).view(*x.shape[:-1], -1)
        return y if bias is None else y + bias

    def linear_w8p(self, x, packed, scales, bias=None):
        """W8A16 on the packed weight: x rounded to int16 per row (max|x| / 32512), exact integer sums."""
        self.calls["linear_w8p"] += 1
        qweight = self.unpack_w8a8(packed, scales.numel(), x.shape[-1])
        x2 = x.reshape(-1, x.shape[-1]).float()
        amax = x2.abs().amax(dim=1, keepdim=True)
        s = torch.where(amax > 0, amax / 32512.0, torch.ones_like(amax))
        xq = torch.round(x2 * (1.0 / s)).clamp(-32512, 32512)
        acc = (xq.double() @ qweight.double().t()).float()
        y = acc * s * scales + (bias.float() if bias is not None else 0.0)
        return y.to(x.dtype).view(*x.shape[:-1], -1)

    def w4_supported(self, in_features, group_size):
        return in_features % group_size == 0

    def pack_w4(self, q):
        return q.to(torch.uint8).t().contiguous()  # [K, N]

    def unpack_w4(self, packed):
        return packed.t()

    def linear_w4(self, x, packed, scale, zero, group_size, bias=None):
        self.calls["linear_w4"] += 1
        return F.linear(x, self.dequant_w4(packed, scale, zero, group_size), bias)

    def dequant_w4(self, packed, scale, zero, group_size):
        q = self.unpack_w4(packed).float()
        n, k = q.shape
        w = q.view(n, k // group_size, group_size) * scale.unsqueeze(-1) + zero.unsqueeze(-1)
        return w.view(n, k).bfloat16()

    def pack_w4p(self, q, scale, zero, group_size):  # (a layout of its own: [K, N] bytes, scale and zero transposed)
        return q.to(torch.uint8).t().contiguous(), scale.t().contiguous(), zero.t().contiguous()

    def unpack_w4p(self, packed, scale, zero, out_features, in_features):
        return packed.t(), scale.t(), zero.t()

    def linear_w4p(self, x, packed, scale, zero, group_size, out_features, bias=None):
        self.calls["linear_w4p"] += 1
        q, s, z = self.unpack_w4p(packed, scale, zero, out_features, x.shape[-1])
        return F.linear(x, self.dequant_w4(q.t(), s, z, group_size), bias)

    def rms_norm(self, x, weight, eps):
        self.calls["rms_norm"] += 1
        return _rms(x, weight, eps)

    def greedy_tokens(self, logits):
        self.calls["greedy_tokens"] += 1
        self.logit_dtypes.add(logits.dtype)
        return logits.float().nan_to_num(nan=float("-inf")).argmax(dim=-1)

    def silu_and_mul(self, gate_up):
        self.calls["silu_and_mul"] += 1
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def gemma_rms_norm(self, x, weight, eps):
        self.calls["gemma_rms_norm"] += 1
        return _rms(x, weight, eps, gemma=True)

    def gelu_and_mul(self, gate_up):
        self.calls["gelu_and_mul"] += 1
        gate, up = gate_up.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up

    def rotary_(self, qk, cos, sin):
        self.calls["rotary"] += 1
        x1, x2 = qk.float().chunk(2, dim=-1)
        qk.copy_(torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1))
        return True

    def can_compress(self, out_features, in_features):
        return True

    def compress(self, weight, gate_up=False):
        self.calls["compress"] += 1
        return TorchCompressed(weight, gate_up)

    def moe_route(self, logits, moe, correction_bias=None, tied=None):
        from infertune.layers.moe import group_by_expert, route

        self.calls["moe_route"] += 1
        weights, ids = route(logits, moe, correction_bias)
        return MoeRouting(weights, ids, *group_by_expert(ids, moe.num_experts))

    def moe_experts(self, x, experts, routing):
        from infertune.layers.moe import run_experts

        self.calls["moe_experts"] += 1

        def matmul(lin: KernelLinear):
            if lin.kind == "bf16":
                return lambda e, rows: F.linear(rows, lin.weight[e])
            if lin.kind == "bf16c":  # each expert's own compress(): the reference's swapped int16 view
                return lambda e, rows: lin.compressed_experts[e].linear(rows)
            if lin.kind == "w8":
                return lambda e, rows: F.linear(rows, self.dequant_w8(lin.qweight[e], lin.scales[e]))
            return lambda e, rows: F.linear(
                rows, self.dequant_w4(lin.qweight[e], lin.scales[e], lin.zero[e], lin.group_size)
            )

        grouping = (routing.order, routing.counts)
        return run_experts(
            x,
            routing.weights,
            routing.ids,
            experts.total or experts.num_experts,
            matmul(experts.gate_up),
            matmul(experts.down),
            grouping,
            first=experts.first,  # (expert parallel: this rank's block of the router's experts)
            local=experts.num_experts,
        )

    def fused_decoder(self, model):
        if model.tp_allreduce is not None:
            return "the reference kernels have no all-reduce (tensor parallel)"
        if model.kv_int4:
            return "the reference kernels read no int4 KV blocks"
        if any(layer.mla is not None for layer in model.layers):
            return "the reference kernels run no latent attention"
        if any(layer.moe is not None and layer.moe.router.dtype is not torch.bfloat16 for layer in model.layers):
            return "the reference kernels route in bf16 only"
        return TorchFused(model, self) if self.fused else "the reference kernels were asked not to fuse"

    def profiled(self, name):
        import contextlib

        return contextlib.nullcontext()


def test_the_reference_implementation_satisfies_the_contract():
    assert isinstance(TorchKernels(), DecodeKernels)
    for name in _protocol_members():
        want = inspect.signature(getattr(DecodeKernels, name))
        assert list(inspect.signature(getattr(TorchKernels, name)).parameters) == list(want.parameters), name


def _run(model, monkeypatch, kernels, **options):
    from conftest import hf_model
    from test_kernels import _hf_logprob_errors

    from infertune import LLM, SamplingParams
    from infertune.backends.cpu import CPUBackend

    monkeypatch.setattr(CPUBackend, "decode_kernels", lambda self: kernels)
    llm = LLM(str(model), dtype="bfloat16", max_model_len=96, block_size=16, enable_prefix_caching=False, **options)
    gen = torch.Generator().manual_seed(3)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (4, 21, 40)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)
    return llm, max(_hf_logprob_errors(llm, prompts, params, hf_model(model).float(), argmax=False))


@pytest.mark.parametrize(
    "quant,compress,fused",
    [
        (None, "off", True),
        (None, "auto", True),
        ("w8a16", "off", True),
        ("w4a16", "off", True),
        ("w8a8", "off", True),
        ("w8a8", "off", False),
        (None, "off", False),
    ],
)
def test_the_engine_runs_on_a_second_implementation(tmp_path, monkeypatch, quant, compress, fused):
    """Every seam is taken (the counts), the fused step runs from the FusedModel alone, and the logprobs against
    HF transformers in float32 are as close as those of the engine with no kernels (same quantization)."""
    from conftest import make_checkpoint

    from infertune.layers.linear import CompressedMethod, DecodeKernelMethod, Linear

    model = make_checkpoint(
        tmp_path / "m", "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, dtype=torch.bfloat16
    )
    options = dict(quantization=quant, quant_group_size=64, compress_weights=compress)
    _, plain = _run(model, monkeypatch, None, **options)
    ref = TorchKernels(fused=fused)
    llm, mine = _run(model, monkeypatch, ref, **options)
    runner = llm.engine.executor.runner
    assert runner.decode_kernels is ref and (runner.fused is not None) == fused
    methods = {type(m.quant_method) for m in runner.model.modules() if isinstance(m, Linear)}
    if quant is None:
        assert methods == ({CompressedMethod} if compress == "auto" else {DecodeKernelMethod})
        assert (ref.calls["compress"] > 0) == (compress == "auto")
    assert ref.calls["greedy_tokens"] >= 8  # (greedy: every step's tokens through the kernels)
    if fused:
        assert ref.calls["fused_step"] >= 7  # (the decode steps; prompts of up to 64 tokens too)
    else:
        assert ref.calls["rms_norm"] and ref.calls["rotary"] and ref.calls["fused_step"] == 0
        assert ref.calls["silu_and_mul"] and ref.calls["linear_bf16"]
    if quant == "w8a8":  # (the fused step's layers and the per-module ones both through linear_w8a8)
        assert ref.calls["linear_w8a8"] > 0
    if quant == "w8a16":  # (packed at load, as max_rows("w8p") > 0 asks: every layer through linear_w8p)
        assert ref.calls["linear_w8p"] > 0 and ref.calls["linear_w8"] == 0
    if quant == "w4a16":  # (packed at load, as max_rows("w4p") > 0 asks: the reference's own [K, N] bytes)
        q = runner.model.model.layers[0].mlp.down_proj.qweight
        assert q.shape == (256, 128) and q.dtype is torch.uint8
        assert ref.calls["linear_w4p"] > 0 and ref.calls["linear_w4"] == 0
    assert mine <= 1.5 * plain + 0.02, (mine, plain)


def test_greedy_steps_hand_the_kernels_bf16_logits(tmp_path, monkeypatch):
    """A bf16 model's greedy steps with nothing else to compute hand greedy_tokens the LM head's bf16 logits (no
    [rows, V] fp32 copy); with logprobs asked for, fp32; the tokens are the same either way, and the same as the
    sampler's own torch formula gives with no kernels."""
    from conftest import make_checkpoint

    from infertune import LLM, SamplingParams
    from infertune.backends.cpu import CPUBackend

    model = make_checkpoint(
        tmp_path / "m", "llama", hidden_size=128, intermediate_size=256, num_hidden_layers=2, dtype=torch.bfloat16
    )
    ref = TorchKernels(fused=True)
    monkeypatch.setattr(CPUBackend, "decode_kernels", lambda self: ref)
    llm = LLM(str(model), dtype="bfloat16", max_model_len=96, block_size=16)
    gen = torch.Generator().manual_seed(5)
    prompts = [{"prompt_token_ids": torch.randint(3, 250, (n,), generator=gen).tolist()} for n in (4, 21, 40)]
    ids = lambda outs: [o.outputs[0].token_ids for o in outs]  # noqa: E731
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    fast = ids(llm.generate(prompts, plain))
    assert ref.logit_dtypes == {torch.bfloat16}
    ref.logit_dtypes.clear()
    scored = ids(llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=1)))
    assert ref.logit_dtypes == {torch.float32}
    monkeypatch.setattr(CPUBackend, "decode_kernels", lambda self: None)
    torch_only = ids(LLM(str(model), dtype="bfloat16", max_model_len=96, block_size=16).generate(prompts, plain))
    assert fast == scored == torch_only


@pytest.mark.parametrize("variant,fused", [("gemma2", True), ("gemma3", True), ("gemma3", False)])
def test_gemma_runs_on_a_second_implementation(tmp_path, monkeypatch, variant, fused):
    """Gemma's (1 + w) norms, four a layer, GeLU-tanh, the scaled embeddings, each layer kind's rotary table and Gemma
    2's soft-capped scores all reach a backend through the FusedModel: the pure-PyTorch step built from it alone is as
    close to HF transformers (float32) as the engine without kernels. Unfused, the modules call gemma_rms_norm and
    gelu_and_mul."""
    from test_gemma import VARIANTS, make_gemma

    model = make_gemma(tmp_path / variant, **VARIANTS[variant])
    _, plain = _run(model, monkeypatch, None)
    ref = TorchKernels(fused=fused)
    llm, mine = _run(model, monkeypatch, ref)
    if fused:
        spec = llm.engine.executor.runner.fused.decoder.m
        assert (spec.act, spec.norm, spec.attn_softcap > 0) == ("gelu_tanh", "gemma", variant == "gemma2")
        assert ref.calls["fused_step"] >= 7
    else:
        assert ref.calls["gemma_rms_norm"] and ref.calls["gelu_and_mul"] and ref.calls["rms_norm"] == 0
    assert mine <= 1.5 * plain + 0.02, (mine, plain)
