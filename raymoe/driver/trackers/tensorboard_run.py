"""TensorBoard: ``torch.utils.tensorboard.SummaryWriter`` event files in ``TrainerConfig.logging_dir`` (default
``output_dir/runs``; ``tensorboard --logdir`` it). Needs the ``tensorboard`` package (``raymoe[tensorboard]``).

One run is one directory. A reopened run (a resumed run, a restart, a later ``fit``) writes a new event file there
with ``purge_step`` one past the step it is at: TensorBoard then shows none of what the earlier files logged after
that step (what a crashed run logged past its last state), so each step appears once, with its last value. A new
run purges from step 0, hiding an earlier run's files in the same directory (``overwrite=True``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raymoe.driver.trackers.protocol import RunStart


class TensorBoardRun:
    """A ``SummaryWriter`` on ``logging_dir``; scalars by tag, the config as text, the plot as an image."""

    purges = True

    def __init__(self, writer: Any, logging_dir: Path) -> None:
        self._writer = writer
        self.logging_dir = logging_dir
        self.run_id = str(logging_dir)

    @classmethod
    def open(cls, start: RunStart) -> TensorBoardRun:
        reopened = start.run_id is not None
        logging_dir = Path(start.run_id) if start.run_id is not None else start.logging_dir
        run = cls(_writer(logging_dir, purge_step=start.step + 1 if reopened else 0), logging_dir)
        if not reopened:
            params = "\n".join(f"| {key} | {value} |" for key, value in start.params.items())
            run._writer.add_text("config/params", f"| parameter | value |\n|---|---|\n{params}", 0)
            run._writer.add_text("config/params.json", json.dumps(dict(start.params), indent=1), 0)
            for name, text in start.texts.items():
                run._writer.add_text(f"config/{name}", f"```\n{text}\n```", 0)
            run._writer.flush()
        return run

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        for tag, value in values.items():
            self._writer.add_scalar(tag, value, step)
        self._writer.flush()

    def log_image(self, name: str, path: Path, step: int) -> None:
        import numpy as np
        from PIL import Image

        with Image.open(path) as image:
            pixels = np.asarray(image.convert("RGB"))
        self._writer.add_image(name, pixels, step, dataformats="HWC")
        self._writer.flush()

    def rewind(self, step: int) -> None:
        self._writer.close()
        self._writer = _writer(self.logging_dir, purge_step=step + 1)

    def close(self, *, failed: bool) -> None:
        self._writer.close()


def _writer(logging_dir: Path, *, purge_step: int) -> Any:
    """A ``SummaryWriter`` appending a new event file to ``logging_dir`` that hides earlier files' steps from
    ``purge_step`` on."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(logging_dir), purge_step=purge_step)
