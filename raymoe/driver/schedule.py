"""Learning-rate schedule of a run: linear warmup, then cosine decay to a floor.

    lr
    peak |    /`-.
         |   /    `-._
     min |  /         `------
         +--+----------------+--  step
          warmup_steps    total_steps

Steps count from 0; step ``s`` of warmup uses ``peak * (s + 1) / warmup_steps`` so the first
step already learns, and the last step (``total_steps - 1``) reaches ``min_lr``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosine:
    """The learning rate of each optimizer step; ``min_lr = peak_lr * min_lr_ratio``."""

    peak_lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        if not (isinstance(self.peak_lr, int | float) and math.isfinite(self.peak_lr) and self.peak_lr > 0):
            raise ValueError(f"schedule: lr={self.peak_lr!r} must be a number > 0")
        if not _is_int(self.total_steps) or self.total_steps < 1:
            raise ValueError(f"schedule: steps={self.total_steps!r} must be an int >= 1")
        if not _is_int(self.warmup_steps) or not 0 <= self.warmup_steps <= self.total_steps:
            raise ValueError(
                f"schedule: warmup_steps={self.warmup_steps!r} must be an int in [0, steps={self.total_steps}]"
            )
        if not (isinstance(self.min_lr_ratio, int | float) and 0 <= self.min_lr_ratio <= 1):
            raise ValueError(f"schedule: min_lr_ratio={self.min_lr_ratio!r} must be in [0, 1]")

    @property
    def min_lr(self) -> float:
        return self.peak_lr * self.min_lr_ratio

    def lr_at(self, step: int) -> float:
        """The learning rate of step ``step`` (0-based); steps past the end stay at ``min_lr``."""
        if step < self.warmup_steps:
            return self.peak_lr * (step + 1) / self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        if decay_steps <= 1:
            return self.peak_lr if step < self.total_steps else self.min_lr
        progress = min(1.0, (step - self.warmup_steps) / (decay_steps - 1))
        return self.min_lr + (self.peak_lr - self.min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
