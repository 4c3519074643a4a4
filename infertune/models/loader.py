"""Build a model on the meta device and load a Hugging Face safetensors checkpoint straight into place.

Each parameter is allocated once on the target device and each checkpoint tensor is copied into its
slot (packed q/k/v and gate/up shards into their slices), so the weights never exist twice.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from infertune.backends.base import trim_host_heap
from infertune.config import ArchConfig, QuantConfig
from infertune.kernels import hugepages
from infertune.layers.attention import AttentionBackend
from infertune.layers.linear import default_weight_loader
from infertune.layers.parallel import TensorParallel, shard_model
from infertune.models.registry import get_model_class
from infertune.models.safetensors_io import CorruptCheckpointError, iter_tensors
from infertune.quant import attach_linear_methods
from infertune.quant.checkpoint import attach_stored_methods
from infertune.quant.fp8 import Fp8Dequantizer, read_fp8_checkpoint, requantize_config
from infertune.stored_quant import read_stored_quant

log = logging.getLogger("infertune")

# Checkpoint tensors that carry no weights of ours (recomputed at load time).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
# One routed expert's projection in the per-expert layout (Qwen-MoE / DeepSeek names, and Mixtral's w1 / w3 / w2)
# -> its slice of the fused 3-D tensors of layers/moe.py Experts. A quantized checkpoint's P.weight_<x> (scales,
# packed nibbles: tools/quant_format.py) goes to the slot gate_up_proj_weight_<x> / down_proj_weight_<x>.
_EXPERT = re.compile(
    r"^(?P<prefix>.*\.experts)\.(?P<n>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight(?P<tensor>_\w+)?$"
)
_OUR_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<proj>gate_up_proj|down_proj)(?:_(?P<tensor>weight\w*))?$")
_EXPERT_SLOT = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def checkpoint_files(model_dir: str) -> list[Path]:
    root = Path(model_dir)
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index ({e}); re-save the checkpoint") from e
        files = sorted({root / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise FileNotFoundError(f"{model_dir}: shards listed in {index.name} are missing: {', '.join(missing)}")
        return files
    files = sorted(root.glob("*.safetensors"))
    if not files:
        hint = (
            " (found PyTorch .bin weights: re-save with save_pretrained(safe_serialization=True))"
            if any(root.glob("*.bin"))
            else ""
        )
        raise FileNotFoundError(f"{model_dir}: no *.safetensors weights found{hint}")
    return files


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give every meta parameter and buffer real (uninitialised) storage, keeping tied weights tied."""
    made: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in made:
                new = nn.Parameter(_empty_on(param, device), requires_grad=False)
                new.__dict__.update(param.__dict__)  # e.g. weight_loader
                made[id(param)] = new
            module._parameters[name] = made[id(param)]
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                module._buffers[name] = _empty_on(buf, device)


def _empty_on(meta: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Uninitialised storage shaped like `meta`. Not torch.empty_like: on a meta tensor that runs a Python
    decomposition which imports torch.fx's symbolic shapes and sympy (~35 MiB of resident memory)."""
    if device.type == "cpu" and meta.is_contiguous():
        # (on 2 MB pages where the system allows: weights the kernels stream as loaded, bf16 on CPUs without the
        # 12-bit layout, read faster from them; kernels/hugepages.py)
        return hugepages.empty(meta.shape, meta.dtype, own=True)
    return torch.empty_strided(meta.shape, meta.stride(), dtype=meta.dtype, device=device)


# Bytes of checkpoint tensors between two returns of the C heap's free pages to the OS (backends/base.py
# trim_host_heap): the load's transients never pile up past about this much plus one module's. 8 MiB: Llama-1B
# W4A16's load peaked 124 MiB above its end state at 64 MiB, 48 at 8 (a bf16 module freed after quantizing waits in
# the heap until the next trim)
TRIM_EVERY_BYTES = 8 << 20
_PACKED_INT_SUFFIXES = (".qweight", ".qzeros", ".g_idx")  # GPTQ's and AWQ's own tensors


def _no_shared_expert(arch, name: str) -> bool:
    """A Qwen2-MoE shared expert's gate in a model whose shared expert has size 0 (transformers builds both anyway: its
    output is sigmoid(gate x) times an empty product, zeros)."""
    return arch.moe is not None and not arch.moe.shared_intermediate_size and ".mlp.shared_expert" in name


def load_model(
    arch: ArchConfig,
    model_dir: str,
    dtype: torch.dtype,
    device: torch.device,
    max_position: int,
    attn: AttentionBackend,
    show_progress: bool = False,
    quant: QuantConfig | None = None,
    backend=None,
    prepack: bool = True,
    kernels=None,
    compress: bool = False,
    tp: TensorParallel | None = None,
) -> nn.Module:
    """`arch` is the shape this process builds: with tensor parallel `tp`, one rank's share
    (ArchConfig.for_tensor_parallel), whose slices of each checkpoint tensor the loader copies (layers/parallel.py)."""
    files = checkpoint_files(model_dir)
    cls = get_model_class(arch.architecture)
    with torch.device("meta"):
        model = cls(arch, max_position, attn, dtype)
        if tp is not None:
            shard_model(model, tp)
    packed = getattr(cls, "packed_modules", {})
    renames = getattr(cls, "checkpoint_renames", {})
    stored = read_stored_quant(model_dir)

    fp8 = read_fp8_checkpoint(model_dir)  # block-scaled fp8: dequantized as it loads, then like a 16-bit checkpoint
    if fp8 is not None and quant is not None and quant.method is not None:
        quant = requantize_config(model, fp8, quant, packed)
    if stored is None:
        attach_linear_methods(model, quant, backend, prepack, dtype, kernels, compress)
    else:  # already quantized: the stored integers are loaded as they are, then only packed for the kernels
        if quant is not None and quant.method not in (None, stored.method):
            raise ValueError(f"{model_dir} is already quantized ({stored.method}); drop quantization={quant.method!r}")
        # (quantize_lm_head: the head, left in full precision by the checkpoint, in int8 as on the fly; no other layer)
        head = (
            QuantConfig(stored.method, quantize_lm_head=True, keep_fp=("*",))
            if quant and quant.quantize_lm_head
            else None
        )
        attach_linear_methods(model, head, backend, prepack, dtype, kernels, compress)
        attach_stored_methods(model, stored, packed, dtype, backend, kernels)
    materialize(model, device)
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = _expected_shards(model)  # param name -> shards still to load (None = the whole tensor)
    ready = _ReadyModules(model)  # modules whose weights are all in: quantized / packed as soon as they are
    early: dict[str, set] = {}  # the parameters of the modules processed so: name -> the shards they took
    expert_names: dict[str, str] = {}  # fused experts param -> one per-expert tensor name that filled it
    skipped = 0
    skips = lambda name: skips_layer(name, arch.skip_layers_from)  # noqa: E731
    dequant = Fp8Dequantizer(fp8, dtype, passes=skips) if fp8 is not None else None
    since_trim = 0  # bytes of checkpoint tensors loaded since the heap was last trimmed
    for path in tqdm(files, desc="loading weights", unit="file", disable=not show_progress or len(files) < 2):
        try:
            tensors = iter_tensors(path)
            if dequant is not None:  # (before the split: a fused fp8 tensor's block scales are the fused tensor's)
                tensors = dequant.stream(tensors)
            if arch.fused_checkpoint:
                tensors = split_fused(tensors, arch.fused_checkpoint)
            for name, tensor in tensors:
                if name.endswith(_IGNORED_SUFFIXES) or (arch.tie_word_embeddings and name == "lm_head.weight"):
                    continue
                if skips(name):
                    skipped += 1
                    continue
                target, shard = map_checkpoint_name(name, packed, renames)
                if shard is not None and ".experts." in name:
                    expert_names.setdefault(target, name)  # how this checkpoint names experts, for errors
                if target in early:
                    if shard is not None and shard not in early[target]:
                        continue  # another rank's expert (expert parallel): not loaded here, as its loader would do
                    raise ValueError(f"{path.name}: tensor {name!r} comes again after its layer was loaded whole")
                if target not in params:
                    if tensor.numel() == 0 or _no_shared_expert(arch, name):  # (what transformers builds for a
                        continue  # shared expert of size 0, left out here: zeros, and its gate scales zeros)
                    if name.endswith(_PACKED_INT_SUFFIXES):  # (an AutoGPTQ / AutoAWQ folder whose config.json has
                        raise ValueError(  # no quantization_config: quantize_config.json beside it, or nothing)
                            f"{path.name}: tensor {name!r} is a GPTQ / AWQ-style packed int4 weight (qweight, qzeros, "
                            "scales, g_idx), a format infertune does not load; quantize the unquantized model with "
                            "`infertune quantize --method w4a16` instead"
                        )
                    raise ValueError(
                        f"{path.name}: tensor {name!r} has no place in {arch.architecture}; "
                        "is config.json right for these weights?"
                    )
                param = params[target]
                try:
                    load = getattr(param, "weight_loader", default_weight_loader)
                    load(param, _cast(tensor, param), shard)
                except ValueError as e:
                    raise ValueError(f"{path.name}: {name}: {e}") from e
                since_trim += tensor.nbytes
                if shard is None:  # the whole tensor: every slice of it is filled
                    missing.pop(target, None)
                else:
                    missing.get(target, set()).discard(shard)
                if not missing.get(target):
                    complete = ready.loaded(param)
                    del param
                    gone = None
                    for module in complete:
                        # (our own references first, so that a method replacing a weight frees it at once: the
                        # checkpoint's full-precision layers are never all in memory together)
                        names = ready.param_names(module)
                        for n in names:
                            gone = params.pop(n, None)
                            early[n] = set(getattr(gone, "expected_shards", None) or ())
                        del gone
                        try:
                            module.quant_method.process_weights_after_loading(module)
                        except ValueError as e:  # (e.g. a group size that does not divide this layer's inputs)
                            raise ValueError(f"{names[0].rpartition('.')[0] if names else path.name}: {e}") from e
                    if since_trim >= TRIM_EVERY_BYTES:  # (after the modules it completed: their transients too)
                        trim_host_heap()
                        since_trim = 0
        except CorruptCheckpointError as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e}); re-download or re-save it") from e
    if dequant is not None:
        dequant.finish()  # every fp8 weight met its scales
    if skipped:
        log.info(
            "skipped %d checkpoint tensors of layers %d and up (multi-token-prediction layers, which infertune "
            "does not run)",
            skipped,
            arch.skip_layers_from,
        )
    del params  # drop our references, so a method replacing a weight (quantize, prepack) frees it at once
    absent = sorted(
        _checkpoint_name(name, s, packed, expert_names.get(name)) for name, shards in missing.items() for s in shards
    )
    if absent:
        raise ValueError(f"{model_dir}: checkpoint is missing tensors: {', '.join(absent[:8])}")
    for module in model.modules():
        if hasattr(module, "quant_method") and not ready.processed(module):
            module.quant_method.process_weights_after_loading(module)
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    trim_host_heap()
    return model.eval()


class _ReadyModules:
    """Which modules with a quant_method have every parameter of their own loaded (a tied weight counts once it is in,
    under whichever name): the loader quantizes / packs each such module at once, so a quantized or compressed
    model's peak memory is its packed layers plus about one layer in the checkpoint's precision, not the whole
    checkpoint at that precision."""

    def __init__(self, model: nn.Module) -> None:
        self.left: dict[nn.Module, set[int]] = {}  # module -> ids of its parameters not yet whole
        self.owners: dict[int, list[nn.Module]] = {}  # parameter id -> the modules waiting on it
        self.names: dict[nn.Module, list[str]] = {}
        self.done: set[nn.Module] = set()
        for mod_name, module in model.named_modules(remove_duplicate=False):
            if not hasattr(module, "quant_method"):
                continue
            own = list(module.named_parameters(recurse=False))
            if module in self.left or not own:
                continue
            self.left[module] = {id(p) for _, p in own}
            self.names[module] = [f"{mod_name}.{n}" if mod_name else n for n, _ in own]
            for _, p in own:
                self.owners.setdefault(id(p), []).append(module)

    def loaded(self, param: torch.Tensor) -> list[nn.Module]:
        """param is whole now: the modules this completes (each returned once)."""
        out = []
        for module in self.owners.pop(id(param), []):
            left = self.left[module]
            left.discard(id(param))
            if not left:
                self.done.add(module)
                out.append(module)
        return out

    def param_names(self, module: nn.Module) -> list[str]:
        return self.names.get(module, [])

    def processed(self, module: nn.Module) -> bool:
        return module in self.done


def _cast(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """Float tensors take the slot's dtype (the model dtype, or fp32 for quantization scales); integer tensors
    (pre-quantized weights) must be stored in the slot's dtype already."""
    if tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(
            f"stored as {tensor.dtype}, which needs its block scales: config.json has no quantization_config with "
            "quant_method 'fp8'"
        )
    if tensor.is_floating_point() and param.is_floating_point():
        return tensor.to(param.dtype)
    if tensor.dtype != param.dtype:
        raise ValueError(f"stored as {tensor.dtype}, the model expects {param.dtype}")
    return tensor


def skips_layer(name: str, first_skipped: int | None) -> bool:
    """Whether checkpoint tensor `name` is of a layer the engine does not run (index >= first_skipped: DeepSeek's
    multi-token-prediction layers; None: no layer is skipped)."""
    return first_skipped is not None and _layer_index(name, first_skipped)


def _layer_index(name: str, first_skipped: int) -> bool:
    m = _LAYER.match(name)
    return m is not None and int(m.group(1)) >= first_skipped


def map_checkpoint_name(
    name: str, packed: dict[str, tuple[str, object]], renames: dict[str, str] | None = None
) -> tuple[str, object]:
    """A checkpoint name -> (our name, shard): model.layers.0.self_attn.q_proj.weight -> (...qkv_proj.weight, 'q');
    model.layers.1.mlp.experts.3.up_proj.weight -> (...mlp.experts.gate_up_proj, (3, 1)). `renames` maps a
    family's module names onto ours (Mixtral's block_sparse_moe -> mlp)."""
    if renames:
        name = ".".join(renames.get(p, p) for p in name.split("."))
    m = _EXPERT.match(name)
    if m:
        n, proj, tensor = int(m["n"]), m["proj"], f"_weight{m['tensor']}" if m["tensor"] else ""
        if proj in ("down_proj", "w2"):
            return f"{m['prefix']}.down_proj{tensor}", n
        return f"{m['prefix']}.gate_up_proj{tensor}", (n, _EXPERT_SLOT[proj])
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            new, shard = packed[part]
            return ".".join(parts[:i] + [new] + parts[i + 1 :]), shard
    return name, None


def split_fused(tensors, fused: dict[str, tuple[tuple[str, int], ...]]):
    """A checkpoint's fused projections (Phi-3's qkv_proj, gate_up_proj: ArchConfig.fused_checkpoint) as the
    per-shard tensors the packed layers load: row views of the fused tensor (no copy), named as their own tensors
    would be (qkv_proj.weight -> q_proj.weight, k_proj.weight, v_proj.weight), so that the shards, tensor parallel's
    slices of each and the missing-tensor check work as for a Llama checkpoint. A stored quantized layer's per-row
    tensors (weight_scale: `infertune quantize` keeps the source's fused names) split the same way; a per-tensor one
    (input_scale) and other tensors pass unchanged."""
    for name, tensor in tensors:
        module, _, leaf = name.rpartition(".")
        prefix, _, proj = module.rpartition(".")
        shards = fused.get(proj) if leaf in ("weight", "bias") or leaf.startswith("weight_") else None
        rows = sum(n for _, n in shards) if shards is not None else 0
        if shards is None or (leaf.startswith("weight_") and (tensor.dim() == 0 or tensor.shape[0] != rows)):
            yield name, tensor
            continue
        if tensor.shape[0] != rows:
            raise ValueError(
                f"tensor {name!r} has {tensor.shape[0]} rows; config.json's shape needs {rows} "
                f"({' + '.join(f'{s} {n}' for s, n in shards)}); is config.json right for these weights?"
            )
        start = 0
        for shard_name, n in shards:
            yield f"{prefix}.{shard_name}.{leaf}", tensor.narrow(0, start, n)
            start += n


def _checkpoint_name(
    name: str, shard: object, packed: dict[str, tuple[str, object]], example: str | None = None
) -> str:
    """Our (packed name, shard) back to the tensor name the checkpoint should have had; for an expert, named like
    `example` (another expert's tensor of the same checkpoint) where there is one: Mixtral's are
    block_sparse_moe.experts.N.w1 / w3 / w2."""
    if shard is None:
        return name
    m = _OUR_EXPERT.match(name)
    if m and example is not None and (ex := _EXPERT.match(example)):
        projs = ("w1", "w3", "w2") if ex["proj"] in ("w1", "w2", "w3") else ("gate_proj", "up_proj", "down_proj")
        n, proj = (shard[0], projs[shard[1]]) if isinstance(shard, tuple) else (shard, projs[2])
        return f"{ex['prefix']}.{n}.{proj}.weight{ex.groupdict().get('tensor') or ''}"
    if m:
        tensor = m["tensor"] or "weight"
        if m["proj"] == "gate_up_proj":
            return f"{m['prefix']}.{shard[0]}.{('gate_proj', 'up_proj')[shard[1]]}.{tensor}"
        return f"{m['prefix']}.{shard}.down_proj.{tensor}"
    for hf_part, (ours, key) in packed.items():
        if key == shard and f".{ours}." in name:
            return name.replace(f".{ours}.", f".{hf_part}.")
    return f"{name}[{shard}]"


def _expected_shards(model: nn.Module) -> dict[str, set]:
    expected: dict[str, set] = {}
    for mod_name, module in model.named_modules():
        for p_name, param in module.named_parameters(recurse=False):
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            shards = getattr(param, "expected_shards", None)  # a weight that loads in slices (MoE experts)
            expected[full] = set(shards) if shards else set(getattr(module, "shard_offsets", {None: None}))
    # A tied weight is reachable under two names; the checkpoint fills it once.
    for name, _ in model.named_parameters(remove_duplicate=False):
        if name not in dict(model.named_parameters()):
            expected.pop(name, None)
    return expected
