"""Offline quantization: a Hugging Face checkpoint in, a quantized checkpoint folder out (see quant_format.py).

Weights are read from the source safetensors and quantized per Hugging Face projection (q_proj, k_proj, ...);
every scheme is per output row, so this equals quantizing the engine's packed qkv / gate-up weights. Which
layers are quantized follows the engine's own rule: every Linear except those matching keep_fp and those
sharing their weight with another module (a tied lm_head), and every MoE experts block keep_fp does not match
(each expert's projections quantized as Linears, stored per expert). Calibration (W8A8 only: nothing in weight-only
quantization uses activations here) runs sample text through the engine with hooks (calibration.py); it
gives the static activation scales and the SmoothQuant factors.

SmoothQuant (optional, W8A8): for the layers fed by an RMSNorm (q/k/v after input_layernorm, gate/up after
post_attention_layernorm), s_j = max|x_j|^alpha / max|W_:,j|^(1-alpha) per input channel; the norm weight
is divided by s and the weight columns multiplied by it, which leaves the model's function unchanged and
moves activation outliers into the weights, where per-channel int8 absorbs them.

A block-scaled fp8 checkpoint (DeepSeek-V3, Qwen3-*-FP8; quant/fp8.py) is a source too: each fp8 weight is
dequantized to the dtype the engine runs the checkpoint in as it is read, as the engine's load does, so the result
equals quantizing on the fly (`quantization=...` on the fp8 checkpoint); its modules_to_not_convert stay in full
precision, and DeepSeek's multi-token-prediction layers, which the engine skips, are copied as they are stored.
"""

from __future__ import annotations

import fnmatch
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from infertune.config import GEMMA_ARCHITECTURES, QUANT_METHODS, ArchConfig, default_model_path
from infertune.evaluate.data import default_calib_path, load_documents
from infertune.files import check_writable_folder
from infertune.layers.attention import TorchPagedAttention
from infertune.layers.linear import Linear
from infertune.layers.moe import Experts
from infertune.models.loader import checkpoint_files, map_checkpoint_name, skips_layer
from infertune.models.registry import get_model_class
from infertune.quant import is_lm_head, shared_parameters
from infertune.quant.fp8 import SCALE_SUFFIX, Fp8Checkpoint, Fp8Dequantizer, not_converted_modules, read_fp8_checkpoint
from infertune.tools import quant_format as ckpt
from infertune.tools.calibration import ActivationStats, calibration_samples, collect
from infertune.tools.weight_clipping import parse_clip, quantize_int4, quantize_int8

log = logging.getLogger(__name__)

GROUP_SIZES = (32, 64, 128, 256)
# Llama-family layers whose input is an RMSNorm's output: (module suffix, norm suffix) within a decoder layer.
SMOOTHABLE = {"self_attn.qkv_proj": "input_layernorm", "mlp.gate_up_proj": "post_attention_layernorm"}


@dataclass
class QuantizeResult:
    out: str
    method: str
    quantized: list[str]  # Hugging Face module names
    kept: list[str]
    weight_bytes_before: int  # of the quantized layers' weights, as stored in the source
    weight_bytes_after: int  # their stored replacement (q + scales + zeros)
    stats: dict[str, ActivationStats] = field(default_factory=dict)  # engine layer name -> input statistics
    input_scales: dict[str, float] = field(default_factory=dict)  # engine layer name -> static scale (w8a8)
    smooth_alpha: float | None = None
    calib_seconds: float = 0.0
    seconds: float = 0.0
    quantize_lm_head: bool = False  # the head stored as it is, put in int8 at every load

    def format(self) -> str:
        kept = [f"{n} (int8 at load)" if self.quantize_lm_head and n == "lm_head" else n for n in self.kept]
        lines = [
            f"wrote {self.out}: {len(self.quantized)} linear layers as {self.method}; full precision: "
            f"{', '.join(kept) or 'none'}",
            f"quantized weights: {self.weight_bytes_before / 2**20:.2f} MiB -> {self.weight_bytes_after / 2**20:.2f} MiB "
            f"({100 * self.weight_bytes_after / max(self.weight_bytes_before, 1):.1f} %)",
        ]
        if self.stats:
            first = next(iter(self.stats.values()))
            lines.append(
                f"calibration: {first.samples} samples, {first.tokens:,} tokens, {self.calib_seconds:.1f} s; "
                f"activation |x| per layer input (percentile {first.percentile:g} = mean of per-sample "
                f"nearest-rank values):"
            )
            lines.append(
                f"  {'layer':40}{'max':>10}{'p' + format(first.percentile, 'g'):>10}{'clip/max':>10}"
                f"{'static scale':>14}"
            )
            for name, s in self.stats.items():
                scale = self.input_scales.get(name)
                lines.append(
                    f"  {name:40}{s.max:10.4g}{s.percentile_value:10.4g}"
                    f"{s.percentile_value / max(s.max, 1e-12):10.3f}"
                    f"{'' if scale is None else format(scale, '.4g'):>14}"
                )
        elif self.method != "w8a8":
            lines.append(
                f"calibration: none needed ({self.method} quantizes weights only; activations stay in the model dtype)"
            )
        if self.smooth_alpha is not None:
            lines.append(
                f"SmoothQuant alpha {self.smooth_alpha:g} folded into the norms before {', '.join(SMOOTHABLE)}"
            )
        lines.append(f"({self.seconds:.1f} s)")
        return "\n".join(lines)


def _kept(name: str, keep_fp: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(name, p) or name.startswith(p + ".") for p in keep_fp)


def _meta_model(arch: ArchConfig):
    cls = get_model_class(arch.architecture)
    with torch.device("meta"):
        return cls(arch, arch.max_position_embeddings, TorchPagedAttention(), torch.float32)


def _linear_layout(arch: ArchConfig):
    """The engine's Linear modules (on the meta device): {name: module}, and the names whose weight is shared."""
    cls = get_model_class(arch.architecture)
    model = _meta_model(arch)
    tied = shared_parameters(model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    shared = {n for n, m in linears.items() if id(m.weight) in tied}
    return linears, shared, getattr(cls, "packed_modules", {})


def plan_layers(
    model: str, keep_fp: tuple[str, ...], tensors: dict[str, torch.Tensor]
) -> tuple[list[str], dict[str, tuple[str, object]]]:
    """(engine layers to quantize, {HF weight name: (engine layer, shard)}) under the engine's rule."""
    linears, shared, packed = _linear_layout(ArchConfig.from_model_dir(model))
    # (the LM head stays in full precision whatever keep_fp says, as in the engine: quant.keeps)
    chosen = sorted(n for n in linears if n not in shared and not _kept(n, keep_fp) and not is_lm_head(n))
    if not chosen:
        raise ValueError(f"--keep-fp {','.join(keep_fp)} leaves no linear layer to quantize")
    targets = {}
    for name in tensors:
        if name.endswith(".weight"):
            layer, shard = map_checkpoint_name(name.removesuffix(".weight"), packed)
            if layer in chosen:
                targets[name] = (layer, shard)
    return chosen, targets


def plan_experts(
    model: str, keep_fp: tuple[str, ...], tensors: dict[str, torch.Tensor]
) -> tuple[dict[str, str], list[str]]:
    """({HF tensor name: engine experts module} of the expert weights to quantize, experts modules kept in full
    precision): per-expert weights (...experts.N.gate_proj.weight) and fused ones (...experts.gate_up_proj) alike."""
    arch = ArchConfig.from_model_dir(model)
    experts = {n for n, m in _meta_model(arch).named_modules() if isinstance(m, Experts)}
    renames = getattr(get_model_class(arch.architecture), "checkpoint_renames", {})
    kept = sorted(n for n in experts if _kept(n, keep_fp))
    targets = {}
    for name in tensors:
        module, _, proj = map_checkpoint_name(name, {}, renames)[0].rpartition(".")
        if module in experts and module not in kept and proj in ("gate_up_proj", "down_proj"):
            targets[name] = module
    return targets, kept


def read_tensors(
    model: str,
    fp8: Fp8Checkpoint | None = None,
    dtype: torch.dtype = torch.bfloat16,
    stored_bytes: dict[str, int] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint by name; an fp8 checkpoint's weights dequantized to `dtype` (their scales
    consumed), except those of layers the engine skips (DeepSeek's MTP layers), which stay as stored. stored_bytes,
    when given, receives each tensor's bytes in the files (an fp8 weight's with its scales)."""
    sizes = {} if stored_bytes is None else stored_bytes

    def raw():
        for path in checkpoint_files(model):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():
                    t = f.get_tensor(name)
                    sizes[name] = t.numel() * t.element_size()
                    yield name, t

    if fp8 is None:
        return dict(raw())
    skipped_from = ArchConfig.from_model_dir(model).skip_layers_from
    dequant = Fp8Dequantizer(fp8, dtype, passes=lambda name: skips_layer(name, skipped_from))
    tensors = dict(dequant.stream(raw()))
    dequant.finish()
    for name in tensors:
        if name + SCALE_SUFFIX in sizes and name + SCALE_SUFFIX not in tensors:
            sizes[name] += sizes.pop(name + SCALE_SUFFIX)
    return tensors


def _smoothing_factors(
    stats: dict[str, ActivationStats], weights: dict[str, list[torch.Tensor]], alpha: float
) -> dict[str, torch.Tensor]:
    """engine layer -> s [K] for the layers fed by a norm; weights[layer] = its HF shards."""
    out = {}
    for name, s in stats.items():
        if not any(name.endswith("." + suffix) for suffix in SMOOTHABLE) or name not in weights:
            continue
        w_max = torch.stack([w.float().abs().amax(dim=0) for w in weights[name]]).amax(dim=0)  # [K]
        a_max = s.absmax
        factor = (a_max.clamp(min=1e-5) ** alpha) / (w_max.clamp(min=1e-5) ** (1 - alpha))
        out[name] = torch.where((a_max > 0) & (w_max > 0), factor, torch.ones_like(factor)).clamp(min=1e-5)
    return out


def smooth(
    tensors: dict[str, torch.Tensor],
    targets: dict[str, tuple[str, object]],
    stats: dict[str, ActivationStats],
    alpha: float,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """SmoothQuant: (factors {engine layer: s [K]}, {tensor name: rescaled tensor}) for the norm-fed layers.

    Linear weights come back in fp32 (they are quantized next); norm weights in their stored dtype.
    """
    by_layer: dict[str, list[torch.Tensor]] = {}
    for name, (layer, _) in targets.items():
        by_layer.setdefault(layer, []).append(tensors[name])
    factors = _smoothing_factors(stats, by_layer, alpha)
    out = {}
    for name, (layer, _) in targets.items():
        if layer in factors:
            out[name] = tensors[name].float() * factors[layer]  # scale the input columns
    for layer, s in factors.items():
        norm = _norm_of(layer) + ".weight"
        out[norm] = (tensors[norm].float() / s).to(tensors[norm].dtype)
    return factors, out


def _norm_of(layer: str) -> str:
    for suffix, norm in SMOOTHABLE.items():
        if layer.endswith("." + suffix):
            return layer[: -len(suffix)] + norm
    raise AssertionError(layer)


def quantize(
    model: str | None,
    method: str,
    out: str,
    *,
    group_size: int = 128,
    symmetric: bool = False,
    clip: str = "minmax",
    act_clip: str = "percentile:99.9",
    static_activations: bool = False,
    smoothquant: float | None = None,
    calib: str | None = None,
    num_samples: int = 512,
    seq_len: int = 128,
    keep_fp: tuple[str, ...] = ("lm_head",),
    quantize_lm_head: bool = False,
    dtype: str = "auto",
    device: str = "auto",
    show_progress: bool = True,
) -> QuantizeResult:
    """Quantize `model` (a Hugging Face folder; None = the demo model) with `method` and write it to `out`."""
    t0 = time.perf_counter()
    model = model or default_model_path()
    if method not in QUANT_METHODS:
        raise ValueError(f"--method {method!r} is not one of {', '.join(QUANT_METHODS)}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"--group-size {group_size} must be one of {GROUP_SIZES}")
    parse_clip(clip)
    act_kind, _ = parse_clip(act_clip)
    if act_kind == "mse":
        raise ValueError("--act-clip takes percentile:P or minmax (mse applies to weights)")
    percentile = float(act_clip.partition(":")[2] or 99.9) if act_kind == "percentile" else 100.0
    if (static_activations or smoothquant is not None) and method != "w8a8":
        raise ValueError("--static-activations and --smoothquant apply to --method w8a8 only")
    if smoothquant is not None and not 0.0 <= smoothquant <= 1.0:
        raise ValueError(f"--smoothquant {smoothquant} must be in [0, 1] (0.5 is the usual choice)")
    calibrate = method == "w8a8" and num_samples > 0
    if (static_activations or smoothquant is not None) and not calibrate:
        raise ValueError("--static-activations and --smoothquant need calibration: give --num-samples > 0")
    if calibrate and seq_len < 1:
        raise ValueError(f"--seq-len {seq_len} must be >= 1 (tokens per calibration sample)")
    if calibrate:
        load_documents(calib or default_calib_path())  # (a missing or empty --calib said now, not after the load)
    elif calib is not None:
        log.warning("--calib %s is not read: %s calibrates nothing (w8a8 with --num-samples > 0 does)", calib, method)
    config_path = Path(model) / "config.json"
    fp8 = read_fp8_checkpoint(model) if config_path.is_file() else None  # dequantized as it is read
    if config_path.is_file() and fp8 is None:
        qc = json.loads(config_path.read_text()).get("quantization_config")
        if qc:
            raise ValueError(
                f"{model} is already quantized (quantization_config: quant_method "
                f"{qc.get('quant_method')!r}, format {qc.get('format')!r}); quantize the checkpoint it was made from "
                "(its bf16 / fp16 / fp32 weights, or block-scaled fp8), or serve this one as it is"
            )
    out_path = Path(out)
    if out_path.resolve() == Path(model).resolve():
        raise ValueError("--out must not be the source model's folder")
    if out_path.exists() and not out_path.is_dir():
        raise ValueError(f"--out {out} is a file; give a new folder for the quantized checkpoint")
    if out_path.exists() and any(out_path.iterdir()):
        raise ValueError(f"--out {out} exists and is not empty; choose a new folder")
    check_writable_folder("--out", out_path)  # (before the work: it was first written after all of it)

    arch = ArchConfig.from_model_dir(model)
    if smoothquant is not None and arch.architecture in GEMMA_ARCHITECTURES:
        raise ValueError(
            f"--smoothquant divides Llama-style norm weights; {arch.architecture}'s (1 + w) norms do not take its "
            "factors: drop --smoothquant"
        )
    linears, _, packed = _linear_layout(arch)
    # The weights are rounded to the dtype the engine runs the checkpoint in (dtype, resolved as the engine resolves
    # it: an fp16 checkpoint runs in bf16 on CPU) before they are quantized, as quantizing while loading rounds them:
    # the saved checkpoint then gives on-the-fly quantization's values at that dtype. (fp8: dequantized to it.)
    from infertune.backends import get_backend

    run_dtype = get_backend(device).resolve_dtype(dtype, arch.torch_dtype)
    stored_bytes: dict[str, int] = {}
    tensors = read_tensors(model, fp8, run_dtype, stored_bytes)
    # what the fp8 checkpoint left unquantized stays so, as on the fly (quant/fp8.py: requantize_config)
    keep_all = keep_fp + tuple(not_converted_modules(_meta_model(arch), fp8, packed) if fp8 is not None else ())
    chosen, targets = plan_layers(model, keep_all, tensors)
    expert_targets, kept_experts = plan_experts(model, keep_all, tensors)
    linear_names = set(linears) | set(expert_targets.values()) | set(kept_experts)
    for pattern in keep_fp:
        if pattern != "lm_head" and not any(_kept(n, (pattern,)) for n in linear_names):
            # (lm_head, the default, is absent from tied-embedding models: not worth a word)
            log.warning("--keep-fp %r matches no linear layer or experts module of this model", pattern)
    if method == "w4a16":
        for name in [*targets, *expert_targets]:
            if tensors[name].shape[-1] % group_size:
                raise ValueError(
                    f"{name}: in_features={tensors[name].shape[-1]} is not a multiple of --group-size "
                    f"{group_size}; pick one dividing it"
                )

    result = QuantizeResult(
        str(out_path), method, [], [], 0, 0, smooth_alpha=smoothquant, quantize_lm_head=quantize_lm_head
    )
    weights = {name: tensors[name] for name in targets}
    if calibrate:
        from infertune.llm import LLM  # the engine itself runs the calibration text

        tc = time.perf_counter()
        llm = LLM(model, dtype=dtype, device=device, enable_prefix_caching=False, max_num_seqs=1)
        runner = llm.engine.executor.runner
        samples = calibration_samples(
            llm.tokenizer, load_documents(calib or default_calib_path()), num_samples, seq_len
        )
        if len(samples) < num_samples:
            log.warning(
                "calibration text gives %d samples of <= %d tokens, fewer than --num-samples %d",
                len(samples),
                seq_len,
                num_samples,
            )
        result.stats = collect(runner, chosen, samples, percentile, show_progress=show_progress)
        if smoothquant is not None:
            factors, smoothed = smooth(tensors, targets, result.stats, smoothquant)
            for name, t in smoothed.items():
                (weights if name in targets else tensors)[name] = t
            # The smoothed layers now see x / s: measure those inputs for the report and the static scales.
            result.stats = collect(
                runner,
                chosen,
                samples,
                percentile,
                divisors=factors,
                desc="calibrating (smoothed)",
                show_progress=show_progress,
            )
        del llm, runner
        result.calib_seconds = time.perf_counter() - tc
        result.input_scales = {n: s.clip_value(act_kind) / 127.0 for n, s in result.stats.items()}

    stored: dict[str, torch.Tensor] = {}
    quantized_experts = []
    for name, t in tensors.items():
        if name in expert_targets:  # each expert's projection as a Linear of its own (dynamic activations)
            per_expert = ckpt.split_fused_experts(name, t) if t.dim() == 3 else {name: t}
            for wname, w in per_expert.items():
                w = w.to(run_dtype).float()
                q = quantize_int4(w, group_size, symmetric, clip) if method == "w4a16" else quantize_int8(w, clip)
                new = ckpt.layer_tensors(wname.removesuffix(".weight"), method, q)
                stored.update(new)
                quantized_experts.append(wname.removesuffix(".weight"))
                result.weight_bytes_after += sum(v.numel() * v.element_size() for v in new.values())
            result.weight_bytes_before += stored_bytes[name]
            continue
        if name not in targets:
            stored[name] = t.contiguous()
            continue
        layer, _ = targets[name]
        w = weights[name].to(run_dtype).float()
        q = quantize_int4(w, group_size, symmetric, clip) if method == "w4a16" else quantize_int8(w, clip)
        scale = result.input_scales.get(layer) if static_activations else None
        new = ckpt.layer_tensors(name.removesuffix(".weight"), method, q, scale)
        stored.update(new)
        result.weight_bytes_before += stored_bytes[name]
        result.weight_bytes_after += sum(v.numel() * v.element_size() for v in new.values())
    result.quantized = sorted([*(n.removesuffix(".weight") for n in targets), *quantized_experts])
    hf_linears = set()
    for name in tensors:
        if name.endswith(".weight") and map_checkpoint_name(name.removesuffix(".weight"), packed)[0] in linears:
            hf_linears.add(name.removesuffix(".weight"))
    if arch.tie_word_embeddings and "lm_head" in linears:
        hf_linears.add("lm_head")  # tied: no tensor of its own, still a Linear the scheme leaves alone
    result.kept = sorted((hf_linears - set(result.quantized)) | set(kept_experts))

    extra = {
        "source_model": str(Path(model).resolve()),
        "weight_clip": clip,
        "activation_clip": act_clip if calibrate else None,
        "smoothquant_alpha": smoothquant,
        # the head's values are stored as they are (in `ignore`); each load puts it in int8 per row, as on the fly
        "quantize_lm_head": quantize_lm_head,
        "calibration": None
        if not calibrate
        else {
            "file": str(calib or default_calib_path()),
            "samples": next(iter(result.stats.values())).samples,
            "seq_len": seq_len,
            "percentile": percentile,
        },
    }
    qcfg = ckpt.quantization_config(
        method, group_size, symmetric, clip, static_activations, act_clip, result.kept, extra
    )
    # Written into a hidden folder beside --out and renamed to it once whole: an interrupted run leaves no
    # half-written checkpoint under that name (which a rerun refused as not empty, and a load read half of).
    out_path.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{out_path.name}.partial-", dir=out_path.parent))
    umask = os.umask(0)
    os.umask(umask)
    partial.chmod(0o777 & ~umask)  # (mkdtemp's folder is private: the checkpoint's is made as mkdir makes one)
    try:
        save_file(stored, str(partial / "model.safetensors"), metadata={"format": "pt"})
        ckpt.write_config(model, str(partial), qcfg)
        ckpt.copy_side_files(model, str(partial))
        if out_path.is_dir():
            out_path.rmdir()  # (empty: checked before the work)
        partial.rename(out_path)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    result.seconds = time.perf_counter() - t0
    return result
