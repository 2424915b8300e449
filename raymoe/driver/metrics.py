"""A run's metrics: one JSON object per step appended to ``metrics.jsonl``, and a PNG plot of them.

A record (fields absent when they do not apply; the routing ones only for MoE models)::

    {"step": 12, "loss": 2.91, "lr": 0.0029, "grad_norm": 0.84, "num_tokens": 1016,
     "tokens_per_s": 2210.5, "step_time_s": 0.46,
     "lm_loss": 2.90, "aux_loss": 1.03, "max_expert_imbalance": 1.9, "max_rank_imbalance": 1.2,
     "dead_experts": 0, "dropped_pairs": 0, "expert_load": [[...E...], ...one per MoE layer],
     "eval_loss": 2.95}

plus ``compile_s`` (of ``step_time_s``) on a step that compiled the decoder blocks (``compile=``: a new batch shape's
first) and ``eval_compile_s`` on an evaluation that did. ``step`` counts optimizer steps; a record with ``step: 0``
and only ``eval_loss`` (and ``eval_compile_s``) is the evaluation before training. ``loss = lm_loss + coef *
aux_loss`` (``aux_loss`` is reported even when its coefficient is 0). The plot is drawn without pyplot (a bare Agg
canvas), so it works headless and leaves a notebook's matplotlib backend alone: loss, throughput and the worst
layer's imbalance per step, and for MoE models a heatmap of each layer's expert load over the steps.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"


class MetricsLog:
    """Records kept in memory and appended, one line each, to ``path``.

    A new run (``keep_through_step`` None) creates the file empty. A resumed one passes the step it resumes at:
    the file's records up to that step (train and eval) are kept, later ones dropped (they came after the state
    and the run will make them again), and the file is rewritten with those (atomically: a crash leaves either
    the old or the new file) before it is appended to. A line a crash cut short at the end is dropped too.
    ``on_append`` is given each record appended (the Trainer's experiment trackers).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        keep_through_step: int | None = None,
        on_append: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.path = Path(path)
        self.on_append = on_append
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: list[dict[str, Any]] = []
        if keep_through_step is not None and self.path.is_file():
            self.records = [r for r in _read_tolerant(self.path) if r.get("step", 0) <= keep_through_step]
        staged = self.path.with_name(f".{self.path.name}.tmp")
        staged.write_text("".join(json.dumps(record) + "\n" for record in self.records))
        os.replace(staged, self.path)

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        if self.on_append is not None:
            self.on_append(record)


def read_metrics(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file, in order."""
    with Path(path).open() as f:
        return [json.loads(line) for line in f if line.strip()]


def _read_tolerant(path: Path) -> list[dict[str, Any]]:
    """``read_metrics``, except that an unreadable last line (a write a crash cut short) is left out."""
    lines = path.read_text().splitlines()
    last = max((number for number, line in enumerate(lines, start=1) if line.strip()), default=0)
    records = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as error:
            if number == last:
                break
            raise ValueError(f"{path} line {number} is not a JSON record: {error}") from error
    return records


def plot_metrics(records: Sequence[dict[str, Any]], path: str | os.PathLike[str]) -> Path:
    """Loss (train, its LM and aux parts, eval), tokens/s, the worst expert / rank imbalance per step and,
    for MoE models, the expert-load heatmap, as one PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    loads = [(r["step"], r["expert_load"]) for r in records if r.get("expert_load")]
    figure = Figure(figsize=(16 if loads else 12, 3.6), layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots(1, 4 if loads else 3)
    loss_ax, speed_ax, balance_ax = axes[:3]
    _line(loss_ax, records, "loss", "train loss")
    if any("lm_loss" in r and r["lm_loss"] != r["loss"] for r in records):  # the aux loss is trained on
        _line(loss_ax, records, "lm_loss", "LM part")
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
    if loads:
        _load_heatmap(figure, axes[3], loads)
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(target, dpi=100)
    return target


def _load_heatmap(figure: Any, ax: Any, loads: list[tuple[int, list[list[int]]]]) -> None:
    """Rows: (layer, expert); columns: steps; colour: the expert's share of its layer's pairs x experts (1 = fair)."""
    import numpy as np

    steps = [step for step, _ in loads]
    load_SLE = np.asarray([load for _, load in loads], dtype=np.float64)
    num_steps, num_layers, num_experts = load_SLE.shape
    share_SLE = load_SLE / np.maximum(load_SLE.sum(axis=2, keepdims=True), 1.0) * num_experts
    image = ax.imshow(
        share_SLE.reshape(num_steps, num_layers * num_experts).T,
        aspect="auto",
        interpolation="nearest",
        cmap="magma",
        vmin=0.0,
        extent=(steps[0] - 0.5, steps[-1] + 0.5, num_layers * num_experts - 0.5, -0.5),
    )
    ax.set_title("expert load (1 = fair share)")
    ax.set_xlabel("step")
    ax.set_ylabel(f"layer x expert ({num_layers} x {num_experts})")
    ax.set_yticks([layer * num_experts for layer in range(num_layers)], [f"L{layer}" for layer in range(num_layers)])
    figure.colorbar(image, ax=ax)


def _line(ax: Any, records: Sequence[dict[str, Any]], key: str, label: str, marker: str | None = None) -> None:
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    if points:
        steps, values = zip(*points, strict=True)
        ax.plot(steps, values, label=label, marker=marker)
