"""The one way the handle sends a call to its ranks and reads the answers: rows split by batch, fanned out, gathered.

A global batch's rows go to the data-parallel batches in blocks (TOPO-1); every rank of a batch (its tp
group, its pipeline stages) gets the same rows, and the batch's *answering* rank (the first of its tp group,
on the last pipeline stage: ``RankContext.answers_for_batch``) returns the batch's answer::

    B = 5 rows, dp_size = 2, tp = 2       batch 0: rows 0-2 -> ranks 0, 1 (rank 0 answers)
                                          batch 1: rows 3-4 -> ranks 2, 3 (rank 2 answers)

    split_rows(B, dp)          inference: any B; with fewer rows than batches an idle batch decodes a copy of
                               row 0 (its ranks must join every step's collectives) and its answer is dropped
    split_batch_rows(B, dp)    training and evaluation: at least one row per batch

    FanOut.per_batch(fn, args_of_batch)   fn(ctx, *args_of_batch[b]) on every rank of batch b -> one answer per b
    FanOut.to_batches(fn, args_of_batch)  the same, for calls that answer nothing
    FanOut.every_rank(fn, *args)          the same call everywhere -> every rank's answer, in rank order
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from raymoe.driver.group import RankGroup, one_per_batch
from raymoe.spec.topology import Topology


@dataclass(frozen=True)
class RowSplit:
    """The global rows each data-parallel batch holds (``rows[b]``, indices), and which batches are idle."""

    rows: tuple[Tensor, ...]
    idle: tuple[bool, ...]

    def take(self, tensor: Tensor | None) -> list[Tensor | None]:
        """Each batch's rows of ``tensor [B, ...]``; None stays None."""
        return [None if tensor is None else tensor[rows] for rows in self.rows]

    def take_all(self, tensor: Tensor) -> list[Tensor]:
        return [tensor[rows] for rows in self.rows]

    def gather(self, answers: Sequence[Tensor]) -> Tensor:
        """The batches' answers (in batch order) as one tensor of the global rows, idle ones dropped."""
        return torch.cat([answer for answer, idle in zip(answers, self.idle, strict=True) if not idle])


def split_rows(num_rows: int, dp_size: int) -> RowSplit:
    """Blocks of row indices per data-parallel batch (uneven allowed); a batch without rows borrows row 0."""
    blocks = torch.tensor_split(torch.arange(num_rows), dp_size)
    idle = tuple(block.numel() == 0 for block in blocks)
    return RowSplit(
        tuple(torch.zeros(1, dtype=torch.int64) if empty else b for b, empty in zip(blocks, idle, strict=True)), idle
    )


def split_batch_rows(num_rows: int, dp_size: int) -> RowSplit:
    """:func:`split_rows` for a training or evaluation batch, which gives every data-parallel batch a row."""
    if num_rows < dp_size:
        raise ValueError(
            f"the global batch has {num_rows} rows but the layout has dp_size={dp_size} data-parallel ranks "
            "(dp_replicate_size * fsdp_size); give at least one row per data-parallel rank"
        )
    return split_rows(num_rows, dp_size)


class FanOut:
    """Sends rank functions to the group ``ranks()`` returns (it raises once the handle is shut down)."""

    def __init__(self, ranks: Callable[[], RankGroup], topology: Topology) -> None:
        self._ranks = ranks
        self.topology = topology

    @property
    def is_alive(self) -> bool:
        """Whether the ranks still run (not shut down, no rank failure ended them)."""
        try:
            return self._ranks().is_alive
        except RuntimeError:  # shut down: the lease refuses every call
            return False

    def per_batch(
        self,
        fn: Callable[..., Any],
        args_of_batch: Sequence[tuple[Any, ...]],
        objects_of_batch: Sequence[Sequence[Any]] | None = None,
    ) -> list[Any]:
        """``fn(ctx, *args_of_batch[b])`` on every rank of batch ``b``; each batch's answer, in batch order.
        ``objects_of_batch[b]``: object-store references the ranks of batch ``b`` read (their values follow the
        arguments)."""
        return one_per_batch(self.to_batches(fn, args_of_batch, objects_of_batch), self.topology)

    def to_batches(
        self,
        fn: Callable[..., Any],
        args_of_batch: Sequence[tuple[Any, ...]],
        objects_of_batch: Sequence[Sequence[Any]] | None = None,
    ) -> list[Any]:
        """``fn(ctx, *args_of_batch[b])`` on every rank of batch ``b``; every rank's return value, in rank order."""
        if len(args_of_batch) != self.topology.config.dp_size:
            raise ValueError(f"{len(args_of_batch)} argument tuples for {self.topology.config.dp_size} batches")
        ranks = self.topology.ranks
        objects = None if objects_of_batch is None else [objects_of_batch[c.batch] for c in ranks]
        return self._ranks().execute_per_rank(fn, [args_of_batch[c.batch] for c in ranks], None, objects)

    def every_rank(self, fn: Callable[..., Any], *args: Any) -> list[Any]:
        """``fn(ctx, *args)`` on every rank; the answers in rank order."""
        return self._ranks().execute(fn, *args)
