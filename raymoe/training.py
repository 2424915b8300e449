"""Training steps on a rank: loss of the global batch, gradient reduction, norm, clipping, AdamW (SPEC TRAIN-2).

Every data-parallel rank takes the *sum* of its token losses and divides by the number of
label tokens in the whole global batch (counted on the driver), so summing gradients over
data-parallel ranks (FSDP2 does, see raymoe.fsdp) gives exactly one process's gradient of the
global mean loss, however unevenly the tokens are spread::

    loss = sum_over_ranks(sum_of_token_losses_r) / global_tokens
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate

from raymoe.fsdp import expert_modules
from raymoe.loading import rank_model
from raymoe.models.loss import causal_lm_loss
from raymoe.models.moe.router import TopKRouter
from raymoe.runtime import RankContext
from raymoe.vocab_parallel import vocab_parallel_loss, whole


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
    """One rank's share of a step: its summed token loss, the global gradient norm before clipping, and
    (first rank of a tp group, MoE models) tokens per expert of its batch ``[moe_layers, E]``."""

    loss_sum: float
    grad_norm: float
    expert_load: Tensor | None = None


def configure_training(ctx: RankContext, config: TrainingConfig) -> None:
    """A fresh AdamW over this rank's parameters, one group per mesh (dense, expert); replaces earlier state."""
    model = rank_model(ctx)
    groups = [{"params": params, "mesh": name} for name, params in parameter_groups(model, ctx).items() if params]
    # foreach: one multi-tensor op per update step instead of one DTensor dispatch per parameter
    ctx.state["optimizer"] = torch.optim.AdamW(
        groups, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, foreach=True
    )
    ctx.state["training"] = config
    for router in routers(model):
        router.record_load = True


def parameter_groups(model: nn.Module, ctx: RankContext) -> dict[str, list[nn.Parameter]]:
    """One group per mesh (SPEC TRAIN-2): ``dense`` and ``expert`` DTensor parameters, and ``replicated``
    plain tensors (tensor parallelism without FSDP leaves norms unsharded), since a multi-tensor
    optimizer step cannot mix DTensors and plain tensors. Experts count as dense without EP."""
    spec = ctx.state["spec"]
    expert_paths = set(expert_modules(spec.plans)) if (ctx.topology.config.ep_size or 1) > 1 else set()
    groups: dict[str, list[nn.Parameter]] = {"dense": [], "expert": [], "replicated": []}
    for name, param in model.named_parameters():
        if not isinstance(param, DTensor):
            groups["replicated"].append(param)
        else:
            groups["expert" if name.rpartition(".")[0] in expert_paths else "dense"].append(param)
    return groups


def routers(model: nn.Module) -> list[TopKRouter]:
    return [module for module in model.modules() if isinstance(module, TopKRouter)]


def train_step(
    ctx: RankContext, micro_batches: list[tuple[Tensor, Tensor]], global_tokens: int, lr: float | None = None
) -> StepResult:
    """One optimizer step over this rank's rows of the global batch, given as ``(input_ids, labels)`` micro-batches.

    Every micro-batch's loss is divided by the token count of the whole global batch, so
    accumulating their gradients gives the gradient of the global mean loss. FSDP2 reduces
    gradients only after the last micro-batch.
    """
    model = rank_model(ctx)
    optimizer = ctx.state.get("optimizer")
    config = ctx.state.get("training")
    if not isinstance(optimizer, torch.optim.Optimizer) or not isinstance(config, TrainingConfig):
        raise RuntimeError("train_step before configure_training")
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float32)
    expert_load: Tensor | None = None
    for index, (input_ids_BS, labels_BS) in enumerate(micro_batches):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        with vocab_parallel_loss(model):
            logits = model(input_ids_BS.to(ctx.device))
            micro_loss = whole(causal_lm_loss(logits, labels_BS.to(ctx.device), reduction="sum"))
            # FSDP2 sums the gradients over data-parallel ranks (raymoe.fsdp), giving one process's gradient.
            (micro_loss / global_tokens).backward()
        loss_sum += micro_loss.detach().float().cpu()
        load = _expert_load(model)
        expert_load = load if expert_load is None or load is None else expert_load + load
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = grad_norm(params)
    if config.max_grad_norm is not None:
        _clip(params, norm, config.max_grad_norm)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(float(loss_sum), float(norm), expert_load if ctx.coords.tp == 0 else None)


def _expert_load(model: nn.Module) -> Tensor | None:
    """``[moe_layers, E]`` tokens per expert of the last forward, or None for a dense model."""
    load = [router.last_load.cpu() for router in routers(model) if router.last_load is not None]
    return torch.stack(load) if load else None


def grad_norm(params: list[nn.Parameter]) -> Tensor:
    """The 2-norm of all gradients as one vector, over both meshes (SPEC TRAIN-2).

    Squares of the local shards are summed with plain tensor ops per layout (mesh, placements);
    each layout's sum is then reduced once, over the mesh axes its gradients are sharded on
    (a sharded axis holds different pieces, a replicated one the same piece).
    """
    # (mesh, placements) of a DTensor gradient; None for plain tensors, which every rank holds whole
    locals_by_layout: dict[tuple[DeviceMesh, tuple[Placement, ...]] | None, list[Tensor]] = {}
    for param in params:
        grad = param.grad
        assert grad is not None
        if isinstance(grad, DTensor):
            locals_by_layout.setdefault((grad.device_mesh, grad.placements), []).append(grad.to_local())
        else:
            locals_by_layout.setdefault(None, []).append(grad)
    total = torch.zeros((), dtype=torch.float32)
    for layout, local_grads in locals_by_layout.items():
        square = torch.stack(torch._foreach_norm(local_grads, 2, dtype=torch.float32)).pow(2).sum()
        if layout is not None:
            mesh, placements = layout
            summed_over = [Replicate() if p.is_replicate() else Partial() for p in placements]
            square = DTensor.from_local(square, mesh, summed_over, run_check=False).full_tensor()
        total = total + square.cpu()
    return total.sqrt()


def _clip(params: list[nn.Parameter], norm: Tensor, max_norm: float) -> None:
    scale = max_norm / (float(norm) + 1e-6)
    if scale < 1.0:
        for param in params:
            grad = param.grad
            assert grad is not None
            grad.mul_(scale)
