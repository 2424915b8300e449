"""Packed rows that stay on the cluster: what ``load_dataset(engine="ray")`` and ``from_ray_dataset`` give.

The rows are blocks in Ray's object store, written by the Ray Data pipeline (``actors/ray_data.py``, one block per
Ray Data block of packing windows); the driver holds the blocks' references (opaque objects here: only ``actors/``
resolves them) and, per row, where it is and how many tokens take loss (12 bytes a row), never a row::

    block b              input_ids, labels (the targets), token_mask, document_ids?   [R_b, S]  (data_operators)
    StreamedData         blocks (references), block_of_row [N], row_in_block [N], label_tokens [N]
    .batch(indices, dp)  StreamedBatch: per data-parallel batch a BlockRows (which row of which of its blocks)
                         and the references it needs; the ranks read them from the object store, not the driver
    .split(fraction)     the last rows held out for evaluation, as a view of the same blocks
    .collect()           every row on the driver as PackedData (small data, tests); ids numbered through

Order (``block_batch_indices``, :mod:`raymoe.driver.batch_order`): each epoch shuffles the blocks, then the rows
inside each block, both seeded by ``seed + epoch``, so consecutive global batches read one or two blocks (not a
block per row) and a run resumed at a step draws exactly the batches the straight run drew, on any layout.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from raymoe.driver.fanout import split_batch_rows
from raymoe.driver.packing import DataReport, PackedData, held_out_rows
from raymoe.models.common.loss import IGNORE_INDEX
from raymoe.rank.contract import BlockRows

Fetch = Callable[[list[Any]], list[dict[str, np.ndarray]]]  # block references -> the blocks, on the driver


@dataclass(frozen=True)
class BlockStats:
    """What the driver keeps of one block: label tokens per row ``[R]`` (as ``train_step`` counts them: every
    target but a row's first), real tokens, the smallest and largest token id, and its windows' counts."""

    label_tokens: np.ndarray
    tokens: int
    min_id: int
    max_id: int
    examples: int
    truncated: int
    dropped: int
    window_sizes: tuple[int, ...]

    @classmethod
    def of_block(
        cls, block: dict[str, np.ndarray], counts: Sequence[dict[str, int]], sizes: Sequence[int]
    ) -> BlockStats:
        ids = block["input_ids"]
        return cls(
            label_tokens=(block["labels"][:, 1:] != IGNORE_INDEX).sum(axis=1).astype(np.int32),
            tokens=int(block["token_mask"].sum()),
            min_id=int(ids.min()) if ids.size else 0,
            max_id=int(ids.max()) if ids.size else -1,
            examples=sum(c["examples"] for c in counts),
            truncated=sum(c["truncated"] for c in counts),
            dropped=sum(c["dropped"] for c in counts),
            window_sizes=tuple(int(size) for size in sizes),
        )

    @property
    def rows(self) -> int:
        return int(self.label_tokens.shape[0])


@dataclass(frozen=True)
class StreamedBatch:
    """One global batch of a :class:`StreamedData`: each data-parallel batch's rows and the block references they
    come from (the same blocks for every rank of the batch); ``num_label_tokens`` of the whole batch."""

    rows: tuple[BlockRows, ...]
    blocks: tuple[tuple[Any, ...], ...]
    num_label_tokens: int
    seq_len: int

    @property
    def num_rows(self) -> int:
        return sum(rows.num_rows for rows in self.rows)


@dataclass(frozen=True, eq=False)
class StreamedData:
    """Rows in Ray's object store (see the module docstring); ``fetch(references) -> blocks`` reads blocks onto the
    driver, for :meth:`collect` only."""

    blocks: tuple[Any, ...]
    stats: tuple[BlockStats, ...]
    seq_len: int
    block_of_row: np.ndarray
    row_in_block: np.ndarray
    label_tokens: np.ndarray  # [N] int32: each row's label tokens, as train_step counts them
    fetch: Fetch = field(repr=False)
    has_labels: bool = False
    report: DataReport | None = None

    @classmethod
    def of_blocks(
        cls,
        blocks: Sequence[Any],
        stats: Sequence[BlockStats],
        seq_len: int,
        fetch: Fetch,
        *,
        has_labels: bool,
        report: DataReport | None = None,
    ) -> StreamedData:
        rows = np.asarray([s.rows for s in stats], dtype=np.int64)
        block_of_row = np.repeat(np.arange(len(stats), dtype=np.int32), rows)
        label_tokens = np.concatenate([s.label_tokens for s in stats]) if stats else np.zeros(0, np.int32)
        row_in_block = (
            np.concatenate([np.arange(r, dtype=np.int32) for r in rows]) if len(rows) else np.zeros(0, np.int32)
        )
        return cls(
            tuple(blocks), tuple(stats), seq_len, block_of_row, row_in_block, label_tokens, fetch, has_labels, report
        )

    # --- what the Trainer checks --------------------------------------------------------------

    @property
    def num_sequences(self) -> int:
        return int(self.block_of_row.shape[0])

    @property
    def num_label_tokens(self) -> int:
        return int(self.label_tokens.sum())

    @property
    def id_range(self) -> tuple[int, int]:
        """The smallest and largest token id of the blocks this view reads."""
        used = [self.stats[b] for b in np.unique(self.block_of_row)]
        return min((s.min_id for s in used), default=0), max((s.max_id for s in used), default=-1)

    # --- views and batches --------------------------------------------------------------------

    def view(self, rows: np.ndarray | slice) -> StreamedData:
        """The rows ``rows`` of this view (indices or a slice), over the same blocks."""
        return StreamedData(
            self.blocks,
            self.stats,
            self.seq_len,
            self.block_of_row[rows],
            self.row_in_block[rows],
            self.label_tokens[rows],
            self.fetch,
            self.has_labels,
            self.report,
        )

    def split(self, eval_fraction: float) -> tuple[StreamedData, StreamedData | None]:
        """The last ``eval_fraction`` of the rows (at least one) held out for evaluation, like ``PackedData.split``."""
        num_eval = held_out_rows(self.num_sequences, eval_fraction)
        if num_eval == 0:
            return self, None
        return self.view(slice(0, -num_eval)), self.view(slice(-num_eval, None))

    def batch(self, indices: torch.Tensor | np.ndarray, dp_size: int, blank: int = 0) -> StreamedBatch:
        """Global batch of this view's rows ``indices`` (then ``blank`` all-padding rows), split over ``dp_size``
        data-parallel batches as the fan-out splits a batch on the driver (TOPO-1)."""
        picked = np.asarray(indices, dtype=np.int64)
        blocks = np.concatenate([self.block_of_row[picked], np.full(blank, -1, np.int32)])
        rows = np.concatenate([self.row_in_block[picked], np.zeros(blank, np.int32)])
        split = split_batch_rows(len(blocks), dp_size)
        parts, refs = [], []
        fallback = blocks[:1] if len(picked) else self.block_of_row[:1]  # a batch of padding rows reads its shape
        for part in split.rows:
            mine = blocks[part.numpy()]
            used = np.unique(mine[mine >= 0]) if (mine >= 0).any() else fallback
            local = np.searchsorted(used, mine).astype(np.int32)
            parts.append(BlockRows(np.where(mine >= 0, local, -1), rows[part.numpy()]))
            refs.append(tuple(self.blocks[b] for b in used))
        tokens = int(self.label_tokens[picked].sum())
        return StreamedBatch(tuple(parts), tuple(refs), tokens, self.seq_len)

    def collect(self) -> PackedData:
        """Every row of this view on the driver (it reads every block it uses: for small data and tests). Document
        ids are numbered through the windows as the driver engine numbers them; labels are the targets."""
        used = np.unique(self.block_of_row)
        fetched = dict(zip(used.tolist(), self.fetch([self.blocks[b] for b in used]), strict=True))
        first_example = np.cumsum([0, *(s.examples for s in self.stats)])
        for b, block in fetched.items():  # a block numbers its examples from 0; the dataset numbers them through
            if "document_ids" in block:
                ids = block["document_ids"]
                fetched[b] = {**block, "document_ids": np.where(ids >= 0, ids + first_example[b], ids)}

        def column(name: str) -> np.ndarray:
            picks = zip(self.block_of_row.tolist(), self.row_in_block.tolist(), strict=True)
            return np.stack([fetched[b][name][r] for b, r in picks])

        ids = torch.from_numpy(column("input_ids").astype(np.int64))
        mask = torch.from_numpy(column("token_mask").astype(np.int64))
        labels = torch.from_numpy(column("labels").astype(np.int64)) if self.has_labels else None
        documents = None
        if all("document_ids" in block for block in fetched.values()):
            documents = torch.from_numpy(column("document_ids").astype(np.int64))
        return PackedData(ids, mask, labels, documents, report=self.report)
