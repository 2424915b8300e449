"""Rotary position embeddings (RoPE), with the linear, Llama-3 and YaRN frequency scalings.

YaRN also multiplies cos/sin by an attention factor (:func:`attention_scaling`, 1 for the other
kinds); q and k both being rotated, the attention logits scale by its square.

The frequencies are recomputed from the config on each forward, on the activations' device:
the model then holds no buffer, so building it on the meta device, ``to_empty`` and sharding
never leave stale RoPE state behind. It costs one small kernel per model forward.

Shapes: ``positions [S]``, ``cos/sin [S, head_dim]``, ``q/k [B, heads, S, head_dim]``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from raymoe.models.common.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int, device: torch.device) -> Tensor:
    """``[head_dim // 2]`` float32 angular frequencies, one per rotated pair of channels."""
    exponents = torch.arange(0, head_dim, 2, device=device, dtype=torch.int64).float() / head_dim
    wavelength_scale = rope.theta**exponents
    inv_freq = 1.0 / wavelength_scale
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_scaled(inv_freq, rope)
    if rope.kind == "yarn":
        return _yarn_scaled(inv_freq, wavelength_scale, rope, head_dim)
    return inv_freq


def _llama3_scaled(inv_freq: Tensor, rope: RopeConfig) -> Tensor:
    """Llama 3.1: slow down low frequencies by ``factor``, keep high ones, blend the band between."""
    context = rope.original_max_position_embeddings
    wavelength = 2 * math.pi / inv_freq
    low_freq_wavelength = context / rope.low_freq_factor
    high_freq_wavelength = context / rope.high_freq_factor
    scaled = torch.where(wavelength > low_freq_wavelength, inv_freq / rope.factor, inv_freq)
    blend = (context / wavelength - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - blend) * scaled / rope.factor + blend * scaled
    in_band = (wavelength >= high_freq_wavelength) & (wavelength <= low_freq_wavelength)
    return torch.where(in_band, blended, scaled)


def _yarn_scaled(inv_freq: Tensor, wavelength_scale: Tensor, rope: RopeConfig, head_dim: int) -> Tensor:
    """YaRN: divide by ``factor`` the pairs that turn fewer than ``beta_slow`` times over the original
    context, keep those turning more than ``beta_fast`` times, and ramp linearly (by pair index) between.

    ``inv_freq`` / ``wavelength_scale`` ``[head_dim // 2]`` are ``1 / theta**(2i / head_dim)`` and its inverse.
    """

    # The (fractional) pair index i whose frequency theta**(-2i / head_dim) makes `rotations` turns over the
    # original context; the fast bound gives the lower index since frequencies fall with the index.
    def pair_index(rotations: float) -> float:
        inverse_frequency = rope.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(inverse_frequency) / (2 * math.log(rope.theta))

    start, end = pair_index(rope.beta_fast), pair_index(rope.beta_slow)
    if rope.truncate:
        start, end = math.floor(start), math.ceil(end)
    # transformers clamps the upper end to head_dim - 1 (a channel bound, not a pair bound): kept for parity.
    start, end = max(start, 0), min(end, head_dim - 1)
    if start == end:
        end += 0.001  # a step, not a division by zero
    pairs = torch.arange(head_dim // 2, dtype=torch.float32, device=inv_freq.device)
    scaled_share = ((pairs - start) / (end - start)).clamp(0, 1)  # 0: keep the frequency, 1: divide by factor
    # Written as the weighted sum transformers evaluates, so the float32 rounding (hence cos/sin) matches.
    kept_share = 1 - scaled_share
    scaled = 1.0 / (rope.factor * wavelength_scale)
    return scaled * (1 - kept_share) + inv_freq * kept_share


def attention_scaling(rope: RopeConfig) -> float:
    """The factor cos and sin are multiplied by: 1 except for YaRN.

    YaRN's is ``attention_factor`` when given; else ``m(factor, mscale) / m(factor, mscale_all_dim)`` when
    both are non-zero, else ``m(factor, 1)``, with ``m(s, k) = 1 + 0.1 k ln s`` for ``s > 1`` and 1 otherwise.
    """
    if rope.kind != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def magnitude(weight: float) -> float:
        return 1.0 if rope.factor <= 1 else 0.1 * weight * math.log(rope.factor) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return magnitude(rope.mscale) / magnitude(rope.mscale_all_dim)
    return magnitude(1.0)


def rope_cos_sin(rope: RopeConfig, head_dim: int, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``cos, sin [S, head_dim]`` for integer ``positions [S]`` (or ``[B, S, head_dim]`` for per-row positions
    ``[B, S]``, as left-padded rows have), computed in float32 then cast to ``dtype``.

    Both are multiplied by :func:`attention_scaling` in float32, before the cast.
    """
    angles = positions.float()[..., None] * inverse_frequencies(rope, head_dim, positions.device)
    angles = torch.cat((angles, angles), dim=-1)  # channel i pairs with channel i + head_dim/2
    scale = attention_scaling(rope)
    return (angles.cos() * scale).to(dtype), (angles.sin() * scale).to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, heads, S, head_dim]`` by the per-position angles (``cos/sin [S, D]`` or per row ``[B, S, D]``)."""
    if cos.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
