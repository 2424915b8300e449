"""How an expert turns its fused gate/up projection into the input of its down projection.

``gate_up [S, 2I]`` holds, for each of ``S`` rows, the expert's gate and up features in one of two
orders (the family's checkpoint layout, kept in memory so tensor-parallel shards stay whole)::

    halves (Qwen3-MoE, Mixtral)     [g0 g1 ... g(I-1) | u0 u1 ... u(I-1)]   -> gate = [:I], up = [I:]
    interleaved (gpt-oss)           [g0 u0 g1 u1 ... g(I-1) u(I-1)]         -> gate = [0::2], up = [1::2]

and combines them with SwiGLU, ``silu(gate) * up``, or gpt-oss's clamped variant::

    gate = min(gate, limit);  up = clamp(up, -limit, limit)
    out  = (up + 1) * gate * sigmoid(alpha * gate)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


@dataclass(frozen=True)
class GatedActivation:
    """``gate_up [.., 2I]`` -> ``[.., I]``. ``clamp_limit`` None is plain SwiGLU; a number is the clamped variant."""

    interleaved: bool = False
    clamp_limit: float | None = None
    alpha: float = 1.702

    def __post_init__(self) -> None:
        if self.clamp_limit is not None and not self.clamp_limit > 0:
            raise ValueError(f"clamped SwiGLU limit must be > 0, got {self.clamp_limit}")

    def split(self, gate_up: Tensor) -> tuple[Tensor, Tensor]:
        """``(gate, up)``, each ``[.., I]``."""
        if self.interleaved:
            return gate_up[..., 0::2], gate_up[..., 1::2]
        gate, up = gate_up.chunk(2, dim=-1)
        return gate, up

    def __call__(self, gate_up: Tensor) -> Tensor:
        gate, up = self.split(gate_up)
        if self.clamp_limit is None:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.clamp_limit)
        up = up.clamp(min=-self.clamp_limit, max=self.clamp_limit)
        return (up + 1) * gate * torch.sigmoid(gate * self.alpha)


SWIGLU = GatedActivation()
