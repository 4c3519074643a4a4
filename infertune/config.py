"""EngineConfig tree: what to load (model), how to cache (cache), how to batch (scheduler), where to run (device).

Every dataclass validates itself in __post_init__ and raises ValueError naming the field to change.
This module imports no torch, so the engine core and its tests stay pure Python.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda", "npu")
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def default_model_path() -> str:
    """The small model that ships inside the package, used when no --model is given."""
    return str(Path(__file__).parent / "assets" / "demo-model")


@dataclass(slots=True)
class ArchConfig:
    """The parts of a Hugging Face config.json that the model code needs, parsed without transformers."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str
    sliding_window: int | None
    torch_dtype: str | None
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None

    @classmethod
    def from_dict(cls, cfg: dict, where: str = "config.json") -> "ArchConfig":
        archs = cfg.get("architectures") or []
        arch = archs[0] if archs else _arch_from_model_type(cfg.get("model_type"))
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"{where}: architecture {arch!r} is not supported; infertune runs "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}."
            )
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers >= 5 nests rope_theta inside rope_parameters; older configs keep rope_theta + rope_scaling.
        rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or None
        rope_theta = float(cfg.get("rope_theta") or (rope or {}).get("rope_theta") or 10000.0)
        if rope is not None:
            rope = dict(rope)
            rope_type = rope.get("rope_type", rope.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"{where}: rope type {rope_type!r} is not supported; infertune implements "
                    f"{', '.join(SUPPORTED_ROPE_TYPES)}."
                )
            rope["rope_type"] = rope_type
            if rope_type == "default":
                rope = None
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{where}: hidden_act {cfg.get('hidden_act')!r} is not supported; only 'silu' is.")
        window = cfg.get("sliding_window")
        # Qwen2 configs carry a sliding_window that is inactive unless use_sliding_window is true, and
        # then only for layers from max_window_layers on; explicit layer_types say it directly.
        layers = int(cfg["num_hidden_layers"])
        if arch == "Qwen2ForCausalLM" and (
            not cfg.get("use_sliding_window", False) or int(cfg.get("max_window_layers", 0)) >= layers
        ):
            window = None
        if cfg.get("layer_types") and "sliding_attention" not in cfg["layer_types"]:
            window = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_hidden_layers=int(cfg["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 always has q/k/v bias and no flag for it.
            attention_bias=bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM")),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            hidden_act="silu",
            sliding_window=int(window) if window else None,
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
        )

    @classmethod
    def from_model_dir(cls, model: str) -> "ArchConfig":
        path = Path(model) / "config.json"
        if not Path(model).is_dir():
            raise FileNotFoundError(
                f"model path {model!r} is not a directory; pass a Hugging Face model folder "
                "(with config.json, *.safetensors and tokenizer files), or omit --model to use the built-in model."
            )
        if not path.is_file():
            raise FileNotFoundError(f"{model!r} has no config.json; is it a Hugging Face model folder?")
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        return cls.from_dict(cfg, where=str(path))

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes


def _arch_from_model_type(model_type: str | None) -> str:
    return {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}.get(
        model_type or "", f"model_type={model_type!r}"
    )


@dataclass(slots=True)
class ModelConfig:
    model: str = field(default_factory=default_model_path)
    tokenizer: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    # Reorder plain weights once into the backend's fastest matmul layout (oneDNN blocked bf16 on CPU).
    prepack_weights: bool = True
    # The backend's own small-batch linear kernels for decode steps (infertune/kernels on CPU: AVX-512 BF16 / VNNI
    # and AMX): "auto" uses them where the backend has them, with the fused decode step (every layer of a
    # decode-only step in one call); "linear" only the linear kernels under the PyTorch forward; "off" keeps
    # torch's matmuls.
    decode_kernels: str = "auto"
    # Plain bf16 weights under the decode kernels kept losslessly in 12 bits a weight (layers/linear.py
    # Bf16cMethod): "auto" where the kernels run and the CPU has AMX (not with compile="on"), "off" keeps them as
    # loaded. Same outputs bit for bit; decode steps stream 25% fewer bytes.
    compress_weights: str = "auto"
    # torch.compile the dense stages of each decoder layer: "auto" (models >= 100M parameters, on backends that
    # support it), "on" or "off". Compilation happens in a warm-up before serving; see runner/compiled.py.
    compile: str = "auto"
    arch: ArchConfig | None = None

    def __post_init__(self) -> None:
        self.model = os.fspath(self.model)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not one of {DTYPES}")
        if self.decode_kernels not in ("auto", "linear", "off"):
            raise ValueError(f"decode_kernels={self.decode_kernels!r} is not one of ('auto', 'linear', 'off')")
        if self.compress_weights not in ("auto", "off"):
            raise ValueError(f"compress_weights={self.compress_weights!r} is not one of ('auto', 'off')")
        if self.compile not in ("auto", "on", "off"):
            raise ValueError(f"compile={self.compile!r} is not one of ('auto', 'on', 'off')")
        if self.arch is None:
            self.arch = ArchConfig.from_model_dir(self.model)
        if self.tokenizer is None:
            self.tokenizer = self.model
        limit = self.arch.max_position_embeddings
        if self.max_model_len is None:
            self.max_model_len = limit
        elif self.max_model_len <= 0:
            raise ValueError(f"max_model_len={self.max_model_len} must be positive")
        elif self.max_model_len > limit and (self.arch.rope_scaling is None):
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={limit}; "
                "lower max_model_len."
            )
        window = self.arch.sliding_window
        if window is not None and window < self.max_model_len:
            raise ValueError(
                f"{self.arch.architecture} uses sliding-window attention (window {window}), which infertune does "
                f"not implement yet; set max_model_len <= {window} so full attention is exact."
            )


@dataclass(slots=True)
class CacheConfig:
    block_size: int = 16
    # An absolute budget wins over the fraction; None means "fraction of the memory free after loading".
    kv_cache_memory_bytes: int | None = None
    kv_cache_memory_fraction: float = 0.5
    enable_prefix_caching: bool = True
    # "int8": K/V stored as int8 with one fp32 scale per token and head, ~0.53x the bytes of bf16 at head_dim 64
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size={self.block_size} must be a positive power of two (e.g. 16)")
        if self.kv_cache_memory_bytes is not None and self.kv_cache_memory_bytes <= 0:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} must be positive")
        if not 0.0 < self.kv_cache_memory_fraction <= 1.0:
            raise ValueError(f"kv_cache_memory_fraction={self.kv_cache_memory_fraction} must be in (0, 1]")
        if self.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} must be 'auto' (the model dtype) or 'int8'")


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Dynamic batch by input length (the seeds' policy): admit a sequence only while the running sequences'
    # lengths, its own included, sum to at most this many tokens, so short inputs run in larger batches than
    # long ones. None: only max_num_seqs and the KV blocks limit the batch.
    max_running_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs={self.max_num_seqs} must be positive")
        if self.max_running_tokens is not None and self.max_running_tokens <= 0:
            raise ValueError(f"max_running_tokens={self.max_running_tokens} must be positive (or None)")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be positive")


QUANT_METHODS = ("w8a16", "w4a16", "w8a8")


@dataclass(slots=True)
class QuantConfig:
    """Weight (and activation) quantization applied on the fly after loading; None keeps the model dtype."""

    quantization: str | None = None
    quant_group_size: int = 128  # W4A16 group size along the input dim
    quant_symmetric: bool = False  # W4A16: symmetric groups (-8..7) instead of [min, max] -> 0..15
    # Layers left in full precision: fnmatch patterns or module prefixes ("lm_head", "model.layers.0.*").
    keep_fp: tuple[str, ...] = ("lm_head",)

    def __post_init__(self) -> None:
        if self.quantization is not None and self.quantization not in QUANT_METHODS:
            raise ValueError(f"quantization={self.quantization!r} is not one of {QUANT_METHODS} (or None)")
        if self.quant_group_size not in (32, 64, 128, 256):
            raise ValueError(f"quant_group_size={self.quant_group_size} must be 32, 64, 128 or 256")
        self.keep_fp = tuple(self.keep_fp)

    @property
    def method(self) -> str | None:
        return self.quantization

    @property
    def group_size(self) -> int:
        return self.quant_group_size

    @property
    def symmetric(self) -> bool:
        return self.quant_symmetric


@dataclass(slots=True)
class DeviceConfig:
    device: str = "auto"

    def __post_init__(self) -> None:
        kind, _, index = self.device.partition(":")
        if kind not in DEVICES or (index and (kind == "auto" or not index.isdigit())):
            raise ValueError(f"device={self.device!r} is not one of {DEVICES} (optionally with an index, e.g. 'cuda:1')")


EXECUTOR_BACKENDS = ("uni", "mp")


@dataclass(slots=True)
class ParallelConfig:
    """Where the model runner lives: "uni" in the engine's own process, "mp" in a worker process of its own that
    gets each step's SchedulerOutput pickled over a pipe (the seam tensor parallel and Ray workers build on)."""

    distributed_executor_backend: str = "uni"

    def __post_init__(self) -> None:
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r} is not one of "
                             f"{EXECUTOR_BACKENDS}")


def _opt(default, help: str, **kw):
    """A dataclass field whose help text the CLI flags are made from (one declaration per option)."""
    return field(default=default, metadata={"help": help, **kw})


@dataclass(slots=True)
class LimitsConfig:
    """What one request may cost, checked before it is queued, and what the server holds at most.

    The per-request bounds (max_n, stops) apply offline too; the queue, memory and deadline limits are enforced
    by the server's AsyncLLMEngine.
    """

    max_n: int = _opt(128, "most samples (n) one request may ask for; OpenAI's limit is 128")
    max_prompts: int = _opt(128, "most prompts in one /v1/completions request (a list of strings or of token lists)")
    max_stop: int = _opt(16, "most stop strings in one request")
    max_stop_len: int = _opt(256, "longest stop string, in characters")
    max_stop_token_ids: int = _opt(256, "most stop_token_ids in one request")
    max_waiting: int = _opt(512, "sequences (a request counts n per prompt) queued before new requests get 429")
    max_request_share: float = _opt(
        0.5, "largest share of --max-waiting that one request's sequences may take; a larger request is a 400")
    request_timeout: float | None = _opt(
        None, "seconds from arrival after which a request is aborted and answered with a timeout error (408) "
        "(default: no deadline)")
    memory_limit: int | None = _opt(
        None, "host-memory ceiling in bytes (suffixes K, M, G, Ki, Mi, Gi allowed); requests that would take the "
        "process past it are refused with 429 / 503 and Retry-After (default: 90%% of the memory available at "
        "start-up plus what the process holds, within any cgroup limit)", size=True)

    def __post_init__(self) -> None:
        for name in ("max_n", "max_prompts", "max_stop", "max_stop_len", "max_stop_token_ids", "max_waiting"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if not 0.0 < self.max_request_share <= 1.0:
            raise ValueError(f"max_request_share={self.max_request_share} must be in (0, 1]")
        if self.request_timeout is not None and not self.request_timeout > 0:
            raise ValueError(f"request_timeout={self.request_timeout} must be a positive number of seconds (or None)")
        if self.memory_limit is not None and (not isinstance(self.memory_limit, int) or self.memory_limit <= 0):
            raise ValueError(f"memory_limit={self.memory_limit!r} must be a positive number of bytes (or None)")

    @property
    def max_seqs_per_request(self) -> int:
        """The most sequences one request may put in the waiting queue."""
        return max(1, int(self.max_waiting * self.max_request_share))


def parse_size(text: str) -> int:
    """'8G', '512Mi', '1000000' -> bytes (K/M/G are powers of 1000, Ki/Mi/Gi of 1024)."""
    units = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
             "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
    s = str(text).strip().lower().removesuffix("b")
    number = s.rstrip("kmgti")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in units or not value > 0:
        raise ValueError(f"{text!r} is not a size in bytes (examples: 8G, 512Mi, 1000000)")
    return int(value * units[unit])


@dataclass(slots=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        sched = self.scheduler
        if not sched.enable_chunked_prefill and sched.max_num_batched_tokens < self.model.max_model_len:
            raise ValueError(
                f"with chunked prefill off, max_num_batched_tokens ({sched.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.model.max_model_len}) so every prompt fits in one step"
            )

    @classmethod
    def create(cls, model: str | None = None, **kwargs) -> "EngineConfig":
        """Build the tree from flat keyword arguments (the LLM(...) and CLI surface)."""
        groups = {"model": ModelConfig, "cache": CacheConfig, "scheduler": SchedulerConfig, "device": DeviceConfig,
                  "quant": QuantConfig, "limits": LimitsConfig, "parallel": ParallelConfig}
        parts: dict[str, dict] = {name: {} for name in groups}
        for key, value in kwargs.items():
            owner = next((g for g, c in groups.items() if key in c.__dataclass_fields__ and key != "arch"), None)
            if owner is None:
                known = sorted(k for c in groups.values() for k in c.__dataclass_fields__ if k != "arch")
                raise TypeError(f"unknown engine option {key!r}; known options: {', '.join(known)}")
            parts[owner][key] = value
        if model is not None:
            parts["model"]["model"] = model
        return cls(**{name: groups[name](**parts[name]) for name in groups})
