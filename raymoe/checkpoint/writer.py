"""Writing hub safetensors checkpoints, one tensor at a time.

:class:`CheckpointWriter` takes ``(name, tensor)`` pairs as they come (a gathered shard, a
parameter of a single-process model) and keeps at most one shard's worth of them in CPU memory:
when the next tensor would push the current shard past ``max_shard_size`` bytes, the shard is
written out. On close the shards get their hub names::

    one shard      model.safetensors
    several        model-00001-of-00003.safetensors, ... + model.safetensors.index.json

Given a model's hub layout, fused parameters are split back into per-expert hub tensors, and
closing checks that every parameter of the layout was written.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import TracebackType

from safetensors.torch import save_file
from torch import Tensor

from raymoe.checkpoint.reader import INDEX_FILE, SAFETENSORS_FILE
from raymoe.models.common.hub_layout import HubLayout, split_fused

DEFAULT_MAX_SHARD_SIZE = 5 * 10**9  # bytes
_PARTIAL_SUFFIX = ".partial"  # shard files before their final name (the shard count) is known


class CheckpointWriter:
    """Streams tensors into safetensors shards under ``directory``; use as a context manager.

    Shards are written as ``*.partial`` files; only a successful :meth:`close` removes the weight
    files of an earlier save in ``directory`` (``model.safetensors``, ``model-*-of-*.safetensors``,
    the index) and renames the new shards into place, so a failed save never loses the previous
    checkpoint and a stale index cannot point at old shards.
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
        self.directory.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self.max_shard_size = max_shard_size
        self._pending: dict[str, Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []  # written partial file, its keys
        self._total_bytes = 0
        self._written_params: set[str] = set()
        self._written_keys: set[str] = set()
        self._closed = False
        _remove_files(self.directory, (f"model-*.safetensors{_PARTIAL_SUFFIX}",))  # left by a crashed save

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
        path = self.directory / f"model-{len(self._shards) + 1:05d}.safetensors{_PARTIAL_SUFFIX}"
        save_file(self._pending, path, metadata={"format": "pt"})
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[Path]:
        """Write the last shard, give shards their final names, write the index; return the weight files."""
        if self._closed:
            raise ValueError("the checkpoint writer is already closed")
        if self.layout is not None:
            unwritten = sorted(set(self.layout) - self._written_params)
            if unwritten:
                self.abort()
                raise ValueError(f"checkpoint incomplete, {len(unwritten)} parameters never written: {unwritten[:20]}")
        if self._pending or not self._shards:
            self._flush()
        self._closed = True
        _remove_files(self.directory, (SAFETENSORS_FILE, INDEX_FILE, "model-*-of-*.safetensors"))
        if len(self._shards) == 1:
            final = self.directory / SAFETENSORS_FILE
            self._shards[0][0].rename(final)
            return [final]
        return self._finalise_sharded()

    def _finalise_sharded(self) -> list[Path]:
        count = len(self._shards)
        weight_map: dict[str, str] = {}
        files = []
        for i, (partial, keys) in enumerate(self._shards, start=1):
            final = self.directory / f"model-{i:05d}-of-{count:05d}.safetensors"
            partial.rename(final)
            files.append(final)
            weight_map.update(dict.fromkeys(keys, final.name))
        index = {"metadata": {"total_size": self._total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        with (self.directory / INDEX_FILE).open("w") as f:
            json.dump(index, f, indent=2)
        return files

    def abort(self) -> None:
        """Drop everything written so far (used when saving fails half-way)."""
        self._closed = True
        self._pending.clear()
        for path, _ in self._shards:
            path.unlink(missing_ok=True)


def _remove_files(directory: Path, patterns: tuple[str, ...]) -> None:
    for pattern in patterns:
        for path in directory.glob(pattern):
            path.unlink()
