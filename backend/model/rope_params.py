"""RoPE parameters of a checkpoint's `config.json`, read as transformers (v5) reads them.

Both spellings transformers has written are accepted: v4 (`rope_theta`, `rope_scaling` with
`type` or `rope_type`, Gemma 3's `rope_local_base_freq`, Phi-3's top-level
`original_max_position_embeddings`) and v5 (`rope_parameters`, per layer type for Gemma 3:
`{"full_attention": {...}, "sliding_attention": {...}}`).

Types served (their frequencies are `backend.model.rope`'s): `default`, `linear`, `llama3`,
`dynamic` (NTK: the base grows with a sequence's length past `max_position_embeddings`), `yarn`
(interpolated/extrapolated bands and an attention factor) and `longrope` (Phi-3: short or long
factors per sequence length, and an attention factor). Anything else, and partial rotary
embeddings, are refused with the field named: computed as plain RoPE they would give wrong logits.
This module imports no torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

HF_DEFAULT_ROPE_THETA = 10000.0
ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


class Fields(Protocol):
    raw: dict[str, Any]

    def fail(self, key: str, problem: str) -> Exception: ...

    def positive_float(self, key: str, value: Any = None) -> float: ...

    def positive_int(self, key: str, default: int | None = None, value: Any = None) -> int: ...


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """A scaled RoPE; which fields matter depends on ``rope_type`` (see the module docstring)."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 1.0  # llama3
    original_max_position_embeddings: int = 0  # llama3, yarn, longrope
    attention_factor: float = 1.0  # yarn, longrope: cos and sin are multiplied by it
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    short_factor: tuple[float, ...] = field(default=(), repr=False)  # longrope
    long_factor: tuple[float, ...] = field(default=(), repr=False)  # longrope


@dataclass(frozen=True, slots=True)
class Rope:
    theta: float
    scaling: RopeScaling | None = None


def read_rope(fields: Fields, head_dim: int, *, per_layer_type: bool = False) -> tuple[Rope, Rope]:
    """(the rope of full-attention layers, the rope of sliding-window layers). They differ only
    where a family gives its sliding layers their own (``per_layer_type``: Gemma 3)."""
    raw = fields.raw
    key = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    params = raw.get(key) or {}
    if not isinstance(params, dict):
        raise fields.fail(key, f"expected an object, got {params!r}")
    if any(isinstance(v, dict) for v in params.values()):
        if not per_layer_type:
            raise fields.fail(key, "RoPE parameters per layer type are not supported")
        full = _one(fields, f"{key}.full_attention", params.get("full_attention") or {}, head_dim)
        local = _one(
            fields, f"{key}.sliding_attention", params.get("sliding_attention") or {}, head_dim
        )
        return full, local
    full = _one(fields, key, params, head_dim)
    if per_layer_type:  # v4 Gemma 3: a plain local rope of its own base
        local_theta = raw.get("rope_local_base_freq", HF_DEFAULT_ROPE_THETA)
        return full, Rope(fields.positive_float("rope_local_base_freq", local_theta))
    return full, full


def _one(fields: Fields, key: str, params: dict[str, Any], head_dim: int) -> Rope:
    raw = fields.raw
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "su":  # Phi-3's first name for longrope, which transformers still reads
        kind = "longrope"
    if kind not in ROPE_TYPES:
        raise fields.fail(key, f"rope_type {kind!r} is not supported (only {list(ROPE_TYPES)})")
    partial = params.get("partial_rotary_factor", raw.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise fields.fail("partial_rotary_factor", "partial rotary embeddings are not supported")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    theta = HF_DEFAULT_ROPE_THETA if theta is None else fields.positive_float("rope_theta", theta)
    if kind == "default":
        return Rope(theta)
    if kind in ("linear", "dynamic"):
        return Rope(
            theta, RopeScaling(kind, fields.positive_float(f"{key}.factor", params.get("factor")))
        )
    original = fields.positive_int(
        f"{key}.original_max_position_embeddings",
        # transformers falls back to the top-level field (Phi-3), then max_position_embeddings
        value=params.get(
            "original_max_position_embeddings",
            raw.get("original_max_position_embeddings", raw.get("max_position_embeddings")),
        ),
    )
    if kind == "llama3":
        return Rope(theta, _llama3(fields, key, params, original))
    if kind == "yarn":
        return Rope(theta, _yarn(fields, key, params, original))
    return Rope(theta, _longrope(fields, key, params, original, head_dim))


def _llama3(fields: Fields, key: str, params: dict[str, Any], original: int) -> RopeScaling:
    factor = fields.positive_float(f"{key}.factor", params.get("factor"))
    low = fields.positive_float(f"{key}.low_freq_factor", params.get("low_freq_factor"))
    high = fields.positive_float(f"{key}.high_freq_factor", params.get("high_freq_factor"))
    if high <= low:
        raise fields.fail(f"{key}.high_freq_factor", "must exceed low_freq_factor")
    return RopeScaling("llama3", factor, low, high, original)


def _yarn(fields: Fields, key: str, params: dict[str, Any], original: int) -> RopeScaling:
    factor = params.get("factor")
    if factor is None:  # as transformers: the extension the window implies
        factor = fields.positive_int("max_position_embeddings") / original
    factor = fields.positive_float(f"{key}.factor", factor)
    attention = params.get("attention_factor")
    if attention is None:
        mscale, all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and all_dim:
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, all_dim)
        else:
            attention = _yarn_mscale(factor)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise fields.fail(f"{key}.truncate", "expected true or false")
    return RopeScaling(
        "yarn",
        factor,
        original_max_position_embeddings=original,
        attention_factor=fields.positive_float(f"{key}.attention_factor", attention),
        beta_fast=fields.positive_float(f"{key}.beta_fast", params.get("beta_fast") or 32),
        beta_slow=fields.positive_float(f"{key}.beta_slow", params.get("beta_slow") or 1),
        truncate=truncate,
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _longrope(
    fields: Fields, key: str, params: dict[str, Any], original: int, head_dim: int
) -> RopeScaling:
    factors = {}
    for name in ("short_factor", "long_factor"):
        value = params.get(name)
        if not isinstance(value, list) or len(value) != head_dim // 2:
            raise fields.fail(f"{key}.{name}", f"expected {head_dim // 2} positive numbers")
        if not all(isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in value):
            raise fields.fail(f"{key}.{name}", f"expected {head_dim // 2} positive numbers")
        factors[name] = tuple(float(v) for v in value)
    factor = params.get("factor")
    if factor is None:
        factor = fields.positive_int("max_position_embeddings") / original
    factor = fields.positive_float(f"{key}.factor", factor)
    attention = params.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(
        "longrope",
        factor,
        original_max_position_embeddings=original,
        attention_factor=fields.positive_float(f"{key}.attention_factor", attention),
        short_factor=factors["short_factor"],
        long_factor=factors["long_factor"],
    )
