"""The handle's hub checkpoint: every rank gathers, rank 0 writes the hub layout on its node (SPEC TRAIN-3).

All or nothing: the ranks stage the checkpoint beside the target and swap it in whole (:mod:`raymoe.rank.save`);
a failure comes back as rank 0's answer and is raised here as one ``CheckpointSaveError``, the model still loaded.
A storage URL is uploaded by rank 0 (:mod:`raymoe.checkpoint.upload`: not all or nothing).
"""

from __future__ import annotations

import os
from pathlib import Path

from raymoe.checkpoint.staging import CheckpointSaveError
from raymoe.checkpoint.storage import StorageUrl
from raymoe.driver.fanout import FanOut
from raymoe.driver.local_paths import storage_path
from raymoe.rank.contract import SaveResult
from raymoe.rank.save import save_gathered


def save_pretrained(
    fanout: FanOut, path: str | os.PathLike[str] | StorageUrl, max_shard_size: int
) -> list[Path] | list[str]:
    """Gather the weights into a hub-layout checkpoint at ``path`` (absolute on the driver, or a storage URL); the
    weight files written (their URLs, for a URL)."""
    directory = storage_path(path, "save_pretrained path", write=True)
    result: SaveResult = fanout.every_rank(save_gathered, str(directory), max_shard_size)[0]
    if result.error is not None:
        raise CheckpointSaveError(
            f"save_pretrained({str(directory)!r}) saved nothing: {result.error}. The model is still loaded "
            "(weights and optimizer state): fix the cause and call save_pretrained again",
            result.errno,
        )
    if not isinstance(directory, Path):
        return list(result.files)
    return [Path(file) for file in result.files]
