"""MLflow: a run through ``mlflow.tracking.MlflowClient`` (``raymoe[mlflow]``, the ``mlflow-skinny`` client).

The store is ``MLFLOW_TRACKING_URI`` (unset: MLflow's own default), the experiment ``MLFLOW_EXPERIMENT_NAME``
(created if absent) or ``MLFLOW_EXPERIMENT_ID`` (neither: MLflow's Default experiment), the run's name
``TrainerConfig.run_name``. Hyperparameters are params (logged once, when the run is created: MLflow's params cannot
change), the rank picture and plans text artifacts, each step's scalars metrics at that step, the plot the artifact
``metrics.png``. A reopened run (resume, restart, a later ``fit``) is ``MlflowClient.update_run`` on its id back to
RUNNING; MLflow keeps every value logged, so the caller logs each step once (``session.Trackers``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from raymoe.driver.trackers.protocol import RunStart

MAX_PARAMS_PER_BATCH = 100  # MLflow's limit on the params of one log_batch
MAX_PARAM_LENGTH = 6000  # and on a param value's length


class MlflowRun:
    """One MLflow run, by id."""

    purges = False

    def __init__(self, client: Any, run_id: str) -> None:
        self._client = client
        self.run_id = run_id

    @classmethod
    def open(cls, start: RunStart) -> MlflowRun:
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        if start.run_id is not None:
            client.update_run(start.run_id, status="RUNNING")
            return cls(client, start.run_id)
        run_id = str(client.create_run(_experiment_id(client), run_name=start.run_name).info.run_id)
        params = [Param(key, str(value)[:MAX_PARAM_LENGTH]) for key, value in start.params.items()]
        for begin in range(0, len(params), MAX_PARAMS_PER_BATCH):
            client.log_batch(run_id, params=params[begin : begin + MAX_PARAMS_PER_BATCH])
        for name, text in start.texts.items():
            client.log_text(run_id, text, f"{name}.txt")
        return cls(client, run_id)

    def log_scalars(self, step: int, values: Mapping[str, float]) -> None:
        from mlflow.entities import Metric

        now_ms = int(time.time() * 1000)
        self._client.log_batch(self.run_id, metrics=[Metric(key, value, now_ms, step) for key, value in values.items()])

    def log_image(self, name: str, path: Path, step: int) -> None:
        self._client.log_artifact(self.run_id, str(path))

    def rewind(self, step: int) -> None:
        """Nothing to do: the steps MLflow holds stay, and the caller does not log them again."""

    def close(self, *, failed: bool) -> None:
        self._client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


def _experiment_id(client: Any) -> str:
    """``MLFLOW_EXPERIMENT_NAME``'s experiment (created if absent), else ``MLFLOW_EXPERIMENT_ID``, else Default's."""
    name = os.environ.get("MLFLOW_EXPERIMENT_NAME")
    if name:
        experiment = client.get_experiment_by_name(name)
        return str(experiment.experiment_id) if experiment is not None else str(client.create_experiment(name))
    return os.environ.get("MLFLOW_EXPERIMENT_ID") or "0"
