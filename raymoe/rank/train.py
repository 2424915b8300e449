"""Training steps on a rank: loss of the global batch, load balancing, gradient norm, clipping, AdamW (SPEC TRAIN-2).

Every data-parallel rank takes the *sum* of its token losses and divides by the number of
label tokens in the whole global batch (counted on the driver), so summing gradients over
data-parallel ranks (FSDP2 does, see raymoe.parallel.fsdp) gives exactly one process's gradient of the
global mean loss, however unevenly the tokens are spread::

    loss = sum_over_ranks(sum_of_token_losses_r) / global_tokens  +  coef * aux

The auxiliary load-balancing loss ``aux`` is taken from global-batch statistics
(:mod:`raymoe.rank.balance`): each rank back-propagates its share, and the shares sum to the aux
loss of the global batch. With ``M`` micro-batches (gradient accumulation) the statistics of later
micro-batches are unknown while earlier ones run backward, so the step's aux loss is the mean over
micro-batches of each micro-batch's global aux loss (micro-batch ``i`` of every data-parallel rank
together); with ``M = 1`` it is the global batch's, exactly transformers' value in one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from raymoe.models.common.loss import causal_lm_loss
from raymoe.parallel.grad_norm import clip_grads, grad_norm
from raymoe.parallel.vocab_parallel import vocab_parallel_loss, whole
from raymoe.rank.balance import (
    Routing,
    aux_loss,
    collect_routing,
    record_routing,
    routers,
    sum_over_batches,
    update_selection_bias,
)
from raymoe.rank.context import LoadedModel, RankContext, Training
from raymoe.rank.pipeline import pipeline_group, train_pipeline_micro_batch
from raymoe.spec.balance import BalanceConfig
from raymoe.spec.optimizer import OptimizerConfig


@dataclass(frozen=True)
class MicroBatch:
    """One micro-batch of a rank's rows: ``input_ids`` and ``labels`` ``[b, S]`` (-100: no loss),
    ``token_mask`` ``[b, S]`` bool, the real tokens (False: padding), which the aux loss counts, and for
    packed rows ``document_ids`` ``[b, S]`` (each document attends only to itself; None: plain rows)."""

    input_ids: Tensor
    labels: Tensor
    token_mask: Tensor
    document_ids: Tensor | None = None

    def forward(self, model: nn.Module, device: torch.device) -> Tensor:
        """The model's logits of these rows on ``device`` (one call through the root module, as FSDP2 needs)."""
        documents = self.document_ids.to(device) if self.document_ids is not None else None
        logits: Tensor = model(self.input_ids.to(device), document_ids_BS=documents)
        return logits

    def loss_sum(self, model: nn.Module, device: torch.device) -> Tensor:
        """The summed token loss of these rows (a float32 scalar), with the graph to back-propagate it.

        No reference to the logits ``[b, S, V]`` outlives this call: the loss's graph keeps only their
        log-softmax, so the logits are freed before backward instead of sitting beside its ``[b, S, V]``
        gradients (one vocabulary-wide tensor less at the step's peak; transformers' output keeps them).
        """
        loss: Tensor = whole(causal_lm_loss(self.forward(model, device), self.labels.to(device), reduction="sum"))
        return loss


@dataclass(frozen=True)
class StepResult:
    """One rank's share of a step: its summed token loss, the global gradient norm before clipping, and
    (first rank of a tp group, MoE models) of its rows: pairs per expert ``[L, E]``, dropped pairs ``[L]``,
    and each micro-batch's aux-loss statistics ``[M, 2 L E + 1]`` (chosen pairs of real tokens and summed
    router probabilities per layer, real tokens), from which the driver reports the aux loss whether or
    not it is trained on."""

    loss_sum: float
    grad_norm: float
    expert_load: Tensor | None = None
    dropped_pairs: Tensor | None = None
    aux_stats: Tensor | None = None


def configure_optimizer(ctx: RankContext, config: OptimizerConfig, balance: BalanceConfig | None = None) -> None:
    """A fresh AdamW over this rank's parameters, one group per mesh (dense, expert), and the load-balancing
    settings; replaces earlier state."""
    loaded = ctx.require_model()
    groups = [{"params": params, "mesh": name} for name, params in parameter_groups(loaded).items() if params]
    # fused: one kernel per group reads and writes every tensor once (CPU and CUDA), with no temporaries the size
    # of the parameters (the multi-tensor "foreach" step makes several) and one DTensor dispatch per group
    optimizer = torch.optim.AdamW(
        groups, lr=config.lr, betas=config.betas, eps=config.eps, weight_decay=config.weight_decay, fused=True
    )
    settings = balance or BalanceConfig()
    loaded.training = Training(optimizer, config, settings)
    for part in loaded.parts:
        record_routing(part, settings.record_routing)
        for router in routers(part):
            router.capacity_factor = settings.capacity_factor


def parameter_groups(loaded: LoadedModel) -> dict[str, list[nn.Parameter]]:
    """One group per mesh (SPEC TRAIN-2): ``dense`` and ``expert`` DTensor parameters, and ``replicated``
    plain tensors (tensor parallelism without FSDP leaves norms unsharded), since a fused (or multi-tensor)
    optimizer step cannot mix DTensors and plain tensors. Experts count as dense without EP."""
    plans = loaded.spec.plans
    expert_paths = set(plans.expert_modules) if plans.ep_rules else set()
    groups: dict[str, list[nn.Parameter]] = {"dense": [], "expert": [], "replicated": []}
    for name, param in loaded.named_parameters():
        if not isinstance(param, DTensor):
            groups["replicated"].append(param)
        else:
            groups["expert" if name.rpartition(".")[0] in expert_paths else "dense"].append(param)
    return groups


def train_step(
    ctx: RankContext, micro_batches: list[MicroBatch], global_tokens: int, lr: float | None = None
) -> StepResult:
    """One optimizer step over this rank's rows of the global batch, given as micro-batches.

    Every micro-batch's loss is divided by the token count of the whole global batch, so
    accumulating their gradients gives the gradient of the global mean loss. FSDP2 reduces
    gradients only after the last micro-batch.
    """
    loaded = ctx.require_model()
    if loaded.spec.stages is not None:
        return _pipeline_train_step(ctx, loaded, micro_batches, global_tokens, lr)
    model = loaded.model
    training = loaded.require_training()
    balance = training.balance
    model.train()
    loss_sum = torch.zeros((), dtype=torch.float32)
    routings: list[Routing] = []
    for index, micro in enumerate(micro_batches):
        if isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(index == len(micro_batches) - 1)
        with vocab_parallel_loss(model):
            micro_loss = micro.loss_sum(model, ctx.device)
            # FSDP2 sums the gradients over data-parallel ranks (raymoe.parallel.fsdp), giving one process's gradient.
            objective = micro_loss / global_tokens
            trains_aux = balance.aux_loss_coef > 0
            routing = collect_routing(model, micro.token_mask.reshape(-1).to(ctx.device), with_grad=trains_aux)
            if routing is not None and trains_aux:
                share = aux_loss(routing, ctx, per_layer=balance.aux_loss_per_layer) / len(micro_batches)
                objective = objective + balance.aux_loss_coef * share
            objective.backward()
        loss_sum += micro_loss.detach().float().cpu()
        if routing is not None:
            routings.append(routing)
    norm = _optimizer_step(training, lr)
    load_LE = torch.stack([r.load_LE for r in routings]).sum(dim=0).cpu() if routings else None
    dropped_L = torch.stack([r.dropped_L for r in routings]).sum(dim=0).cpu() if routings else None
    stats = torch.stack([r.aux_stats() for r in routings]).cpu() if routings else None
    if load_LE is not None and balance.bias_update_rate is not None:
        update_selection_bias(model, sum_over_batches(load_LE.double(), ctx), balance.bias_update_rate)
    answers = ctx.answers_for_batch
    return StepResult(
        loss_sum=float(loss_sum),
        grad_norm=float(norm),
        expert_load=load_LE if answers else None,
        dropped_pairs=dropped_L if answers else None,
        aux_stats=stats if answers else None,
    )


def _optimizer_step(
    training: Training, lr: float | None, across: dist.ProcessGroup | None = None, device: torch.device | None = None
) -> Tensor:
    """Clip by the global gradient norm (summed ``across`` the pipeline stages), step AdamW, clear the gradients;
    returns the norm before clipping."""
    optimizer, config = training.optimizer, training.config
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    norm = grad_norm(params, across=across, device=device)
    if config.max_grad_norm is not None:
        clip_grads(params, norm, config.max_grad_norm)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm


def _pipeline_train_step(
    ctx: RankContext, loaded: LoadedModel, micro_batches: list[MicroBatch], global_tokens: int, lr: float | None
) -> StepResult:
    """A step under pipeline parallelism (:mod:`raymoe.rank.pipeline`): each micro-batch through the schedule, the
    gradient norm over every stage, AdamW. Routing is not recorded (the driver refuses the aux loss and bias
    balancing with pp_size > 1)."""
    training = loaded.require_training()
    loss_sum = torch.zeros((), dtype=torch.float32)
    for micro in micro_batches:
        loss_sum += train_pipeline_micro_batch(
            ctx, loaded, micro.input_ids, micro.labels, micro.document_ids, global_tokens
        )
    norm = _optimizer_step(training, lr, across=pipeline_group(ctx), device=ctx.device)
    return StepResult(loss_sum=float(loss_sum) if ctx.answers_for_batch else 0.0, grad_norm=float(norm))
