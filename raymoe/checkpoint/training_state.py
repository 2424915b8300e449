"""The training-state directory: what ``save_state`` writes, and the checks ``load_state`` makes before any rank reads.

A state is a ``torch.distributed.checkpoint`` (DCP) directory written by every rank in parallel, plus one
manifest rank 0 adds when every rank has finished::

    step-00000006/
      .metadata              DCP: every entry's global shape, dtype and where its chunks lie
      __0_0.distcp ...       DCP: one file per rank (its shards; replicated values by one rank only)
      raymoe_state.json      the manifest: model config, step, AdamW and balance settings, caller's extra

Entries, keyed by the model's parameter names (the same under every layout, so DCP reshards)::

    model.<name>                 every parameter (a tied one once) and persistent buffer, global shape
    optim.<name>.exp_avg         AdamW moments of each trainable parameter, shaped like it
    optim.<name>.exp_avg_sq
    optim.<name>.step            AdamW's step count of that parameter, a 0-d float tensor
    rng.rank<r>                  rank r's RNG states (bytes); restored on rank r when it exists

A directory is a state only with its manifest (written last, inside the staging directory that is then
renamed into place: :mod:`raymoe.checkpoint.staging`), so a save that did not finish is never taken for one.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch import Tensor, nn
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

MANIFEST_FILE = "raymoe_state.json"
FORMAT = "raymoe-training-state"
VERSION = 1
MOMENTS = ("exp_avg", "exp_avg_sq")
STATE_DIR_PATTERN = re.compile(r"^step-(\d+)$")


class TrainingStateError(ValueError):
    """A training state that cannot be loaded into this model: the message names the directory and what is wrong."""


def model_key(name: str) -> str:
    return f"model.{name}"


def optimizer_key(name: str, what: str) -> str:
    return f"optim.{name}.{what}"


def rng_key(rank: int) -> str:
    return f"rng.rank{rank}"


def state_dir_name(step: int) -> str:
    """``step-00000012``: the name the Trainer gives the state of ``step`` (sorts by step)."""
    return f"step-{step:08d}"


@dataclass(frozen=True)
class StateManifest:
    """``raymoe_state.json``: what a state holds beyond its tensors. ``extra`` is the caller's (the Trainer's
    data position); ``saved_layout`` (the ``DistributedConfig`` it was saved under) is for people reading it.
    ``checkpoint_dtype``: what ``save_pretrained`` writes for this model (the precision policy's, not the master
    dtype the state holds), which ``raymoe export`` writes too; None in states written before it was recorded."""

    model_config: dict[str, Any]
    step: int
    optimizer: dict[str, Any]
    balance: dict[str, Any]
    world_size: int
    saved_layout: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    checkpoint_dtype: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "model_type": self.model_config.get("model_type"),
            "step": self.step,
            "world_size": self.world_size,
            "saved_layout": self.saved_layout,
            "optimizer": self.optimizer,
            "balance": self.balance,
            "extra": self.extra,
            "checkpoint_dtype": self.checkpoint_dtype,
            "model_config": self.model_config,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], directory: Path) -> StateManifest:
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise TrainingStateError(
                f"{directory / MANIFEST_FILE} is not a raymoe training state of version {VERSION} "
                f"(format={raw.get('format')!r}, version={raw.get('version')!r})"
            )
        try:
            return cls(
                model_config=dict(raw["model_config"]),
                step=int(raw["step"]),
                optimizer=dict(raw["optimizer"]),
                balance=dict(raw["balance"]),
                world_size=int(raw["world_size"]),
                saved_layout=dict(raw["saved_layout"]),
                extra=dict(raw.get("extra") or {}),
                checkpoint_dtype=_optional_str(raw.get("checkpoint_dtype")),
            )
        except (KeyError, TypeError, ValueError) as error:
            raise TrainingStateError(f"{directory / MANIFEST_FILE} lacks or garbles a field: {error!r}") from error


def _optional_str(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"checkpoint_dtype={value!r} must be a string or null")
    return value


def read_manifest(directory: str | os.PathLike[str]) -> StateManifest:
    """The manifest of the state in ``directory``; a :class:`TrainingStateError` when it is missing or unreadable."""
    directory = Path(directory)
    if not directory.is_dir():
        raise TrainingStateError(f"training state {directory} does not exist (or is not a directory)")
    path = directory / MANIFEST_FILE
    if not path.is_file():
        raise TrainingStateError(
            f"{directory} is not a complete raymoe training state: it has no {MANIFEST_FILE} (written last, "
            "so this is a save that did not finish, or another kind of directory)"
        )
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TrainingStateError(f"cannot read {path}: {error}") from error
    if not isinstance(raw, dict):
        raise TrainingStateError(f"{path} must hold a JSON object")
    return StateManifest.from_json(raw, directory)


def model_entries(model: nn.Module) -> dict[str, Tensor]:
    """The model's tensors a state holds, by name: every parameter (a tied one under its first name only) and every
    persistent buffer."""
    entries: dict[str, Tensor] = dict(model.named_parameters())
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                entries[f"{module_name}.{name}" if module_name else name] = buffer
    return entries


def expected_entries(model: nn.Module, *, with_optimizer: bool = True) -> dict[str, tuple[int, ...]]:
    """Every tensor entry a state of ``model`` holds, with its global shape (``model`` may live on ``meta``);
    ``with_optimizer=False``: the model's entries only (what an export reads)."""
    entries = {model_key(name): tuple(value.shape) for name, value in model_entries(model).items()}
    if with_optimizer:
        for name, param in model.named_parameters():
            if param.requires_grad:
                entries.update({optimizer_key(name, moment): tuple(param.shape) for moment in MOMENTS})
                entries[optimizer_key(name, "step")] = ()
    return entries


def check_training_state(
    directory: str | os.PathLike[str], model: nn.Module, model_type: str, *, with_optimizer: bool = True
) -> StateManifest:
    """Everything about ``directory`` that can be known without reading a tensor, checked on the driver.

    The manifest, the model type, DCP's ``.metadata`` (readable), every entry ``model`` needs (present, same global
    shape; ``model`` on ``meta`` is enough), and every data file the metadata points into (present and long enough:
    a removed or truncated file is found here, before any weight changes). All problems in one
    :class:`TrainingStateError` naming ``directory``.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    saved_type = manifest.model_config.get("model_type")
    if saved_type != model_type:
        raise TrainingStateError(
            f"training state {directory} is of a {saved_type!r} model; this model is {model_type!r}"
        )
    metadata = read_metadata(directory)
    expected = expected_entries(model, with_optimizer=with_optimizer)
    problems = _entry_problems(metadata, expected, with_optimizer) + _file_problems(directory, metadata)
    if problems:
        shown = "; ".join(problems[:8]) + (f"; ... (+{len(problems) - 8} more)" if len(problems) > 8 else "")
        raise TrainingStateError(f"training state {directory} does not fit this model: {shown}")
    return manifest


def read_metadata(directory: Path) -> Metadata:
    try:
        return FileSystemReader(directory).read_metadata()
    except Exception as error:  # DCP raises whatever reading or unpickling .metadata raised
        raise TrainingStateError(
            f"cannot read {directory / '.metadata'} (the index of the state's tensors): {type(error).__name__}: {error}"
        ) from error


def _entry_problems(metadata: Metadata, expected: dict[str, tuple[int, ...]], with_optimizer: bool) -> list[str]:
    saved = metadata.state_dict_metadata
    problems = [f"missing tensor {key}" for key in expected if key not in saved]
    for key, shape in expected.items():
        entry = saved.get(key)
        if isinstance(entry, BytesStorageMetadata):
            problems.append(f"{key} is stored as bytes, not a tensor")
        elif isinstance(entry, TensorStorageMetadata) and tuple(entry.size) != shape:
            problems.append(f"{key} has shape {tuple(entry.size)} in the state, {shape} in this model")
    kinds = ("model.", "optim.") if with_optimizer else ("model.",)
    unexpected = [key for key in saved if key.startswith(kinds) and key not in expected]
    problems += [f"unexpected tensor {key} (not in this model)" for key in unexpected]
    return problems


def _file_problems(directory: Path, metadata: Metadata) -> list[str]:
    """Data files that are missing or shorter than the last byte the metadata reads from them."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for relative, end in sorted(needed.items()):
        path = directory / relative
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"data file {relative} is missing")
            continue
        if size < end:
            problems.append(f"data file {relative} is truncated ({size} bytes, the metadata reads up to byte {end})")
    return problems


def completed_states(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, path)`` of every complete ``step-<n>`` state under ``directory``, oldest first; staging
    directories (dot-prefixed) and states without their manifest are not counted."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STATE_DIR_PATTERN.match(entry.name)
        if match and entry.is_dir() and (entry / MANIFEST_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def latest_state(directory: str | os.PathLike[str]) -> Path | None:
    """The complete state of the highest step under ``directory``, or None."""
    states = completed_states(directory)
    return states[-1][1] if states else None
