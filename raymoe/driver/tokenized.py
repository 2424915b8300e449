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
packing reads the cached arrays. The cache itself (``$RAYMOE_CACHE_DIR``, default ``~/.cache/raymoe/tokenized``,
one directory per key, written whole or not at all) is :mod:`raymoe.driver.token_cache`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
from tokenizers import Tokenizer
from tqdm import tqdm

from raymoe.driver.chat import ChatTemplate
from raymoe.driver.example_encoder import Chunk, EncodeOptions, ExampleEncoder
from raymoe.driver.records import Fields, RecordKind, RecordSource, describe_record, record_kind
from raymoe.driver.token_cache import CACHE_VERSION, TokenArrays, default_cache_dir, read_cache, write_cache

logger = logging.getLogger(__name__)

PARALLEL_ABOVE_BYTES = 32 * 2**20
MAX_WORKERS = 8


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

    def window(self, start: int, stop: int) -> TokenizedExamples:
        """Examples ``start:stop`` (a packing window), their ids and labels sliced, offsets from 0."""
        stop = min(stop, self.num_examples)
        first, last = int(self.offsets[start]), int(self.offsets[stop])
        return replace(
            self,
            ids=self.ids[first:last],
            labels=self.labels[first:last] if self.labels is not None else None,
            offsets=self.offsets[start : stop + 1] - first,
            rows=self.rows[start:stop],
        )


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


def _encode_in_worker(batch: list[tuple[int, Any]]) -> Chunk:
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
        cached = read_cache(entry)
        if cached is not None:
            kind, arrays = cached
            logger.info("%s: %d examples from the tokenization cache %s", source.name, len(arrays.rows), entry)
            return TokenizedExamples(
                kind, arrays.ids, arrays.labels, arrays.offsets, arrays.rows, source.name, unit, entry, True,
                time.perf_counter() - started,
            )  # fmt: skip
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
        write_cache(entry, examples)
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
) -> list[Chunk]:
    chunks: list[Chunk] = []
    with tqdm(total=source.num_rows(), unit="rows", desc="tokenize", disable=not progress, mininterval=0.5) as bar:
        if workers == 1:
            for batch in batches:
                chunks.append(encoder.encode(batch))
                bar.update(len(batch))
            return chunks
        context = _worker_context()
        with ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=(encoder,)) as pool:
            pending: deque[tuple[Future[Chunk], int]] = deque()
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


def _concatenate(kind: RecordKind, chunks: list[Chunk], name: str, unit: str) -> TokenArrays:
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
    return TokenArrays(np.concatenate(pieces), labels, offsets, rows)
