"""The Ray Data engine's pipeline (issue 35): read records on the cluster, tokenize and pack them with the pure
operators of :mod:`raymoe.driver.data_operators` (handed in by ``raymoe/api.py``), and bring the packed rows back.

    read        .jsonl: read_text (each line parsed by the tokenize operator, as the driver engine parses it)
                .parquet: read_parquet; a datasets.Dataset: from_huggingface; other: read_binary_files (one
                document per file); local paths and URLs are passed to Ray Data as they are
    tokenize    map_batches(tokenize, batch_format="pyarrow")
    window      repartition(target_num_rows_per_block=pack_window, strict=True): blocks of exactly pack_window
    pack        map_batches(pack, batch_size=pack_window): one row per window
    collect     iter_batches on the driver, in order (the pipeline's DataContext: execution_options.preserve_order)

The driver still receives every packed row in this version; streaming each data-parallel group's share to its
ranks without the driver is not there yet.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray
import ray.data

Operator = Callable[[Any], Any]


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


def tokenize_and_pack(
    records: ray.data.Dataset, tokenize: Operator, pack: Operator, pack_window: int, progress: bool
) -> list[Any]:
    """The pack operator's output tables, in order (one row per packing window)."""
    packed = (
        records.map_batches(tokenize, batch_format="pyarrow", batch_size=1000)
        .repartition(target_num_rows_per_block=pack_window, strict=True)
        .map_batches(pack, batch_format="pyarrow", batch_size=pack_window)
    )
    context = packed.context  # this dataset's own copy: the executor reads it, the user's dataset is left alone
    context.execution_options.preserve_order = True
    context.enable_progress_bars = progress
    return [batch for batch in packed.iter_batches(batch_format="pyarrow", batch_size=None)]


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
