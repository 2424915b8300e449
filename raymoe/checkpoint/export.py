"""A hub checkpoint from a training state, in one process: no cluster, no process group (``raymoe export``).

    read_manifest -> parse its config.json dict -> build the model on meta, in the dtype the state holds
    the weights in -> check_training_state (nothing is written when it fails)
    -> for each parameter: read ``model.<name>`` whole from the DCP files -> save_model (hub layout)

The state's entries have their natural global shapes (``model.model.layers.0.mlp.experts.gate_up_proj`` is
``[E, 2 * I, H]`` whatever layout saved it), so reading one needs no process group; ``save_model`` splits
fused parameters into per-expert hub tensors and swaps the directory in whole
(:mod:`raymoe.checkpoint.writer`). The optimizer moments and RNG states are not read.

Either side may be a storage URL (:mod:`raymoe.checkpoint.storage`): a state at a URL is read where its commit
marker points (DCP's fsspec reader, one entry at a time, as from a directory); a checkpoint for a URL is written
into a local scratch directory, then uploaded (:func:`~raymoe.checkpoint.upload.save_to_url`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from raymoe.checkpoint.model_io import save_model
from raymoe.checkpoint.staging import CheckpointSaveError
from raymoe.checkpoint.storage import Location, StorageUrl, UserPath
from raymoe.checkpoint.training_state import (
    StateManifest,
    TrainingStateError,
    check_training_state,
    model_key,
    read_manifest,
    read_metadata,
    resolve_state,
)
from raymoe.checkpoint.upload import save_to_url
from raymoe.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE
from raymoe.models.registry import build_model, parse_model_config

# The entry whose dtype the exported config.json names (save_model's write_config reads the embedding's).
_DTYPE_ENTRY = model_key("model.embed_tokens.weight")
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def export_state(
    state_dir: UserPath,
    out_dir: UserPath,
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> list[Path] | list[str]:
    """Write the model weights of the training state ``state_dir`` as a hub checkpoint into ``out_dir``.

    Every parameter is written in the dtype ``save_pretrained`` of the model would write (the manifest's
    ``checkpoint_dtype``: the checkpoint's own, not the float32 masters a mixed-precision state holds; a state
    without it: the dtype the state stores); ``config.json`` is the manifest's model config with that dtype.
    The shapes are the state's global ones, so a state saved under any layout and world size exports the same way.

    One process, no process group, no cluster: parameters are read one at a time (DCP ``no_dist``, only the
    bytes of that entry), so memory is about one parameter plus the writer's current shard (the copies it
    keeps until they reach ``max_shard_size`` bytes; a smaller ``max_shard_size`` holds less).

    The state is checked first (:func:`~raymoe.checkpoint.training_state.check_training_state`: manifest,
    model type, every entry's shape, every data file present and long enough); a bad state raises a
    :class:`TrainingStateError` naming ``state_dir`` and writes nothing. Writing is all or nothing, and
    files of ``out_dir`` the export does not write (a tokenizer) are kept (:func:`save_model`); a failure
    there is a :class:`CheckpointSaveError`. Returns the weight files written (their URLs, for a URL).
    """
    state_dir = state_location(state_dir)
    manifest = read_manifest(state_dir)
    refuse_export_into_itself(state_dir, out_dir)
    if manifest.lora is not None:
        raise TrainingStateError(
            f"training state {state_dir} holds LoRA adapters, not the base weights: `raymoe export --adapter "
            "STATE_DIR OUT_DIR` writes the PEFT adapter, `raymoe export --merge STATE_DIR OUT_DIR --base BASE` the "
            "merged hub checkpoint of the base it was trained on"
        )
    try:
        config = parse_model_config(manifest.model_config)
    except ValueError as error:
        raise TrainingStateError(f"training state {state_dir}: its model config does not parse: {error}") from error
    metadata = read_metadata(state_dir)
    model = build_model(config, device="meta", dtype=_stored_dtype(metadata, _DTYPE_ENTRY) or torch.float32)
    check_training_state(state_dir, model, config.model_type, with_optimizer=False)
    dtype = written_dtype(manifest, state_dir)

    def write(local: Path) -> list[Path]:
        tensors = read_entries(state_dir, model.named_parameters())
        return save_model(model, local, max_shard_size=max_shard_size, tensors=tensors, dtype=dtype)

    return write_into(out_dir, write)


def state_location(state_dir: UserPath) -> Location:
    """Where a state's files are: its directory, or on a storage URL the generation its commit marker names."""
    return resolve_state(state_dir if isinstance(state_dir, StorageUrl) else Path(state_dir))


def write_into(out_dir: UserPath, write: Callable[[Path], list[Path]]) -> list[Path] | list[str]:
    """``write(directory)`` into ``out_dir``; for a storage URL into a local scratch directory, then uploaded."""
    if isinstance(out_dir, StorageUrl):
        return save_to_url(out_dir, write)
    return write(Path(out_dir))


def refuse_export_into_itself(state_dir: Location, out_dir: UserPath) -> None:
    """``out_dir`` may not be the state (on a URL: the directory whose committed generation ``state_dir`` is)."""
    if isinstance(state_dir, Path) and not isinstance(out_dir, StorageUrl):
        same = Path(out_dir).resolve() == state_dir.resolve()
    else:  # a URL state is a generation under the directory the user named
        same = str(out_dir) in (str(state_dir), str(state_dir.parent) if isinstance(state_dir, StorageUrl) else "")
    if same:
        raise CheckpointSaveError(f"cannot export training state {state_dir} into itself; name another directory")


def written_dtype(manifest: StateManifest, state_dir: Location) -> torch.dtype | None:
    """The dtype ``save_pretrained`` would write the state's model in (its manifest's ``checkpoint_dtype``)."""
    named = manifest.checkpoint_dtype
    written = getattr(torch, named, None) if named else None
    if named and not isinstance(written, torch.dtype):
        raise TrainingStateError(f"training state {state_dir}: checkpoint_dtype={named!r} is not a torch dtype")
    return written if isinstance(written, torch.dtype) else None


def _stored_dtype(metadata: Metadata, key: str) -> torch.dtype | None:
    entry = metadata.state_dict_metadata.get(key)
    return entry.properties.dtype if isinstance(entry, TensorStorageMetadata) else None


def read_entries(state_dir: Location, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """``(name, full tensor)`` of the state's ``model.<name>`` entry for every ``(name, tensor)`` of ``named`` (a
    meta model's parameters: their global shapes), read one at a time, in the dtype the state stores."""
    reader: FileSystemReader = (
        _MetadataOnceFsspecReader(str(state_dir))
        if isinstance(state_dir, StorageUrl)
        else _MetadataOnceReader(state_dir)
    )
    metadata = reader.read_metadata()
    for name, param in named:
        key = model_key(name)
        dtype = _stored_dtype(metadata, key) or param.dtype
        entry: dict[str, Any] = {key: torch.empty(param.shape, dtype=dtype)}
        try:
            with warnings.catch_warnings():  # DCP warns that it loads in one process even when told no_dist
                warnings.filterwarnings("ignore", _SINGLE_PROCESS_WARNING, UserWarning)
                dcp_load(entry, storage_reader=reader, no_dist=True)
        except Exception as error:  # DCP wraps what reading a file raised in its CheckpointException
            raise TrainingStateError(
                f"cannot read {key} from training state {state_dir}: {type(error).__name__}: {error}"
            ) from error
        yield name, entry.pop(key)


class _MetadataOnceReader(FileSystemReader):
    """A ``FileSystemReader`` that unpickles ``.metadata`` once: DCP reads it on every ``load``, and the
    index of a large state (every chunk of every entry) would otherwise be read once per parameter."""

    _metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if args or kwargs:  # a rank's own metadata file: not cached
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata


class _MetadataOnceFsspecReader(FsspecReader, _MetadataOnceReader):
    """:class:`_MetadataOnceReader` of a storage URL (DCP's fsspec reader: its filesystem, the same reads)."""
