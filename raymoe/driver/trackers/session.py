"""The experiment trackers of one :class:`~raymoe.driver.trainer.Trainer` (``TrainerConfig.report_to``): opened at
the start of each ``fit``, given every ``metrics.jsonl`` record, the plot at the end, and closed.

    Trackers(config, run_directory, resumed_at=...)   which trackers, and the runs a resumed run reopens
      opened(model, step)        a context for one fit: open (new runs, or the runs of trackers.json), close after
      note_step(step, metrics)   train_step's per-layer routing telemetry, for the record of that step
      log(record)                a record as scalars at its step (metrics.jsonl's on_append)
      rewind(step)               the failure policy restarted from the state of ``step``
      log_image(path, step)      the plot (metrics.png), at the end of the fit

Each step reaches each tracker once: a tracker keeps the last step it logged (in ``output_dir/trackers.json``, which a
resumed run reads back) and is not given that step or an earlier one again, except TensorBoard, which hides what
follows a step when its run is reopened there (``purge_step``) and is given those steps again. So after a restart or
a resume the append-only tools (MLflow, wandb, trackio) keep the values first logged for the steps the run made
again (the same values, as the restarted run recomputes the uninterrupted one), and TensorBoard shows the new ones.

A tracker that raises while logging is a warning and logs nothing more in this Trainer; the run goes on
(``metrics.jsonl`` has every step). One that cannot open its run at the first ``fit`` is an error before any step.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

from raymoe.driver.local_paths import local_path
from raymoe.driver.trackers.logged_values import PER_LAYER, run_params, run_texts, step_scalars
from raymoe.driver.trackers.mlflow_run import MlflowRun
from raymoe.driver.trackers.protocol import RunStart, Tracker
from raymoe.driver.trackers.run_ids import TRACKERS_FILE, TrackedRun, read_run_ids, write_run_ids
from raymoe.driver.trackers.tensorboard_run import TensorBoardRun
from raymoe.driver.trackers.trackio_run import TrackioRun
from raymoe.driver.trackers.wandb_run import WandbRun

if TYPE_CHECKING:
    from raymoe.driver.handle import DistributedModel
    from raymoe.driver.run_directory import RunDirectory
    from raymoe.driver.trainer_config import TrainerConfig

OPENERS: dict[str, Callable[[RunStart], Tracker]] = {
    "tensorboard": TensorBoardRun.open,
    "mlflow": MlflowRun.open,
    "wandb": WandbRun.open,
    "trackio": TrackioRun.open,
}
PLOT_NAME = "plot"


class Trackers:
    """The trackers ``config.report_to`` names, for the run in ``run``; see the module doc."""

    def __init__(self, config: TrainerConfig, run: RunDirectory, *, resumed_at: int | None) -> None:
        self.config = config
        self.names = config.trackers
        self.run_name = config.run_name or run.where.name
        self.output_dir = run.root
        self.logging_dir = local_path(config.logging_dir, "logging_dir") if config.logging_dir else run.root / "runs"
        self.path = run.root / TRACKERS_FILE
        # A run resumed from a state continues the runs it logged to; any other starts new ones.
        self.runs: dict[str, TrackedRun] = read_run_ids(self.path) if resumed_at is not None and self.names else {}
        self.open: dict[str, Tracker] = {}
        self.dropped: set[str] = set()
        self._started = False
        self._layers: tuple[int, dict[str, Any]] | None = None

    @contextmanager
    def opened(self, model: DistributedModel, step: int) -> Iterator[Trackers]:
        """Open every tracker at ``step`` for one ``fit``; close them after it (marked failed when it raised)."""
        self._open_all(model, step)
        try:
            yield self
        except BaseException:
            self._close_all(failed=True)
            raise
        self._close_all(failed=False)

    def _open_all(self, model: DistributedModel, step: int) -> None:
        names = [name for name in self.names if name not in self.dropped]
        if not names:
            return
        new = any(name not in self.runs for name in names)
        params = run_params(self.config, model) if new else {}
        texts = run_texts(model) if new else {}
        for name in names:
            known = self.runs.get(name)
            run_id = known.run_id if known is not None else None
            start = RunStart(self.run_name, self.output_dir, self.logging_dir, step, run_id, params, texts)
            try:
                tracker = OPENERS[name](start)
            except Exception as error:
                if self._started:
                    self._drop(name, error, "reopening its run")
                    continue
                self._close_all(failed=True)
                raise RuntimeError(
                    f"report_to: {name} could not start its run: {type(error).__name__}: {error}"
                ) from error
            self.open[name] = tracker
            logged = -1 if known is None else step if tracker.purges else known.logged_through
            self.runs[name] = TrackedRun(tracker.run_id, logged)
        self._started = True
        self._save()

    def note_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        """``train_step``'s per-layer telemetry of ``step``, logged with that step's record."""
        if self.open:
            self._layers = (step, {key: metrics[key] for key in PER_LAYER if key in metrics})

    def log(self, record: Mapping[str, Any]) -> None:
        """A ``metrics.jsonl`` record as scalars at its step, to each tracker that has not logged that step yet."""
        if not self.open:
            return
        step = int(record.get("step", 0))
        per_layer = self._layers[1] if self._layers is not None and self._layers[0] == step else None
        values = step_scalars(record, per_layer)
        if not values:  # a restart record: metrics.jsonl keeps it
            return
        for name, tracker in list(self.open.items()):
            if step <= self.runs[name].logged_through:
                continue
            try:
                tracker.log_scalars(step, values)
            except Exception as error:
                self._drop(name, error, f"logging step {step}")
                continue
            self.runs[name].logged_through = step
        self._save()

    def rewind(self, step: int) -> None:
        """The run went back to ``step``: a purging tracker logs what follows again, the others go on after theirs."""
        for name, tracker in list(self.open.items()):
            try:
                tracker.rewind(step)
            except Exception as error:
                self._drop(name, error, f"going back to step {step}")
                continue
            if tracker.purges:
                self.runs[name].logged_through = step
        self._save()

    def log_image(self, path: Path | None, step: int) -> None:
        """The plot of the run (``metrics.png``, with its expert-load heatmap) as an image at ``step``."""
        if path is None:
            return
        for name, tracker in list(self.open.items()):
            try:
                tracker.log_image(PLOT_NAME, path, step)
            except Exception as error:
                self._drop(name, error, "logging the plot")

    def _close_all(self, *, failed: bool) -> None:
        for name, tracker in list(self.open.items()):
            try:
                tracker.close(failed=failed)
            except Exception as error:
                warnings.warn(f"report_to: {name} failed to close its run: {error}", RuntimeWarning, stacklevel=2)
        self.open = {}

    def _drop(self, name: str, error: Exception, doing: str) -> None:
        """Warn, close the tracker's run as failed (if it can) and log nothing more to it in this Trainer."""
        warnings.warn(
            f"report_to: {name} failed {doing} ({type(error).__name__}: {error}); it logs nothing more in this run, "
            "which goes on (metrics.jsonl has every step)",
            RuntimeWarning,
            stacklevel=3,
        )
        self.dropped.add(name)
        tracker = self.open.pop(name, None)
        if tracker is not None:
            with suppress(Exception):  # a tracker that failed may fail to close too; the warning said it is gone
                tracker.close(failed=True)

    def _save(self) -> None:
        if self.runs:
            write_run_ids(self.path, self.runs)
