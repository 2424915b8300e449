"""A directory on object storage replaced whole or not at all: generations under the target, one commit marker.

Object stores have no rename, so the local swap (:mod:`raymoe.checkpoint.staging`) has no equivalent. A save
writes a new generation under the target and commits it by writing one small marker object, which a single PUT
replaces whole; readers follow the marker::

    s3://bucket/run/state/
      raymoe_commit.json       {"format": "raymoe-commit", "version": 1, "generation": "g-<time>-<id>"}
      g-20261203T070501-1a2b/  the committed state (what the marker names)
      g-20261203T080233-9f8e/  a save being written, or one that never committed (ignored, removed by the next save)

      write g-new/ (every rank)   marker -> g-old: readers see the old state, complete
      write the marker (rank 0)   marker -> g-new: readers see the new one, complete
      remove g-old/               (a failure here leaves garbage, never a broken state)

A save interrupted before its marker leaves the previous state loadable; the next save removes what it left.
"""

from __future__ import annotations

import json
import time
import uuid

from raymoe.checkpoint.storage import StorageUrl, children

COMMIT_FILE = "raymoe_commit.json"
FORMAT = "raymoe-commit"
VERSION = 1
_GENERATION_PREFIX = "g-"


class CommitError(ValueError):
    """A commit marker that cannot be read or names nothing usable."""


def new_generation(target: StorageUrl) -> StorageUrl:
    """A fresh, unused generation URL under ``target`` (sortable by time, unique by id)."""
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
    return target.join(f"{_GENERATION_PREFIX}{stamp}-{uuid.uuid4().hex[:8]}")


def committed(target: StorageUrl) -> StorageUrl | None:
    """The generation ``target``'s marker names, or None when it has no marker (nothing committed there)."""
    fs = target.filesystem()
    marker = target.join(COMMIT_FILE)
    try:
        raw = fs.cat_file(marker.path)
    except FileNotFoundError:
        return None
    try:
        record = json.loads(raw)
        generation = record["generation"]
    except (ValueError, KeyError, TypeError) as error:
        raise CommitError(f"{marker} is not a raymoe commit marker: {error}") from error
    if record.get("format") != FORMAT or not isinstance(generation, str) or "/" in generation:
        raise CommitError(f"{marker} is not a raymoe commit marker: {record!r}")
    return target.join(generation)


def commit(target: StorageUrl, generation: StorageUrl) -> None:
    """Make ``generation`` (complete) what ``target`` holds: one marker object written whole, then the generations
    it replaced removed (best effort: a failure there leaves only unused objects)."""
    if generation.parent != target:
        raise ValueError(f"{generation} is not a generation of {target}")
    fs = target.filesystem()
    record = {"format": FORMAT, "version": VERSION, "generation": generation.name}
    fs.pipe_file(target.join(COMMIT_FILE).path, json.dumps(record).encode())
    remove_uncommitted(target)


def remove_uncommitted(target: StorageUrl) -> list[StorageUrl]:
    """Remove every generation under ``target`` its marker does not name (saves that never committed, generations
    a commit replaced); the ones removed."""
    fs = target.filesystem()
    keep = committed(target)
    removed = []
    for generation in generations(target):
        if generation != keep:
            fs.rm(generation.path, recursive=True)
            removed.append(generation)
    return removed


def generations(target: StorageUrl) -> list[StorageUrl]:
    """Every generation directory under ``target``, oldest first."""
    names = (name for name, entry in children(target).items() if entry.get("type") == "directory")
    return [target.join(name) for name in sorted(names) if name.startswith(_GENERATION_PREFIX)]
