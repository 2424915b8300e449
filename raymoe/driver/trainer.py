"""``raymoe.Trainer``: fit a sharded model on packed data from the driver, with progress, metrics and checkpoints.

    Trainer(model, train_data, TrainerConfig(output_dir=..., steps=...), eval_data=..., tokenizer=...)
      checks (before any step)   seq_len <= max_position_embeddings, ids < vocab_size, enough rows,
                                 global_batch_size vs data-parallel ranks x gradient accumulation
      fit()                      per step: next global batch -> model.train_step(lr=schedule(step),
                                 micro_batches=gradient_accumulation_steps) -> metrics.jsonl + progress bar;
                                 eval before the first step, every eval_every steps and after the last;
                                 checkpoint every save_every steps and at the end; metrics.png at the end
      evaluate() / save()        on request

Token counting does not depend on the layout: the global batch is what ``train_step`` gets,
the loss is the mean over all its label tokens (``num_tokens``, counted on the driver), and
gradient accumulation splits each data-parallel rank's rows into micro-batches inside the
one optimizer step. ``tokens_per_s`` is label tokens per wall-clock second of the step, as
seen from the driver.

Driver-side only: this module never imports ``ray`` or ``actors``; it drives the handle that
:func:`raymoe.from_pretrained` returned.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from raymoe.driver.batch import check_input_ids
from raymoe.driver.data import PackedData, TextTokenizer
from raymoe.driver.metrics import METRICS_FILE, PLOT_FILE, MetricsLog, plot_metrics
from raymoe.driver.schedule import WarmupCosine
from raymoe.spec.balance import DEFAULT_BIAS_UPDATE_RATE, BalanceOptions
from raymoe.spec.optimizer import OptimizerConfig

if TYPE_CHECKING:
    from raymoe.driver.handle import DistributedModel

CHECKPOINT_DIR = "checkpoint"


@dataclass(frozen=True)
class TrainerConfig:
    """What a run does. ``global_batch_size`` rows (sequences) make one optimizer step.

    ``gradient_accumulation_steps`` splits each data-parallel rank's share of the global batch
    into that many forward/backward passes before the step (same result, less activation memory).
    ``lr`` is the peak of the schedule; it and the other AdamW fields default to
    :class:`~raymoe.spec.optimizer.OptimizerConfig`'s. ``warmup_steps`` None: a tenth of ``steps``.
    ``eval_every``/``save_every`` None: evaluate only before the first and after the last step,
    save only at the end. ``balance``, ``router_aux_loss_coef``, ``bias_update_rate`` and
    ``capacity_factor`` are the load-balancing options of :mod:`raymoe.spec.balance`.
    """

    output_dir: str | Path
    steps: int = 100
    global_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    lr: float = OptimizerConfig.lr
    warmup_steps: int | None = None
    min_lr_ratio: float = 0.1
    weight_decay: float = OptimizerConfig.weight_decay
    betas: tuple[float, float] = OptimizerConfig.betas
    eps: float = OptimizerConfig.eps
    max_grad_norm: float | None = OptimizerConfig.max_grad_norm
    balance: str = "auto"
    router_aux_loss_coef: float | None = None
    bias_update_rate: float = DEFAULT_BIAS_UPDATE_RATE
    capacity_factor: float | None = None
    eval_every: int | None = None
    save_every: int | None = None
    save_at_end: bool = True
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "gradient_accumulation_steps"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("seed", self.seed, minimum=0)
        for name in ("eval_every", "save_every"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        # The schedule checks lr, 0 <= warmup_steps <= steps and min_lr_ratio, naming each field;
        # the balance options check theirs (all before any rank is asked).
        self.schedule()
        self.balance_options()

    def balance_options(self) -> BalanceOptions:
        return BalanceOptions(self.balance, self.router_aux_loss_coef, self.bias_update_rate, self.capacity_factor)

    def schedule(self) -> WarmupCosine:
        warmup = self.warmup_steps if self.warmup_steps is not None else self.steps // 10
        return WarmupCosine(self.lr, self.steps, warmup, self.min_lr_ratio)


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"TrainerConfig: {name}={value!r} must be an int >= {minimum}")


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
    checkpoint: Path | None
    metrics_file: Path
    plot_file: Path | None
    history: list[dict[str, Any]] = field(repr=False, default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        """Label tokens per second over the training steps (evaluation and saving excluded)."""
        return self.num_tokens / self.train_time_s if self.train_time_s > 0 else 0.0


class Trainer:
    """Fits ``model`` (a :class:`~raymoe.driver.handle.DistributedModel`) on ``train_data``; see the module doc."""

    def __init__(
        self,
        model: DistributedModel,
        train_data: PackedData | Tensor | np.ndarray,
        config: TrainerConfig,
        *,
        eval_data: PackedData | Tensor | np.ndarray | None = None,
        tokenizer: TextTokenizer | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.train_data = _as_packed(train_data)
        self.eval_data = _as_packed(eval_data) if eval_data is not None else None
        self._check_data(self.train_data, "train data", min_rows=config.global_batch_size)
        if self.eval_data is not None:
            self._check_data(self.eval_data, "eval data", min_rows=1)
        self._check_batch_layout()
        self.schedule = config.schedule()
        self.output_dir = Path(config.output_dir).expanduser().absolute()
        self.step = 0
        self._batches = _batch_indices(self.train_data.num_sequences, config.global_batch_size, config.seed)
        model.configure_training(
            lr=self.schedule.lr_at(0),
            weight_decay=config.weight_decay,
            betas=config.betas,
            eps=config.eps,
            max_grad_norm=config.max_grad_norm,
            balance=config.balance,
            router_aux_loss_coef=config.router_aux_loss_coef,
            bias_update_rate=config.bias_update_rate,
            capacity_factor=config.capacity_factor,
        )
        self.log = MetricsLog(self.output_dir / METRICS_FILE)

    # --- checks, all before the first step ---------------------------------------------------------

    def _check_data(self, data: PackedData, name: str, min_rows: int) -> None:
        config = self.model.model_config
        if data.seq_len > config.max_position_embeddings:
            raise ValueError(
                f"{name}: seq_len={data.seq_len} exceeds the model's max_position_embeddings="
                f"{config.max_position_embeddings}; pack into rows of at most that many tokens"
            )
        check_input_ids(data.input_ids, config.vocab_size, name=name)
        if data.num_sequences < min_rows:
            need = f"global_batch_size={self.config.global_batch_size} needs" if name == "train data" else "needs"
            raise ValueError(
                f"{name}: {data.num_sequences} sequences of {data.seq_len} tokens, but {need} at least {min_rows}; "
                "use more data, a shorter seq_len or a smaller global_batch_size"
            )

    def _check_batch_layout(self) -> None:
        dp_size = self.model.topology.config.dp_size
        accum = self.config.gradient_accumulation_steps
        if self.config.global_batch_size < dp_size * accum:
            raise ValueError(
                f"global_batch_size={self.config.global_batch_size} must be at least dp_size * "
                f"gradient_accumulation_steps = {dp_size} * {accum} = {dp_size * accum}: each of the {dp_size} "
                "data-parallel ranks (dp_replicate_size * fsdp_size) needs a row per micro-batch"
            )

    # --- running ---------------------------------------------------------------------------------

    def fit(self, num_steps: int | None = None) -> TrainSummary:
        """Run ``num_steps`` more optimizer steps (default: to the end of the schedule, ``config.steps``)."""
        count = self.config.steps - self.step if num_steps is None else num_steps
        _check_int("num_steps", count, minimum=0)
        eval_before = self._evaluate_record(0) if self.step == 0 and self.eval_data is not None else None
        first = len(self.log.records)
        train_time, checkpoint = self._run_steps(count)
        if self.config.save_at_end and count > 0 and not self._save_due():
            checkpoint = self.save()
        plot = plot_metrics(self.log.records, self.output_dir / PLOT_FILE) if self.log.records else None
        run = [r for r in self.log.records[first:] if "loss" in r]
        evals = [r["eval_loss"] for r in run if "eval_loss" in r]
        return TrainSummary(
            steps=len(run),
            first_loss=run[0]["loss"] if run else None,
            last_loss=run[-1]["loss"] if run else None,
            eval_loss_before=eval_before,
            eval_loss_after=evals[-1] if evals else None,
            num_tokens=sum(r["num_tokens"] for r in run),
            train_time_s=train_time,
            checkpoint=checkpoint,
            metrics_file=self.log.path,
            plot_file=plot,
            history=list(self.log.records),
        )

    def _run_steps(self, count: int) -> tuple[float, Path | None]:
        """``count`` steps under the progress bar; returns their wall time and the last periodic checkpoint."""
        train_time, checkpoint = 0.0, None
        with tqdm(total=count, desc="train", unit="step", disable=not self.config.progress, mininterval=0.5) as bar:
            for _ in range(count):
                record = self._train_one_step()
                train_time += record["step_time_s"]
                if self._eval_due():
                    record["eval_loss"] = self.evaluate()
                self.log.append(record)
                bar.set_postfix(_postfix(record), refresh=False)
                bar.update()
                if self._save_due():
                    checkpoint = self.save()
        return train_time, checkpoint

    def _train_one_step(self) -> dict[str, Any]:
        batch = self.train_data.rows(next(self._batches))
        lr = self.schedule.lr_at(self.step)
        start = time.perf_counter()
        metrics = self.model.train_step(
            batch.input_ids,
            attention_mask=batch.attention_mask,
            lr=lr,
            micro_batches=self.config.gradient_accumulation_steps,
        )
        elapsed = time.perf_counter() - start
        self.step += 1
        record: dict[str, Any] = {
            "step": self.step,
            "loss": metrics["loss"],
            "lr": metrics["lr"],
            "grad_norm": metrics["grad_norm"],
            "num_tokens": metrics["num_tokens"],
            "tokens_per_s": metrics["num_tokens"] / elapsed,
            "step_time_s": elapsed,
        }
        record.update(_routing_record(metrics))
        return record

    def _eval_due(self) -> bool:
        if self.eval_data is None:
            return False
        every = self.config.eval_every
        return self.step == self.config.steps or (every is not None and self.step % every == 0)

    def _save_due(self) -> bool:
        every = self.config.save_every
        return every is not None and self.step % every == 0

    def _evaluate_record(self, step: int) -> float:
        loss = self.evaluate()
        self.log.append({"step": step, "eval_loss": loss})
        return loss

    def evaluate(self, data: PackedData | Tensor | np.ndarray | None = None) -> float:
        """Mean loss over every label token of ``data`` (default: the eval data), forward only."""
        packed = _as_packed(data) if data is not None else self.eval_data
        if packed is None:
            raise ValueError("evaluate() needs data: pass it, or give the Trainer eval_data")
        if data is not None:
            self._check_data(packed, "eval data", min_rows=1)
        loss_sum, num_tokens = 0.0, 0
        for chunk in self._eval_chunks(packed):
            result = self.model.evaluate(
                chunk.input_ids,
                attention_mask=chunk.attention_mask,
                micro_batches=self.config.gradient_accumulation_steps,
            )
            loss_sum += result["loss_sum"]
            num_tokens += result["num_tokens"]
        return loss_sum / num_tokens

    def _eval_chunks(self, data: PackedData) -> Iterator[PackedData]:
        """Global batches of the eval rows; a short last one is filled with masked rows (they add no tokens)."""
        size = self.config.global_batch_size
        least = self.model.topology.config.dp_size * self.config.gradient_accumulation_steps
        for start in range(0, data.num_sequences, size):
            chunk = data.rows(slice(start, start + size))
            if int(chunk.attention_mask[:, 1:].sum()) == 0:
                continue
            missing = least - chunk.num_sequences
            if missing > 0:
                blank = torch.zeros((missing, chunk.seq_len), dtype=torch.int64)
                chunk = PackedData(torch.cat([chunk.input_ids, blank]), torch.cat([chunk.attention_mask, blank]))
            yield chunk

    def save(self, path: str | Path | None = None) -> Path:
        """Write the model (hub layout, by rank 0 on its node) and the tokenizer; default ``output_dir/checkpoint``."""
        target = Path(path).expanduser().absolute() if path is not None else self.output_dir / CHECKPOINT_DIR
        self.model.save_pretrained(target)
        if self.tokenizer is not None:
            self.tokenizer.save(target)
        return target

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every record written to ``metrics.jsonl`` so far."""
        return list(self.log.records)


def _as_packed(data: PackedData | Tensor | np.ndarray) -> PackedData:
    if isinstance(data, PackedData):
        return data
    if isinstance(data, Tensor | np.ndarray):
        return PackedData.from_rows(data)
    raise ValueError(
        f"training data must be raymoe.driver.data.PackedData or a 2-D array of token ids, got {type(data).__name__}"
    )


def _batch_indices(num_rows: int, batch_size: int, seed: int) -> Iterator[Tensor]:
    """Row indices of successive global batches: a fresh seeded shuffle each epoch, the short tail dropped."""
    epoch = 0
    while True:
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
        for start in range(0, num_rows - batch_size + 1, batch_size):
            yield order[start : start + batch_size]
        epoch += 1


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


def _postfix(record: dict[str, Any]) -> dict[str, str]:
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
