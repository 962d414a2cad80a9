"""`ModelConfig`: the decoder fields of a checkpoint's `config.json`, validated once.

Lifecycle: `ModelConfig.from_dir(path)` reads and checks the file, and the frozen result is
passed to the tokenizer, checkpoint loader and model. Every problem (missing file, malformed
JSON, a missing or wrong-typed field, an unsupported architecture, RoPE variant or any field that
would change the arithmetic in a way the engine does not implement) raises `CheckpointError`
naming the file and the field. This module imports no torch.

Three Hugging Face families share one decoder here (RMSNorm, RoPE, GQA, SwiGLU); what differs is
read from the config exactly as transformers reads it:
- `LlamaForCausalLM` (model_type llama): optional `attention_bias` on q/k/v/o; no window.
- `MistralForCausalLM` (mistral): `sliding_window` on every layer (4096 when absent, as
  transformers' default; null means none).
- `Qwen2ForCausalLM` (qwen2): bias on q/k/v (not o); a window only with `use_sliding_window`, on
  the layers `layer_types` (or `max_window_layers`) names.
The class defaults that differ between them (KV heads, window) are the transformers classes'.

Both spellings that transformers has written are accepted: v4 (`rope_theta`, `rope_scaling`,
`torch_dtype`) and v5 (`rope_parameters: {"rope_type": ..., "rope_theta": ...}`, `dtype`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.model.errors import CheckpointError

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SUPPORTED_DTYPES = frozenset({"float32", "float16", "bfloat16"})
BYTE_TOKENIZER = "byte"


@dataclass(frozen=True, slots=True)
class _Family:
    model_type: str
    kv_heads_default: int | None  # None: as many as query heads
    qkv_bias: bool | None  # None: `attention_bias` decides (and it covers o_proj too)


FAMILIES = {
    "LlamaForCausalLM": _Family("llama", None, None),
    "MistralForCausalLM": _Family("mistral", 8, False),
    "Qwen2ForCausalLM": _Family("qwen2", 32, True),
}
_MISTRAL_DEFAULT_WINDOW = 4096
_QWEN2_DEFAULT_WINDOW_LAYERS = 28
_HF_DEFAULT_ROPE_THETA = 10000.0
ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A scaled RoPE (`rope_type` linear or llama3); the frequencies are `backend.model.rope`'s."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 1.0
    original_max_position_embeddings: int = 0


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
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False
    o_bias: bool = False
    # per layer: keys farther back than this many positions are not attended (None: all)
    layer_windows: tuple[int | None, ...] = ()
    rope_scaling: RopeScaling | None = None

    @property
    def num_query_groups(self) -> int:
        """Query heads sharing one KV head (GQA group size)."""
        return self.num_attention_heads // self.num_key_value_heads

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @classmethod
    def from_dir(cls, checkpoint_dir: Path | str) -> ModelConfig:
        path = Path(checkpoint_dir) / CONFIG_FILE
        raw = read_json_object(Path(checkpoint_dir), path, required=True)
        assert raw is not None
        return cls.from_json(raw, path)

    @classmethod
    def from_json(cls, raw: dict[str, Any], path: Path) -> ModelConfig:
        fields = _Fields(raw, path)
        family = _check_architecture(fields)
        heads = fields.positive_int("num_attention_heads")
        hidden = fields.positive_int("hidden_size")
        kv_heads = fields.positive_int(
            "num_key_value_heads", default=family.kv_heads_default or heads
        )
        if heads % kv_heads:
            raise fields.fail("num_key_value_heads", f"{kv_heads} does not divide {heads} heads")
        layers = fields.positive_int("num_hidden_layers")
        qkv_bias, o_bias = _biases(fields, family)
        theta, scaling = read_rope(fields)
        config = cls(
            hidden_size=hidden,
            intermediate_size=fields.positive_int("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=_head_dim(fields, hidden, heads),
            rms_norm_eps=fields.positive_float("rms_norm_eps"),
            rope_theta=theta,
            vocab_size=fields.positive_int("vocab_size"),
            max_position_embeddings=fields.positive_int("max_position_embeddings"),
            tie_word_embeddings=fields.boolean("tie_word_embeddings", default=False),
            bos_token_id=fields.optional_token_id("bos_token_id"),
            eos_token_ids=_token_ids(fields, "eos_token_id"),
            torch_dtype=_dtype(fields),
            kvguard_tokenizer=_tokenizer_kind(fields),
            architecture=fields.raw["architectures"][0],
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            layer_windows=_layer_windows(fields, family, layers),
            rope_scaling=scaling,
        )
        _check_token_ids(config, path)
        return config


def read_json_object(directory: Path, path: Path, *, required: bool) -> dict[str, Any] | None:
    """A JSON object file of a checkpoint; None when it is absent and optional."""
    if not directory.is_dir():
        raise CheckpointError(directory, "checkpoint directory does not exist")
    if path.is_symlink() and not path.exists():
        raise CheckpointError(path, "is a link to a missing file (an incomplete download?)")
    if not path.is_file():
        if required:
            raise CheckpointError(path, "file is missing")
        return None
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(path, f"malformed JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(path, "top level must be a JSON object")
    return raw


def generation_eos_ids(checkpoint_dir: Path | str, vocab_size: int) -> tuple[int, ...]:
    """`eos_token_id` of `generation_config.json` (what transformers' `generate` stops on):
    chat checkpoints often keep their end-of-turn token only there."""
    path = Path(checkpoint_dir) / GENERATION_CONFIG_FILE
    raw = read_json_object(Path(checkpoint_dir), path, required=False)
    if raw is None or raw.get("eos_token_id") is None:
        return ()
    ids = _token_ids(_Fields(raw, path), "eos_token_id")
    for token_id in ids:
        if token_id >= vocab_size:
            raise CheckpointError(
                path, f"field 'eos_token_id': {token_id} is outside the vocabulary ({vocab_size})"
            )
    return ids


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

    def positive_int(self, key: str, default: int | None = None, value: Any = None) -> int:
        value = self.raw.get(key) if value is None else value
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


def _check_architecture(fields: _Fields) -> _Family:
    archs = fields.get("architectures")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise fields.fail("architectures", "expected a list of strings")
    if len(archs) != 1 or archs[0] not in FAMILIES:
        raise fields.fail("architectures", f"only one of {sorted(FAMILIES)} is supported")
    family = FAMILIES[archs[0]]
    model_type = fields.raw.get("model_type", family.model_type)
    if model_type != family.model_type:
        raise fields.fail(
            "model_type",
            f"{model_type!r} does not match architectures {archs} (expected "
            f"{family.model_type!r}; transformers builds the model from model_type)",
        )
    if fields.raw.get("hidden_act", "silu") != "silu":
        raise fields.fail("hidden_act", "only 'silu' (SwiGLU) is supported")
    if fields.raw.get("mlp_bias", False) is not False:
        raise fields.fail("mlp_bias", "biases in the MLP are not supported")
    if fields.raw.get("quantization_config") is not None:
        raise fields.fail("quantization_config", "quantized checkpoints are not supported")
    if fields.raw.get("pretraining_tp", 1) != 1:  # v4 Llama split the matmuls; same math only at 1
        raise fields.fail("pretraining_tp", "only 1 is supported")
    return family


def _biases(fields: _Fields, family: _Family) -> tuple[bool, bool]:
    """(q/k/v bias, o bias): Qwen2 always biases q/k/v; Llama's attention_bias covers all four."""
    if family.qkv_bias is not None:
        if fields.raw.get("attention_bias") not in (None, family.qkv_bias):
            raise fields.fail("attention_bias", f"{family.model_type} does not read this field")
        return family.qkv_bias, False
    bias = fields.boolean("attention_bias", default=False)
    return bias, bias


def _layer_windows(fields: _Fields, family: _Family, layers: int) -> tuple[int | None, ...]:
    window = fields.raw.get("sliding_window")
    if family.model_type == "llama":
        if window is not None:
            raise fields.fail(
                "sliding_window",
                "LlamaForCausalLM has no sliding window (transformers ignores the field); "
                "remove it, or set architectures to MistralForCausalLM if the model was "
                "trained with one",
            )
        return ()
    if family.model_type == "mistral":
        if "sliding_window" not in fields.raw:
            window = _MISTRAL_DEFAULT_WINDOW
        size = None if window is None else fields.positive_int("sliding_window", value=window)
        return (size,) * layers
    # qwen2: a window only when use_sliding_window, on the layers layer_types marks as sliding
    if not fields.boolean("use_sliding_window", default=False):
        return ()
    size = fields.positive_int("sliding_window", default=_MISTRAL_DEFAULT_WINDOW)
    kinds = fields.raw.get("layer_types")
    if kinds is None:
        first = fields.positive_int("max_window_layers", default=_QWEN2_DEFAULT_WINDOW_LAYERS)
        kinds = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    allowed = {"sliding_attention", "full_attention"}
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= allowed:
        raise fields.fail("layer_types", f"expected {layers} of {sorted(allowed)}")
    return tuple(size if kind == "sliding_attention" else None for kind in kinds)


def read_rope(fields: _Fields) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling) from either spelling. Unknown or runtime-dependent variants (dynamic,
    yarn, longrope, ...) are refused: computed as plain RoPE they would give wrong logits."""
    key = "rope_parameters" if fields.raw.get("rope_parameters") is not None else "rope_scaling"
    params = fields.raw.get(key) or {}
    if not isinstance(params, dict):
        raise fields.fail(key, f"expected an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        raise fields.fail(key, "RoPE parameters per layer type are not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_TYPES:
        raise fields.fail(key, f"rope_type {kind!r} is not supported (only {list(ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", fields.raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise fields.fail("partial_rotary_factor", "partial rotary embeddings are not supported")
    theta = params.get("rope_theta", fields.raw.get("rope_theta"))
    theta = _HF_DEFAULT_ROPE_THETA if theta is None else fields.positive_float("rope_theta", theta)
    if kind == "default":
        return theta, None
    factor = fields.positive_float(f"{key}.factor", params.get("factor"))
    if kind == "linear":
        return theta, RopeScaling("linear", factor)
    low = fields.positive_float(f"{key}.low_freq_factor", params.get("low_freq_factor"))
    high = fields.positive_float(f"{key}.high_freq_factor", params.get("high_freq_factor"))
    if high <= low:
        raise fields.fail(f"{key}.high_freq_factor", "must exceed low_freq_factor")
    original = fields.positive_int(
        f"{key}.original_max_position_embeddings",
        # transformers falls back to max_position_embeddings
        value=params.get(
            "original_max_position_embeddings", fields.raw.get("max_position_embeddings")
        ),
    )
    return theta, RopeScaling("llama3", factor, low, high, original)


def _head_dim(fields: _Fields, hidden: int, heads: int) -> int:
    if fields.raw.get("head_dim") is not None:
        return fields.positive_int("head_dim")
    if hidden % heads:
        raise fields.fail("hidden_size", f"{hidden} is not divisible by {heads} heads")
    return hidden // heads


def _token_ids(fields: _Fields, key: str) -> tuple[int, ...]:
    value = fields.get(key)
    ids = value if isinstance(value, list) else [value]
    if not ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise fields.fail(key, f"expected an integer or a list of integers: {value!r}")
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
