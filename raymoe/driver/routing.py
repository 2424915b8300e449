"""Routing telemetry of a training step on the driver (SPEC LB-1, LB-2): a layer finishes when its busiest rank does.

Input: pairs per expert ``[moe_layers, E]`` of each distinct batch (global expert ids, counted
by the router before any expert-parallel masking or capacity drop). Output, per MoE layer:

    expert_load       pairs per expert, summed over the global batch
    expert_imbalance  max / mean over experts
    rank_load         pairs each rank's experts received (its ep group's batches, its expert block)
    rank_imbalance    max / mean over ranks; 1.0 means perfectly balanced hardware
    dead_experts      experts that got no pair in any of the last DEAD_EXPERT_WINDOW steps
    dropped_pairs     pairs the capacity limit dropped

and the step's auxiliary loss (:func:`aux_loss_value`), reported whether or not it is trained on.
"""

from __future__ import annotations

from collections import deque
from typing import Any

import torch
from torch import Tensor

from raymoe.models.moe.balance import aux_loss_share
from raymoe.spec.topology import Axis, Topology

DEAD_EXPERT_WINDOW = 10  # steps


def expert_load_metrics(load_per_batch: list[Tensor], topology: Topology) -> dict[str, Any]:
    """``load_per_batch[b]``: ``[moe_layers, E]`` tokens per expert of batch ``b`` (batch index order)."""
    loads_BLE = torch.stack(load_per_batch).to(torch.float64)
    total_LE = loads_BLE.sum(0)
    rank_load_LR = _rank_load(loads_BLE, topology)
    return {
        "expert_load": total_LE.to(torch.int64).tolist(),
        "expert_imbalance": _max_over_mean(total_LE).tolist(),
        "rank_load": rank_load_LR.to(torch.int64).tolist(),
        "rank_imbalance": _max_over_mean(rank_load_LR).tolist(),
    }


def _rank_load(loads_BLE: Tensor, topology: Topology) -> Tensor:
    """``[moe_layers, world]``: tokens routed to each rank's experts from the batches of its ep group. Under context
    parallelism an ep group may hold some of a batch's cp ranks only: their shares count as that fraction of the
    batch's load (each cp rank holds ``1 / cp_size`` of its tokens; which experts they chose is not told apart)."""
    num_experts, cp = loads_BLE.shape[-1], topology.axis_size(Axis.CP)
    columns = []
    for coords in topology.ranks:
        group = [topology.ranks[r] for r in topology.group_of(coords.rank, Axis.EP)]
        shares = {b: len({r.cp for r in group if r.batch == b}) / cp for b in {r.batch for r in group}}
        experts = topology.experts_of(coords.rank, num_experts)
        held_BL = loads_BLE[:, :, experts.start : experts.stop].sum(dim=2)
        columns.append(torch.stack([share * held_BL[b] for b, share in sorted(shares.items())]).sum(dim=0))
    return torch.stack(columns, dim=1)


def _max_over_mean(load_LN: Tensor) -> Tensor:
    mean_L = load_LN.mean(dim=1).clamp_min(1e-12)
    return load_LN.max(dim=1).values / mean_L


def aux_loss_value(stats_per_batch: list[Tensor], num_experts: int, *, per_layer: bool) -> float:
    """The step's aux loss from each batch's ``[M, 2 L E + 1]`` statistics (``raymoe.rank.balance.Routing``):
    per micro-batch the global batch's value (``aux_loss_share`` of the summed statistics), then the mean
    over micro-batches."""
    stats_MS = torch.stack(stats_per_batch).sum(dim=0)  # summed over batches
    num_layers = (stats_MS.shape[1] - 1) // (2 * num_experts)
    values = []
    for stats in stats_MS:
        counts_LE = stats[: num_layers * num_experts].view(num_layers, num_experts)
        probs_LE = stats[num_layers * num_experts : -1].view(num_layers, num_experts)
        values.append(aux_loss_share(probs_LE, counts_LE, stats[-1], per_layer=per_layer))
    return float(torch.stack(values).mean())


class DeadExperts:
    """Experts with no pair over the last ``window`` steps, per layer (counted once the window is full)."""

    def __init__(self, window: int = DEAD_EXPERT_WINDOW) -> None:
        self.window = window
        self._loads: deque[Tensor] = deque(maxlen=window)

    def update(self, load_LE: Tensor) -> list[int]:
        """Add one step's global load; the dead experts of each layer (zeros until ``window`` steps are seen)."""
        self._loads.append(load_LE)
        if len(self._loads) < self.window:
            return [0] * load_LE.shape[0]
        total_LE = torch.stack(list(self._loads)).sum(dim=0)
        return (total_LE == 0).sum(dim=1).tolist()

    def reset(self) -> None:
        self._loads.clear()
