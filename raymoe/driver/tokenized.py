"""Tokenized examples on the driver: records in, token ids and loss masks out, in parallel batches with a progress
bar, cached on disk by content hash so that a second run starts at once.

    records (raymoe.driver.records)  ->  ExampleEncoder, per batch of 1000 records   ->  TokenizedExamples
                                          text: the document's ids + eos                  ids [T], labels [T] or None,
                                          chat: rendered with the chat template, the      offsets [N + 1], rows [N]
                                          answers' tokens (+ end token) as labels

Batches go to ``num_proc`` worker processes (default: one per CPU, at most 8, for sources above 32 MB; in
this process below that, where starting workers would cost more than it saves), forked from a server process
that imported this module once. Within a process the
``tokenizers`` package encodes each batch on its own threads.

The cache key is a SHA-256 over the source's content (the bytes of a file; a ``datasets`` split's own
fingerprint), the tokenizer (its ``tokenizer.json``), the chat template and its variables, and the options that
change the result (fields, ``loss_on``). Packing options (``seq_len``, ``packing``, ``overlong``) are not in it:
packing reads the cached arrays. The cache lives in ``$RAYMOE_CACHE_DIR`` (default
``~/.cache/raymoe/tokenized``), one directory per key, written under a temporary name and renamed into place
when complete, so a run killed while writing leaves nothing a later run would read.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from raymoe.driver.chat import ChatTemplate, check_messages
from raymoe.driver.records import Fields, RecordKind, RecordSource, describe_record, record_kind

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
CACHE_ENV = "RAYMOE_CACHE_DIR"
PARALLEL_ABOVE_BYTES = 32 * 2**20
MAX_WORKERS = 8
LossOn = Literal["assistant", "all"]


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "raymoe" / "tokenized"


@dataclass(frozen=True)
class TokenizedExamples:
    """Every example's tokens back to back: example ``i`` is ``ids[offsets[i]:offsets[i + 1]]`` from record
    ``rows[i]`` of ``source``; ``labels`` (chat) marks the tokens that take loss, None meaning all of them."""

    kind: RecordKind
    ids: np.ndarray
    labels: np.ndarray | None
    offsets: np.ndarray
    rows: np.ndarray
    source: str
    unit: str = "row"
    cache: Path | None = field(default=None, compare=False)
    from_cache: bool = field(default=False, compare=False)
    seconds: float = field(default=0.0, compare=False)

    @property
    def num_examples(self) -> int:
        return len(self.rows)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def where(self, example: int) -> str:
        return f"{self.source} {self.unit} {int(self.rows[example])}"


@dataclass(frozen=True)
class EncodeOptions:
    """What turns records into examples besides the tokenizer and template (all part of the cache key)."""

    fields: Fields = field(default_factory=Fields)
    loss_on: LossOn = "assistant"
    template_kwargs: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.loss_on not in ("assistant", "all"):
            raise ValueError(f"loss_on={self.loss_on!r}: choose 'assistant' or 'all'")
        try:
            json.dumps(dict(self.template_kwargs))
        except TypeError as exc:
            raise ValueError(f"template_kwargs must be JSON values (they are part of the cache key): {exc}") from None


@dataclass
class _Chunk:
    ids: list[np.ndarray]
    labels: list[np.ndarray] | None
    rows: list[int]


class ExampleEncoder:
    """Encodes batches of ``(row number, record)``; picklable (workers rebuild the tokenizer from its JSON)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        eos_token_id: int | None,
        template: ChatTemplate | None,
        kind: RecordKind,
        options: EncodeOptions,
        source: str,
        unit: str = "row",
    ) -> None:
        self.tokenizer_json = tokenizer.to_str()
        self.eos_token_id = eos_token_id
        self.template = template
        self.kind = kind
        self.options = options
        self.source = source
        self.unit = unit
        self._setup()

    def _setup(self) -> None:
        tokenizer = Tokenizer.from_str(self.tokenizer_json)
        # Without added special tokens a post-processor changes no id, only (for ByteLevel) trims the offsets
        # of tokens that start with a space; untrimmed offsets say exactly which characters each token covers.
        tokenizer.post_processor = None
        self._tokenizer = tokenizer
        self._special_ids = np.array(
            sorted(i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special), dtype=np.int64
        )

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k not in ("_tokenizer", "_special_ids")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._setup()

    def where(self, row: int) -> str:
        return f"{self.source} {self.unit} {row}"

    def encode(self, batch: list[tuple[int, Any]]) -> _Chunk:
        for row, record in batch:
            kind = record_kind(record, self.options.fields)
            if kind != self.kind:
                raise ValueError(self._wrong_kind(row, record))
        if self.kind == "text":
            return self._encode_text(batch)
        return self._encode_chat(batch)

    def _wrong_kind(self, row: int, record: object) -> str:
        fields = self.options.fields
        want = (
            f"a JSON string or an object with a string field {fields.text!r}"
            if self.kind == "text"
            else f"an object with {fields.messages!r}, or {fields.prompt!r} and {fields.completion!r}"
        )
        return f"{self.where(row)} must be {want} (like the first record), got {describe_record(record)}"

    def _encode_text(self, batch: list[tuple[int, Any]]) -> _Chunk:
        texts = [record if isinstance(record, str) else record[self.options.fields.text] for _, record in batch]
        eos = [self.eos_token_id] if self.eos_token_id is not None else []
        chunk = _Chunk([], None, [])
        for (row, _), encoding in zip(
            batch, self._tokenizer.encode_batch(texts, add_special_tokens=False), strict=True
        ):
            if encoding.ids:  # an empty document adds nothing, not even a separator
                chunk.ids.append(np.asarray([*encoding.ids, *eos], dtype=np.int32))
                chunk.rows.append(row)
        return chunk

    def _encode_chat(self, batch: list[tuple[int, Any]]) -> _Chunk:
        if self.template is None:
            raise ValueError(
                f"{self.source} holds conversations, but the checkpoint has no chat template (no chat_template in "
                "its tokenizer_config.json and no chat_template.jinja): give one with --chat-template FILE "
                "(load_dataset(..., chat_template=...))"
            )
        texts, spans_of = [], []
        kwargs = dict(self.options.template_kwargs)
        for row, record in batch:
            messages = self._conversation(row, record)
            try:
                if self.options.loss_on == "assistant":
                    text, spans = self.template.answer_spans(messages, **kwargs)
                else:
                    text, spans = self.template.render(messages, **kwargs), []
            except ValueError as exc:
                raise ValueError(f"{self.where(row)}: {exc}") from None
            texts.append(text)
            spans_of.append(spans)
        chunk = _Chunk([], [], [])
        assert chunk.labels is not None
        for (row, _), encoding, spans in zip(
            batch, self._tokenizer.encode_batch(texts, add_special_tokens=False), spans_of, strict=True
        ):
            ids = np.asarray(encoding.ids, dtype=np.int32)
            if self.options.loss_on == "all":
                labels = np.ones(len(ids), dtype=bool)
            else:
                labels = self._answer_labels(ids, np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2), spans)
                if not labels.any():
                    raise ValueError(f"{self.where(row)}: no token of the assistant answers survives tokenization")
            chunk.ids.append(ids)
            chunk.labels.append(labels)
            chunk.rows.append(row)
        return chunk

    def _conversation(self, row: int, record: dict[str, Any]) -> list[dict[str, Any]]:
        fields, where = self.options.fields, self.where(row)
        if record.get(fields.messages) is not None:
            return check_messages(record[fields.messages], where)
        prompt, completion = record[fields.prompt], record[fields.completion]
        if isinstance(prompt, str) and isinstance(completion, str):
            messages: object = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
        elif isinstance(prompt, list) and isinstance(completion, list):
            if not all(isinstance(m, dict) and m.get("role") == "assistant" for m in completion) or not completion:
                raise ValueError(f"{where}: {fields.completion!r} must be a list of assistant messages")
            messages = [*prompt, *completion]
        else:
            raise ValueError(
                f"{where}: {fields.prompt!r} and {fields.completion!r} must both be strings or both lists of messages, "
                f"got {type(prompt).__name__} and {type(completion).__name__}"
            )
        return check_messages(messages, where)

    def _answer_labels(self, ids: np.ndarray, offsets: np.ndarray, spans: list[tuple[int, int]]) -> np.ndarray:
        """Tokens overlapping an answer's characters, and the special token right after each answer."""
        starts, ends = offsets[:, 0], offsets[:, 1]
        labels = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            labels |= ((starts < end) & (ends > start)) | ((starts == ends) & (starts >= start) & (starts < end))
            after = int(np.searchsorted(starts, end, side="left"))  # the first token starting at or after the end
            if after < len(ids) and starts[after] == end and np.isin(ids[after], self._special_ids):
                labels[after] = True
        return labels


_WORKER: ExampleEncoder | None = None


def _worker_context() -> multiprocessing.context.BaseContext:
    """Workers come from a fork server that imported this module once (a fresh process per worker would import
    raymoe and torch each time); where there is none (Windows), they are spawned. Never forked from the driver:
    it runs threads (Ray's, the tokenizers' pool)."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload([__name__])
    return context


def _start_worker(encoder: ExampleEncoder) -> None:
    global _WORKER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the processes are the parallelism here
    _WORKER = encoder


def _encode_in_worker(batch: list[tuple[int, Any]]) -> _Chunk:
    assert _WORKER is not None
    return _WORKER.encode(batch)


def cache_key(
    source: RecordSource,
    tokenizer: Tokenizer,
    eos_token_id: int | None,
    template: ChatTemplate | None,
    options: EncodeOptions,
) -> str:
    """The SHA-256 naming a tokenization's cache entry (see the module docstring)."""
    parts = {
        "version": CACHE_VERSION,
        "source": source.fingerprint(),
        "tokenizer": hashlib.sha256(tokenizer.to_str().encode()).hexdigest(),
        "eos": eos_token_id,
        "template": None if template is None else [template.source, dict(template.special_tokens)],
        "fields": [
            options.fields.text,
            options.fields.messages,
            options.fields.prompt,
            options.fields.completion,
            options.fields.kind,
        ],
        "loss_on": options.loss_on,
        "template_kwargs": dict(options.template_kwargs),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def tokenize(
    source: RecordSource,
    tokenizer: Tokenizer,
    eos_token_id: int | None,
    template: ChatTemplate | None,
    options: EncodeOptions,
    *,
    cache_dir: str | os.PathLike[str] | Literal[False] | None = None,
    num_proc: int | None = None,
    progress: bool = False,
) -> TokenizedExamples:
    """The examples of ``source``, from the cache when it holds them (``cache_dir=False``: no cache)."""
    started = time.perf_counter()
    unit = source.unit
    entry = None
    if cache_dir is not False:
        root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
        entry = root / cache_key(source, tokenizer, eos_token_id, template, options)
        cached = _read_cache(entry, source.name, unit, started)
        if cached is not None:
            logger.info("%s: %d examples from the tokenization cache %s", source.name, cached.num_examples, entry)
            return cached
    batches = source.batches()
    first = next(batches, None)
    if first is None:
        raise ValueError(f"{source.name} is empty: it holds no records to train on")
    kind = _kind_of(first, options.fields, source.name, unit)
    encoder = ExampleEncoder(tokenizer, eos_token_id, template, kind, options, source.name, unit)
    workers = _workers(num_proc, source)
    chunks = _encode_all(encoder, _chain(first, batches), workers, source, progress)
    examples = _concatenate(kind, chunks, source.name, unit)
    seconds = time.perf_counter() - started
    if entry is not None:
        _write_cache(entry, examples)
    return TokenizedExamples(
        kind, examples.ids, examples.labels, examples.offsets, examples.rows, source.name, unit, entry, False, seconds
    )


def _kind_of(batch: list[tuple[int, Any]], fields: Fields, name: str, unit: str) -> RecordKind:
    row, record = batch[0]
    kind = record_kind(record, fields)
    if fields.kind != "auto":
        return fields.kind
    if kind is None:
        raise ValueError(
            f"{name} {unit} {row} must be a JSON string or an object with a string field {fields.text!r} (text), "
            f"{fields.messages!r} (a conversation) or {fields.prompt!r} and {fields.completion!r}, got "
            f"{describe_record(record)}"
        )
    return kind


def _chain(first: list[tuple[int, Any]], rest: Iterator[list[tuple[int, Any]]]) -> Iterator[list[tuple[int, Any]]]:
    yield first
    yield from rest


def _workers(num_proc: int | None, source: RecordSource) -> int:
    if num_proc is not None:
        if isinstance(num_proc, bool) or not isinstance(num_proc, int) or num_proc < 1:
            raise ValueError(f"num_proc={num_proc!r} must be an int >= 1")
        return num_proc
    size = source.size_bytes()
    if size is None or size < PARALLEL_ABOVE_BYTES:
        return 1
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def _encode_all(
    encoder: ExampleEncoder,
    batches: Iterator[list[tuple[int, Any]]],
    workers: int,
    source: RecordSource,
    progress: bool,
) -> list[_Chunk]:
    chunks: list[_Chunk] = []
    with tqdm(total=source.num_rows(), unit="rows", desc="tokenize", disable=not progress, mininterval=0.5) as bar:
        if workers == 1:
            for batch in batches:
                chunks.append(encoder.encode(batch))
                bar.update(len(batch))
            return chunks
        context = _worker_context()
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(encoder,)) as pool:
            pending: deque[tuple[Future[_Chunk], int]] = deque()
            for batch in batches:  # at most 2 batches per worker in flight: the source is never read whole
                pending.append((pool.submit(_encode_in_worker, batch), len(batch)))
                while len(pending) > 2 * workers:
                    future, rows = pending.popleft()
                    chunks.append(future.result())
                    bar.update(rows)
            while pending:
                future, rows = pending.popleft()
                chunks.append(future.result())
                bar.update(rows)
    return chunks


@dataclass(frozen=True)
class _Arrays:
    ids: np.ndarray
    labels: np.ndarray | None
    offsets: np.ndarray
    rows: np.ndarray


def _concatenate(kind: RecordKind, chunks: list[_Chunk], name: str, unit: str) -> _Arrays:
    pieces = [ids for chunk in chunks for ids in chunk.ids]
    if not pieces:
        raise ValueError(f"{name} is empty: it holds no text to train on")
    lengths = np.fromiter((len(p) for p in pieces), dtype=np.int64, count=len(pieces))
    offsets = np.zeros(len(pieces) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    labels = None
    if kind == "chat":
        labels = np.concatenate([lab for chunk in chunks for lab in (chunk.labels or [])])
    rows = np.fromiter((row for chunk in chunks for row in chunk.rows), dtype=np.int64, count=len(pieces))
    return _Arrays(np.concatenate(pieces), labels, offsets, rows)


_CACHE_FILES = ("ids.npy", "offsets.npy", "rows.npy")


def _read_cache(entry: Path, name: str, unit: str, started: float) -> TokenizedExamples | None:
    meta_file = entry / "meta.json"
    if not meta_file.is_file():
        return None
    try:
        meta = json.loads(meta_file.read_text())
        arrays = {file: np.load(entry / file, allow_pickle=False) for file in _CACHE_FILES}
        labels = np.load(entry / "labels.npy", allow_pickle=False) if meta["kind"] == "chat" else None
    except (OSError, ValueError, KeyError) as exc:  # a damaged entry is rebuilt, not trusted
        logger.warning("removing the damaged tokenization cache entry %s (%s)", entry, exc)
        shutil.rmtree(entry, ignore_errors=True)
        return None
    return TokenizedExamples(
        meta["kind"],
        arrays["ids.npy"],
        labels,
        arrays["offsets.npy"],
        arrays["rows.npy"],
        name,
        unit,
        entry,
        True,
        time.perf_counter() - started,
    )


def _write_cache(entry: Path, examples: _Arrays) -> None:
    staging = entry.with_name(f".{entry.name}.{os.getpid()}.partial")
    try:
        staging.mkdir(parents=True, exist_ok=True)
        np.save(staging / "ids.npy", examples.ids)
        np.save(staging / "offsets.npy", examples.offsets)
        np.save(staging / "rows.npy", examples.rows)
        if examples.labels is not None:
            np.save(staging / "labels.npy", examples.labels)
        kind = "chat" if examples.labels is not None else "text"
        meta = {"version": CACHE_VERSION, "kind": kind, "examples": len(examples.rows), "tokens": len(examples.ids)}
        (staging / "meta.json").write_text(json.dumps(meta))
        if entry.exists():  # another run wrote it meanwhile: same key, same content
            shutil.rmtree(staging)
        else:
            staging.rename(entry)
    except OSError as exc:  # an unwritable cache costs the next run a tokenization, not this run its data
        logger.warning("could not write the tokenization cache %s (%s)", entry, exc)
        shutil.rmtree(staging, ignore_errors=True)
