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

Any other exception (a failed collective, a bug) is a rank failure as before. A storage URL is written on rank 0's
disk first and uploaded from there (:mod:`raymoe.checkpoint.upload`).
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor

from raymoe.checkpoint.model_io import save_model
from raymoe.checkpoint.storage import StorageUrl, location_of
from raymoe.checkpoint.upload import save_to_url
from raymoe.models.common.lora import merge_stream
from raymoe.models.moe.packed import packed_companions, unpacked_stream
from raymoe.rank.context import LoadedModel, RankContext
from raymoe.rank.contract import SaveResult


def save_gathered(ctx: RankContext, directory: str, max_shard_size: int) -> SaveResult:
    """Every rank gathers; rank 0 writes under ``directory`` (on its node) and answers the files or the failure.

    The weights are written in the checkpoint's dtype (:attr:`PrecisionPolicy.checkpoint`), not the master's.

    Under pipeline parallelism every stage gathers its own parameters, and the rank of rank 0's pp group that
    holds a stage sends them on to rank 0, which writes the whole model as one checkpoint.
    """
    loaded = ctx.require_model()
    model, gathered = loaded.runner.gathered(ctx, loaded.spec)
    tensors = as_saved(loaded, gathered)
    if ctx.rank != 0:
        _join_remaining(tensors)
        return SaveResult()
    dtype = loaded.precision.checkpoint
    target = location_of(directory)
    try:
        if isinstance(target, StorageUrl):
            urls = save_to_url(
                target,
                lambda local: save_model(model, local, max_shard_size=max_shard_size, tensors=tensors, dtype=dtype),
            )
            return SaveResult(files=tuple(urls))
        files = save_model(model, target, max_shard_size=max_shard_size, tensors=tensors, dtype=dtype)
    except (OSError, ValueError) as error:
        _join_remaining(tensors)
        cause = str(error) if isinstance(error, OSError) else f"{type(error).__name__}: {error}"
        return SaveResult(error=cause, errno=error.errno if isinstance(error, OSError) else None)
    return SaveResult(files=tuple(str(path) for path in files))


def as_saved(loaded: LoadedModel, tensors: Iterator[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """``(parameter name, full tensor)`` as ``save_pretrained`` writes the model: packed MXFP4 experts dequantized
    (into the compute dtype), LoRA factors merged into their bases (``W + s B A``)."""
    packed = {blocks: pair for part in loaded.parts for blocks, pair in packed_companions(part).items()}
    if packed:
        tensors = unpacked_stream(tensors, packed, loaded.precision.compute)
    if loaded.spec.lora is not None:
        tensors = merge_stream(tensors, loaded.spec.lora.targets)
    return tensors


def _join_remaining(tensors: Iterator[tuple[str, Tensor]]) -> None:
    """Take part in every gather not yet done (all of them, or those after a failed write), dropping the tensors."""
    for _ in tensors:
        pass
