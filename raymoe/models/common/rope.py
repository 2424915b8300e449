"""Rotary position embeddings (RoPE), with the linear and Llama-3 frequency scalings.

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
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind == "linear":
        return inv_freq / rope.factor
    if rope.kind == "llama3":
        return _llama3_scaled(inv_freq, rope)
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


def rope_cos_sin(rope: RopeConfig, head_dim: int, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``cos, sin [S, head_dim]`` for integer ``positions [S]``, computed in float32 then cast to ``dtype``."""
    angles = positions.float()[:, None] * inverse_frequencies(rope, head_dim, positions.device)[None, :]
    angles = torch.cat((angles, angles), dim=-1)  # channel i pairs with channel i + head_dim/2
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, heads, S, head_dim]`` by the per-position angles."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
