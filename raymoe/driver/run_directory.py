"""A run's output directory, and the policy for what an earlier run left there (nothing is lost by accident).

    output_dir/
      metrics.jsonl           one record per step, evaluation and restart (raymoe.driver.metrics)
      metrics.png             the plot, at the end of fit()
      checkpoint/             the hub checkpoint (save_every, the end); of a LoRA model, the merged weights
      adapter/                a LoRA model's adapters, a PEFT directory (TrainerConfig.save_adapter)
      states/step-00000006/   training states (save_state_every); keep_last of them stay

An ``output_dir`` holding an earlier run (a non-empty ``metrics.jsonl``, ``checkpoint/``, ``adapter/`` or a state) is
refused unless the run says what to do with it: resume from a state (``resume_from``) or start over (``overwrite``).
Everything here is checked on the driver, without writing, before any rank is asked.

``output_dir`` may be a storage URL (``s3://bucket/run``): the ranks write the checkpoint and the states there
(:mod:`raymoe.checkpoint.committed`, :mod:`raymoe.checkpoint.upload`), and the driver's own files (metrics, plot,
trackers) are written in a local mirror (``root``) and published to the URL after each state save and at the end of
``fit`` (:meth:`RunDirectory.publish`); a resumed run takes the URL's metrics back into its mirror first.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from raymoe.checkpoint.storage import Location, StorageUrl, UserPath, child, is_directory, size_of
from raymoe.checkpoint.training_state import (
    TrainingStateError,
    completed_states,
    latest_state,
    read_manifest,
    resolve_state,
)
from raymoe.checkpoint.upload import upload_directory
from raymoe.driver.local_paths import storage_path
from raymoe.driver.metrics import METRICS_FILE, PLOT_FILE
from raymoe.driver.trackers.run_ids import TRACKERS_FILE
from raymoe.spec.shared_paths import SharedPath, write_path

CHECKPOINT_DIR = "checkpoint"
ADAPTER_DIR = "adapter"
STATES_DIR = "states"  # output_dir/states/step-00000006/: the training states save_state_every writes
LATEST = "latest"


class SavesTokenizer(Protocol):
    def save(self, directory: str | os.PathLike[str]) -> Path: ...


class RunDirectory:
    """The files of one run under ``output_dir`` (made absolute on the driver, or a checked storage URL:
    ``remote``, the driver's files then in the local mirror ``root``)."""

    def __init__(self, output_dir: UserPath, *, checked: Location | None = None) -> None:
        """``checked``: ``output_dir`` as :func:`storage_path` already resolved it (no second probe of a URL)."""
        where = checked if checked is not None else storage_path(output_dir, "output_dir", write=True)
        self._published: dict[Path, tuple[int, int]] = {}  # mirror file -> (size, mtime) when last uploaded
        self.remote = where if isinstance(where, StorageUrl) else None
        self.root = where if isinstance(where, Path) else _mirror(where)
        self.where: Location = where  # output_dir as the user knows it
        self.checkpoint = child(where, CHECKPOINT_DIR)
        self.adapter = child(where, ADAPTER_DIR)
        self.states = child(where, STATES_DIR)
        self.metrics = self.root / METRICS_FILE
        self.plot = self.root / PLOT_FILE

    def earlier_run(self) -> list[str]:
        """What of an earlier run this directory holds (empty: nothing a new run would overwrite)."""
        held = []
        if _size(child(self.where, METRICS_FILE)) > 0:
            held.append(f"a non-empty {METRICS_FILE}")
        if is_directory(self.checkpoint):
            held.append(f"a {CHECKPOINT_DIR}/ directory")
        if is_directory(self.adapter):
            held.append(f"an {ADAPTER_DIR}/ directory")
        states = completed_states(self.states)
        if states:
            held.append(f"{len(states)} training state(s) in {STATES_DIR}/, the latest of step {states[-1][0]}")
        return held

    def start_point(self, resume_from: UserPath | None, overwrite: bool) -> Location | None:
        """The state a run resumes from (None: it starts at step 0), against what the directory holds. A
        ``ValueError`` when it holds an earlier run that neither ``resume_from`` nor ``overwrite`` is given for,
        or when the ``resume_from`` path is not a complete state."""
        if resume_from == LATEST:
            return self.latest_state()
        if resume_from is not None:
            path = storage_path(resume_from, "resume_from", write=False)
            try:
                read_manifest(resolve_state(path))
            except TrainingStateError as error:
                raise TrainingStateError(f"TrainerConfig: resume_from={str(resume_from)!r}: {error}") from None
            return path
        held = self.earlier_run()
        if held and not overwrite:
            raise ValueError(
                f"output_dir {self.where} holds an earlier run ({', '.join(held)}); a new run would empty its "
                f"{METRICS_FILE} and replace its checkpoint or adapter. Continue it with resume_from={LATEST!r} "
                "(finetune.py --resume), or start over with overwrite=True (--overwrite), or pick another output_dir"
            )
        return None

    def latest_state(self) -> Location | None:
        """The newest complete training state (None: none yet)."""
        return latest_state(self.states)

    def clear_states(self) -> None:
        """``overwrite``: the earlier run's states go (the metrics start afresh; the next save replaces checkpoint/)."""
        _remove(self.states)

    def saved(self, *, checkpoint: bool, adapter: bool) -> bool:
        """Whether ``checkpoint/`` (when ``checkpoint``) and ``adapter/`` (when ``adapter``) exist: what a run that
        saves those has written."""
        return (is_directory(self.checkpoint) or not checkpoint) and (is_directory(self.adapter) or not adapter)

    def clear_unsaved(self, *, checkpoint: bool, adapter: bool) -> None:
        """``overwrite``: the earlier run's ``checkpoint/`` or ``adapter/`` goes when this run does not save one
        (otherwise its next save replaces it), so nothing of the earlier run is left to be taken for this one's."""
        for path, saved in ((self.checkpoint, checkpoint), (self.adapter, adapter)):
            if not saved:
                _remove(path)

    def after_state_save(self, keep_last: int | None, written: Location) -> None:
        """A state was written: remove the complete states older than the newest ``keep_last`` (never ``written``;
        unfinished saves are not states, so they are never touched here), then :meth:`publish`."""
        if keep_last is not None:
            states = completed_states(self.states)
            for _, path in states[: max(len(states) - keep_last, 0)]:
                if path != written:
                    _remove(path)
        self.publish()

    def shared_paths(self) -> list[SharedPath]:
        """What every rank node must see as the driver does (:mod:`raymoe.spec.shared_paths`): a local
        ``output_dir`` (the ranks write state shards there); nothing for a URL (every node reaches it itself)."""
        return [write_path("output_dir", self.root)] if self.remote is None else []

    def write(self, save: Callable[[Location], object], path: Location, tokenizer: SavesTokenizer | None) -> None:
        """``save(path)`` (a checkpoint, an adapter), and the tokenizer beside it (to a URL: saved here, uploaded)."""
        save(path)
        if tokenizer is None:
            return
        if isinstance(path, Path):
            tokenizer.save(path)
            return
        with tempfile.TemporaryDirectory(prefix="raymoe-tokenizer-") as scratch:
            tokenizer.save(scratch)
            upload_directory(Path(scratch), path, replace_weights=False)

    def open_mirror(self, *, resumed: bool) -> None:
        """On a URL: the mirror emptied (nothing of another run there is published as this one's) and, for a resumed
        run, the URL's metrics and tracker files taken into it (what the run keeps)."""
        if self.remote is None:
            return
        shutil.rmtree(self.root, ignore_errors=True)
        self.root.mkdir(parents=True)
        fs = self.remote.filesystem()
        for name in (METRICS_FILE, TRACKERS_FILE) if resumed else ():
            if fs.exists(self.remote.join(name).path):
                fs.get_file(self.remote.join(name).path, str(self.root / name))

    def publish(self) -> None:
        """On a URL: the mirror's files (metrics, plot, trackers' local stores) that changed since the last publish
        uploaded to it; nothing locally."""
        if self.remote is None:
            return
        now = {path: _stamp(path) for path in self.root.rglob("*") if path.is_file()}
        changed = [path for path, stamp in now.items() if self._published.get(path) != stamp]
        if changed:
            upload_directory(self.root, self.remote, replace_weights=False, only=set(changed))
        self._published.update({path: now[path] for path in changed})


def _mirror(remote: StorageUrl) -> Path:
    """The driver's local directory for a URL run's own files: one per URL, in the temporary directory."""
    digest = hashlib.sha256(str(remote).encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "raymoe-runs" / f"{remote.name}-{digest}"


def _stamp(path: Path) -> tuple[int, int]:
    stat = path.stat()
    return stat.st_size, stat.st_mtime_ns


def _size(location: Location) -> int:
    try:
        return size_of(location)
    except FileNotFoundError:
        return 0


def _remove(location: Location) -> None:
    if isinstance(location, Path):
        if location.exists():
            shutil.rmtree(location)
    elif is_directory(location):
        location.filesystem().rm(location.path, recursive=True)
