"""Dense SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))``."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from raymoe.models.common.shard_hints import INPUT_CONSUMERS_ATTR


class FeedForward(nn.Module):
    """Hidden ``[..., H]`` -> ``[..., H]`` through an intermediate width ``I``.

    ``gate_proj``/``up_proj`` are ``[I, H]`` and ``down_proj`` is ``[H, I]``, named as in the hub
    checkpoints so tensor-parallel plans address them directly.
    """

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        setattr(self, INPUT_CONSUMERS_ATTR, ("gate_proj", "up_proj"))  # x is theirs alone (forward)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out
