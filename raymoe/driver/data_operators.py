"""The Ray Data engine's two operators, pure (no Ray): tokenize a batch of records, pack a window of examples.

Both take and give ``pyarrow.Table`` batches (Ray Data's ``batch_format="pyarrow"``: records stay Arrow, so a
Parquet or ``datasets`` row is ``to_pylist()``-ed exactly as the driver engine reads it)::

    TokenizeOperator   records (decoding: "json_lines" column text = one JSONL line each; "text_file" column
                       bytes = a whole file, one document; "table": each row a record)
                       -> ids: large_list<int32> [E], labels: large_list<bool> [E] (chat only)
    PackOperator       a window of consecutive examples (those columns)
                       -> ONE row: input_ids, attention_mask, labels?, document_ids?: large_list<int64>
                          (the window's R rows flattened, R * seq_len), num_rows, examples, truncated, dropped
    packed_windows     those rows, on the driver -> PackedWindow list (raymoe.driver.packing.packed_of_windows)

Tokenizing is :meth:`ExampleEncoder.encode`, packing :func:`raymoe.driver.row_packing.pack_window_rows`: the
same code as the driver engine. Ray Data keeps no line numbers, so errors name a record by its place in its
batch ("batch record 3") and an example by its place in its packing window ("window example 3").
"""

from __future__ import annotations

import importlib
import json
from typing import Any, Literal

import numpy as np

from raymoe.driver.example_encoder import ExampleEncoder
from raymoe.driver.row_packing import Overlong, PackedWindow, Packing, pack_window_rows
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


def packed_windows(tables: list[Any], seq_len: int, pack_window: int) -> list[PackedWindow]:
    """The pack operator's rows (one per window, in order) as windows; every window but the last must hold
    ``pack_window`` examples (a ``RuntimeError`` if Ray Data cut them otherwise: the rows would differ)."""
    windows: list[PackedWindow] = []
    sizes: list[int] = []
    for table in tables:
        for row in table.to_pylist():
            ids, mask, labels, documents = (_rows(row.get(name), seq_len) for name in ROWS)
            assert ids is not None and mask is not None
            counts = {name: int(row[name]) for name in ("examples", "truncated", "dropped")}
            windows.append(PackedWindow(ids, mask, labels, documents, **counts))
            sizes.append(int(row["window_size"]))
    if any(size != pack_window for size in sizes[:-1]):
        raise RuntimeError(f"Ray Data gave packing windows of {sorted(set(sizes[:-1]))} examples, not {pack_window}")
    return windows


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
