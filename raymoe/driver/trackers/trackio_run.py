"""Trackio: ``trackio.init`` / ``run.log`` / ``run.finish`` (``raymoe[trackio]``), a local SQLite store by default.

The project is ``TRACKIO_PROJECT`` (unset: ``raymoe``); trackio itself reads ``TRACKIO_DIR`` (where the local store
lives, default under the Hugging Face cache), ``TRACKIO_SPACE_ID`` / ``TRACKIO_SERVER_URL`` (log to a Space or a
server instead). The run is named ``TrainerConfig.run_name``; the hyperparameters and descriptions are its config.
A reopened run (resume, restart, a later ``fit``) is ``trackio.init(name=..., resume="allow")``, the same run by
name; trackio keeps every row logged, so the caller logs each step once (``session.Trackers``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raymoe.driver.trackers.protocol import RunStart

DEFAULT_PROJECT = "raymoe"


class TrackioRun:
    """One trackio run, reopened by its name."""

    purges = False

    def __init__(self, run: Any) -> None:
        self._run = run
        self.run_id = str(run.name)

    @classmethod
    def open(cls, start: RunStart) -> TrackioRun:
        import trackio

        run = trackio.init(
            project=os.environ.get("TRACKIO_PROJECT") or DEFAULT_PROJECT,
            name=start.run_id if start.run_id is not None else start.run_name,
            config=None if start.run_id is not None else {**start.params, **start.texts},
            resume="allow" if start.run_id is not None else "never",
            embed=False,
            auto_log_gpu=False,
            auto_log_cpu=False,
        )
        return cls(run)

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def log_image(self, name: str, path: Path, step: int) -> None:
        import trackio

        self._run.log({name: trackio.Image(str(path))}, step=step)

    def rewind(self, step: int) -> None:
        """Nothing to do: trackio keeps the rows it has, and the caller does not log those steps again."""

    def close(self, *, failed: bool) -> None:
        self._run.finish()
