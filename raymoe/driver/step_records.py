"""What the steps of a run leave behind: each step's metrics record, the progress bar's postfix, the fit's summary.

A step's record (one line of ``metrics.jsonl``)::

    {"step": 3, "loss": 2.41, "lr": 3e-3, "grad_norm": 0.9, "num_tokens": 1016, "tokens_per_s": 2310.0,
     "step_time_s": 0.44, "lm_loss": 2.33, "aux_loss": 2.01, "max_expert_imbalance": 1.3, ...}  # MoE models

``compile_s`` (of ``step_time_s``) on a step that compiled the decoder blocks, ``eval_loss`` on a step followed by an
evaluation and ``eval_compile_s`` where that compiled them.

The routing fields reduce the step's per-layer telemetry to the worst layer (imbalance) or a total (dead
experts, dropped pairs); ``expert_load`` keeps the whole ``[L, E]`` table for the plot's heat map.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from raymoe.checkpoint.storage import Location


def step_record(step: int, metrics: dict[str, Any], elapsed_s: float) -> dict[str, Any]:
    """The metrics record of ``step`` from ``train_step``'s answer and its wall time on the driver."""
    record: dict[str, Any] = {
        "step": step,
        "loss": metrics["loss"],
        "lr": metrics["lr"],
        "grad_norm": metrics["grad_norm"],
        "num_tokens": metrics["num_tokens"],
        "tokens_per_s": metrics["num_tokens"] / elapsed_s,
        "step_time_s": elapsed_s,
    }
    record.update(_routing_record(metrics))
    if "compile_s" in metrics:  # this step compiled the decoder blocks for a new shape
        record["compile_s"] = metrics["compile_s"]
    return record


@dataclass(frozen=True)
class TrainSummary:
    """The outcome of :meth:`Trainer.fit`; losses are None where nothing was measured."""

    steps: int
    first_loss: float | None
    last_loss: float | None
    eval_loss_before: float | None
    eval_loss_after: float | None
    num_tokens: int
    train_time_s: float
    checkpoint: Location | None  # the hub checkpoint this fit wrote last (a LoRA model's merged weights)
    metrics_file: Path
    plot_file: Path | None
    resumed_from: Location | None = None  # the state this Trainer started from
    state: Location | None = None  # the last training state this fit wrote
    restarts: int = 0  # how often fit() replaced failed ranks and went on (TrainerConfig.max_failures)
    adapter: Location | None = None  # the PEFT adapter directory this fit wrote last (TrainerConfig.save_adapter)
    history: list[dict[str, Any]] = field(repr=False, default_factory=list)
    compile_s: float = 0.0  # of train_time_s: the steps' compiling of decoder blocks (a new shape's first step)
    eval_compile_s: float = 0.0  # this fit's evaluations' compiling of decoder blocks

    @property
    def tokens_per_s(self) -> float:
        """Label tokens per second over the training steps, not counting the seconds they spent compiling
        (``compile_s``: the first batches of new shapes, however long the run); evaluation and saving excluded."""
        running = self.train_time_s - self.compile_s
        return self.num_tokens / running if running > 0 else 0.0


def compile_note(when: str, seconds: float) -> str:
    """The progress output's line for a step or an evaluation that compiled the decoder blocks."""
    return (
        f"{when}: compiled the decoder blocks in {seconds:.1f} s for a batch shape they had not run "
        "(once the row length changes, they compile it symbolic, for every later length)"
    )


def _routing_record(metrics: dict[str, Any]) -> dict[str, Any]:
    """The routing telemetry of a step as one metrics record's fields (empty for a dense model)."""
    if "expert_imbalance" not in metrics:
        return {}
    return {
        "lm_loss": metrics["lm_loss"],
        "aux_loss": metrics["aux_loss"],
        "max_expert_imbalance": max(metrics["expert_imbalance"]),
        "max_rank_imbalance": max(metrics["rank_imbalance"]),
        "dead_experts": sum(metrics["dead_experts"]),
        "dropped_pairs": sum(metrics["dropped_pairs"]),
        "expert_load": metrics["expert_load"],
    }


def progress_postfix(record: dict[str, Any]) -> dict[str, str]:
    """What the progress bar shows of a record: loss, tokens/s, and for MoE models the worst imbalance and aux."""
    shown = {"loss": f"{record['loss']:.3f}", "tok/s": f"{record['tokens_per_s']:.0f}"}
    if "max_expert_imbalance" in record:
        shown["imbalance"] = f"{record['max_expert_imbalance']:.2f}"  # the worst layer
        shown["aux"] = f"{record['aux_loss']:.3f}"
        if record["dead_experts"]:
            shown["dead"] = str(record["dead_experts"])
        if record["dropped_pairs"]:
            shown["dropped"] = str(record["dropped_pairs"])
    if "eval_loss" in record and math.isfinite(record["eval_loss"]):
        shown["eval"] = f"{record['eval_loss']:.3f}"
    return shown
