"""A hub checkpoint from a training state, in one process: no cluster, no process group (``raymoe export``).

    read_manifest -> parse its config.json dict -> build the model on meta, in the dtype the state holds
    the weights in -> check_training_state (nothing is written when it fails)
    -> for each parameter: read ``model.<name>`` whole from the DCP files -> save_model (hub layout)

The state's entries have their natural global shapes (``model.model.layers.0.mlp.experts.gate_up_proj`` is
``[E, 2 * I, H]`` whatever layout saved it), so reading one needs no process group; ``save_model`` splits
fused parameters into per-expert hub tensors and swaps the directory in whole
(:mod:`raymoe.checkpoint.writer`). The optimizer moments and RNG states are not read.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import load as dcp_load
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from raymoe.checkpoint.model_io import save_model
from raymoe.checkpoint.staging import CheckpointSaveError
from raymoe.checkpoint.training_state import (
    StateManifest,
    TrainingStateError,
    check_training_state,
    model_key,
    read_manifest,
    read_metadata,
)
from raymoe.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE
from raymoe.models.registry import build_model, parse_model_config

# The entry whose dtype the exported config.json names (save_model's write_config reads the embedding's).
_DTYPE_ENTRY = model_key("model.embed_tokens.weight")
_SINGLE_PROCESS_WARNING = "torch.distributed is disabled, unavailable or uninitialized"


def export_state(
    state_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
) -> list[Path]:
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
    there is a :class:`CheckpointSaveError`. Returns the weight files written.
    """
    state_dir = Path(state_dir)
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
    tensors = read_entries(state_dir, model.named_parameters())
    return save_model(
        model, out_dir, max_shard_size=max_shard_size, tensors=tensors, dtype=written_dtype(manifest, state_dir)
    )


def refuse_export_into_itself(state_dir: Path, out_dir: str | os.PathLike[str]) -> None:
    if Path(out_dir).resolve() == state_dir.resolve():
        raise CheckpointSaveError(f"cannot export training state {state_dir} into itself; name another directory")


def written_dtype(manifest: StateManifest, state_dir: Path) -> torch.dtype | None:
    """The dtype ``save_pretrained`` would write the state's model in (its manifest's ``checkpoint_dtype``)."""
    named = manifest.checkpoint_dtype
    written = getattr(torch, named, None) if named else None
    if named and not isinstance(written, torch.dtype):
        raise TrainingStateError(f"training state {state_dir}: checkpoint_dtype={named!r} is not a torch dtype")
    return written if isinstance(written, torch.dtype) else None


def _stored_dtype(metadata: Metadata, key: str) -> torch.dtype | None:
    entry = metadata.state_dict_metadata.get(key)
    return entry.properties.dtype if isinstance(entry, TensorStorageMetadata) else None


def read_entries(state_dir: Path, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
    """``(name, full tensor)`` of the state's ``model.<name>`` entry for every ``(name, tensor)`` of ``named`` (a
    meta model's parameters: their global shapes), read one at a time, in the dtype the state stores."""
    reader = _MetadataOnceReader(state_dir)
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

    def __init__(self, path: str | os.PathLike[str]) -> None:
        super().__init__(path)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if args or kwargs:  # a rank's own metadata file: not cached
            return super().read_metadata(*args, **kwargs)
        if self._metadata is None:
            self._metadata = super().read_metadata()
        return self._metadata
