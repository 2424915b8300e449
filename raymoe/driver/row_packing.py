"""One packing window of tokenized examples into rows of ``seq_len`` (numpy only): the algorithm both engines run.

``pack_window_rows`` packs consecutive examples as :mod:`raymoe.driver.packing` describes (text back to back,
conversations whole, best-fit decreasing; ``overlong`` first); :func:`raymoe.driver.packing.pack_examples` calls it
on the whole dataset (``pack_window=None``) or on each window of ``pack_window`` examples, and the Ray Data pack
operator (:mod:`raymoe.driver.data_operators`) calls it on each window on the cluster. Shapes::

    examples   ids [T], labels [T] bool or None, offsets [E + 1]       (a TokenizedExamples window)
    rows       input_ids, attention_mask, labels, document_ids [R, seq_len] int64
               document_ids number the window's kept examples from 0 (-1 on padding)
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Literal

import numpy as np

from raymoe.driver.tokenized import TokenizedExamples
from raymoe.models.common.loss import IGNORE_INDEX

Packing = Literal["document", "plain"]
Overlong = Literal["error", "truncate", "drop"]


@dataclass(frozen=True)
class PackedWindow:
    """A window's rows ``[R, seq_len]`` (``labels`` None for text, ``document_ids`` None for plain packing) and what
    packing it kept, truncated and dropped."""

    input_ids: np.ndarray
    attention_mask: np.ndarray
    labels: np.ndarray | None
    document_ids: np.ndarray | None
    examples: int
    truncated: int = 0
    dropped: int = 0

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])


def check_pack_options(packing: object, overlong: object) -> None:
    if packing not in ("document", "plain"):
        raise ValueError(f"packing={packing!r}: choose 'document' or 'plain'")
    if overlong not in ("error", "truncate", "drop"):
        raise ValueError(f"overlong={overlong!r}: choose 'error', 'truncate' or 'drop'")


def check_pack_window(pack_window: object) -> int | None:
    """``pack_window``: None (the whole dataset is one window) or an int >= 1 (examples per window)."""
    if pack_window is None:
        return None
    if isinstance(pack_window, bool) or not isinstance(pack_window, int) or pack_window < 1:
        raise ValueError(f"pack_window={pack_window!r} must be None (the whole dataset) or an int >= 1 (examples)")
    return pack_window


def pack_window_rows(
    examples: TokenizedExamples, seq_len: int, packing: Packing, overlong: Overlong, pad_token_id: int = 0
) -> PackedWindow:
    """The rows of one window of examples (see the module docstring); a window left empty gives 0 rows."""
    starts, lengths, truncated, dropped = _kept(examples, seq_len, overlong)
    total = int(lengths.sum())
    ends = np.cumsum(lengths)
    # Every kept token's index in the examples' arrays, in order.
    index = np.arange(total, dtype=np.int64) + np.repeat(starts - (ends - lengths), lengths)
    ids = examples.ids[index].astype(np.int64)
    labels = np.where(examples.labels[index], ids, IGNORE_INDEX) if examples.labels is not None else None
    documents = np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)
    if examples.kind == "chat" and packing == "document" and len(lengths):
        rows = _pack_whole(ids, labels, documents, lengths, seq_len, pad_token_id)
    else:
        rows = cut_stream(ids, labels, documents if packing == "document" else None, seq_len, pad_token_id)
    return PackedWindow(*rows, examples=len(lengths), truncated=truncated, dropped=dropped)


def _kept(examples: TokenizedExamples, seq_len: int, overlong: Overlong) -> tuple[np.ndarray, np.ndarray, int, int]:
    """``(starts, lengths, truncated, dropped)`` of the examples packing keeps: conversations longer than ``seq_len``
    an error, cut to ``seq_len`` or left out, as ``overlong`` says."""
    lengths = examples.lengths
    starts = examples.offsets[:-1]
    truncated = dropped = 0
    keep = np.ones(len(lengths), dtype=bool)
    if examples.kind == "chat":
        long = np.flatnonzero(lengths > seq_len)
        if len(long) and overlong == "error":
            first = int(long[0])
            raise ValueError(
                f"{examples.where(first)} is {int(lengths[first])} tokens long, more than seq_len={seq_len} "
                f"({len(long)} of {len(lengths)} conversations are); raise --seq-len, or pass --overlong truncate "
                "(keep the first seq_len tokens) or --overlong drop"
            )
        if overlong == "drop":
            keep[long] = False
            dropped = len(long)
        elif overlong == "truncate":
            assert examples.labels is not None
            answered = np.array([examples.labels[starts[i] : starts[i] + seq_len].any() for i in long], dtype=bool)
            keep[long[~answered]] = False  # nothing of the answer fits: nothing to train on
            dropped = int((~answered).sum())
            truncated = int(answered.sum())
        lengths = np.minimum(lengths, seq_len)
    return starts[keep], lengths[keep], truncated, dropped


Rows = tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]


def cut_stream(
    ids: np.ndarray, labels: np.ndarray | None, documents: np.ndarray | None, seq_len: int, pad_token_id: int
) -> Rows:
    """A token stream ``[T]`` cut into rows ``[R, seq_len]``, the last one right-padded (dropped if it holds one token
    only, which has no next-token target)."""
    total = len(ids)
    num_rows = -(-total // seq_len)
    size = num_rows * seq_len

    def filled(values: np.ndarray, pad: int) -> np.ndarray:
        out = np.full(size, pad, dtype=np.int64)
        out[:total] = values
        return out.reshape(num_rows, seq_len)

    mask = filled(np.ones(total, dtype=np.int64), 0)
    rows = num_rows - 1 if total % seq_len == 1 else num_rows
    return (
        filled(ids, pad_token_id)[:rows],
        mask[:rows],
        filled(labels, IGNORE_INDEX)[:rows] if labels is not None else None,
        filled(documents, -1)[:rows] if documents is not None else None,
    )


def _pack_whole(
    ids: np.ndarray,
    labels: np.ndarray | None,
    documents: np.ndarray,
    lengths: np.ndarray,
    seq_len: int,
    pad_token_id: int,
) -> Rows:
    """Whole examples (each ``<= seq_len``) into rows, best-fit decreasing; rows ordered by their first example."""
    row_of, column_of, num_rows = _best_fit_decreasing(lengths, seq_len)
    first_example = np.full(num_rows, len(lengths), dtype=np.int64)
    np.minimum.at(first_example, row_of, np.arange(len(lengths)))
    order = np.argsort(first_example, kind="stable")
    rank = np.empty(num_rows, dtype=np.int64)
    rank[order] = np.arange(num_rows)
    ends = np.cumsum(lengths)
    within = np.arange(int(ends[-1]), dtype=np.int64) - np.repeat(ends - lengths, lengths)
    target = np.repeat(rank[row_of] * seq_len + column_of, lengths) + within
    size = num_rows * seq_len

    def placed(values: np.ndarray, pad: int) -> np.ndarray:
        out = np.full(size, pad, dtype=np.int64)
        out[target] = values
        return out.reshape(num_rows, seq_len)

    return (
        placed(ids, pad_token_id),
        placed(np.ones(len(ids), dtype=np.int64), 0),
        placed(labels, IGNORE_INDEX) if labels is not None else None,
        placed(documents, -1),
    )


def _best_fit_decreasing(lengths: np.ndarray, capacity: int) -> tuple[np.ndarray, np.ndarray, int]:
    """``(row, column, rows)``: each length placed into the row with the least room that still fits it, longest
    first. Rows with room ``r`` are kept in a bucket per ``r`` and the distinct rooms in a sorted list, so a
    placement costs a bisection (not a scan of the rows)."""
    row_of = np.empty(len(lengths), dtype=np.int64)
    column_of = np.empty(len(lengths), dtype=np.int64)
    rooms: list[int] = []  # sorted distinct rooms with at least one row
    rows_with: dict[int, list[int]] = {}
    used: list[int] = []  # tokens placed in each row
    for example in np.argsort(-lengths, kind="stable").tolist():
        length = int(lengths[example])
        at = bisect.bisect_left(rooms, length)
        if at < len(rooms):
            room = rooms[at]
            row = rows_with[room].pop()
            if not rows_with[room]:
                del rows_with[room]
                rooms.pop(at)
        else:
            row, room = len(used), capacity
            used.append(0)
        row_of[example], column_of[example] = row, used[row]
        used[row] += length
        left = room - length
        if left > 0:
            if left not in rows_with:
                bisect.insort(rooms, left)
                rows_with[left] = []
            rows_with[left].append(row)
    return row_of, column_of, len(used)
