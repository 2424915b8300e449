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

A policy loss (RL, :mod:`raymoe.spec.policy`) takes the same path with its own normalizer in place of the
token count: the driver's, for the built-in losses; for a callable, the sum over the world of what each batch's
callable returned, by which the accumulated gradients are divided before the norm (one all-reduce).
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from raymoe.parallel.compiled_blocks import compile_seconds
from raymoe.parallel.context_parallel.split import ContextSplit
from raymoe.parallel.grad_norm import clip_grads, grad_norm, sum_partial_grads
from raymoe.parallel.sharding import local_tensor
from raymoe.rank.balance import record_routing, routers, sum_over_batches, update_selection_bias
from raymoe.rank.context import LoadedModel, RankContext, Training
from raymoe.rank.contract import MicroBatch, StepResult
from raymoe.rank.runner import Backward
from raymoe.spec.balance import BalanceConfig
from raymoe.spec.optimizer import OptimizerConfig
from raymoe.spec.policy import PolicyLoss
from raymoe.spec.topology import Axis


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
        if not param.requires_grad:
            continue  # a frozen base (LoRA): no gradient, no optimizer state
        if not isinstance(param, DTensor):
            groups["replicated"].append(param)
        else:
            groups["expert" if name.rpartition(".")[0] in expert_paths else "dense"].append(param)
    return groups


def train_step(
    ctx: RankContext,
    micro_batches: list[MicroBatch],
    global_tokens: float,
    lr: float | None = None,
    policy: PolicyLoss | None = None,
) -> StepResult:
    """One optimizer step over this rank's rows of the global batch, given as micro-batches.

    Every micro-batch's loss is divided by ``global_tokens``, the token count (or a built-in policy loss's
    normalizer) of the whole global batch, so accumulating their gradients gives the gradient of the global
    loss (the runner's :meth:`~raymoe.rank.runner.StageRunner.backward`); then clipping by the global norm,
    AdamW and, with bias balancing, the routers' selection biases.
    """
    loaded = ctx.require_model()
    training = loaded.require_training()
    compiling_since = compile_seconds()
    divisor = 1.0 if policy is not None and policy.is_callable else global_tokens
    done = loaded.runner.backward(ctx, training, micro_batches, divisor, policy)
    scale = _callable_scale(ctx, done) if policy is not None and policy.is_callable else None
    stage_ranks = ctx.topology.world_size // ctx.topology.axis_size(Axis.PP)
    norm = _optimizer_step(training, lr, stage_ranks, device=ctx.device, scale=scale)
    routings = done.routings
    load_LE = torch.stack([r.load_LE for r in routings]).sum(dim=0) if routings else None
    bias_rate = training.balance.bias_update_rate
    if load_LE is not None and bias_rate is not None:
        update_selection_bias(loaded.model, sum_over_batches(load_LE.double(), ctx), bias_rate)
    result = _step_result(done, norm, answers=ctx.answers_for_batch, split=loaded.shares.context)
    return dataclasses.replace(result, compile_s=compile_seconds() - compiling_since)


def _callable_scale(ctx: RankContext, done: Backward) -> Tensor:
    """``1 / N``, ``N`` the sum over the world of each batch's normalizer (its answering rank's; others add 0)."""
    mine = done.stats[0] if done.stats is not None and ctx.answers_for_batch else None
    total = mine.clone() if mine is not None else torch.zeros((), dtype=torch.float64, device=ctx.device)
    dist.all_reduce(total)
    return 1.0 / total


def _step_result(done: Backward, norm: Tensor, *, answers: bool, split: ContextSplit | None = None) -> StepResult:
    """What the step reports, read from the device in one copy (the step's one host sync): loss and norm, and
    the routing of the batch's answering rank (its loads ``[L, E]``, dropped pairs ``[L]``, statistics ``[M, n]``).
    Counts travel as float64, exact below 2**53. Under context parallelism every rank holds a share of the batch's
    tokens: the shares' sums are added over the cp group first (one all-reduce, every rank of each group)."""
    reports = answers or split is not None
    routings = done.routings if reports else []
    parts = [done.loss_sum.double()[None]]
    if routings:
        parts += [
            torch.stack([r.load_LE for r in routings]).sum(dim=0).double().reshape(-1),
            torch.stack([r.dropped_L for r in routings]).sum(dim=0).double(),
            torch.stack([r.aux_stats() for r in routings]).reshape(-1),
        ]
    policy = done.stats if reports else None
    if policy is not None:
        parts.append(policy.double())
    summed = torch.cat(parts)
    if split is not None:
        split.sum(summed)
    if not answers:
        routings, policy = [], None
    host = torch.cat([summed[:1], norm.double()[None], summed[1:]]).cpu()
    loss_sum, grad_norm_value = float(host[0]), float(host[1])
    policy_stats = tuple(host[-policy.numel() :].tolist()) if policy is not None else None
    if not routings:
        return StepResult(loss_sum=loss_sum if answers else 0.0, grad_norm=grad_norm_value, policy_stats=policy_stats)
    layers, experts = routings[0].load_LE.shape
    sizes = [layers * experts, layers, len(routings) * (2 * layers * experts + 1)]
    load, dropped, stats = host[2 : 2 + sum(sizes)].split(sizes)
    return StepResult(
        loss_sum=loss_sum,
        grad_norm=grad_norm_value,
        expert_load=load.view(layers, experts).long(),
        dropped_pairs=dropped.long(),
        aux_stats=stats.view(len(routings), -1),
        policy_stats=policy_stats,
    )


def _optimizer_step(
    training: Training,
    lr: float | None,
    stage_ranks: int,
    device: torch.device | None = None,
    scale: Tensor | None = None,
) -> Tensor:
    """Scale the gradients by ``scale`` (a callable policy loss's ``1 / N``), clip by the global gradient norm
    (over every stage; ``stage_ranks``: the ranks of one pipeline stage), step AdamW, clear the gradients; returns
    the norm before clipping."""
    optimizer, config = training.optimizer, training.config
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    if scale is not None:
        for param in params:
            assert param.grad is not None
            local = local_tensor(param.grad)
            local.mul_(scale.to(local.dtype))
    sum_partial_grads(params)
    norm = grad_norm(params, stage_ranks, device=device)
    if config.max_grad_norm is not None:
        clip_grads(params, norm, config.max_grad_norm)
    if lr is not None:
        for group in optimizer.param_groups:
            group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
