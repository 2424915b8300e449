"""Load balancing on a rank (SPEC LB-2): routing statistics of a micro-batch, reduced over the global batch.

Every rank of a tp group holds the same tokens, so a sum over all ranks counts each token ``tp``
times; dividing by ``tp`` gives the global-batch statistic on every rank, identically::

    local (this rank's rows)                          global (one all-reduce over all ranks, / tp)
    counts [L, E]  chosen pairs of real tokens        C [L, E]
    tokens         real tokens                        T
    probs  [L, E]  router probabilities (gradient)    (stays local: each rank back-propagates its share)

    aux share = raymoe.models.moe.balance.aux_loss_share(probs, C, T)    summed over ranks: the global aux

Bias balancing moves every router's selection bias after the optimizer step from the step's
global load ``[L, E]`` (all routed pairs, padding included: it costs compute too), the same on
every rank.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

from raymoe.models.moe.balance import aux_loss_share, bias_step
from raymoe.models.moe.experts import tokens_per_expert
from raymoe.models.moe.router import TopKRouter
from raymoe.rank.context import RankContext
from raymoe.spec.topology import Axis


@dataclass(frozen=True)
class Routing:
    """One micro-batch's routing on this rank: what the aux loss needs and what the metrics report."""

    counts_LE: Tensor  # float64, chosen pairs of real tokens, per layer
    tokens: Tensor  # float64 0-d, real tokens
    prob_sum_LE: Tensor  # float32, with gradient, per layer
    load_LE: Tensor  # int64, chosen pairs per layer and expert, every token
    dropped_L: Tensor  # int64, pairs the capacity limit dropped, per layer

    def aux_stats(self) -> Tensor:
        """``[2 * L * E + 1]`` float64, no gradient: counts, probability sums, tokens (the driver reports from them)."""
        return torch.cat(
            [self.counts_LE.reshape(-1), self.prob_sum_LE.detach().double().reshape(-1), self.tokens[None]]
        )


def routers(model: nn.Module) -> list[TopKRouter]:
    return [module for module in model.modules() if isinstance(module, TopKRouter)]


def record_routing(model: nn.Module, on: bool) -> None:
    """Keep (or stop keeping) each router's last forward for :func:`collect_routing`."""
    for router in routers(model):
        router.record = on
        if not on:
            router.last_routing = None


def collect_routing(model: nn.Module, token_mask_T: Tensor, *, with_grad: bool) -> Routing | None:
    """The routing of the forward just run; ``token_mask_T`` marks the real tokens of the flattened rows.

    ``with_grad``: keep the probability sums in the autograd graph (the aux loss is trained on); otherwise
    they are measured only. Each router's record is released here.
    """
    found = [router for router in routers(model) if router.last_routing is not None]
    if not found:
        return None
    mask_T = token_mask_T.to(torch.float32)
    counts, probs, loads, dropped = [], [], [], []
    for router in found:
        record = router.last_routing
        assert record is not None
        router.last_routing = None
        top_k = record.chosen_TK.shape[1]
        weights_P = mask_T.repeat_interleave(top_k)
        counts.append(
            torch.zeros(router.num_experts, dtype=torch.float32, device=mask_T.device).scatter_add_(
                0, record.chosen_TK.reshape(-1), weights_P
            )
        )
        probs_TE = record.probs_TE if with_grad else record.probs_TE.detach()
        probs.append((probs_TE * mask_T[:, None]).sum(dim=0))
        loads.append(tokens_per_expert(record.chosen_TK, router.num_experts))
        dropped.append(record.num_dropped)
    return Routing(
        counts_LE=torch.stack(counts).double(),
        tokens=mask_T.sum().double(),
        prob_sum_LE=torch.stack(probs),
        load_LE=torch.stack(loads),
        dropped_L=torch.stack(dropped),
    )


def aux_loss(routing: Routing, ctx: RankContext, *, per_layer: bool) -> Tensor:
    """This rank's share of the global batch's aux loss (differentiable through its router probabilities)."""
    stats = sum_over_batches(torch.cat([routing.counts_LE.reshape(-1), routing.tokens[None]]), ctx)
    counts_LE = stats[:-1].view_as(routing.counts_LE).float()
    tokens = stats[-1].float()
    return aux_loss_share(routing.prob_sum_LE, counts_LE, tokens, per_layer=per_layer)


def sum_over_batches(stats: Tensor, ctx: RankContext) -> Tensor:
    """``stats`` (on the rank's device) summed over the distinct batches (all ranks, each tp group counted once);
    no gradient, on the device."""
    total = stats.detach().clone()
    dist.all_reduce(total)
    return total / ctx.topology.axis_size(Axis.TP)


def update_selection_bias(model: nn.Module, global_load_LE: Tensor, rate: float) -> None:
    """``bias += rate * sign(mean_load - load)`` for every router with a selection bias, layer by layer."""
    biased = [router for router in routers(model) if router.e_score_correction_bias is not None]
    if len(biased) != global_load_LE.shape[0]:
        raise RuntimeError(f"{len(biased)} routers with a selection bias, but load of {global_load_LE.shape[0]} layers")
    steps_LE = bias_step(global_load_LE, rate)
    with torch.no_grad():
        for router, step_E in zip(biased, steps_LE, strict=True):
            bias = router.e_score_correction_bias
            assert bias is not None
            _add_everywhere(bias, step_E)


def _add_everywhere(param: Tensor, delta: Tensor) -> None:
    """Add the full ``delta`` (on the rank's device) to ``param``, whose local storage may be a shard (FSDP2
    DTensor) and may live on the host (``fsdp_cpu_offload``): the shard of ``delta`` is cut on the mesh's device
    (no communication) and added where the shard lives."""
    if isinstance(param, DTensor):
        local = param.to_local()
        piece = distribute_tensor(delta, param.device_mesh, param.placements, src_data_rank=None).to_local()
        local.add_(piece.to(device=local.device, dtype=local.dtype))
    else:
        param.add_(delta.to(device=param.device, dtype=param.dtype))
