"""The tokenization cache: tokenized examples on disk, one directory per cache key, so a second run starts at once.

    $RAYMOE_CACHE_DIR (default ~/.cache/raymoe/tokenized)/<sha256 key>/
      meta.json  ids.npy  offsets.npy  rows.npy  [labels.npy]

An entry is written under a temporary name and renamed into place when complete, so a run killed while writing
leaves nothing a later run would read; a damaged entry is removed and rebuilt, never trusted. The key is
computed by :func:`raymoe.driver.tokenized.cache_key`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from raymoe.driver.records import RecordKind

logger = logging.getLogger(__name__)

CACHE_VERSION = 1
CACHE_ENV = "RAYMOE_CACHE_DIR"


def default_cache_dir() -> Path:
    root = os.environ.get(CACHE_ENV)
    return Path(root).expanduser() if root else Path.home() / ".cache" / "raymoe" / "tokenized"


@dataclass(frozen=True)
class TokenArrays:
    """Every example's token ids back to back ``ids [T]``, their loss mask ``labels [T]`` (chat) or None,
    ``offsets [N + 1]`` (example i is ``ids[offsets[i]:offsets[i + 1]]``) and each example's source row ``rows [N]``."""

    ids: np.ndarray
    labels: np.ndarray | None
    offsets: np.ndarray
    rows: np.ndarray


_CACHE_FILES = ("ids.npy", "offsets.npy", "rows.npy")


def read_cache(entry: Path) -> tuple[RecordKind, TokenArrays] | None:
    """The arrays of a complete cache entry (None: no entry, or a damaged one, which is removed)."""
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
    return meta["kind"], TokenArrays(arrays["ids.npy"], labels, arrays["offsets.npy"], arrays["rows.npy"])


def write_cache(entry: Path, examples: TokenArrays) -> None:
    """Write ``examples`` under a temporary name and rename it into place once complete."""
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
