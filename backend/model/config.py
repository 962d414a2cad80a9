"""`ModelConfig`: the LlamaForCausalLM fields of a checkpoint's `config.json`, validated once.

Lifecycle: `ModelConfig.from_dir(path)` reads and checks the file, and the frozen result is
passed to the tokenizer, checkpoint loader and model. Every problem (missing file, malformed
JSON, a missing or wrong-typed field, an unsupported architecture or RoPE variant) raises
`CheckpointError` naming the file and the field. This module imports no torch.

Both spellings that transformers has written are accepted: v4 (`rope_theta`, `torch_dtype`)
and v5 (`rope_parameters: {"rope_type": "default", "rope_theta": ...}`, `dtype`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.model.errors import CheckpointError

CONFIG_FILE = "config.json"
SUPPORTED_ARCHITECTURE = "LlamaForCausalLM"
SUPPORTED_DTYPES = frozenset({"float32", "float16", "bfloat16"})
BYTE_TOKENIZER = "byte"
_HF_DEFAULT_ROPE_THETA = 10000.0


@dataclass(frozen=True, slots=True)
class ModelConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    vocab_size: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    torch_dtype: str
    kvguard_tokenizer: str | None = None

    @property
    def num_query_groups(self) -> int:
        """Query heads sharing one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dir(cls, checkpoint_dir: Path | str) -> ModelConfig:
        path = Path(checkpoint_dir) / CONFIG_FILE
        if not Path(checkpoint_dir).is_dir():
            raise CheckpointError(checkpoint_dir, "checkpoint directory does not exist")
        if not path.is_file():
            raise CheckpointError(path, "file is missing")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(path, f"malformed JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(path, "top level must be a JSON object")
        return cls.from_json(raw, path)

    @classmethod
    def from_json(cls, raw: dict[str, Any], path: Path) -> ModelConfig:
        fields = _Fields(raw, path)
        _check_architecture(fields)
        heads = fields.positive_int("num_attention_heads")
        hidden = fields.positive_int("hidden_size")
        kv_heads = fields.positive_int("num_key_value_heads", default=heads)
        if heads % kv_heads:
            raise CheckpointError(
                path, f"field 'num_key_value_heads': {kv_heads} does not divide {heads} heads"
            )
        config = cls(
            hidden_size=hidden,
            intermediate_size=fields.positive_int("intermediate_size"),
            num_hidden_layers=fields.positive_int("num_hidden_layers"),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=_head_dim(fields, hidden, heads),
            rms_norm_eps=fields.positive_float("rms_norm_eps"),
            rope_theta=_rope_theta(fields),
            vocab_size=fields.positive_int("vocab_size"),
            max_position_embeddings=fields.positive_int("max_position_embeddings"),
            tie_word_embeddings=fields.boolean("tie_word_embeddings", default=False),
            bos_token_id=fields.optional_token_id("bos_token_id"),
            eos_token_ids=_eos_ids(fields),
            torch_dtype=_dtype(fields),
            kvguard_tokenizer=_tokenizer_kind(fields),
        )
        _check_token_ids(config, path)
        return config


class _Fields:
    """Typed access to one config.json object; every failure names the file and the field."""

    def __init__(self, raw: dict[str, Any], path: Path) -> None:
        self.raw = raw
        self.path = path

    def fail(self, key: str, problem: str) -> CheckpointError:
        return CheckpointError(self.path, f"field '{key}': {problem}")

    def get(self, key: str) -> Any:
        if key not in self.raw:
            raise self.fail(key, "is missing")
        return self.raw[key]

    def positive_int(self, key: str, default: int | None = None) -> int:
        value = self.raw.get(key)
        if value is None:
            # HF treats an absent or null optional count as its default (e.g. kv heads = heads).
            value = default if default is not None else self.get(key)
        # bool is an int subclass in Python; `true` is never a valid count.
        if not isinstance(value, int) or isinstance(value, bool):
            raise self.fail(key, f"expected an integer, got {type(value).__name__}")
        if value <= 0:
            raise self.fail(key, f"must be positive, got {value}")
        return value

    def positive_float(self, key: str, value: Any = None) -> float:
        value = self.get(key) if value is None else value
        if not isinstance(value, int | float) or isinstance(value, bool):
            raise self.fail(key, f"expected a number, got {type(value).__name__}")
        if value <= 0:
            raise self.fail(key, f"must be positive, got {value}")
        return float(value)

    def boolean(self, key: str, default: bool) -> bool:
        value = self.raw.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {type(value).__name__}")
        return value

    def optional_token_id(self, key: str) -> int | None:
        value = self.raw.get(key)
        if value is None:
            return None
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise self.fail(key, f"expected a non-negative integer or null, got {value!r}")
        return value


def _check_architecture(fields: _Fields) -> None:
    archs = fields.get("architectures")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise fields.fail("architectures", "expected a list of strings")
    if archs != [SUPPORTED_ARCHITECTURE]:
        raise fields.fail("architectures", f"only [{SUPPORTED_ARCHITECTURE!r}] is supported")
    if fields.raw.get("hidden_act", "silu") != "silu":
        raise fields.fail("hidden_act", "only 'silu' (SwiGLU) is supported")
    for key in ("attention_bias", "mlp_bias"):
        if fields.raw.get(key, False) is not False:
            raise fields.fail(key, "biases are not supported")


def _head_dim(fields: _Fields, hidden: int, heads: int) -> int:
    if fields.raw.get("head_dim") is not None:
        return fields.positive_int("head_dim")
    if hidden % heads:
        raise fields.fail("hidden_size", f"{hidden} is not divisible by {heads} heads")
    return hidden // heads


def _rope_theta(fields: _Fields) -> float:
    """Default (unscaled) RoPE only: a scaled variant would silently produce wrong logits."""
    scaling = fields.raw.get("rope_scaling")
    if scaling is not None and not _is_default_rope(scaling):
        raise fields.fail("rope_scaling", f"RoPE scaling is not supported: {scaling!r}")
    params = fields.raw.get("rope_parameters")
    if params is not None:
        if not isinstance(params, dict) or not _is_default_rope(params):
            raise fields.fail(
                "rope_parameters", f"only rope_type 'default' is supported: {params!r}"
            )
        if "rope_theta" in params:
            return fields.positive_float("rope_parameters.rope_theta", params["rope_theta"])
    if "rope_theta" not in fields.raw:
        return _HF_DEFAULT_ROPE_THETA  # what transformers assumes for configs that predate it
    return fields.positive_float("rope_theta")


def _is_default_rope(params: Any) -> bool:
    if not isinstance(params, dict):
        return False
    kind = params.get("rope_type", params.get("type", "default"))
    return bool(kind == "default")


def _eos_ids(fields: _Fields) -> tuple[int, ...]:
    value = fields.get("eos_token_id")
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise fields.fail("eos_token_id", f"expected an integer or a list of integers: {value!r}")
    return tuple(ids)


def _dtype(fields: _Fields) -> str:
    key = "torch_dtype" if "torch_dtype" in fields.raw else "dtype"
    value = fields.raw.get(key, "float32")
    if value is None:
        return "float32"
    if not isinstance(value, str) or value not in SUPPORTED_DTYPES:
        raise fields.fail(key, f"expected one of {sorted(SUPPORTED_DTYPES)}, got {value!r}")
    return value


def _tokenizer_kind(fields: _Fields) -> str | None:
    value = fields.raw.get("kvguard_tokenizer")
    if value is not None and value != BYTE_TOKENIZER:
        raise fields.fail("kvguard_tokenizer", f"only {BYTE_TOKENIZER!r} is known, got {value!r}")
    return value


def _check_token_ids(config: ModelConfig, path: Path) -> None:
    ids = [("eos_token_id", i) for i in config.eos_token_ids]
    if config.bos_token_id is not None:
        ids.append(("bos_token_id", config.bos_token_id))
    for key, token_id in ids:
        if token_id >= config.vocab_size:
            raise CheckpointError(
                path, f"field '{key}': {token_id} is outside the vocabulary ({config.vocab_size})"
            )
