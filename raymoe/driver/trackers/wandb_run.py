"""Weights & Biases: ``wandb.init`` / ``run.log`` / ``run.finish`` (``raymoe[wandb]``).

wandb reads its own settings from the environment: ``WANDB_PROJECT`` (unset: ``raymoe``), ``WANDB_MODE``
(``offline``: a local run directory, ``wandb sync`` uploads it later), ``WANDB_DIR`` (unset: ``output_dir``, so
the run lands in ``output_dir/wandb/``), ``WANDB_API_KEY``, ... The run is named ``TrainerConfig.run_name``; the
hyperparameters and descriptions are its config. A reopened run (resume, restart, a later ``fit``) is
``wandb.init(id=..., resume="allow")``: the same run, its step axis going on. wandb accepts each step once (an
earlier step is dropped), and offline each session writes its own file, so the caller logs each step once
(``session.Trackers``).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raymoe.driver.trackers.protocol import RunStart

DEFAULT_PROJECT = "raymoe"


class WandbRun:
    """One wandb run."""

    purges = False

    def __init__(self, run: Any) -> None:
        self._run = run
        self.run_id = str(run.id)

    @classmethod
    def open(cls, start: RunStart) -> WandbRun:
        import wandb

        config = None if start.run_id is not None else {**start.params, **start.texts}
        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            name=start.run_name,
            id=start.run_id,
            resume="allow" if start.run_id is not None else None,
            dir=None if os.environ.get("WANDB_DIR") else str(start.output_dir),
            config=config,
            reinit="create_new",
        )
        return cls(run)

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        self._run.log(dict(values), step=step)

    def log_image(self, name: str, path: Path, step: int) -> None:
        import wandb

        self._run.log({name: wandb.Image(str(path))}, step=step)

    def rewind(self, step: int) -> None:
        """Nothing to do: wandb keeps the steps it has, and the caller does not log them again."""

    def close(self, *, failed: bool) -> None:
        self._run.finish(exit_code=1 if failed else 0)
