"""What every experiment tracker does for a run (:class:`Tracker`), and what it opens one with (:class:`RunStart`).

One class per tool implements it (``tensorboard_run``, ``mlflow_run``, ``wandb_run``, ``trackio_run``), each through the
tool's own public API, its library imported inside its ``open`` only (``import raymoe`` imports no tracker).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

Param = str | int | float | bool


@dataclass(frozen=True)
class RunStart:
    """What a tracker opens a run with.

    ``step``: the step the run is at (the next step logged is ``step + 1``; 0 before the evaluation at step 0).
    ``run_id``: the run to reopen (a resumed run, or a later ``fit``), or None for a new one. ``params``: flat
    hyperparameters (``trainer/lr``, ``layout/tp_size``, ...); ``texts``: longer descriptions (the rank picture,
    the plans), each a name and its text. A reopened run keeps the ``params`` and ``texts`` of its start."""

    run_name: str
    output_dir: Path
    logging_dir: Path
    step: int
    run_id: str | None = None
    params: Mapping[str, Param] = field(default_factory=dict)
    texts: Mapping[str, str] = field(default_factory=dict)


class Tracker(Protocol):
    """One tool's run. Every call may raise: the caller warns and drops the tracker (``session.Trackers``).

    ``purges``: whether the tool hides what was logged after a step when the run is reopened there (TensorBoard's
    ``purge_step``); the others keep what they have (append-only stores), so the caller logs a step there once."""

    run_id: str
    purges: bool

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        """``values`` at ``step``."""

    def log_image(self, name: str, path: Path, step: int) -> None:
        """The PNG ``path`` as an image (or artifact) ``name`` at ``step``."""

    def rewind(self, step: int) -> None:
        """The run went back to ``step`` (a restart from a state): what follows is logged from ``step + 1`` again."""

    def close(self, *, failed: bool) -> None:
        """Flush and end the run (``failed``: ``fit`` raised)."""
