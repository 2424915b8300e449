"""Saving a sharded model from its ranks into one hub-layout checkpoint (SPEC TRAIN-3).

Parameters are gathered one at a time, in the same order on every rank (each gather is a
collective), and rank 0 streams them to :class:`~raymoe.checkpoint.writer.CheckpointWriter`,
so no rank ever holds more than one full parameter beyond its own shards.

A failed write does not fail the rank. Rank 0 catches the writer's ``OSError`` / ``ValueError``,
keeps joining every remaining gather, dropping the tensors (the other ranks are already waiting in
the next one and would hang there until the collective timeout), and answers the failure as data;
the driver raises it, and the ranks keep their weights and optimizer state::

    rank 0    gather p0, write   gather p1, write fails   gather p2 (dropped) ... gather pN   -> SaveResult(error=...)
    rank 1..  gather p0          gather p1                gather p2           ... gather pN   -> SaveResult()

Any other exception (a failed collective, a bug) is a rank failure as before.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from raymoe.checkpoint.model_io import save_model
from raymoe.models.common.decoder import CausalLM
from raymoe.rank.context import LoadedModel, RankContext
from raymoe.spec.topology import Axis


@dataclass(frozen=True)
class SaveResult:
    """One rank's answer to :func:`save_gathered`: rank 0's files, or why it saved nothing (``error``, a message
    naming the file and the cause; ``errno``, the disk's code when it gave one). Other ranks answer an empty one."""

    files: tuple[str, ...] = ()
    error: str | None = None
    errno: int | None = None


def save_gathered(ctx: RankContext, directory: str, max_shard_size: int) -> SaveResult:
    """Every rank gathers; rank 0 writes under ``directory`` (on its node) and answers the files or the failure.

    Under pipeline parallelism every stage gathers its own parameters, and the rank of rank 0's pp group that
    holds a stage sends them on to rank 0, which writes the whole model as one checkpoint.
    """
    loaded = ctx.require_model()
    if loaded.spec.stages is None:
        model, tensors = loaded.model, _gathered(loaded.model)
    else:
        model = loaded.spec.build_meta_model().to(next(loaded.parts[0].parameters()).dtype)
        tensors = _gathered_stages(ctx, loaded, model)
    if ctx.rank != 0:
        _join_remaining(tensors)
        return SaveResult()
    try:
        files = save_model(model, directory, max_shard_size=max_shard_size, tensors=tensors)
    except (OSError, ValueError) as error:
        _join_remaining(tensors)
        cause = str(error) if isinstance(error, OSError) else f"{type(error).__name__}: {error}"
        return SaveResult(error=cause, errno=error.errno if isinstance(error, OSError) else None)
    return SaveResult(files=tuple(str(path) for path in files))


def _gathered(model: CausalLM) -> Iterator[tuple[str, Tensor]]:
    for name, param in model.named_parameters():
        yield name, (param.full_tensor() if isinstance(param, DTensor) else param.detach())


def _gathered_stages(ctx: RankContext, loaded: LoadedModel, whole: CausalLM) -> Iterator[tuple[str, Tensor]]:
    """Every parameter of the ``whole`` (meta) model in its order, full, on rank 0: gathered inside the stage
    that holds it (its ranks only), then sent to rank 0 over the pp group when another stage holds it."""
    mine = dict(loaded.named_parameters())
    group = ctx.mesh(Axis.PP).get_group()
    zero_group = ctx.topology.group_of(0, Axis.PP)  # rank 0 and the ranks at its place in the other stages
    plan = loaded.spec.stages
    assert plan is not None
    owners = {name: plan.rank_of(stage) for stage in range(plan.num_stages) for name in _part_names(loaded, stage)}
    for name, meta in whole.named_parameters():
        owner = owners[name]
        full: Tensor | None = None
        if name in mine:
            param = mine[name]
            full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
        if ctx.rank not in zero_group or owner == 0:
            if ctx.rank == 0:
                assert full is not None
                yield name, full
            continue
        if ctx.rank == 0:
            received = torch.empty(meta.shape, dtype=meta.dtype, device=ctx.device)
            dist.recv(received, group=group, group_src=owner)
            yield name, received
        elif ctx.coords.pp == owner:
            assert full is not None
            dist.send(full.contiguous(), group=group, group_dst=0)


def _part_names(loaded: LoadedModel, stage: int) -> list[str]:
    return [name for name, _ in loaded.spec.build_meta_part(stage).named_parameters()]


def _join_remaining(tensors: Iterator[tuple[str, Tensor]]) -> None:
    """Take part in every gather not yet done (all of them, or those after a failed write), dropping the tensors."""
    for _ in tensors:
        pass
