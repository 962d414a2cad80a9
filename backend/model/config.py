"""`ModelConfig`: the decoder fields of a checkpoint's `config.json`, validated once.

Lifecycle: `ModelConfig.from_dir(path)` reads and checks the file, and the frozen result is
passed to the tokenizer, checkpoint loader and model. Every problem (missing file, malformed
JSON, a missing or wrong-typed field, an unsupported architecture, RoPE variant or any field that
would change the arithmetic in a way the engine does not implement) raises `CheckpointError`
naming the file and the field. This module imports no torch.

Six Hugging Face families share one decoder here (RMSNorm, RoPE, GQA, a gated MLP); what differs
is read from the config exactly as transformers reads it:
- `LlamaForCausalLM` (model_type llama): optional `attention_bias` on q/k/v/o; no window.
- `MistralForCausalLM` (mistral): `sliding_window` on every layer (4096 when absent, as
  transformers' default; null means none).
- `Qwen2ForCausalLM` (qwen2): bias on q/k/v (not o); a window only with `use_sliding_window`, on
  the layers `layer_types` (or `max_window_layers`) names.
- `Qwen3ForCausalLM` (qwen3): Qwen2's windows, `attention_bias` as Llama's, and an RMSNorm of
  each query and key head before RoPE (q/k norms).
- `Gemma3ForCausalLM` (gemma3_text): norms that scale by `1 + weight`, four per layer (around
  attention and around the MLP), q/k norms, the embedding scaled by sqrt(hidden_size), a
  GELU-tanh gated MLP, attention scaled by `query_pre_attn_scalar`, sliding-window layers
  interleaved with global ones (`layer_types`, else every `sliding_window_pattern`-th is global)
  with a RoPE of their own (`rope_local_base_freq`, or per layer type in v5); tied embeddings.
  Logit soft-capping is refused (Gemma 3 has none; Gemma 2 does, and is another architecture).
- `Phi3ForCausalLM` (phi3): fused `qkv_proj` and `gate_up_proj` tensors, `sliding_window` on
  every layer when set, `longrope` scaling.
The class defaults that differ between them (KV heads, windows, eps) are the transformers classes'.
RoPE parameters (both spellings, every type served) are `backend.model.rope_params`'.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from backend.model.errors import CheckpointError
from backend.model.rope_params import Rope, RopeScaling, read_rope

__all__ = ["FAMILIES", "ModelConfig", "Rope", "RopeScaling", "read_json_object"]

CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
SUPPORTED_DTYPES = frozenset({"float32", "float16", "bfloat16"})
BYTE_TOKENIZER = "byte"


@dataclass(frozen=True, slots=True)
class _Family:
    model_type: str
    kv_heads_default: int | None  # None: as many as query heads
    qkv_bias: bool | None  # None: `attention_bias` decides (and it covers o_proj too)
    windows: str  # how layers get a sliding window: none, all, qwen, gemma (see _layer_windows)
    qk_norm: bool = False
    gemma: bool = False  # Gemma's norms, embedding scale, MLP activation and local RoPE
    fused: bool = False  # Phi-3's checkpoint: qkv_proj and gate_up_proj tensors


FAMILIES = {
    "LlamaForCausalLM": _Family("llama", None, None, "none"),
    "MistralForCausalLM": _Family("mistral", 8, False, "all"),
    "Qwen2ForCausalLM": _Family("qwen2", 32, True, "qwen"),
    "Qwen3ForCausalLM": _Family("qwen3", 32, None, "qwen", qk_norm=True),
    "Gemma3ForCausalLM": _Family("gemma3_text", 4, None, "gemma", qk_norm=True, gemma=True),
    "Phi3ForCausalLM": _Family("phi3", None, False, "phi3", fused=True),
}
_MISTRAL_DEFAULT_WINDOW = 4096
_QWEN2_DEFAULT_WINDOW_LAYERS = 28
_GEMMA3_DEFAULTS = {"head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window_pattern": 6}


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
    sliding_rope: Rope | None = None  # the sliding layers' own RoPE (Gemma 3); None: the same
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE
    gemma: bool = False  # norms scale by 1 + w, four per layer; embedding * sqrt(hidden); GELU
    fused_checkpoint: bool = False  # Phi-3's tensor names (qkv_proj, gate_up_proj)
    query_scale: float | None = None  # attention scale; None: head_dim ** -0.5

    @property
    def max_positions(self) -> int:
        """The longest sequence the model computes: `max_position_embeddings`, extended by the
        factor of a RoPE that scales past it at run time (dynamic NTK)."""
        scaling = self.rope_scaling
        if scaling is not None and scaling.rope_type == "dynamic":
            return int(self.max_position_embeddings * scaling.factor)
        return self.max_position_embeddings

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
        head_dim = _head_dim(fields, hidden, heads, family)
        rope, sliding_rope = read_rope(fields, head_dim, per_layer_type=family.gemma)
        config = cls(
            hidden_size=hidden,
            intermediate_size=fields.positive_int("intermediate_size"),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=fields.positive_float(
                "rms_norm_eps", fields.raw.get("rms_norm_eps", 1e-6 if family.gemma else None)
            ),
            rope_theta=rope.theta,
            vocab_size=fields.positive_int("vocab_size"),
            max_position_embeddings=fields.positive_int("max_position_embeddings"),
            tie_word_embeddings=fields.boolean("tie_word_embeddings", default=family.gemma),
            bos_token_id=fields.optional_token_id("bos_token_id"),
            eos_token_ids=_token_ids(fields, "eos_token_id"),
            torch_dtype=_dtype(fields),
            kvguard_tokenizer=_tokenizer_kind(fields),
            architecture=fields.raw["architectures"][0],
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            layer_windows=_layer_windows(fields, family, layers),
            rope_scaling=rope.scaling,
            sliding_rope=sliding_rope if sliding_rope != rope else None,
            qk_norm=family.qk_norm,
            gemma=family.gemma,
            fused_checkpoint=family.fused,
            query_scale=_query_scale(fields, family),
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
    act_key = "hidden_activation" if "hidden_activation" in fields.raw else "hidden_act"
    act = fields.raw.get(act_key, "gelu_pytorch_tanh" if family.gemma else "silu")
    if act != ("gelu_pytorch_tanh" if family.gemma else "silu"):
        want = "'gelu_pytorch_tanh'" if family.gemma else "'silu' (SwiGLU)"
        raise fields.fail(act_key, f"only {want} is supported for {family.model_type}")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if fields.raw.get(key) is not None:
            raise fields.fail(key, "logit soft-capping is not supported")
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
    if family.windows == "none":
        if window is not None:
            raise fields.fail(
                "sliding_window",
                "LlamaForCausalLM has no sliding window (transformers ignores the field); "
                "remove it, or set architectures to MistralForCausalLM if the model was "
                "trained with one",
            )
        return ()
    if family.windows in ("all", "phi3"):
        if family.windows == "all" and "sliding_window" not in fields.raw:
            window = _MISTRAL_DEFAULT_WINDOW
        size = None if window is None else fields.positive_int("sliding_window", value=window)
        return (size,) * layers if size is not None else ()
    if family.windows == "gemma":
        size = fields.positive_int("sliding_window", default=_MISTRAL_DEFAULT_WINDOW)
        pattern = fields.positive_int(
            "sliding_window_pattern", default=_GEMMA3_DEFAULTS["sliding_window_pattern"]
        )
        default = [
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)
        ]
        return _windows_by_type(fields, layers, size, default)
    # qwen2, qwen3: a window only when use_sliding_window, on the layers layer_types marks
    if not fields.boolean("use_sliding_window", default=False):
        return ()
    size = fields.positive_int("sliding_window", default=_MISTRAL_DEFAULT_WINDOW)
    first = fields.positive_int("max_window_layers", default=_QWEN2_DEFAULT_WINDOW_LAYERS)
    default = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return _windows_by_type(fields, layers, size, default)


def _windows_by_type(
    fields: _Fields, layers: int, size: int, default: list[str]
) -> tuple[int | None, ...]:
    kinds = fields.raw.get("layer_types") or default
    allowed = {"sliding_attention", "full_attention"}
    if not isinstance(kinds, list) or len(kinds) != layers or not set(kinds) <= allowed:
        raise fields.fail("layer_types", f"expected {layers} of {sorted(allowed)}")
    return tuple(size if kind == "sliding_attention" else None for kind in kinds)


def _query_scale(fields: _Fields, family: _Family) -> float | None:
    if not family.gemma:
        return None
    scalar = fields.raw.get("query_pre_attn_scalar", _GEMMA3_DEFAULTS["query_pre_attn_scalar"])
    return fields.positive_float("query_pre_attn_scalar", scalar) ** -0.5


def _head_dim(fields: _Fields, hidden: int, heads: int, family: _Family) -> int:
    if fields.raw.get("head_dim") is not None:
        return fields.positive_int("head_dim")
    if family.gemma:
        return _GEMMA3_DEFAULTS["head_dim"]
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
