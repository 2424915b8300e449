"""The training-state directory: what ``save_state`` writes, and the checks ``load_state`` makes before any rank reads.

A state is a ``torch.distributed.checkpoint`` (DCP) directory written by every rank in parallel, plus one
manifest rank 0 adds when every rank has finished::

    step-00000006/
      .metadata              DCP: every entry's global shape, dtype and where its chunks lie
      __0_0.distcp ...       DCP: one file per rank (its shards; replicated values by one rank only)
      raymoe_state.json      the manifest: model config, step, AdamW and balance settings, caller's extra;
                             under LoRA also the adapter's config and the base's fingerprint

Entries, keyed by the model's parameter names (the same under every layout, so DCP reshards)::

    model.<name>                 every parameter (a tied one once) and persistent buffer, global shape; under LoRA
                                 not the frozen base weights: the factors, and what a run still moves (a router's
                                 selection bias, buffers)
    optim.<name>.exp_avg         AdamW moments of each trainable parameter, shaped like it
    optim.<name>.exp_avg_sq
    optim.<name>.step            AdamW's step count of that parameter, a 0-d float tensor
    rng.rank<r>                  rank r's RNG states (bytes); restored on rank r when it exists

A LoRA state is small (adapters, their moments) and useless without its base: the manifest's ``base``
(:class:`~raymoe.checkpoint.fingerprint.BaseFingerprint`) names the checkpoint it was trained on, and resuming
checks it (:func:`check_lora_state`).

A directory is a state only with its manifest (written last, inside the staging directory that is then
renamed into place: :mod:`raymoe.checkpoint.staging`), so a save that did not finish is never taken for one.
On storage URLs (:mod:`raymoe.checkpoint.storage`) the directory is the generation the target's commit marker
names (:mod:`raymoe.checkpoint.committed`); the checks below read it through fsspec.
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
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from raymoe.checkpoint.committed import committed
from raymoe.checkpoint.fingerprint import BaseFingerprint
from raymoe.checkpoint.storage import Location, StorageUrl, child, children, is_directory, read_bytes, size_of
from raymoe.models.common.lora import frozen_base_names

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
    dtype the state holds), which ``raymoe export`` writes too; None in states written before it was recorded.
    ``lora``: the adapter's PEFT ``adapter_config.json`` dict and ``base`` the fingerprint of the checkpoint it was
    trained on, for a LoRA state (None: a full fine-tuning state)."""

    model_config: dict[str, Any]
    step: int
    optimizer: dict[str, Any]
    balance: dict[str, Any]
    world_size: int
    saved_layout: dict[str, Any]
    extra: dict[str, Any] = field(default_factory=dict)
    checkpoint_dtype: str | None = None
    lora: dict[str, Any] | None = None
    base: BaseFingerprint | None = None

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
            "lora": self.lora,
            "base": self.base.to_json() if self.base is not None else None,
            "model_config": self.model_config,
        }

    @classmethod
    def from_json(cls, raw: Mapping[str, Any], directory: Location) -> StateManifest:
        if raw.get("format") != FORMAT or raw.get("version") != VERSION:
            raise TrainingStateError(
                f"{child(directory, MANIFEST_FILE)} is not a raymoe training state of version {VERSION} "
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
                lora=dict(raw["lora"]) if raw.get("lora") is not None else None,
                base=BaseFingerprint.from_json(raw["base"]) if raw.get("base") is not None else None,
            )
        except (KeyError, TypeError, ValueError) as error:
            where = child(directory, MANIFEST_FILE)
            raise TrainingStateError(f"{where} lacks or garbles a field: {error!r}") from error


def _optional_str(value: Any) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"checkpoint_dtype={value!r} must be a string or null")
    return value


def read_manifest(directory: str | os.PathLike[str] | StorageUrl) -> StateManifest:
    """The manifest of the state in ``directory``; a :class:`TrainingStateError` when it is missing or unreadable."""
    directory = _location(directory)
    if not is_directory(directory):
        raise TrainingStateError(f"training state {directory} does not exist (or is not a directory)")
    path = child(directory, MANIFEST_FILE)
    try:
        raw = json.loads(read_bytes(path))
    except FileNotFoundError:
        raise TrainingStateError(
            f"{directory} is not a complete raymoe training state: it has no {MANIFEST_FILE} (written last, "
            "so this is a save that did not finish, or another kind of directory)"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise TrainingStateError(f"cannot read {path}: {error}") from error
    if not isinstance(raw, dict):
        raise TrainingStateError(f"{path} must hold a JSON object")
    return StateManifest.from_json(raw, directory)


def model_entries(model: nn.Module) -> dict[str, Tensor]:
    """The model's tensors a state holds, by name: every parameter (a tied one under its first name only) but the
    base weights LoRA froze (:func:`~raymoe.models.common.lora.frozen_base_names`), and every persistent buffer."""
    frozen = frozen_base_names(model)
    entries: dict[str, Tensor] = {name: p for name, p in model.named_parameters() if name not in frozen}
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
    directory: str | os.PathLike[str] | StorageUrl, model: nn.Module, model_type: str, *, with_optimizer: bool = True
) -> StateManifest:
    """Everything about ``directory`` that can be known without reading a tensor, checked on the driver.

    The manifest, the model type, DCP's ``.metadata`` (readable), every entry ``model`` needs (present, same global
    shape; ``model`` on ``meta`` is enough), and every data file the metadata points into (present and long enough:
    a removed or truncated file is found here, before any weight changes). All problems in one
    :class:`TrainingStateError` naming ``directory``.
    """
    directory = _location(directory)
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


# adapter_config.json fields that say where or how an adapter is used, not what it is
_LORA_CONTEXT_FIELDS = ("base_model_name_or_path", "inference_mode")


def check_lora_state(
    directory: str | os.PathLike[str] | StorageUrl,
    manifest: StateManifest,
    lora: Mapping[str, Any] | None,
    base: BaseFingerprint | None,
) -> None:
    """A state fits a model's adapters: both full fine-tuning, or both LoRA with the same adapter config
    (``lora``: the model's ``adapter_config.json`` dict) on the same base (``base``: the model's fingerprint).
    A :class:`TrainingStateError` naming ``directory`` and what differs otherwise."""
    directory = _location(directory)
    if manifest.lora is None and lora is None:
        return
    if manifest.lora is None:
        raise TrainingStateError(
            f"training state {directory} is a full fine-tuning state (every weight, no LoRA adapters); this model has "
            "LoRA adapters: load the model without lora= to resume it"
        )
    if lora is None:
        source = manifest.base.source if manifest.base is not None else "its base"
        raise TrainingStateError(
            f"training state {directory} holds LoRA adapters (r={manifest.lora.get('r')}) trained on {source}, not "
            "the base weights: load that base with from_pretrained(..., lora=) and the same LoraConfig to resume it, "
            "or write a merged checkpoint with `raymoe export --merge`"
        )
    differ = [
        f"{key}={manifest.lora.get(key)!r} in the state, {lora.get(key)!r} in this model"
        for key in sorted(set(manifest.lora) | set(lora))
        if key not in _LORA_CONTEXT_FIELDS and manifest.lora.get(key) != lora.get(key)
    ]
    if differ:
        raise TrainingStateError(
            f"training state {directory} holds other LoRA adapters than this model's: {'; '.join(differ)}"
        )
    if manifest.base is not None and base is not None and manifest.base.differences(base):
        raise TrainingStateError(
            f"training state {directory} holds LoRA adapters trained on {manifest.base.source}, and this model's "
            f"base {base.source} is another checkpoint: {'; '.join(manifest.base.differences(base))}; load the base "
            "the adapters were trained on"
        )


def read_metadata(directory: Location) -> Metadata:
    try:
        if isinstance(directory, StorageUrl):
            return FsspecReader(str(directory)).read_metadata()
        return FileSystemReader(directory).read_metadata()
    except Exception as error:  # DCP raises whatever reading or unpickling .metadata raised
        raise TrainingStateError(
            f"cannot read {child(directory, '.metadata')} (the index of the state's tensors): "
            f"{type(error).__name__}: {error}"
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


def _file_problems(directory: Location, metadata: Metadata) -> list[str]:
    """Data files that are missing or shorter than the last byte the metadata reads from them."""
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        end = int(info.offset) + int(info.length)
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), end)
    problems = []
    for relative, end in sorted(needed.items()):
        try:
            size = size_of(child(directory, relative))
        except OSError:
            problems.append(f"data file {relative} is missing")
            continue
        if size < end:
            problems.append(f"data file {relative} is truncated ({size} bytes, the metadata reads up to byte {end})")
    return problems


def resolve_state(location: Location) -> Location:
    """The directory of the state at ``location``: itself, or on a storage URL the generation its commit marker
    names (:mod:`raymoe.checkpoint.committed`); a :class:`TrainingStateError` for a URL with no committed state."""
    if not isinstance(location, StorageUrl):
        return location
    try:
        generation = committed(location)
    except Exception as error:  # what the URL's filesystem raised (OSError, botocore's, a garbled marker)
        raise TrainingStateError(f"cannot read the training state {location}: {error!r}") from error
    if generation is None:
        raise TrainingStateError(
            f"{location} holds no committed raymoe training state: it has no commit marker (a save that did not "
            "finish, another kind of directory, or nothing at all)"
        )
    return generation


def completed_states(directory: str | os.PathLike[str] | StorageUrl) -> list[tuple[int, Location]]:
    """``(step, path)`` of every complete ``step-<n>`` state under ``directory``, oldest first; staging
    directories (dot-prefixed) and states without their manifest (on a URL: without a commit marker) are not
    counted."""
    if isinstance(directory, StorageUrl):
        return _committed_states(directory)
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = STATE_DIR_PATTERN.match(entry.name)
        if match and entry.is_dir() and (entry / MANIFEST_FILE).is_file():
            found.append((int(match.group(1)), entry))
    return sorted(found)


def _location(directory: str | os.PathLike[str] | StorageUrl) -> Location:
    return directory if isinstance(directory, StorageUrl) else Path(directory)


def _committed_states(root: StorageUrl) -> list[tuple[int, Location]]:
    found: list[tuple[int, Location]] = []
    for name in children(root):
        match = STATE_DIR_PATTERN.match(name)
        if match and committed(root.join(name)) is not None:
            found.append((int(match.group(1)), root.join(name)))
    return sorted(found, key=lambda entry: entry[0])


def latest_state(directory: str | os.PathLike[str] | StorageUrl) -> Location | None:
    """The complete state of the highest step under ``directory``, or None."""
    states = completed_states(directory)
    return states[-1][1] if states else None
