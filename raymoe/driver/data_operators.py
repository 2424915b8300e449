"""The Ray Data engine's two operators, pure (no Ray): tokenize a batch of records, pack a window of examples.

Both take and give ``pyarrow.Table`` batches (Ray Data's ``batch_format="pyarrow"``: records stay Arrow, so a
Parquet or ``datasets`` row is ``to_pylist()``-ed exactly as the driver engine reads it)::

    TokenizeOperator   records (decoding: "json_lines" column text = one JSONL line each; "text_file" column
                       bytes = a whole file, one document; "table": each row a record)
                       -> ids: large_list<int32> [E], labels: large_list<bool> [E] (chat only)
    PackOperator       a window of consecutive examples (those columns)
                       -> ONE row: input_ids, attention_mask, labels?, document_ids?: large_list<int64>
                          (the window's R rows flattened, R * seq_len), num_rows, examples, truncated, dropped
    BlockOperator      a Ray Data block of those rows (its windows, in order) -> the block of rows the ranks read
                       (input_ids, the targets, token_mask, document_ids: [R, seq_len]) and its BlockStats

Tokenizing is :meth:`ExampleEncoder.encode`, packing :func:`raymoe.driver.row_packing.pack_window_rows`: the
same code as the driver engine. Ray Data keeps no line numbers, so errors name a record by its place in its
batch ("batch record 3") and an example by its place in its packing window ("window example 3").
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor

from raymoe.driver.example_encoder import ExampleEncoder
from raymoe.driver.packing import PackedData
from raymoe.driver.row_packing import Overlong, PackedWindow, Packing, pack_window_rows
from raymoe.driver.streamed_data import BlockStats
from raymoe.driver.tokenized import TokenizedExamples

Decoding = Literal["json_lines", "text_file", "table"]
RAY_PACK_WINDOW = 10_000  # examples per packing window of the Ray engine (bounded: a window is packed in one task)
ROWS = ("input_ids", "attention_mask", "labels", "document_ids")


def decode_records(table: Any, decoding: Decoding) -> list[Any]:
    """A batch's records, as the driver engine's sources give them (:mod:`raymoe.driver.records`)."""
    if decoding == "json_lines":
        lines = table.column("text").to_pylist()
        return [json.loads(line) for line in lines if line.strip()]
    if decoding == "text_file":
        return [raw.decode("utf-8") for raw in table.column("bytes").to_pylist()]
    return list(table.to_pylist())


class TokenizeOperator:
    """Records -> tokenized examples (see the module docstring); picklable, like its encoder."""

    def __init__(self, encoder: ExampleEncoder, decoding: Decoding) -> None:
        self.encoder = encoder
        self.decoding = decoding

    @staticmethod
    def records(table: Any, decoding: Decoding) -> list[Any]:
        return decode_records(table, decoding)

    def __call__(self, table: Any) -> Any:
        pa: Any = importlib.import_module("pyarrow")

        records = decode_records(table, self.decoding)
        chunk = self.encoder.encode(list(enumerate(records, start=1)))
        columns = {"ids": _lists(chunk.ids, pa.int32())}
        if chunk.labels is not None:
            columns["labels"] = _lists(chunk.labels, pa.bool_())
        return pa.table(columns)


class PackOperator:
    """A window of tokenized examples -> one row holding its packed rows (see the module docstring)."""

    def __init__(self, kind: str, source: str, seq_len: int, packing: Packing, overlong: Overlong) -> None:
        self.kind, self.source, self.seq_len = kind, source, seq_len
        self.packing: Packing = packing
        self.overlong: Overlong = overlong

    def __call__(self, table: Any) -> Any:
        pa: Any = importlib.import_module("pyarrow")

        window = pack_window_rows(self.examples_of(table), self.seq_len, self.packing, self.overlong)
        columns: dict[str, Any] = {
            name: _lists([rows.reshape(-1)], pa.int64()) for name in ROWS if (rows := getattr(window, name)) is not None
        }
        for name in ("num_rows", "examples", "truncated", "dropped"):
            columns[name] = pa.array([int(getattr(window, name))], pa.int64())
        columns["window_size"] = pa.array([table.num_rows], pa.int64())
        return pa.table(columns)

    def examples_of(self, table: Any) -> TokenizedExamples:
        ids, lengths = _flat(table.column("ids"))
        offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        labels = _flat(table.column("labels"))[0].astype(bool) if "labels" in table.column_names else None
        rows = np.arange(1, len(lengths) + 1, dtype=np.int64)
        return TokenizedExamples(self.kind, ids, labels, offsets, rows, self.source, "window example")  # type: ignore[arg-type]


def _rows(values: list[int] | None, seq_len: int) -> np.ndarray | None:
    return None if values is None else np.asarray(values, dtype=np.int64).reshape(-1, seq_len)


def _lists(arrays: list[np.ndarray], value_type: Any) -> Any:
    pa: Any = importlib.import_module("pyarrow")

    offsets = np.zeros(len(arrays) + 1, dtype=np.int64)
    np.cumsum([len(a) for a in arrays], out=offsets[1:])
    values = np.concatenate(arrays) if arrays else np.zeros(0)
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values, value_type))


def _flat(column: Any) -> tuple[np.ndarray, np.ndarray]:
    pc: Any = importlib.import_module("pyarrow.compute")

    combined = column.combine_chunks()
    lengths = pc.list_value_length(combined).to_numpy(zero_copy_only=False).astype(np.int64)
    return pc.list_flatten(combined).to_numpy(zero_copy_only=False), lengths


class BlockOperator:
    """The pack operator's rows of one Ray Data block (its windows, in order) -> the block the ranks read and the
    statistics the driver keeps (:mod:`raymoe.driver.streamed_data`)::

        block   input_ids int32, labels int32 (the targets train_step trains on: -100 on padding, on document
                starts and where loss_on leaves none), token_mask bool, document_ids int32 (document packing):
                [R, seq_len]; document ids number the block's examples from 0 (-1 on padding)
        stats   BlockStats: rows, label tokens per row, tokens, the largest id, each window's counts
    """

    def __init__(self, seq_len: int) -> None:
        self.seq_len = seq_len

    def __call__(self, table: Any) -> tuple[dict[str, np.ndarray], BlockStats]:
        rows = table.to_pylist()
        windows = [_window(row, self.seq_len) for row in rows]
        block = block_of_windows(windows, self.seq_len)
        return block, BlockStats.of_block(block, [_counts(row) for row in rows], [row["window_size"] for row in rows])


def block_of_windows(windows: list[PackedWindow], seq_len: int) -> dict[str, np.ndarray]:
    """Windows' rows one after another as the ranks' block (see :class:`BlockOperator`)."""
    if not windows:
        empty = np.zeros((0, seq_len), dtype=np.int32)
        return {"input_ids": empty, "labels": empty, "token_mask": empty.astype(bool)}
    ids, mask = (torch.from_numpy(np.concatenate([getattr(w, n) for w in windows])) for n in ROWS[:2])
    data = PackedData(ids, mask, _joined(windows, "labels"), _joined(windows, "document_ids"))
    block = {
        "input_ids": data.input_ids.numpy().astype(np.int32),
        "labels": data.targets().numpy().astype(np.int32),
        "token_mask": (data.attention_mask != 0).numpy(),
    }
    if data.document_ids is not None:
        block["document_ids"] = data.document_ids.numpy().astype(np.int32)
    return block


def _joined(windows: list[PackedWindow], name: str) -> Tensor | None:
    """The windows' ``name`` rows one after another; document ids go on from the previous window's."""
    parts = [getattr(window, name) for window in windows]
    if parts[0] is None:
        return None
    if name == "document_ids":
        firsts = np.cumsum([0, *(window.examples for window in windows)])
        parts = [np.where(part >= 0, part + first, part) for part, first in zip(parts, firsts, strict=False)]
    return torch.from_numpy(np.concatenate(parts))


def _window(row: dict[str, Any], seq_len: int) -> PackedWindow:
    ids, mask, labels, documents = (_rows(row.get(name), seq_len) for name in ROWS)
    assert ids is not None and mask is not None
    return PackedWindow(ids, mask, labels, documents, **_counts(row))


def _counts(row: dict[str, Any]) -> dict[str, int]:
    return {name: int(row[name]) for name in ("examples", "truncated", "dropped")}
