"""The Ray Data engine's pipeline: read records on the cluster, tokenize and pack them with the pure
operators of :mod:`raymoe.driver.data_operators` (handed in by ``raymoe/api.py``), and keep the packed rows in the
object store, where the ranks read them.

    read        .jsonl: read_text (each line parsed by the tokenize operator, as the driver engine parses it)
                .parquet: read_parquet; a datasets.Dataset: from_huggingface; other: read_binary_files (one
                document per file); local paths and URLs are passed to Ray Data as they are
    tokenize    map_batches(tokenize, batch_format="pyarrow")
    window      repartition(target_num_rows_per_block=pack_window, strict=True): blocks of exactly pack_window
    pack        map_batches(pack, batch_size=pack_window): one row per window
    blocks      one task per Ray Data block, in order (the pipeline's DataContext: execution_options.preserve_order),
                where the block is: the block operator turns its windows into the rows the ranks read; the rows
                stay in the object store, their references and the blocks' statistics come to the driver
                (raymoe.driver.streamed_data.StreamedData); the ranks read their rows there (actors/rank.py)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import ray.data

Operator = Callable[[Any], Any]
BlockOperator = Callable[[Any], tuple[Any, Any]]


def read_records(path: str | None, fmt: str, dataset: Any = None) -> ray.data.Dataset:
    """The records of ``path`` (``fmt``: "jsonl", "parquet", "text") or of a ``datasets.Dataset`` ("datasets")."""
    _connect()
    if fmt == "datasets":
        return ray.data.from_huggingface(dataset)
    assert path is not None
    if fmt == "jsonl":
        return ray.data.read_text(path)
    if fmt == "parquet":
        return ray.data.read_parquet(path)
    return ray.data.read_binary_files(path)


def first_batch(records: ray.data.Dataset) -> Any:
    """The first record as a one-row pyarrow table (None for an empty dataset)."""
    for batch in records.limit(1).iter_batches(batch_format="pyarrow", batch_size=1):
        return batch
    return None


def stream_blocks(
    records: ray.data.Dataset,
    tokenize: Operator,
    pack: Operator,
    to_block: BlockOperator,
    pack_window: int,
    progress: bool,
) -> tuple[list[Any], list[Any]]:
    """Each Ray Data block of packed windows, in order, as a block of rows in the object store (``to_block`` run
    as one task per block, where the block is): the rows' references and the blocks' statistics. Only the
    statistics come to this process."""
    packed = (
        records.map_batches(tokenize, batch_format="pyarrow", batch_size=1000)
        .repartition(target_num_rows_per_block=pack_window, strict=True)
        .map_batches(pack, batch_format="pyarrow", batch_size=pack_window)
    )
    context = packed.context  # this dataset's own copy: the executor reads it, the user's dataset is left alone
    context.execution_options.preserve_order = True
    context.enable_progress_bars = progress
    blocks, stats = [], []
    for bundle in packed.iter_internal_ref_bundles():
        for entry, piece in zip(bundle.blocks, bundle.slices, strict=True):
            span = None if piece is None else (piece.start_offset, piece.end_offset)
            made: Any = _to_block.options(num_returns=2).remote(to_block, entry.ref, span)
            blocks.append(made[0])
            stats.append(made[1])
    return blocks, ray.get(stats)


@ray.remote(num_cpus=0.5)
def _to_block(to_block: BlockOperator, table: Any, span: tuple[int, int] | None) -> tuple[Any, Any]:
    if span is not None:
        table = table.slice(span[0], span[1] - span[0])
    return to_block(table)


def fetch(blocks: list[Any]) -> list[Any]:
    """Blocks read onto this process (``StreamedData.collect``)."""
    return list(ray.get(blocks))


def unwrap(error: BaseException) -> BaseException:
    """A ValueError raised inside an operator, out of Ray's wrapping (else ``error`` itself)."""
    cause: BaseException | None = error
    while cause is not None:
        if isinstance(cause, ValueError) and not isinstance(cause, ray.exceptions.RayError):
            return cause
        cause = cause.__cause__
    return error


def _connect() -> None:
    if not ray.is_initialized():
        from actors.cluster import connect

        connect(num_ranks=1, cpus_per_rank=1.0)
