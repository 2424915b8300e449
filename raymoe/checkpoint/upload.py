"""A hub checkpoint written to a storage URL: written and read back on the saving rank's disk, then uploaded.

    rank 0   save_model(-> <tmp>/ckpt/)        every check of a local save (shards whole, index exact)
             put shards  -> s3://.../ckpt/     in parallel (fsspec's batched put; large files in multipart parts)
             put the rest (index, config.json)  last, so a reader that finds the index finds every shard it names
             remove the old weight files the new checkpoint does not have (a different shard count)
             remove <tmp>/ckpt/

Unlike a local save this is not all or nothing: object stores have no rename, and a hub checkpoint is read by
tools that know no commit marker (transformers, vLLM). Until the upload finishes, a reader can see old files
beside new ones; a failed upload raises :class:`~raymoe.checkpoint.staging.CheckpointSaveError` naming the URL,
and saving again completes it. The local copy needs the checkpoint's size on the saving node's temporary
directory (``TMPDIR``).
"""

from __future__ import annotations

import fnmatch
import tempfile
from collections.abc import Callable, Collection
from pathlib import Path

from raymoe.checkpoint.staging import CheckpointSaveError
from raymoe.checkpoint.storage import StorageUrl, children
from raymoe.checkpoint.writer import WEIGHT_FILES


def save_to_url(target: StorageUrl, write: Callable[[Path], list[Path]]) -> list[str]:
    """``write(local_dir)`` (a local save, returning its weight files), uploaded to ``target``; the URLs of the
    weight files written there."""
    with tempfile.TemporaryDirectory(prefix="raymoe-upload-") as scratch:
        local = Path(scratch) / target.name
        weights = write(local)
        upload_directory(local, target)
    return [str(target.join(path.name)) for path in weights]


def upload_directory(
    local: Path, target: StorageUrl, *, replace_weights: bool = True, only: Collection[Path] | None = None
) -> None:
    """Every file under ``local`` (or those of ``only``) to the same place under ``target``: safetensors shards
    first (in parallel), then the other files; then (``replace_weights``: ``local`` is a whole checkpoint) the
    weight files of an earlier checkpoint there that this one does not have are removed."""
    fs = target.filesystem()
    files = sorted(path for path in local.rglob("*") if path.is_file() and (only is None or path in only))
    shards = [path for path in files if path.suffix == ".safetensors"]
    rest = [path for path in files if path.suffix != ".safetensors"]
    try:
        for batch in (shards, rest):
            if batch:
                remote = [target.join(*path.relative_to(local).parts).path for path in batch]
                fs.put([str(path) for path in batch], remote)
        if replace_weights:
            _remove_stale_weights(target, {path.name for path in files})
    except Exception as error:  # filesystem packages raise their own types besides OSError
        raise CheckpointSaveError(
            f"could not upload the checkpoint to {target}: {error!r}; it may hold old and new files side by side "
            "until a save completes",
            getattr(error, "errno", None),
        ) from error


def _remove_stale_weights(target: StorageUrl, written: set[str]) -> None:
    fs = target.filesystem()
    for name in children(target):
        if name not in written and any(fnmatch.fnmatch(name, pattern) for pattern in WEIGHT_FILES):
            fs.rm_file(target.join(name).path)
