"""Training steps on a rank: loss of the global batch, gradient reduction, norm, clipping, AdamW (SPEC TRAIN-2).

Every data-parallel rank takes the *sum* of its token losses and divides by the number of
label tokens in the whole global batch (counted on the driver), so summing gradients over
data-parallel ranks (FSDP2 does, see raymoe.parallel.fsdp) gives exactly one process's gradient of the
global mean loss, however unevenly the tokens are spread::

    loss = sum_over_ranks(sum_of_token_losses_r) / global_tokens
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from raymoe.models.common.loss import causal_lm_loss
from raymoe.models.moe.router import TopKRouter
from raymoe.parallel.grad_norm import clip_grads, grad_norm
from raymoe.parallel.vocab_parallel import vocab_parallel_loss, whole
from raymoe.rank.context import LoadedModel, RankContext, Training
from raymoe.spec.optimizer import OptimizerConfig


@dataclass(frozen=True)
class StepResult:
    """One rank's share of a step: its summed token loss, the global gradient norm before clipping, and
    (first rank of a tp group, MoE models) tokens per expert of its batch ``[moe_layers, E]``."""

    loss_sum: float
    grad_norm: float
    expert_load: Tensor | None = None


def configure_optimizer(ctx: RankContext, config: OptimizerConfig) -> None:
    """A fresh AdamW over this rank's parameters, one group per mesh (dense, expert); replaces earlier state."""
    loaded = ctx.require_model()
    model = loaded.model
    groups = [{"params": params, "mesh": name} for name, params in parameter_groups(loaded).items() if params]
    # foreach: one multi-tensor op per update step instead of one DTensor dispatch per parameter
    optimizer = torch.optim.AdamW(
        groups, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, foreach=True
    )
    loaded.training = Training(optimizer, config)
    for router in routers(model):
        router.record_load = True


def parameter_groups(loaded: LoadedModel) -> dict[str, list[nn.Parameter]]:
    """One group per mesh (SPEC TRAIN-2): ``dense`` and ``expert`` DTensor parameters, and ``replicated``
    plain tensors (tensor parallelism without FSDP leaves norms unsharded), since a multi-tensor
    optimizer step cannot mix DTensors and plain tensors. Experts count as dense without EP."""
    model, plans = loaded.model, loaded.spec.plans
    expert_paths = set(plans.expert_modules) if plans.ep_rules else set()
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
    loaded = ctx.require_model()
    model = loaded.model
    training = loaded.require_training()
    optimizer, config = training.optimizer, training.config
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float32)
    expert_load: Tensor | None = None
    for index, (input_ids_BS, labels_BS) in enumerate(micro_batches):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        with vocab_parallel_loss(model):
            logits = model(input_ids_BS.to(ctx.device))
            micro_loss = whole(causal_lm_loss(logits, labels_BS.to(ctx.device), reduction="sum"))
            # FSDP2 sums the gradients over data-parallel ranks (raymoe.parallel.fsdp), giving one process's gradient.
            (micro_loss / global_tokens).backward()
        loss_sum += micro_loss.detach().float().cpu()
        load = _expert_load(model)
        expert_load = load if expert_load is None or load is None else expert_load + load
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = grad_norm(params)
    if config.max_grad_norm is not None:
        clip_grads(params, norm, config.max_grad_norm)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return StepResult(float(loss_sum), float(norm), expert_load if ctx.answers_for_batch else None)


def _expert_load(model: nn.Module) -> Tensor | None:
    """``[moe_layers, E]`` tokens per expert of the last forward, or None for a dense model."""
    load = [router.last_load.cpu() for router in routers(model) if router.last_load is not None]
    return torch.stack(load) if load else None
