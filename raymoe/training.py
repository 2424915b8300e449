"""Training steps on a rank: loss of the global batch, gradient reduction, norm, clipping, AdamW (SPEC TRAIN-2).

Every data-parallel rank takes the *sum* of its token losses and divides by the number of
label tokens in the whole global batch (counted on the driver), so summing gradients over
data-parallel ranks gives exactly one process's gradient of the global mean loss, however
unevenly the tokens are spread::

    loss = sum_over_ranks(sum_of_token_losses_r) / global_tokens
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from raymoe.loading import rank_model
from raymoe.models.loss import causal_lm_loss
from raymoe.runtime import RankContext
from raymoe.topology import Axis


@dataclass(frozen=True)
class TrainingConfig:
    """AdamW hyper-parameters (torch's defaults) and optional gradient clipping (None = no clipping)."""

    lr: float = 1e-3
    weight_decay: float = 1e-2
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    max_grad_norm: float | None = None

    def __post_init__(self) -> None:
        _check("lr", self.lr, self.lr > 0, "must be > 0")
        _check("weight_decay", self.weight_decay, self.weight_decay >= 0, "must be >= 0")
        _check("eps", self.eps, self.eps > 0, "must be > 0")
        betas_ok = (
            isinstance(self.betas, tuple | list)
            and len(self.betas) == 2
            and all(_is_number(b) and 0 <= b < 1 for b in self.betas)
        )
        _check("betas", self.betas, betas_ok, "must be two numbers in [0, 1)")
        if self.max_grad_norm is not None:
            _check("max_grad_norm", self.max_grad_norm, self.max_grad_norm > 0, "must be > 0 or None")


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _check(field: str, value: object, ok: bool, rule: str) -> None:
    if not ok or (field != "betas" and not _is_number(value)):
        raise ValueError(f"training: {field}={value!r} {rule}")


@dataclass(frozen=True)
class StepResult:
    """One rank's share of a step: its summed token loss, and the global gradient norm before clipping."""

    loss_sum: float
    grad_norm: float


def configure_training(ctx: RankContext, config: TrainingConfig) -> None:
    """A fresh AdamW over this rank's parameters; replaces any earlier optimizer state."""
    model = rank_model(ctx)
    ctx.state["optimizer"] = torch.optim.AdamW(
        model.parameters(), lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay
    )
    ctx.state["training"] = config


def train_step(
    ctx: RankContext, input_ids_BS: Tensor, labels_BS: Tensor, global_tokens: int, lr: float | None = None
) -> StepResult:
    """Forward, backward, reduce, clip and step on this rank's rows of the global batch."""
    model = rank_model(ctx)
    optimizer = ctx.state.get("optimizer")
    config = ctx.state.get("training")
    if not isinstance(optimizer, torch.optim.Optimizer) or not isinstance(config, TrainingConfig):
        raise RuntimeError("train_step before configure_training")
    model.train()
    logits = model(input_ids_BS.to(ctx.device))
    loss_sum = causal_lm_loss(logits, labels_BS.to(ctx.device), reduction="sum")
    (loss_sum / global_tokens).backward()
    params = [p for p in model.parameters() if p.grad is not None]
    _sum_over_replicas(ctx, params)
    norm = grad_norm(params)
    if config.max_grad_norm is not None:
        _clip(params, norm, config.max_grad_norm)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(float(loss_sum.detach()), float(norm))


def _sum_over_replicas(ctx: RankContext, params: list[nn.Parameter]) -> None:
    """Data-parallel replicas computed gradients of their own rows: sum them (dp_replicate axis)."""
    mesh = ctx.mesh(Axis.DP_REPLICATE)
    if mesh.size() == 1:
        return
    group = mesh.get_group()
    for param in params:
        grad = param.grad
        assert grad is not None
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=group)


def grad_norm(params: list[nn.Parameter]) -> Tensor:
    """The 2-norm of all gradients as one vector; sharded gradients are reduced over their mesh."""
    squares = []
    for param in params:
        grad = param.grad
        assert grad is not None
        norm = torch.linalg.vector_norm(grad.float())
        squares.append((norm.full_tensor() if isinstance(norm, DTensor) else norm) ** 2)
    if not squares:
        return torch.zeros(())
    return torch.stack(squares).sum().sqrt()


def _clip(params: list[nn.Parameter], norm: Tensor, max_norm: float) -> None:
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for param in params:
            grad = param.grad
            assert grad is not None
            grad.mul_(scale)
