"""The handle's steps on rows that stay in Ray's object store (``DistributedModel`` inherits them): a global batch of
a :class:`~raymoe.driver.streamed_data.StreamedData` (``data.batch(indices, dp_size)``), whose rows each
data-parallel batch's ranks read themselves (``raymoe/rank/block_rows.py``), never through the driver.

    train_step_streamed(batch, lr, micro_batches)   -> train_step's metrics (cross-entropy; labels are the targets)
    evaluate_streamed(batch, micro_batches)         -> evaluate's loss, loss_sum, num_tokens
"""

from __future__ import annotations

import dataclasses
from typing import Any

from raymoe.driver.batch import check_micro_batches
from raymoe.driver.streamed_data import StreamedBatch
from raymoe.driver.training import TrainingSession


class StreamedMethods:
    """Mixed into :class:`~raymoe.driver.handle.DistributedModel`, whose training room it uses."""

    _training: TrainingSession

    def train_step_streamed(
        self, batch: StreamedBatch, lr: float | None = None, micro_batches: int = 1
    ) -> dict[str, Any]:
        """One optimizer step on ``batch`` (as :meth:`~raymoe.driver.handle.DistributedModel.train_step`: the loss is
        the mean over all its label tokens; ``micro_batches`` splits each rank's rows for gradient accumulation)."""
        return self._training.train_step_streamed(with_micro_batches(batch, micro_batches), lr)

    def evaluate_streamed(self, batch: StreamedBatch, micro_batches: int = 1) -> dict[str, Any]:
        """Mean loss over every label token of ``batch``, forward only (``loss``, ``loss_sum``, ``num_tokens``;
        ``compile_s`` as :meth:`~raymoe.driver.handle.DistributedModel.evaluate` says)."""
        return self._training.evaluate_streamed(with_micro_batches(batch, micro_batches))


def with_micro_batches(batch: StreamedBatch, micro_batches: int) -> StreamedBatch:
    check_micro_batches(micro_batches)
    rows = tuple(dataclasses.replace(rows, micro_batches=micro_batches) for rows in batch.rows)
    return dataclasses.replace(batch, rows=rows)
