"""A checkpoint at a storage URL (``s3://bucket/models/qwen3``) copied into a local cache on the node that reads it.

Each node downloads what it reads once, whichever of its rank processes asks first (a file lock; the others wait
and find it done), and checks it again on every load: a file the URL holds at another size or ETag than the copy
is fetched again, so a checkpoint saved anew at the same URL is never read stale::

    ~/.cache/raymoe/storage/s3/bucket/models/qwen3/      (or <cache_dir>/raymoe-storage/...)
      config.json, model-00001-of-00004.safetensors ...  what raymoe reads (HUB_ALLOW_PATTERNS), nothing else
      .raymoe-fetched.json                               {name: [size, etag]} of the files as they were fetched
      .lock

A file is written under a temporary name and renamed when whole, so a download that is killed leaves no file a
reader could take for the checkpoint's.
"""

from __future__ import annotations

import fnmatch
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from raymoe.checkpoint.storage import StorageUrl, children

FETCHED_FILE = ".raymoe-fetched.json"


def fetch_checkpoint(url: StorageUrl, patterns: Sequence[str], cache_dir: str | os.PathLike[str] | None) -> Path:
    """The local copy of the files of ``url`` matching ``patterns`` (top level only), fetched or refreshed as needed;
    a ``ValueError`` naming the URL when it holds none of them or cannot be listed."""
    from filelock import FileLock

    local = _cache_root(cache_dir) / url.protocol / url.path
    local.mkdir(parents=True, exist_ok=True)
    wanted = _remote_files(url, patterns)
    with FileLock(str(local / ".lock")):
        fetched = _read_fetched(local)
        stale = {name: key for name, key in wanted.items() if fetched.get(name) != key or not (local / name).is_file()}
        for name in sorted(set(fetched) - set(wanted)):  # gone from the URL (an older shard count): not read
            if any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
                (local / name).unlink(missing_ok=True)
                del fetched[name]
        fs = url.filesystem()
        for name in sorted(stale):
            partial = local / f".{name}.partial"
            fs.get_file(url.join(name).path, str(partial))
            os.replace(partial, local / name)
            fetched[name] = stale[name]
        _write_fetched(local, fetched)
    return local


def _remote_files(url: StorageUrl, patterns: Sequence[str]) -> dict[str, list[Any]]:
    """``{name: [size, etag]}`` of the files directly under ``url`` that match a pattern."""
    try:
        entries = children(url)
    except Exception as error:  # filesystem packages raise their own types besides OSError
        raise ValueError(f"checkpoint {url}: cannot list it: {type(error).__name__}: {error}") from error
    files = {}
    for name, entry in entries.items():
        if entry.get("type") == "file" and any(fnmatch.fnmatch(name, pattern) for pattern in patterns):
            files[name] = [int(entry.get("size") or 0), str(entry.get("ETag") or entry.get("etag") or "")]
    if not files:
        raise ValueError(f"checkpoint {url} holds none of {', '.join(patterns)}: is it a model checkpoint?")
    return files


def _cache_root(cache_dir: str | os.PathLike[str] | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir).expanduser() / "raymoe-storage"
    return Path("~/.cache/raymoe/storage").expanduser()


def _read_fetched(local: Path) -> dict[str, list[Any]]:
    try:
        record = json.loads((local / FETCHED_FILE).read_text())
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}


def _write_fetched(local: Path, fetched: dict[str, list[Any]]) -> None:
    staged = local / f".{FETCHED_FILE}.partial"
    staged.write_text(json.dumps(fetched, sort_keys=True))
    os.replace(staged, local / FETCHED_FILE)
