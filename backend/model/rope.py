"""Rotary position embeddings, computed as transformers computes them.

A ``Rotary`` turns a step's token positions into the ``cos`` and ``sin`` that rotate Q and K:
- default: frequencies ``1 / theta ** (2i / head_dim)`` in float32, transformers' exact expression;
- linear: the default ones divided by ``factor`` (positions stretched uniformly);
- llama3 (Llama 3.1+): long wavelengths (beyond ``original_max_position_embeddings /
  low_freq_factor``) are divided by ``factor``, short ones (below ``original / high_freq_factor``)
  are kept, and the band between blends the two linearly in ``original / wavelength``;
- yarn: per frequency, interpolation (divided by ``factor``) and extrapolation (kept) blended by a
  linear ramp between the dimensions that turn ``beta_fast`` and ``beta_slow`` times over the
  original window; cos and sin are multiplied by the attention factor;
- dynamic (NTK): the default frequencies with a base grown to ``theta * (factor * L / max -
  (factor - 1)) ** (d / (d - 2))`` for a sequence of ``L`` tokens beyond ``max_position_embeddings``
  (``max``), recomputed as the sequence grows: transformers recomputes them each forward from the
  positions it is given, so each token is rotated for the length its sequence has in its step;
- longrope (Phi-3): ``1 / (ext * theta ** (2i / d))`` with ``ext`` the short factors while a
  sequence is within ``original_max_position_embeddings`` and the long ones beyond, decided per
  step like dynamic; cos and sin are multiplied by the attention factor.
Length-dependent types are decided per sequence (transformers decides per forward, over its whole
batch: the same for one sequence at a time, which is what the tests compare).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from backend.model.rope_params import Rope, RopeScaling


def _exponents(dim: int, device: torch.device | str) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).to(device=device, dtype=torch.float) / dim


class Rotary:
    def __init__(
        self, rope: Rope, head_dim: int, max_positions: int, device: torch.device | str = "cpu"
    ) -> None:
        self.dim = head_dim
        self.theta = rope.theta
        self.scaling = rope.scaling
        self.max_positions = max_positions
        self.device = device
        kind = self.kind
        self.attention_factor = (
            rope.scaling.attention_factor if kind in ("yarn", "longrope") and rope.scaling else 1.0
        )
        self.inv_freq = self._static(device)

    @property
    def kind(self) -> str:
        return "default" if self.scaling is None else self.scaling.rope_type

    @property
    def by_length(self) -> bool:
        """Whether a sequence's frequencies depend on its length (dynamic, longrope)."""
        return self.kind in ("dynamic", "longrope")

    def _static(self, device: torch.device | str) -> torch.Tensor:
        s, dim = self.scaling, self.dim
        inv_freq = 1.0 / (self.theta ** _exponents(dim, device))
        if s is None or s.rope_type == "dynamic":  # dynamic: the default within the window
            return inv_freq
        if s.rope_type == "linear":
            return inv_freq / s.factor
        if s.rope_type == "llama3":
            return _llama3(inv_freq, s)
        if s.rope_type == "yarn":
            return _yarn(self.theta, dim, s, device)
        if s.rope_type == "longrope":
            return self._longrope(long=False)
        raise ValueError(f"unknown rope_type {s.rope_type!r}")  # ModelConfig admits no other

    def _longrope(self, *, long: bool) -> torch.Tensor:
        assert self.scaling is not None
        factors = self.scaling.long_factor if long else self.scaling.short_factor
        ext = torch.tensor(factors, dtype=torch.float32, device=self.device)
        return 1.0 / (ext * self.theta ** _exponents(self.dim, self.device))

    def _for_length(self, length: int) -> torch.Tensor:
        """The frequencies of a sequence ``length`` tokens long (dynamic, longrope)."""
        s = self.scaling
        assert s is not None
        if s.rope_type == "longrope":
            return self._longrope(long=length > s.original_max_position_embeddings)
        length = max(length, self.max_positions)
        ratio = s.factor * length / self.max_positions - (s.factor - 1)
        base = self.theta * ratio ** (self.dim / (self.dim - 2))
        return 1.0 / (base ** _exponents(self.dim, self.device))

    def cos_sin(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        seq_lens: Sequence[int] = (),
        query_lens: Sequence[int] = (),
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, head_dim] (broadcast over heads) in ``dtype``; ``seq_lens`` and
        ``query_lens`` (per sequence, in batch order) are needed by the length-dependent types."""
        if self.by_length:
            per_seq = torch.stack([self._for_length(n) for n in seq_lens])
            counts = torch.tensor(query_lens, device=per_seq.device)
            inv_freq = per_seq.repeat_interleave(counts, dim=0)
            freqs = positions.float()[:, None] * inv_freq.to(positions.device)
        else:
            freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    factor, low, high = s.factor, s.low_freq_factor, s.high_freq_factor
    original = s.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    long_waves = wavelength > original / low
    short_waves = wavelength < original / high
    scaled = torch.where(long_waves, inv_freq / factor, inv_freq)
    # in the band between: weight 0 at the long end (all scaled) .. 1 at the short end (unscaled)
    blend = (original / wavelength - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    return torch.where(~long_waves & ~short_waves, blended, scaled)


def _yarn(theta: float, dim: int, s: RopeScaling, device: torch.device | str) -> torch.Tensor:
    original = s.original_max_position_embeddings

    def dimension_of(rotations: float) -> float:  # the dimension turning `rotations` times
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dimension_of(s.beta_fast), dimension_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: no zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_share = (1 - ramp).to(device=device, dtype=torch.float)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(device=device, dtype=torch.float) / dim)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (s.factor * pos_freqs)
    return interpolated * (1 - extrapolation_share) + extrapolated * extrapolation_share
