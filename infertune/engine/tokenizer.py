"""The engine's tokenizer: tokenizer.json through the `tokenizers` library where that is all transformers builds.

transformers' AutoTokenizer costs about 90 MiB of resident memory beyond the tokenizer itself (`import
transformers`, and through AutoConfig torch.distributed and sympy), a tenth of a small model's footprint. For a
plain Llama or Qwen3 tokenizer folder (a generic tokenizer class, every special token already in tokenizer.json as it
would add it, no truncation, padding or chat template) AutoTokenizer's encode and decode are exactly those of
the `tokenizers.Tokenizer` it wraps, so `FastTokenizer` calls that object itself. Whatever else it is asked for
(the rest of the transformers tokenizer API) comes from the transformers tokenizer, loaded on first use. Any
other folder gets AutoTokenizer, as before.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

# The tokenizer classes that transformers builds straight from tokenizer.json (no model-specific __init__).
_GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# Model types whose folders AutoTokenizer gives one of those classes when tokenizer_config.json names one (as
# transformers 5 writes it): qwen3 / qwen2_moe / qwen3_moe register Qwen2Tokenizer but AutoTokenizer trusts the
# folder's generic class for them; qwen2 is on its list of types whose stated class it overrides (Qwen2Tokenizer),
# and mistral may get mistral-common or a pre-tokenizer fix. tests/test_tokenizer.py holds each to AutoTokenizer.
_PLAIN_MODEL_TYPES = ("llama", "qwen3", "qwen2_moe", "qwen3_moe")
_NAMED_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_LIST_SPECIAL = ("extra_special_tokens", "additional_special_tokens")
# tokenizer_config.json keys that change nothing in encode / decode / eos_token_id (the special tokens and
# added_tokens_decoder are checked against tokenizer.json below). Any other key sends the folder to transformers.
_NEUTRAL_KEYS = frozenset(
    {
        "tokenizer_class",
        "backend",
        "model_max_length",
        "model_input_names",
        "padding_side",
        "truncation_side",
        "clean_up_tokenization_spaces",
        "added_tokens_decoder",
        *_NAMED_SPECIAL,
        *_LIST_SPECIAL,
    }
)
# Files transformers reads besides tokenizer.json and tokenizer_config.json (special tokens, chat templates).
_OTHER_FILES = (
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates",
)
_STRIP_FLAGS = ("single_word", "lstrip", "rstrip", "normalized")
_TOKEN_FLAGS = (*_STRIP_FLAGS, "special")


def load_tokenizer(path: str):
    """A FastTokenizer where the folder is plain (see the module docstring), else transformers' AutoTokenizer."""
    root = Path(path)
    cfg = _read_json(root / "tokenizer_config.json")
    reason = _folder_not_plain(root, cfg)
    if reason is None:
        from tokenizers import Tokenizer

        try:
            tok = Tokenizer.from_file(str(root / "tokenizer.json"))
        except Exception as e:  # noqa: BLE001  tokenizers raises plain Exception; AutoTokenizer will say what is wrong
            tok, reason = None, f"tokenizers could not read tokenizer.json ({e})"
        reason = reason or _tokenizer_not_plain(tok, cfg)
        if reason is None:
            return FastTokenizer(tok, path, cfg)
    log.debug("tokenizer of %s: transformers AutoTokenizer (%s)", path, reason)
    return load_transformers_tokenizer(path)


def load_transformers_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e


class FastTokenizer:
    """encode, decode, eos_token_id, get_vocab and len() as transformers' TokenizersBackend computes them for a
    plain folder; any other attribute is the transformers tokenizer's, loaded on first use."""

    def __init__(self, tokenizer, path: str, config: dict) -> None:
        self._tokenizer = tokenizer  # a tokenizers.Tokenizer without truncation or padding (_tokenizer_not_plain)
        self._path = path
        self._full = None
        eos = config.get("eos_token")  # tokenizer_config.json
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id: int | None = None if eos is None else tokenizer.token_to_id(eos)
        self.chat_template = None  # a folder with a chat template is not plain

    def encode(self, text, add_special_tokens: bool = True, **kwargs) -> list[int]:
        if not isinstance(text, str) or kwargs.keys() - {"verbose"}:  # pairs, pre-tokenized input, padding, ...
            return self.transformers_tokenizer().encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids, skip_special_tokens: bool = False, **kwargs) -> str:
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        if kwargs or not isinstance(token_ids, (list, tuple)) or not all(isinstance(t, int) for t in token_ids):
            return self.transformers_tokenizer().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        return self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def __bool__(self) -> bool:
        return True

    def __call__(self, *args, **kwargs):
        return self.transformers_tokenizer()(*args, **kwargs)

    def transformers_tokenizer(self):
        """The transformers tokenizer of the same folder (loaded once, on first use)."""
        if self._full is None:
            self._full = load_transformers_tokenizer(self._path)
        return self._full

    def __getattr__(self, name: str):
        if name.startswith("_"):  # never reached for the attributes set in __init__; keeps copy / pickle sane
            raise AttributeError(name)
        return getattr(self.transformers_tokenizer(), name)

    def __repr__(self) -> str:
        return f"FastTokenizer({self._path!r}, vocab={len(self)})"


def _folder_not_plain(root: Path, cfg: dict) -> str | None:
    """Why AutoTokenizer could build something other than the bare tokenizer.json for this folder, as far as its
    files tell (None: they do not)."""
    if not (root / "tokenizer.json").is_file() or not cfg:
        return "no tokenizer.json or tokenizer_config.json"
    present = [name for name in _OTHER_FILES if (root / name).exists()]
    if present:
        return f"has {', '.join(present)}"
    model_type = _read_json(root / "config.json").get("model_type")
    if model_type not in _PLAIN_MODEL_TYPES:
        return f"model_type {model_type!r}"
    if cfg.get("tokenizer_class") not in _GENERIC_CLASSES:
        return f"tokenizer_class {cfg.get('tokenizer_class')!r}"
    extra = sorted(set(cfg) - _NEUTRAL_KEYS)
    if extra:
        return f"tokenizer_config.json sets {', '.join(extra)}"
    return None


def _tokenizer_not_plain(tok, cfg: dict) -> str | None:
    """Why transformers would change or wrap this tokenizers.Tokenizer differently (None: it would not)."""
    if tok.truncation is not None or tok.padding is not None or tok.post_processor is None:
        return "tokenizer.json has truncation, padding or no post-processor"
    if cfg.get("clean_up_tokenization_spaces") and type(tok.model).__name__ != "BPE":
        return "clean_up_tokenization_spaces on a non-BPE model"  # transformers ignores it for BPE
    by_id = {i: _flags(t) for i, t in tok.get_added_tokens_decoder().items()}
    for idx, entry in (cfg.get("added_tokens_decoder") or {}).items():
        stored = by_id.get(int(idx)) if str(idx).isdigit() else None
        if not isinstance(entry, dict) or stored != {k: entry.get(k) for k in ("content", *_TOKEN_FLAGS)}:
            return f"added_tokens_decoder entry {idx} differs from tokenizer.json"
    specials = [cfg.get(k) for k in _NAMED_SPECIAL]
    for key in _LIST_SPECIAL:
        values = cfg.get(key) or []
        if not isinstance(values, list):
            return f"{key} is not a list"
        specials += values
    by_content = {t["content"]: t for t in by_id.values()}
    for token in specials:
        if token is not None and not _already_special(token, by_content):
            return f"special token {token!r} is not a plain special token of tokenizer.json"
    return None


def _flags(token) -> dict:
    """A tokenizers.AddedToken as the dict tokenizer_config.json's added_tokens_decoder stores."""
    return {"content": token.content, **{k: getattr(token, k) for k in _TOKEN_FLAGS}}


def _already_special(token, added: dict[str, dict]) -> bool:
    """Whether transformers finds `token` among tokenizer.json's added tokens as it would add it itself (special,
    not normalized, no stripping), so that it adds or changes nothing."""
    if isinstance(token, dict):  # an AddedToken as tokenizer_config.json stores it
        if token.get("special") is not True or any(token.get(k) for k in _STRIP_FLAGS):
            return False
        token = token.get("content")
    stored = added.get(token) if isinstance(token, str) else None
    return stored is not None and stored["special"] is True and not any(stored[k] for k in _STRIP_FLAGS)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return data if isinstance(data, dict) else {}


def lone_surrogate(text: str) -> int | None:
    """Where text holds a lone surrogate (half of a UTF-16 pair, e.g. an emoji a JavaScript client cut in half;
    JSON lets "\\ud83d" through), which no tokenizer can take: its index, or None for valid Unicode text."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


_BYTE_TOKEN_TEXT = {f"<0x{b:02X}>": bytes([b]) for b in range(256)}
_byte_level_chars: dict[str, int] | None = None


def token_bytes(tokenizer, token_id: int, text: str) -> bytes:
    """The UTF-8 bytes a token stands for (OpenAI's logprobs `bytes`): `text`'s, its decode alone, unless that holds
    U+FFFD for part of a character (a byte-level BPE token such as "ä½", a byte-fallback token such as "<0xE4>"), whose
    raw bytes are read from the token's vocabulary entry, so that the output's tokens' bytes add up to its text.
    A SentencePiece word-start token ("▁Hello", which decodes alone as "Hello": the decoder strips a leading space)
    keeps its space, as the output's text does."""
    if "\ufffd" not in text and text[:1] == " ":
        return text.encode("utf-8")
    try:  # (a FastTokenizer's own tokenizers object: transformers stays unloaded)
        if isinstance(tokenizer, FastTokenizer):
            piece = tokenizer._tokenizer.id_to_token(token_id)
        else:
            piece = tokenizer.convert_ids_to_tokens(token_id)
    except (AttributeError, IndexError, KeyError, TypeError, ValueError, OverflowError):
        piece = None
    if not isinstance(piece, str):
        return text.encode("utf-8")
    if piece[:1] == "▁" and piece[1:].replace("▁", " ") == text:
        return (" " + text).encode("utf-8")
    if "\ufffd" not in text:
        return text.encode("utf-8")
    if piece in _BYTE_TOKEN_TEXT:  # byte fallback (Llama 2, Mistral, Gemma)
        return _BYTE_TOKEN_TEXT[piece]
    global _byte_level_chars
    if _byte_level_chars is None:  # GPT-2's byte <-> printable character table (byte-level BPE: Llama 3, Qwen)
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
        extra = [b for b in range(256) if b not in printable]
        _byte_level_chars = {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(extra)}
    if all(ch in _byte_level_chars for ch in piece):
        return bytes(_byte_level_chars[ch] for ch in piece)
    return text.encode("utf-8")
