"""Experiment trackers (``TrainerConfig.report_to``): TensorBoard, MLflow, Weights & Biases, Trackio, driver-side.

names.py             the names report_to takes ("none", "all", each tool), the extra each needs, the check
protocol.py          Tracker (one tool's run) and RunStart (what it opens with)
logged_values.py     what is logged: a step's scalars, the run's hyperparameters and descriptions
run_ids.py           output_dir/trackers.json: the runs a resumed run reopens, the last step each logged
session.py           Trackers: the set a Trainer drives (open, log, rewind, the plot, close; failures dropped)
tensorboard_run.py, mlflow_run.py, wandb_run.py, trackio_run.py   one class per tool, its library imported
                     inside its functions only (``import raymoe`` imports no tracker)
"""

from raymoe.driver.trackers.names import TRACKERS, TrackerNotInstalled, resolve_report_to
from raymoe.driver.trackers.session import Trackers

__all__ = ["TRACKERS", "TrackerNotInstalled", "Trackers", "resolve_report_to"]
