"""Router replay on a rank: the experts a forward chose, as ``[B, S, L_moe, K]`` int16 on the answering rank.

Every rank keeps the routes of the routers it holds (:mod:`raymoe.models.moe.replay`). Without pipeline
parallelism that is every sparse layer; under pipelines each stage holds some, and the ranks of a pp group
exchange theirs (one object all-gather over the pp group) so the last stage's answering rank has them all::

    stage 0 ranks: slots {0, 1}  --all-gather (pp group)-->  every stage: slots {0, 1, 2, 3} -> [B, S, 4, K]
    stage 1 ranks: slots {2, 3}
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from raymoe.models.common.decoder import CausalLM
from raymoe.models.moe.replay import keep_routes, take_routes
from raymoe.rank.context import RankContext

ROUTE_DTYPE = torch.int16


def start_keeping(parts: Sequence[CausalLM], on: bool) -> None:
    for part in parts:
        keep_routes(part, on)


def take_from_parts(parts: Sequence[CausalLM], rows: int, width: int) -> dict[int, Tensor]:
    """``{slot: [B, S, K]}`` the last forward's ids of every router the parts hold (``B * S`` tokens), cleared."""
    taken: dict[int, Tensor] = {}
    for part in parts:
        for slot, ids_TK in take_routes(part, part.config.sparse_slots()).items():
            taken[slot] = ids_TK.view(rows, width, -1).to(ROUTE_DTYPE)
    return taken


def assemble_routes(ctx: RankContext, taken: dict[int, Tensor], num_slots: int) -> Tensor | None:
    """``[B, S, L_moe, K]`` int16 on CPU from every slot's ``[B, S, K]``, on ranks that answer for their batch.

    Under pipeline parallelism (the runner's ``norm_group`` is the pp group) every stage's slots are exchanged
    first; every rank of the group must call this."""
    group = ctx.require_model().runner.norm_group(ctx)
    local = {slot: ids.cpu() for slot, ids in taken.items()}
    if group is not None:
        everyone: list[dict[int, Tensor] | None] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, local, group=group)
        local = {slot: ids for part in everyone if part is not None for slot, ids in part.items()}
    if not ctx.answers_for_batch:
        return None
    missing = sorted(set(range(num_slots)) - set(local))
    if missing:
        raise RuntimeError(f"router replay: no routes recorded for sparse-layer slots {missing}")
    return torch.stack([local[slot] for slot in range(num_slots)], dim=2)
