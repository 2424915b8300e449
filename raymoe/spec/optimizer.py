"""AdamW hyper-parameters of a run: the one place their defaults live (handle, Trainer and ranks read them here).

Defaults are the usual ones for fine-tuning large transformers: ``betas=(0.9, 0.95)``, weight
decay 0.01, gradient clipping at norm 1.0. ``max_grad_norm=None`` turns clipping off. Checked on
the driver when built; the ranks receive the checked value.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (``torch.optim.AdamW``) settings and optional gradient clipping; ``ValueError`` on a bad field."""

    lr: float = 1e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    max_grad_norm: float | None = 1.0

    def __post_init__(self) -> None:
        check_lr(self.lr)
        _check("weight_decay", self.weight_decay, _is_number(self.weight_decay) and self.weight_decay >= 0, ">= 0")
        _check("eps", self.eps, _is_number(self.eps) and self.eps > 0, "> 0")
        betas_ok = (
            isinstance(self.betas, tuple | list)
            and len(self.betas) == 2
            and all(_is_number(b) and 0 <= b < 1 for b in self.betas)
        )
        _check("betas", self.betas, betas_ok, "two numbers in [0, 1)")
        if self.max_grad_norm is not None:
            ok = _is_number(self.max_grad_norm) and self.max_grad_norm > 0
            _check("max_grad_norm", self.max_grad_norm, ok, "> 0 or None")
        object.__setattr__(self, "betas", tuple(self.betas))

    def with_lr(self, lr: float) -> OptimizerConfig:
        return replace(self, lr=lr)


def check_lr(lr: object) -> None:
    """The learning-rate rule, shared by every place that takes one."""
    ok = isinstance(lr, int | float) and not isinstance(lr, bool) and math.isfinite(lr) and lr > 0
    _check("lr", lr, ok, "> 0")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check(field: str, value: object, ok: bool, rule: str) -> None:
    if not ok:
        raise ValueError(f"training: {field}={value!r} must be {rule}")
