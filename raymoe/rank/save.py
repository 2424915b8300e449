"""Saving a sharded model from its ranks into one hub-layout checkpoint (SPEC TRAIN-3).

Parameters are gathered one at a time, in the same order on every rank (each gather is a
collective), and rank 0 streams them to :class:`~raymoe.checkpoint.writer.CheckpointWriter`,
so no rank ever holds more than one full parameter beyond its own shards.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor
from torch.distributed.tensor import DTensor

from raymoe.checkpoint.model_io import save_model
from raymoe.models.common.decoder import CausalLM
from raymoe.rank.context import RankContext


def save_gathered(ctx: RankContext, directory: str, max_shard_size: int) -> list[str]:
    """Every rank gathers; rank 0 writes under ``directory`` (on its node) and returns the file names."""
    model = ctx.require_model().model
    if ctx.rank == 0:
        files = save_model(model, directory, max_shard_size=max_shard_size, tensors=_gathered(model))
        return [str(path) for path in files]
    for _ in _gathered(model):
        pass
    return []


def _gathered(model: CausalLM) -> Iterator[tuple[str, Tensor]]:
    for name, param in model.named_parameters():
        yield name, (param.full_tensor() if isinstance(param, DTensor) else param.detach())
