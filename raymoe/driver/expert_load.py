"""Expert load statistics of a training step (SPEC LB-1): a layer finishes when its busiest rank does.

Input: tokens per expert ``[moe_layers, E]`` of each distinct batch (global expert ids, counted
by the router before any expert-parallel masking). Output, per MoE layer:

    expert_load       tokens per expert, summed over the global batch
    expert_imbalance  max / mean over experts
    rank_load         tokens each rank's experts received (its ep group's batches, its expert block)
    rank_imbalance    max / mean over ranks; 1.0 means perfectly balanced hardware
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from raymoe.spec.topology import Axis, Topology


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
    """``[moe_layers, world]``: tokens routed to each rank's experts from the batches of its ep group."""
    num_experts = loads_BLE.shape[-1]
    columns = []
    for coords in topology.ranks:
        group = topology.group_of(coords.rank, Axis.EP)
        batches = sorted({topology.ranks[r].batch for r in group})
        experts = topology.experts_of(coords.rank, num_experts)
        columns.append(loads_BLE[batches][:, :, experts.start : experts.stop].sum(dim=(0, 2)))
    return torch.stack(columns, dim=1)


def _max_over_mean(load_LN: Tensor) -> Tensor:
    mean_L = load_LN.mean(dim=1).clamp_min(1e-12)
    return load_LN.max(dim=1).values / mean_L
