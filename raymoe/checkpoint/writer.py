"""Writing hub safetensors checkpoints, one tensor at a time, swapped in whole or not at all.

:class:`CheckpointWriter` takes ``(name, tensor)`` pairs as they come (a gathered shard, a
parameter of a single-process model) and keeps at most one shard's worth of them in CPU memory:
when the next tensor would push the current shard past ``max_shard_size`` bytes, the shard is
written out. On close the shards get their hub names::

    one shard      model.safetensors
    several        model-00001-of-00003.safetensors, ... + model.safetensors.index.json

Given a model's hub layout, fused parameters are split back into per-expert hub tensors, and
closing checks that every parameter of the layout was written.

A save never loses the previous checkpoint: the shards, the index and the ``config.json`` that
:func:`~raymoe.checkpoint.model_io.save_model` adds are written into a staging directory beside the
target, read back (every shard's size agrees with its header, every JSON file parses, the index maps
exactly the tensors written) and swapped in whole (:mod:`raymoe.checkpoint.staging`). Files of the
target the save does not produce are kept: everything but the old weight files (``model.safetensors``,
``model-*-of-*.safetensors``, the index) and the names the new save writes.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import TracebackType

from safetensors import SafetensorError
from safetensors.torch import save_file
from torch import Tensor

from raymoe.checkpoint.reader import INDEX_FILE, SAFETENSORS_FILE
from raymoe.checkpoint.staging import (
    CheckpointSaveError,
    could_not,
    recover_interrupted_save,
    rename,
    staging_directory,
    swap_in,
    swappable_target,
    sync_file,
    write_json,
)
from raymoe.models.common.hub_layout import HubLayout, split_fused

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # bytes
_PARTIAL_SUFFIX = ".partial"  # shard files before their final name (the shard count) is known
# The weight files of an earlier save: never carried into the new checkpoint (the last one is left by old raymoe).
WEIGHT_FILES = (SAFETENSORS_FILE, INDEX_FILE, "model-*-of-*.safetensors", f"model-*.safetensors{_PARTIAL_SUFFIX}")


class CheckpointWriter:
    """Streams tensors into safetensors shards staged beside ``directory``; use as a context manager.

    Shards go to ``self.staging`` (``.<name>.saving-<pid>`` next to ``directory``) as ``*.partial``
    files; a caller may add files there too (``config.json``). Only a successful :meth:`close` swaps
    the staged checkpoint in (module docstring); a failure or :meth:`abort` removes the staging
    directory and leaves ``directory`` as it was.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        layout: HubLayout | None = None,
        max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    ) -> None:
        if max_shard_size <= 0:
            raise ValueError(f"max_shard_size must be a positive number of bytes, got {max_shard_size}")
        self.directory = Path(directory)
        self.target = swappable_target(self.directory)
        recover_interrupted_save(self.target)
        self.staging = staging_directory(self.target)
        try:
            self.staging.mkdir()
        except OSError as error:
            raise could_not(f"create the staging directory of {self.target} at", self.staging, error) from error
        self.layout = layout
        self.max_shard_size = max_shard_size
        self._pending: dict[str, Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []  # written partial file, its keys
        self._total_bytes = 0
        self._written_params: set[str] = set()
        self._written_keys: set[str] = set()
        self._closed = False

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._closed:
            self.close()

    def write_parameter(self, name: str, tensor: Tensor) -> None:
        """Write model parameter ``name``, split into its hub tensors by the layout."""
        if self.layout is None or name not in self.layout:
            raise ValueError(f"{name!r} is not a parameter of the writer's hub layout")
        if name in self._written_params:
            raise ValueError(f"parameter {name!r} was already written")
        for key, part in split_fused(self.layout[name], tensor.detach()):
            self.write_hub_tensor(key, part)
        self._written_params.add(name)

    def write_hub_tensor(self, key: str, tensor: Tensor) -> None:
        """Write one tensor under its hub name; it is copied to CPU, so the caller may free it."""
        if self._closed:
            raise ValueError("the checkpoint writer is closed")
        if key in self._written_keys:
            raise ValueError(f"hub tensor {key!r} was already written")
        # A private contiguous copy: safetensors refuses views that share storage (gate/up halves).
        owned = tensor.detach().to("cpu", copy=True).contiguous()
        nbytes = owned.numel() * owned.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_size:
            self._flush()
        self._pending[key] = owned
        self._pending_bytes += nbytes
        self._total_bytes += nbytes
        self._written_keys.add(key)

    def _flush(self) -> None:
        path = self.staging / f"model-{len(self._shards) + 1:05d}.safetensors{_PARTIAL_SUFFIX}"
        try:
            save_file(self._pending, path, metadata={"format": "pt"})
            sync_file(path)
        except (OSError, SafetensorError) as error:  # safetensors reports a failed write as SafetensorError
            raise could_not("write", path, error) from error
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, name the shards, write the index, read it all back and swap it in.

        Returns the weight files under ``directory``. Any failure removes the staging directory and
        leaves ``directory`` as it was.
        """
        if self._closed:
            raise ValueError("the checkpoint writer is already closed")
        if self.layout is not None:
            unwritten = sorted(set(self.layout) - self._written_params)
            if unwritten:
                self.abort()
                raise ValueError(f"checkpoint incomplete, {len(unwritten)} parameters never written: {unwritten[:20]}")
        try:
            if self._pending or not self._shards:
                self._flush()
            self._closed = True
            names = self._name_shards()
            _read_back(self.staging, names, self._written_keys)
            swap_in(self.staging, self.target, WEIGHT_FILES)
        except BaseException:
            self.abort()
            raise
        return [self.directory / name for name in names]

    def _name_shards(self) -> list[str]:
        """Give the staged shards their hub names (renames inside the staging directory); write the index."""
        if len(self._shards) == 1:
            rename(self._shards[0][0], self.staging / SAFETENSORS_FILE)
            return [SAFETENSORS_FILE]
        count = len(self._shards)
        weight_map: dict[str, str] = {}
        names = []
        for i, (partial, keys) in enumerate(self._shards, start=1):
            name = f"model-{i:05d}-of-{count:05d}.safetensors"
            rename(partial, self.staging / name)
            names.append(name)
            weight_map.update(dict.fromkeys(keys, name))
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_json(self.staging / INDEX_FILE, index)
        return names

    def abort(self) -> None:
        """Drop everything written so far (used when saving fails half-way); ``directory`` is untouched."""
        self._closed = True
        self._pending.clear()
        shutil.rmtree(self.staging, ignore_errors=True)


def _read_back(staging: Path, weight_files: list[str], keys: set[str]) -> None:
    """Check the staged checkpoint before the target is touched: every shard whole, every JSON file parses,
    the index maps exactly the tensors written to staged shards."""
    for name in weight_files:
        _check_shard(staging / name)
    parsed = {path.name: _read_json(path) for path in sorted(staging.glob("*.json"))}
    if len(weight_files) == 1:
        return
    index = parsed.get(INDEX_FILE)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or set(weight_map) != keys or not set(weight_map.values()) <= set(weight_files):
        raise CheckpointSaveError(
            f"{staging / INDEX_FILE} read back does not map the {len(keys)} tensors written to the staged shards"
        )


def _check_shard(path: Path) -> None:
    """A safetensors file is whole when its size is 8 + the header length + the end of its last tensor."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            header_len = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(header_len)) if 0 < header_len <= size - 8 else {}
        ends = [info["data_offsets"][1] for key, info in header.items() if key != "__metadata__"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError) as error:
        raise could_not("read back", path, error) from error
    expected = 8 + header_len + max(ends, default=0)
    if expected != size:
        raise CheckpointSaveError(f"{path} read back is incomplete: {size} bytes on disk, its header needs {expected}")


def _read_json(path: Path) -> object:
    try:
        with path.open() as f:
            return json.load(f)
    except (OSError, ValueError) as error:
        raise could_not("read back", path, error) from error
