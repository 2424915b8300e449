"""The handle's training states: save (every rank its own shards, DCP), wait for an asynchronous save, check, load.

Format and its checks: :mod:`raymoe.checkpoint.training_state`; the ranks' side: :mod:`raymoe.rank.state`.

    save(path, async, extra)   manifest from the session (step, AdamW and balance settings) -> every rank writes
    wait()                     an asynchronous save finished and swapped in, or its failure raised
    check(path)                a CheckedState: manifest, model type, every entry and data file, on the driver;
                               under LoRA also the adapter config and the base's fingerprint
    load(CheckedState)         every rank reads its shards; the session takes the saved settings and step

A failure raises one error naming the directory and changes nothing: ``path`` keeps its previous state, the
model its weights and optimizer. ``path`` may be a storage URL (``s3://bucket/run/state``): the state is then a
generation under it that a commit marker makes visible (:mod:`raymoe.checkpoint.committed`).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from raymoe.checkpoint.committed import new_generation, remove_uncommitted
from raymoe.checkpoint.fingerprint import BaseFingerprint, fingerprint_base
from raymoe.checkpoint.hub import resolve_config_file
from raymoe.checkpoint.staging import (
    CheckpointSaveError,
    recover_interrupted_save,
    staging_directory,
    swappable_target,
)
from raymoe.checkpoint.storage import Location, StorageUrl
from raymoe.checkpoint.training_state import (
    StateManifest,
    TrainingStateError,
    check_lora_state,
    check_training_state,
    read_manifest,
    resolve_state,
)
from raymoe.driver.fanout import FanOut
from raymoe.driver.local_paths import storage_path
from raymoe.driver.training import TrainingSession
from raymoe.rank.contract import StateAnswer, StateRequest
from raymoe.rank.state import load_training_state, save_training_state, wait_for_state_save
from raymoe.spec.balance import BalanceConfig
from raymoe.spec.launch import LaunchSpec
from raymoe.spec.optimizer import OptimizerConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckedState:
    """A training state checked against this model on the driver: its (absolute) directory (on a storage URL: the
    committed generation), its manifest and the optimizer and balance settings it restores."""

    directory: Location
    manifest: StateManifest
    optimizer: OptimizerConfig
    balance: BalanceConfig


class TrainingStates:
    """Saving and loading the training state of one handle's model (``spec``) and session."""

    def __init__(self, spec: LaunchSpec, session: TrainingSession, fanout: FanOut) -> None:
        self.spec, self.session, self.fanout = spec, session, fanout
        self.saving: Location | None = None  # the target of an asynchronous save still writing
        self._base: BaseFingerprint | None = None  # the base checkpoint's, under LoRA: read once, when first needed

    def lora_config(self) -> dict[str, Any] | None:
        """The adapter's ``adapter_config.json`` dict as a manifest holds it (JSON types); None without LoRA."""
        if self.spec.lora is None:
            return None
        loaded: dict[str, Any] = json.loads(json.dumps(self.spec.lora.config.to_peft_dict(self.spec.source)))
        return loaded

    def base_fingerprint(self) -> BaseFingerprint | None:
        """The fingerprint of the checkpoint the model was loaded from, under LoRA (None without)."""
        if self.spec.lora is None:
            return None
        if self._base is None:
            spec = self.spec
            weights = Path(spec.source) if Path(spec.source).is_dir() else None
            if weights is None:  # a hub id: its snapshot on this machine (config.json at least; weights if fetched)
                weights = resolve_config_file(spec.source, revision=spec.revision, cache_dir=spec.cache_dir).parent
            self._base = fingerprint_base(spec.source, spec.model_config, weights)
        return self._base

    def save(self, target: Location, async_save: bool, extra: Mapping[str, Any] | None) -> Location:
        """``target``: the place the handle checked (:func:`~raymoe.driver.local_paths.storage_path`), probed once."""
        optimizer = self.session.require_optimizer("save_state")
        checked_extra = _checked_extra(extra)
        self.wait()
        target, staging = _save_target(target)
        topology = self.fanout.topology
        manifest = StateManifest(
            model_config=dict(self.spec.model_config),
            step=self.session.step,
            optimizer=asdict(optimizer),
            balance=asdict(self.session.balance),
            world_size=topology.world_size,
            saved_layout=topology.config.model_dump(mode="json"),
            extra=checked_extra,
            checkpoint_dtype=str(self.session.precision.checkpoint).removeprefix("torch."),
            lora=self.lora_config(),
            base=self.base_fingerprint(),
        )
        request = StateRequest(str(staging), str(target), manifest.to_json(), async_save)
        answers: list[StateAnswer] = self.fanout.every_rank(save_training_state, request)
        if async_save:
            self.saving = target
        else:
            _report_save(answers, target)
        return target

    def wait(self) -> Location | None:
        target, self.saving = self.saving, None
        if target is None:
            return None
        answers = [a for a in self.fanout.every_rank(wait_for_state_save) if a is not None]
        _report_save(answers, target)
        return target

    def check(self, path: str | os.PathLike[str] | StorageUrl) -> CheckedState:
        """Everything checkable on the driver (the manifest read once), before any rank reads."""
        directory = resolve_state(storage_path(path, "state path", write=False))
        check_lora_state(directory, read_manifest(directory), self.lora_config(), self.base_fingerprint())
        manifest = check_training_state(directory, self.spec.build_meta_model(), self.spec.config.model_type)
        try:
            optimizer = OptimizerConfig(**manifest.optimizer)
            balance = BalanceConfig(**manifest.balance)
        except (TypeError, ValueError) as error:
            raise TrainingStateError(
                f"training state {directory}: bad optimizer or balance settings: {error}"
            ) from error
        return CheckedState(directory, manifest, optimizer, balance)

    def load(self, state: CheckedState) -> StateManifest:
        self.wait()
        answers: list[StateAnswer] = self.fanout.every_rank(
            load_training_state, str(state.directory), state.optimizer, state.balance
        )
        failures = _failures(answers)
        if failures:
            raise TrainingStateError(
                f"load_state({str(state.directory)!r}) loaded nothing: {failures}; the model is unchanged"
            )
        _log_changed_settings(self.session.optimizer, state.optimizer, self.session.balance, state.balance)
        self.session.restore(state.optimizer, state.balance, state.manifest.step)
        return state.manifest


def _save_target(target: Location) -> tuple[Location, Location]:
    """The target of a save and where it stages: beside a local target (swapped in by rename), or a new generation
    under a URL (committed by its marker); what saves that did not finish left there is removed first."""
    if isinstance(target, StorageUrl):
        try:
            removed = remove_uncommitted(target)
        except Exception as error:  # what the URL's filesystem raised (OSError, botocore's, a garbled marker)
            raise CheckpointSaveError(
                f"save_state({str(target)!r}) saved nothing: cannot use {target}: {error!r}"
            ) from error
        for generation in removed:
            logger.warning("removed %s, left by a save into %s that did not commit", generation, target)
        return target, new_generation(target)
    local = swappable_target(target)
    recover_interrupted_save(local)
    return local, staging_directory(local)


def _checked_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """``extra`` as a plain dict, or a ``ValueError`` before any rank writes when JSON cannot hold it."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"save_state: extra must be a dict, got {type(extra).__name__}")
    try:
        json.dumps(dict(extra))
    except (TypeError, ValueError) as error:
        raise ValueError(f"save_state: extra must be JSON-serialisable: {error}") from error
    return dict(extra)


def _failures(answers: Sequence[StateAnswer]) -> str:
    """The distinct failures the ranks answered, one clause each (every rank reports DCP's failure)."""
    return "; ".join(dict.fromkeys(a.error for a in answers if a.error is not None))


def _report_save(answers: Sequence[StateAnswer], target: Location) -> None:
    """Log what a finished save wrote, or raise its failure as one ``CheckpointSaveError``."""
    failures = _failures(answers)
    if failures:
        errno = next((a.errno for a in answers if a.errno is not None), None)
        raise CheckpointSaveError(
            f"save_state({str(target)!r}) saved nothing: {failures}. {target} keeps what it held before; the model "
            "is still loaded (weights and optimizer state): fix the cause and call save_state again",
            errno,
        )
    written = sum(a.bytes_written for a in answers)
    logger.info(
        "training state %s: %.1f MB from %d ranks, the slowest in %.2f s",
        target, written / 1e6, len(answers), max((a.seconds for a in answers), default=0.0),
    )  # fmt: skip


def _log_changed_settings(
    optimizer: OptimizerConfig | None, saved: OptimizerConfig, balance: BalanceConfig, saved_balance: BalanceConfig
) -> None:
    """Say which configured settings the loaded state replaced (load_state restores the saved run's)."""
    if optimizer is None:
        return
    before, after = asdict(optimizer) | asdict(balance), asdict(saved) | asdict(saved_balance)
    changed = [f"{key}={before[key]!r} -> {after[key]!r}" for key in after if before.get(key) != after[key]]
    if changed:
        logger.warning("load_state restored the saved run's training settings: %s", ", ".join(changed))
