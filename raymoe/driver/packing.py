"""Token sequences into fixed-length rows for training: ``PackedData`` and the two ways of packing.

Packing (``packing=``) makes rows of ``seq_len`` tokens; a row's tail is right-padded with
``attention_mask == 0`` (no loss)::

    "document" (default)   documents keep their ids (``document_ids``): positions restart at each one and
                           attention stays inside it (block-diagonal causal), so a packed document trains as
                           it would alone; its first token is no target of the previous document.
                           Text documents (each + eos) are cut into rows back to back (a long one continues
                           in the next row, as a new document there); conversations are never cut: each is
                           placed whole into the fullest row it fits (best-fit decreasing), rows ordered by
                           their first conversation
    "plain"                the stream cut into rows, attention crossing document boundaries inside a row

    doc A (5) | eos | doc B (9) | eos | doc C (3) | eos        seq_len = 8, text
    [A A A A A e B B] [B B B B B B B e] [C C C e p p p p]     p = pad, mask 0

A conversation longer than ``seq_len`` is an error naming its file and row unless ``overlong`` says
``"truncate"`` (keep its first ``seq_len`` tokens; one with no answer token left is dropped) or ``"drop"``;
either is counted in :attr:`PackedData.report`. (How a model attends inside packed rows is
:mod:`raymoe.models.common.packing`.)

``pack_window`` (examples per packing window) packs each run of that many consecutive tokenized examples alone
(:mod:`raymoe.driver.row_packing`, the one algorithm) and puts the windows' rows one after another: no row holds
two windows' examples, and best-fit looks for room only inside its window. None (the default here) is one window,
the whole dataset; the Ray Data engine packs windows on the cluster (:mod:`raymoe.driver.data_operators`, default
10 000 examples), and the same ``pack_window`` gives the same rows on either engine.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from raymoe.driver.batch import document_starts
from raymoe.driver.row_packing import (
    Overlong,
    PackedWindow,
    Packing,
    check_pack_options,
    check_pack_window,
    cut_stream,
    pack_window_rows,
)
from raymoe.driver.tokenized import TokenizedExamples
from raymoe.models.common.loss import IGNORE_INDEX, count_label_tokens


@dataclass(frozen=True)
class DataReport:
    """How a dataset became rows: what was read, what was cut or left out, and what the tokenization cost."""

    source: str
    kind: str
    packing: str
    examples: int
    truncated: int = 0
    dropped: int = 0
    tokens: int = 0
    label_tokens: int = 0
    rows: int = 0
    seq_len: int = 0
    from_cache: bool = False
    cache: Path | None = None
    tokenize_s: float = 0.0

    def summary(self) -> str:
        kinds = {"chat": "conversations", "text": "documents"}
        parts = [f"{self.examples} {kinds.get(self.kind, 'examples')} -> {self.rows} rows of {self.seq_len} tokens"]
        parts.append(f"{self.packing} packing, {self.tokens / max(1, self.rows * self.seq_len):.0%} filled")
        parts.append(f"{self.label_tokens} label tokens")
        if self.truncated:
            parts.append(f"{self.truncated} truncated to seq_len")
        if self.dropped:
            parts.append(f"{self.dropped} longer than seq_len dropped")
        if self.cache is not None:
            parts.append(
                f"tokenized {'from the cache' if self.from_cache else 'and cached'} in {self.tokenize_s:.1f} s"
            )
        return "; ".join(parts)


@dataclass(frozen=True)
class PackedData:
    """Rows of token ids ``input_ids [N, S]`` and ``attention_mask [N, S]`` (0 = right padding, no loss); for
    chat data ``labels [N, S]`` (-100: no loss; None: every real token is a label), for document packing
    ``document_ids [N, S]`` (a run of equal ids is one document, see the module docstring)."""

    input_ids: Tensor
    attention_mask: Tensor
    labels: Tensor | None = None
    document_ids: Tensor | None = None
    report: DataReport | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.input_ids.dim() != 2 or self.input_ids.shape != self.attention_mask.shape:
            raise ValueError(
                f"PackedData: input_ids {tuple(self.input_ids.shape)} and attention_mask "
                f"{tuple(self.attention_mask.shape)} must both be [num_sequences, seq_len]"
            )
        for name in ("labels", "document_ids"):
            value = getattr(self, name)
            if value is not None and value.shape != self.input_ids.shape:
                raise ValueError(f"PackedData: {name} {tuple(value.shape)} must be shaped like input_ids")

    @classmethod
    def from_rows(cls, input_ids: Tensor | np.ndarray | Sequence[Sequence[int]]) -> PackedData:
        """Already-packed rows ``[N, S]`` of token ids; every position takes a loss."""
        ids = torch.as_tensor(np.asarray(input_ids)) if not isinstance(input_ids, Tensor) else input_ids
        if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(
                f"pre-tokenized rows must be a 2-D integer array [N, S], got {ids.dtype} {tuple(ids.shape)}"
            )
        ids = ids.to(torch.int64)
        return cls(ids, torch.ones_like(ids))

    @classmethod
    def of(cls, data: PackedData | Tensor | np.ndarray) -> PackedData:
        """``data`` as it is, or 2-D rows of token ids as :meth:`from_rows` (what the Trainer takes as data)."""
        if isinstance(data, PackedData):
            return data
        if isinstance(data, Tensor | np.ndarray):
            return cls.from_rows(data)
        raise ValueError(
            f"training data must be raymoe.PackedData or a 2-D array of token ids, got {type(data).__name__}"
        )

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        """Positions that hold data (mask 1)."""
        return int(self.attention_mask.sum())

    @property
    def num_label_tokens(self) -> int:
        """Targets the loss averages over, counted as ``train_step`` counts them (``num_tokens`` of its metrics)."""
        return count_label_tokens(self.targets())

    def targets(self) -> Tensor:
        """The labels ``train_step`` trains on: ``labels`` (or the ids), -100 on padding and document starts."""
        targets = (self.labels if self.labels is not None else self.input_ids).masked_fill(
            self.attention_mask == 0, IGNORE_INDEX
        )
        if self.document_ids is not None:
            targets = targets.masked_fill(document_starts(self.document_ids), IGNORE_INDEX)
        return targets

    def rows(self, index: Tensor | slice) -> PackedData:
        def pick(tensor: Tensor | None) -> Tensor | None:
            return tensor[index] if tensor is not None else None

        return PackedData(self.input_ids[index], self.attention_mask[index], pick(self.labels), pick(self.document_ids))

    def with_blank_rows(self, count: int) -> PackedData:
        """These rows and ``count`` all-padding rows after them (mask 0: they add no token)."""
        if count <= 0:
            return self
        blank = torch.zeros((count, self.seq_len), dtype=torch.int64)

        def extend(tensor: Tensor | None, fill: int) -> Tensor | None:
            return None if tensor is None else torch.cat([tensor, blank.to(tensor.dtype).fill_(fill)])

        return PackedData(
            torch.cat([self.input_ids, blank]),
            torch.cat([self.attention_mask, blank]),
            extend(self.labels, IGNORE_INDEX),
            extend(self.document_ids, -1),
        )

    def split(self, eval_fraction: float) -> tuple[PackedData, PackedData | None]:
        """The last ``eval_fraction`` of the rows (at least one) held out for evaluation; None if 0."""
        num_eval = held_out_rows(self.num_sequences, eval_fraction)
        if num_eval == 0:
            return self, None
        return self.rows(slice(0, -num_eval)), self.rows(slice(-num_eval, None))


def held_out_rows(num_rows: int, eval_fraction: float) -> int:
    """How many of ``num_rows`` rows ``eval_fraction`` holds out for evaluation: at least one unless it is 0, and
    never all (a ``ValueError``)."""
    if not 0 <= eval_fraction < 1:
        raise ValueError(f"eval_fraction={eval_fraction!r} must be in [0, 1)")
    if eval_fraction == 0:
        return 0
    num_eval = max(1, round(num_rows * eval_fraction))
    if num_eval >= num_rows:
        raise ValueError(
            f"eval_fraction={eval_fraction} of {num_rows} sequences leaves none to train on; "
            "use more data or a smaller eval_fraction"
        )
    return num_eval


def check_seq_len(seq_len: object) -> int:
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 2:
        raise ValueError(f"seq_len={seq_len!r} must be an int >= 2 (a row needs an input and a next token)")
    return seq_len


def pack_token_stream(
    documents: Iterable[Sequence[int]], seq_len: int, eos_token_id: int | None, pad_token_id: int = 0
) -> PackedData:
    """Token documents as one stream (each followed by ``eos_token_id``), cut into ``[N, seq_len]`` rows
    (plain packing: attention crosses the documents of a row).

    The last row is right-padded with ``pad_token_id`` (any valid id: padding has mask 0, takes no
    loss and, being on the right, is attended by no real token).
    """
    check_seq_len(seq_len)
    separator = [eos_token_id] if eos_token_id is not None else []
    stream = [token for doc in documents if len(doc) for token in (*doc, *separator)]
    if len(stream) < 2:
        raise ValueError("the dataset is empty: its documents hold fewer than 2 tokens")
    ids, mask, _, _ = cut_stream(np.asarray(stream, dtype=np.int64), None, None, seq_len, pad_token_id)
    return PackedData(torch.from_numpy(ids), torch.from_numpy(mask))


def pack_examples(
    examples: TokenizedExamples,
    seq_len: int,
    *,
    packing: Packing = "document",
    overlong: Overlong = "error",
    pad_token_id: int = 0,
    pack_window: int | None = None,
) -> PackedData:
    """Tokenized examples as rows of ``seq_len`` (see the module docstring for ``packing``, ``overlong`` and
    ``pack_window``): each window of ``pack_window`` consecutive examples packed alone
    (:func:`~raymoe.driver.row_packing.pack_window_rows`), or the whole dataset as one window (None)."""
    check_seq_len(seq_len)
    check_pack_options(packing, overlong)
    window = check_pack_window(pack_window)
    count = examples.num_examples
    windows = [examples] if window is None else [examples.window(at, at + window) for at in range(0, count, window)]
    return packed_of_windows(
        [pack_window_rows(part, seq_len, packing, overlong, pad_token_id) for part in windows],
        seq_len,
        DataReport(
            examples.source, examples.kind, packing, 0, from_cache=examples.from_cache, cache=examples.cache,
            tokenize_s=examples.seconds,
        ),
    )  # fmt: skip


def packed_of_windows(windows: Sequence[PackedWindow], seq_len: int, report: DataReport) -> PackedData:
    """The windows' rows one after another, in order, as one ``PackedData`` [sum R, seq_len]; a window's
    ``document_ids`` go on from the previous window's, so every kept example has its own id. ``report`` gives the
    source, kind, packing and tokenization; the counts are filled in here."""
    examples = sum(window.examples for window in windows)
    if examples == 0 or sum(int(window.attention_mask.sum()) for window in windows) < 2:
        raise ValueError(f"{report.source} is empty: after dropping what exceeds seq_len={seq_len}, nothing is left")
    first_document = np.cumsum([0, *(window.examples for window in windows)])

    def joined(name: str) -> Tensor | None:
        parts = [getattr(window, name) for window in windows]
        if parts[0] is None:
            return None
        if name == "document_ids":
            parts = [
                np.where(part >= 0, part + first, part) for part, first in zip(parts, first_document, strict=False)
            ]
        return torch.from_numpy(np.concatenate(parts).reshape(-1, seq_len))

    ids, mask = joined("input_ids"), joined("attention_mask")
    assert ids is not None and mask is not None
    data = PackedData(ids, mask, joined("labels"), joined("document_ids"))
    counts = replace(
        report,
        examples=examples,
        truncated=sum(window.truncated for window in windows),
        dropped=sum(window.dropped for window in windows),
        tokens=data.num_tokens,
        label_tokens=data.num_label_tokens,
        rows=data.num_sequences,
        seq_len=seq_len,
    )
    return replace(data, report=counts)
