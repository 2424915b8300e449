"""Dataset records on the driver: JSONL lines, Parquet rows, a text file, or a Hugging Face ``datasets`` split, read
in batches (never the whole source at once) and recognised as text documents or conversations.

    source                    how it is read                               row numbers in errors
    .jsonl                    line by line                                 line numbers (1 = first line)
    .parquet                  row group by row group (pyarrow)             row numbers (1 = first row)
    other file                the whole file is one text document          -
    directory or hub id       ``datasets.load_dataset`` (or                row numbers of the split
                              ``load_from_disk`` for a saved dataset),
                              Arrow memory-mapped, iterated in batches

``.parquet`` and hub datasets need the optional ``datasets`` extra (``pip install 'raymoe[datasets]'``,
which brings pyarrow). A hub dataset is read through the ``datasets`` cache: ``HF_DATASETS_OFFLINE=1`` or
``HF_HUB_OFFLINE=1`` reads only what it already holds.

A record's kind (:func:`record_kind`) is read from its fields: ``messages`` (a list of ``{"role",
"content"}``, the OpenAI/HF convention) or ``prompt`` + ``completion`` (strings, or lists of messages as TRL
writes them) make a conversation; ``text`` (or a bare JSON string) a document. The field names are options.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

RecordKind = Literal["text", "chat"]
BATCH_ROWS = 1000


@dataclass(frozen=True)
class Fields:
    """Which record fields hold what; ``kind`` "auto" decides from the first record."""

    text: str = "text"
    messages: str = "messages"
    prompt: str = "prompt"
    completion: str = "completion"
    kind: Literal["auto", "text", "chat"] = "auto"


def record_kind(record: object, fields: Fields) -> RecordKind | None:
    """``chat`` for a record with messages or a prompt and completion, ``text`` for a document, None otherwise."""
    if isinstance(record, str):
        return "text"
    if not isinstance(record, dict):
        return None
    if record.get(fields.messages) is not None or (
        record.get(fields.prompt) is not None and record.get(fields.completion) is not None
    ):
        return "chat"
    if isinstance(record.get(fields.text), str):
        return "text"
    return None


def describe_record(record: object) -> str:
    if isinstance(record, dict):
        return f"an object with fields {sorted(record)}"
    return f"a JSON {type(record).__name__}"


@dataclass(frozen=True)
class RecordSource:
    """Where records come from: ``name`` for messages, ``fingerprint`` (a content hash) for the tokenization cache."""

    name: str
    unit: ClassVar[str] = "row"  # what error messages number: "line 7", "row 7"

    def fingerprint(self) -> str:
        raise NotImplementedError

    def size_bytes(self) -> int | None:
        return None

    def num_rows(self) -> int | None:
        return None

    def batches(self, rows: int = BATCH_ROWS) -> Iterator[list[tuple[int, Any]]]:
        """``[(row number, record), ...]`` lists of at most ``rows`` records, in order."""
        raise NotImplementedError


@dataclass(frozen=True)
class FileSource(RecordSource):
    path: Path

    def fingerprint(self) -> str:
        with self.path.open("rb") as file:
            return f"sha256:{hashlib.file_digest(file, 'sha256').hexdigest()}"

    def size_bytes(self) -> int:
        return self.path.stat().st_size


@dataclass(frozen=True)
class JsonlSource(FileSource):
    unit: ClassVar[str] = "line"

    def batches(self, rows: int = BATCH_ROWS) -> Iterator[list[tuple[int, Any]]]:
        batch: list[tuple[int, Any]] = []
        for numbered in jsonl_records(self.path, self.name):
            batch.append(numbered)
            if len(batch) == rows:
                yield batch
                batch = []
        if batch:
            yield batch


def jsonl_records(path: Path, name: str) -> Iterator[tuple[int, Any]]:
    """``(line number, parsed JSON)`` of each non-blank line of ``path``, read line by line; a line that is not UTF-8
    or not JSON is a ``ValueError`` naming ``name`` (e.g. ``dataset <file>``) and the line."""
    with path.open("rb") as raw_lines:
        for number, raw in enumerate(raw_lines, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(
                    f"{name} line {number} is not UTF-8 text ({exc.reason} at byte {exc.start} of the line)"
                ) from exc
            if not line.strip():
                continue
            try:
                yield number, json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{name} line {number} is not valid JSON: {exc.msg}") from exc


@dataclass(frozen=True)
class TextFileSource(FileSource):
    def batches(self, rows: int = BATCH_ROWS) -> Iterator[list[tuple[int, Any]]]:
        try:
            yield [(1, self.path.read_text(encoding="utf-8"))]
        except UnicodeDecodeError as exc:
            raise ValueError(f"{self.name} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc


@dataclass(frozen=True)
class ParquetSource(FileSource):
    def _file(self) -> Any:
        pyarrow_parquet = _optional("pyarrow.parquet", "reading .parquet files")
        try:
            return pyarrow_parquet.ParquetFile(self.path)
        except Exception as exc:  # pyarrow raises its own error types for a file that is not Parquet
            raise ValueError(f"{self.name} is not a readable Parquet file ({exc})") from exc

    def num_rows(self) -> int:
        return int(self._file().metadata.num_rows)

    def batches(self, rows: int = BATCH_ROWS) -> Iterator[list[tuple[int, Any]]]:
        number = 0
        for batch in self._file().iter_batches(batch_size=rows):
            records = batch.to_pylist()
            yield [(number + i + 1, record) for i, record in enumerate(records)]
            number += len(records)


@dataclass(frozen=True)
class HubSource(RecordSource):
    """A split of a ``datasets`` dataset (memory-mapped Arrow, never loaded whole)."""

    dataset: Any

    def fingerprint(self) -> str:
        # datasets' own fingerprint: a hash of the data files it was built from and of every transform since.
        return f"datasets:{self.dataset._fingerprint}"

    def size_bytes(self) -> int | None:
        return int(self.dataset.data.nbytes)

    def num_rows(self) -> int:
        return len(self.dataset)

    def batches(self, rows: int = BATCH_ROWS) -> Iterator[list[tuple[int, Any]]]:
        number = 0
        for columns in self.dataset.iter(batch_size=rows):
            names = list(columns)
            count = len(columns[names[0]]) if names else 0
            yield [(number + i + 1, {name: columns[name][i] for name in names}) for i in range(count)]
            number += count


def open_hub_dataset(
    name: str, *, split: str = "train", config_name: str | None = None, revision: str | None = None
) -> HubSource:
    """``name`` (a hub id, or a local directory of data files or of ``Dataset.save_to_disk``) as a split's records."""
    datasets = _optional("datasets", f"reading the dataset {name!r} (a hub id or a dataset directory)")
    directory = Path(name).expanduser()
    try:
        if directory.is_dir() and ((directory / "state.json").is_file() or (directory / "dataset_dict.json").is_file()):
            loaded = datasets.load_from_disk(str(directory))
            if isinstance(loaded, datasets.DatasetDict):
                loaded = _split_of(loaded, split, name)
        else:
            loaded = datasets.load_dataset(name, config_name, split=split, revision=revision)
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as exc:
        raise ValueError(f"cannot load the dataset {name!r} (split {split!r}): {type(exc).__name__}: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        loaded = _split_of(loaded, split, name)
    if not isinstance(loaded, datasets.Dataset):
        raise ValueError(f"dataset {name!r} split {split!r} is a {type(loaded).__name__}, not a table of records")
    return HubSource(f"dataset {name} (split {split})", loaded)


def _split_of(dataset_dict: Any, split: str, name: str) -> Any:
    if split not in dataset_dict:
        raise ValueError(f"dataset {name!r} has no split {split!r}; its splits: {', '.join(dataset_dict)}")
    return dataset_dict[split]


def _optional(module: str, purpose: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{purpose} needs the optional 'datasets' extra: pip install 'raymoe[datasets]'") from None


def open_source(path: str | os.PathLike[str], **hub_options: Any) -> RecordSource:
    """The record source of a file (by suffix) or, for a directory or a name that is no file, a ``datasets`` split."""
    file = Path(path).expanduser()
    if file.is_file():
        name = f"dataset {file}"
        if file.suffix == ".jsonl":
            return JsonlSource(name, file)
        if file.suffix == ".parquet":
            return ParquetSource(name, file)
        return TextFileSource(name, file)
    if file.is_dir() or (not file.exists() and _looks_like_hub_id(str(path))):
        return open_hub_dataset(str(path), **hub_options)
    raise ValueError(f"dataset file {str(path)!r} does not exist")


def _looks_like_hub_id(name: str) -> bool:
    """``owner/name`` or ``name``, without a file suffix a local path would have."""
    parts = name.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not Path(name).suffix and not name.startswith((".", "~"))
