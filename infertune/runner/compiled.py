"""Compiled forward: the dense stages of every decoder layer through torch.compile (Inductor), attention eager.

A Llama step spends much of its time outside the matmuls at small batch: each layer issues ~50 small ops (norms
in fp32, rotary, SiLU-and-mul, residual adds), each a separate dispatch and a separate pass over memory. Here the
work between two attention calls, `layer[i].finish` + `layer[i + 1].project` (o_proj, residual, norm, MLP,
residual, next norm, qkv, rotary), is one compiled graph, so a step is L + 1 graph calls plus L attention calls.
Attention stays eager because its shapes follow the sequences' context lengths (the paged cache's block tables).

The graphs take the layer modules as arguments (torch.compile inlines them and passes their weights as inputs),
so one compiled graph serves every layer. Shapes: the token dim is dynamic, so one variant of each graph serves
every step of 2 or more tokens (batched decode, prefill); the warm-up builds it before the engine serves, so no
request waits on a compile. Everything else is static. One-token steps (batch-1 decode) run eager: measured
slower compiled, see `min_tokens`.

Numerics: Inductor fuses the elementwise chains and may reorder floating-point operations inside them (it keeps
the fp32 upcasts), so results match the eager path closely but not bit for bit; tests/test_compiled.py checks the
compiled forward against the eager one and against Hugging Face transformers.
"""

from __future__ import annotations

import logging
import time

import torch

from infertune.layers.moe import MoE

log = logging.getLogger(__name__)

COMPILE_CHOICES = ("auto", "on", "off")
MIN_COMPILED_TOKENS = 2
# "auto" compiles models with at least this many parameters, on backends whose `compile_by_default` is set (where
# it was measured faster; not the CPU backend today): there the per-op overhead it removes is worth the start-up
# cost (tens of seconds); the tiny built-in model and test models start instantly in eager mode.
AUTO_MIN_PARAMETERS = 100_000_000


def _first(model, input_ids: torch.Tensor, positions: torch.Tensor):
    m = model.model
    x = m.embed_tokens(input_ids)
    cos, sin = m.rotary.cos_sin_at(positions)
    q, k, v = m.layers[0].project(x, cos, sin)
    return x, cos, sin, q, k, v


def _between(layer, nxt, o: torch.Tensor, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    x = layer.finish(o, x)
    q, k, v = nxt.project(x, cos, sin)
    return x, q, k, v


def _last(layer, norm, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return norm(layer.finish(o, x))


PRE_NORM_MOE_LAYERS = ("LlamaDecoderLayer", "DeepseekDecoderLayer")


# A MoE layer's finish (o_proj and residual, post-attention norm, MLP and residual) split around its eager MoE block.
def _pre_moe(layer, o: torch.Tensor, x: torch.Tensor):
    x = x + layer.self_attn.o_proj(o.reshape(x.shape[0], -1))
    return x, layer.post_attention_layernorm(x)


def _post_moe(nxt, x: torch.Tensor, m: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    x = x + m
    q, k, v = nxt.project(x, cos, sin)
    return x, q, k, v


def _last_moe(norm, x: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    return norm(x + m)


def should_compile(choice: str, backend, num_parameters: int) -> bool:
    if choice not in COMPILE_CHOICES:
        raise ValueError(f"compile={choice!r} is not one of {COMPILE_CHOICES}")
    if choice == "off":
        return False
    supported = getattr(backend, "supports_compile", False)
    if choice == "on":
        if not supported:
            raise ValueError(f"compile='on': torch.compile is not supported on the {backend.name} backend; use 'off'")
        return True
    return supported and getattr(backend, "compile_by_default", False) and num_parameters >= AUTO_MIN_PARAMETERS


class CompiledForward:
    """Drop-in for `model(input_ids, positions, kv_caches, meta)` that runs the dense stages compiled."""

    def __init__(self, model) -> None:
        import torch._dynamo

        self.model = model
        layers = model.model.layers
        if not layers or not all(hasattr(layer, "project") and hasattr(layer, "finish") for layer in layers):
            raise ValueError(f"{type(model).__name__} does not expose project / attend / finish stages to compile")
        # A MoE layer's experts run on data-dependent row counts (the reference loops over the picked experts, the
        # kernels are C calls), so its MoE block runs eager between two graphs: o_proj, residual and the
        # post-attention norm before it; the residual and the next layer's project after it.
        self.moe_layers = {i for i, layer in enumerate(layers) if isinstance(getattr(layer, "mlp", None), MoE)}
        for i in self.moe_layers:  # _pre_moe / _post_moe restate their finish: x + o_proj(o), x + mlp(norm(x))
            if type(layers[i]).__name__ not in PRE_NORM_MOE_LAYERS:
                raise ValueError(f"{type(layers[i]).__name__}: a MoE layer whose finish the compiled path cannot split")
        # One shape variant per graph (dynamic token count) is expected; the headroom is for mixed layer kinds.
        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 16)
        opts = dict(fullgraph=True, dynamic=None)
        self._first = torch.compile(_first, **opts)
        self._between = torch.compile(_between, **opts)
        self._last = torch.compile(_last, **opts)
        self._pre_moe = torch.compile(_pre_moe, **opts)
        self._post_moe = torch.compile(_post_moe, **opts)
        self._last_moe = torch.compile(_last_moe, **opts)
        self.warmup_seconds: float | None = None
        # Steps with fewer tokens run eager. Measured on the 386M model (2 threads): a one-token decode step took
        # 82 ms compiled against 55 ms eager, because the oneDNN / BLAS GEMVs between the graphs ran about 2x
        # slower there (cause not found: not Inductor's thread count); from 16 tokens up compiled wins (prefill
        # 1.4x). So batch-1 decode keeps the eager path and only the dynamic-size variant is compiled.
        self.min_tokens = MIN_COMPILED_TOKENS

    @staticmethod
    def _dyn(*tensors: torch.Tensor) -> None:
        import torch._dynamo

        if tensors[0].shape[0] > 1:  # a single token is its own static variant
            for t in tensors:
                torch._dynamo.mark_dynamic(t, 0)

    def __call__(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        layers = self.model.model.layers
        self._dyn(input_ids, positions)
        x, cos, sin, q, k, v = self._first(self.model, input_ids, positions)
        last = len(layers) - 1
        for i, layer in enumerate(layers):
            o = layer.attend(q, k, v, kv_caches[i], meta)
            self._dyn(o, x, cos, sin)
            if i in self.moe_layers:
                x, h = self._pre_moe(layer, o, x)
                m = layer.mlp(h)  # eager: the router and the experts (the backend's kernels where it has them)
                self._dyn(x, m)
                if i < last:
                    x, q, k, v = self._post_moe(layers[i + 1], x, m, cos, sin)
                else:
                    x = self._last_moe(self.model.model.norm, x, m)
            elif i < last:
                x, q, k, v = self._between(layer, layers[i + 1], o, x, cos, sin)
            else:
                x = self._last(layer, self.model.model.norm, o, x)
        return x

    def warm_up(self, run_step) -> float:
        """Compile both shape variants before serving: `run_step(num_tokens)` runs one forward of that size."""
        t0 = time.perf_counter()
        for n in (2, 3):  # 2 compiles the dynamic variant; 3 proves it is reused (no recompile)
            run_step(n)
        self.warmup_seconds = time.perf_counter() - t0
        log.info("compiled the decoder's dense stages in %.1fs (torch.compile, Inductor)", self.warmup_seconds)
        return self.warmup_seconds
