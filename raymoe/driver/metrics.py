"""A run's metrics: one JSON object per step appended to ``metrics.jsonl``, and a PNG plot of them.

A record (fields absent when they do not apply)::

    {"step": 12, "loss": 2.91, "lr": 0.0029, "grad_norm": 0.84, "num_tokens": 1016,
     "tokens_per_s": 2210.5, "step_time_s": 0.46, "max_expert_imbalance": 1.9,
     "max_rank_imbalance": 1.2, "eval_loss": 2.95}

``step`` counts optimizer steps; a record with ``step: 0`` and only ``eval_loss`` is the
evaluation before training. The plot is drawn without pyplot (a bare Agg canvas), so it works
headless and leaves a notebook's matplotlib backend alone.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"


class MetricsLog:
    """Records kept in memory and appended, one line each, to ``path`` (created empty for a new run)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("")
        self.records: list[dict[str, Any]] = []

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(records: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Loss (train and eval), tokens/s and the worst expert / rank imbalance per step, as one PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(12, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    loss_ax, speed_ax, balance_ax = figure.subplots(1, 3)
    _line(loss_ax, records, "loss", "train loss")
    _line(loss_ax, records, "eval_loss", "eval loss", marker="o")
    _line(speed_ax, records, "tokens_per_s", "label tokens / s")
    _line(balance_ax, records, "max_expert_imbalance", "experts (max/mean)")
    _line(balance_ax, records, "max_rank_imbalance", "ranks (max/mean)")
    for ax, title in ((loss_ax, "loss"), (speed_ax, "throughput"), (balance_ax, "load imbalance, worst layer")):
        ax.set_title(title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.has_data():
            ax.legend()
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=100)
    return target


def _line(ax: Any, records: Sequence[dict[str, Any]], key: str, label: str, marker: str | None = None) -> None:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if points:
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, label=label, marker=marker)
