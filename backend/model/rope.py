"""Rotary position embedding frequencies, computed as transformers computes them.

`inverse_frequencies(config)` gives the per-pair frequencies the model rotates Q and K by:
- default: ``1 / theta ** (2i / head_dim)`` in float32, transformers' exact expression;
- linear: the default ones divided by ``factor`` (positions stretched uniformly);
- llama3 (Llama 3.1+): long wavelengths (beyond ``original_max_position_embeddings /
  low_freq_factor``) are divided by ``factor``, short ones (below ``original / high_freq_factor``)
  are kept, and the band between blends the two linearly in ``original / wavelength``.
None of these scale the attention logits (transformers' attention factor is 1.0 for them).
"""

from __future__ import annotations

import math

import torch

from backend.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig, device: torch.device | str = "cpu") -> torch.Tensor:
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    inv_freq = 1.0 / (config.rope_theta**exponents)
    scaling = config.rope_scaling
    if scaling is None:
        pass
    elif scaling.rope_type == "linear":
        inv_freq = inv_freq / scaling.factor
    elif scaling.rope_type == "llama3":
        inv_freq = _llama3(
            inv_freq,
            scaling.factor,
            scaling.low_freq_factor,
            scaling.high_freq_factor,
            scaling.original_max_position_embeddings,
        )
    else:  # ModelConfig admits no other type
        raise ValueError(f"unknown rope_type {scaling.rope_type!r}")
    return inv_freq.to(device)


def _llama3(
    inv_freq: torch.Tensor, factor: float, low: float, high: float, original: int
) -> torch.Tensor:
    wavelength = 2 * math.pi / inv_freq
    long_waves = wavelength > original / low
    short_waves = wavelength < original / high
    scaled = torch.where(long_waves, inv_freq / factor, inv_freq)
    # in the band between: weight 0 at the long end (all scaled) .. 1 at the short end (unscaled)
    blend = (original / wavelength - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    return torch.where(~long_waves & ~short_waves, blended, scaled)
