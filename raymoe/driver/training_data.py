"""What the Trainer trains and evaluates on, whichever process holds the rows; one interface, so its loop never asks::

    rows_of(data)         PackedData or a 2-D array (rows on the driver)  -> DriverRows
                          StreamedData (rows in Ray's object store)       -> ObjectStoreRows
    .check(...)           before any step: seq_len within the model's positions, token ids and labels within the
                          vocabulary, some label tokens, at least ``min_rows`` rows
    .batches(...)         row indices of successive global batches (:mod:`raymoe.driver.batch_order`)
    .train_step(...)      one optimizer step on those rows -> the step's metrics
    .evaluate(...)        EvalTotals over every row (loss_sum, num_tokens, compile_s), in global batches of
                          ``batch_size``; a short last one filled with all-padding rows (they add no token), a batch
                          without label tokens skipped

``DriverRows`` sends each step's rows from the driver (``model.train_step``); ``ObjectStoreRows`` sends only which
rows of which blocks each data-parallel batch takes (``model.train_step_streamed``): its ranks read them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor

from raymoe.driver.batch import check_input_ids
from raymoe.driver.batch_order import batch_indices, block_batch_indices
from raymoe.driver.packing import PackedData
from raymoe.driver.streamed_data import StreamedData
from raymoe.models.common.config import ModelConfig
from raymoe.models.common.loss import IGNORE_INDEX

if TYPE_CHECKING:
    from raymoe.driver.handle import DistributedModel

TrainData = PackedData | StreamedData | Tensor | np.ndarray


def rows_of(data: TrainData) -> DriverRows | ObjectStoreRows:
    """The Trainer's view of ``data`` (see the module docstring)."""
    if isinstance(data, StreamedData):
        return ObjectStoreRows(data)
    return DriverRows(PackedData.of(data))


def check_fits(name: str, seq_len: int, config: ModelConfig) -> None:
    if seq_len > config.max_position_embeddings:
        raise ValueError(
            f"{name}: seq_len={seq_len} exceeds the model's max_position_embeddings="
            f"{config.max_position_embeddings}; pack into rows of at most that many tokens"
        )


def check_counts(name: str, seq_len: int, label_tokens: int, rows: int, min_rows: int) -> None:
    if label_tokens == 0:
        raise ValueError(f"{name}: no token takes loss (every label is -100, padding or a document start)")
    if rows < min_rows:
        need = f"global_batch_size={min_rows} needs" if name == "train data" else "needs"
        raise ValueError(
            f"{name}: {rows} sequences of {seq_len} tokens, but {need} at least {min_rows}; "
            "use more data, a shorter seq_len or a smaller global_batch_size"
        )


@dataclass(frozen=True)
class EvalTotals:
    """An evaluation's sums over its global batches: token loss, label tokens, and seconds spent compiling decoder
    blocks (each batch's ``compile_s``: a new shape's first, ``compile=``)."""

    loss_sum: float = 0.0
    num_tokens: int = 0
    compile_s: float = 0.0

    @property
    def loss(self) -> float:
        return self.loss_sum / self.num_tokens

    def plus(self, metrics: dict[str, Any]) -> EvalTotals:
        """These sums and one batch's ``evaluate`` answer."""
        return EvalTotals(
            self.loss_sum + metrics["loss_sum"],
            self.num_tokens + metrics["num_tokens"],
            self.compile_s + metrics.get("compile_s", 0.0),
        )


@dataclass(frozen=True)
class DriverRows:
    """Rows the driver holds (``PackedData``); each step sends its rows to the ranks."""

    data: PackedData
    data_order = "rows"  # one seeded shuffle of every row per epoch (a state records it: resume)

    @property
    def num_sequences(self) -> int:
        return self.data.num_sequences

    def check(self, name: str, config: ModelConfig, min_rows: int) -> None:
        data = self.data
        check_fits(name, data.seq_len, config)
        check_input_ids(data.input_ids, config.vocab_size, name=name)
        if data.labels is not None:
            bad = (data.labels != IGNORE_INDEX) & ((data.labels < 0) | (data.labels >= config.vocab_size))
            if bool(bad.any()):
                raise ValueError(f"{name}: labels must be token ids in [0, {config.vocab_size}) or {IGNORE_INDEX}")
        check_counts(name, data.seq_len, data.num_label_tokens, data.num_sequences, min_rows)

    def batches(self, batch_size: int, seed: int, start: int) -> Iterator[Tensor]:
        return batch_indices(self.data.num_sequences, batch_size, seed, start)

    def train_step(self, model: DistributedModel, indices: Tensor, lr: float, micro_batches: int) -> dict[str, Any]:
        batch = self.data.rows(indices)
        return model.train_step(
            batch.input_ids,
            labels=batch.labels,
            attention_mask=batch.attention_mask,
            lr=lr,
            micro_batches=micro_batches,
            document_ids=batch.document_ids,
        )

    def evaluate(self, model: DistributedModel, batch_size: int, micro_batches: int) -> EvalTotals:
        least = model.topology.config.dp_size * micro_batches
        totals = EvalTotals()
        for start in range(0, self.data.num_sequences, batch_size):
            chunk = self.data.rows(slice(start, start + batch_size))
            if chunk.num_label_tokens == 0:
                continue
            chunk = chunk.with_blank_rows(least - chunk.num_sequences)
            result = model.evaluate(
                chunk.input_ids,
                labels=chunk.labels,
                attention_mask=chunk.attention_mask,
                micro_batches=micro_batches,
                document_ids=chunk.document_ids,
            )
            totals = totals.plus(result)
        return totals


@dataclass(frozen=True)
class ObjectStoreRows:
    """Rows in Ray's object store (``StreamedData``); each step sends which rows each data-parallel batch takes."""

    data: StreamedData

    @property
    def num_sequences(self) -> int:
        return self.data.num_sequences

    @property
    def data_order(self) -> str:
        """Shuffled by block: the order depends on which rows share a block (a digest of each row's block)."""
        digest = hashlib.sha256(np.ascontiguousarray(self.data.block_of_row, dtype=np.int32).tobytes()).hexdigest()
        return f"blocks:{digest[:16]}"

    def check(self, name: str, config: ModelConfig, min_rows: int) -> None:
        check_fits(name, self.data.seq_len, config)
        low, high = self.data.id_range
        if low < 0 or high >= config.vocab_size:
            raise ValueError(
                f"{name}: token ids must be in [0, {config.vocab_size}) (the model's vocab_size), got ids from {low} "
                f"to {high}; use the model's tokenizer"
            )
        check_counts(name, self.data.seq_len, self.data.num_label_tokens, self.data.num_sequences, min_rows)

    def batches(self, batch_size: int, seed: int, start: int) -> Iterator[Tensor]:
        return block_batch_indices(self.data.block_of_row, batch_size, seed, start)

    def train_step(self, model: DistributedModel, indices: Tensor, lr: float, micro_batches: int) -> dict[str, Any]:
        batch = self.data.batch(indices, model.topology.config.dp_size)
        return model.train_step_streamed(batch, lr=lr, micro_batches=micro_batches)

    def evaluate(self, model: DistributedModel, batch_size: int, micro_batches: int) -> EvalTotals:
        least = model.topology.config.dp_size * micro_batches
        tokens = self.data.label_tokens
        totals = EvalTotals()
        for start in range(0, self.data.num_sequences, batch_size):
            indices = np.arange(start, min(start + batch_size, self.data.num_sequences))
            if int(tokens[indices].sum()) == 0:
                continue
            batch = self.data.batch(indices, model.topology.config.dp_size, blank=max(0, least - len(indices)))
            totals = totals.plus(model.evaluate_streamed(batch, micro_batches=micro_batches))
        return totals
