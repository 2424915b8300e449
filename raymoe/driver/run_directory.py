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
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from raymoe.checkpoint.training_state import TrainingStateError, completed_states, latest_state, read_manifest
from raymoe.driver.local_paths import local_path
from raymoe.driver.metrics import METRICS_FILE, PLOT_FILE

CHECKPOINT_DIR = "checkpoint"
ADAPTER_DIR = "adapter"
STATES_DIR = "states"  # output_dir/states/step-00000006/: the training states save_state_every writes
LATEST = "latest"


class RunDirectory:
    """The files of one run under ``output_dir`` (made absolute on the driver)."""

    def __init__(self, output_dir: str | os.PathLike[str]) -> None:
        self.root = local_path(output_dir, "output_dir")
        self.checkpoint = self.root / CHECKPOINT_DIR
        self.adapter = self.root / ADAPTER_DIR
        self.states = self.root / STATES_DIR
        self.metrics = self.root / METRICS_FILE
        self.plot = self.root / PLOT_FILE

    def earlier_run(self) -> list[str]:
        """What of an earlier run this directory holds (empty: nothing a new run would overwrite)."""
        held = []
        if self.metrics.is_file() and self.metrics.stat().st_size > 0:
            held.append(f"a non-empty {METRICS_FILE}")
        if self.checkpoint.is_dir():
            held.append(f"a {CHECKPOINT_DIR}/ directory")
        if self.adapter.is_dir():
            held.append(f"an {ADAPTER_DIR}/ directory")
        states = completed_states(self.states)
        if states:
            held.append(f"{len(states)} training state(s) in {STATES_DIR}/, the latest of step {states[-1][0]}")
        return held

    def start_point(self, resume_from: str | os.PathLike[str] | None, overwrite: bool) -> Path | None:
        """The state a run resumes from (None: it starts at step 0), against what the directory holds. A
        ``ValueError`` when it holds an earlier run that neither ``resume_from`` nor ``overwrite`` is given for,
        or when the ``resume_from`` path is not a complete state."""
        if resume_from == LATEST:
            return self.latest_state()
        if resume_from is not None:
            path = local_path(resume_from, "resume_from")
            try:
                read_manifest(path)
            except TrainingStateError as error:
                raise TrainingStateError(f"TrainerConfig: resume_from={str(resume_from)!r}: {error}") from None
            return path
        held = self.earlier_run()
        if held and not overwrite:
            raise ValueError(
                f"output_dir {self.root} holds an earlier run ({', '.join(held)}); a new run would empty its "
                f"{METRICS_FILE} and replace its checkpoint or adapter. Continue it with resume_from={LATEST!r} "
                "(finetune.py --resume), or start over with overwrite=True (--overwrite), or pick another output_dir"
            )
        return None

    def latest_state(self) -> Path | None:
        """The newest complete training state (None: none yet)."""
        return latest_state(self.states)

    def clear_states(self) -> None:
        """``overwrite``: the earlier run's states go (the metrics start afresh; the next save replaces checkpoint/)."""
        if self.states.exists():
            shutil.rmtree(self.states)

    def saved(self, *, checkpoint: bool, adapter: bool) -> bool:
        """Whether ``checkpoint/`` (when ``checkpoint``) and ``adapter/`` (when ``adapter``) exist: what a run that
        saves those has written."""
        return (self.checkpoint.exists() or not checkpoint) and (self.adapter.exists() or not adapter)

    def clear_unsaved(self, *, checkpoint: bool, adapter: bool) -> None:
        """``overwrite``: the earlier run's ``checkpoint/`` or ``adapter/`` goes when this run does not save one
        (otherwise its next save replaces it), so nothing of the earlier run is left to be taken for this one's."""
        for path, saved in ((self.checkpoint, checkpoint), (self.adapter, adapter)):
            if not saved and path.exists():
                shutil.rmtree(path)

    def prune_states(self, keep_last: int | None, written: Path) -> None:
        """Remove the complete states older than the newest ``keep_last`` (never ``written``; staging directories
        and unfinished saves are not states, so they are never touched here)."""
        if keep_last is None:
            return
        states = completed_states(self.states)
        for _, path in states[: max(len(states) - keep_last, 0)]:
            if path != written:
                shutil.rmtree(path)
