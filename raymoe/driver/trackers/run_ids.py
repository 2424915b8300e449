"""``output_dir/trackers.json``: each tracker's run id and the last step it logged, what a resumed run reopens.

    {"mlflow": {"run_id": "6f0c...", "logged_through": 12}, "tensorboard": {"run_id": "/.../runs", ...}}

Written (atomically) when a tracker opens and after each step it logged; read only by a run that resumes from a
training state (``resume_from``): a new run (or ``overwrite=True``) starts new runs and replaces the file.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

TRACKERS_FILE = "trackers.json"


@dataclass
class TrackedRun:
    """A tracker's run id and the last step logged to it (-1: none yet)."""

    run_id: str
    logged_through: int = -1


def read_run_ids(path: Path) -> dict[str, TrackedRun]:
    """The runs ``path`` records (none when it is missing or unreadable: the trackers start new runs)."""
    try:
        entries = json.loads(path.read_text())
        return {name: TrackedRun(str(entry["run_id"]), int(entry["logged_through"])) for name, entry in entries.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def write_run_ids(path: Path, runs: dict[str, TrackedRun]) -> None:
    """Replace ``path`` with ``runs`` (a crash leaves the old file or the new one)."""
    entries = {name: {"run_id": run.run_id, "logged_through": run.logged_through} for name, run in runs.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    staged = path.with_name(f".{path.name}.tmp")
    staged.write_text(json.dumps(entries, indent=1) + "\n")
    os.replace(staged, path)
