"""``raymoe.Trainer``: fit a sharded model on packed data from the driver, with progress, metrics and checkpoints.

    Trainer(model, train_data, TrainerConfig(output_dir=..., steps=...), eval_data=..., tokenizer=...)
      checks (before any step)   seq_len <= max_position_embeddings, ids < vocab_size, enough rows,
                                 global_batch_size vs data-parallel ranks x gradient accumulation
      fit()                      per step: next global batch (its labels and document_ids too: assistant-only
                                 loss, document-masked packing) -> model.train_step(lr=schedule(step),
                                 micro_batches=gradient_accumulation_steps) -> metrics.jsonl + progress bar;
                                 eval before the first step, every eval_every steps and after the last;
                                 checkpoint every save_every steps and at the end; training state every
                                 save_state_every steps; metrics.png at the end
      evaluate() / save()        on request
      save_state()

Resuming (``resume_from="latest"`` or a state directory): the whole training state (weights, AdamW, balance
settings, RNG) comes back through ``model.load_state``, under any layout and world size; the Trainer's own
position rides in the state's manifest (``extra["trainer"]``): the step, so the learning-rate schedule goes on
where it stopped, and the global sample offset ``step * global_batch_size``, so the batches continue with the
same seeded shuffles (which rows make global batch ``b`` does not depend on the layout). ``metrics.jsonl`` keeps
its records up to the state's step and is appended to; the progress bar starts at that step. An ``output_dir``
holding an earlier run is refused unless the config says what to do with it: ``resume_from`` or ``overwrite``.

Token counting does not depend on the layout: the global batch is what ``train_step`` gets,
the loss is the mean over all its label tokens (``num_tokens``, counted on the driver), and
gradient accumulation splits each data-parallel rank's rows into micro-batches inside the
one optimizer step. ``tokens_per_s`` is label tokens per wall-clock second of the step, as
seen from the driver.

Driver-side only: this module never imports ``ray`` or ``actors``; it drives the handle that
:func:`raymoe.from_pretrained` returned.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import Tensor
from tqdm import tqdm

from raymoe.checkpoint.training_state import (
    TrainingStateError,
    completed_states,
    latest_state,
    read_manifest,
    state_dir_name,
)
from raymoe.driver.batch import check_input_ids
from raymoe.driver.data import PackedData, TextTokenizer
from raymoe.driver.metrics import METRICS_FILE, PLOT_FILE, MetricsLog, plot_metrics
from raymoe.driver.schedule import WarmupCosine
from raymoe.models.common.loss import IGNORE_INDEX
from raymoe.spec.balance import DEFAULT_BIAS_UPDATE_RATE, BalanceOptions
from raymoe.spec.optimizer import OptimizerConfig

if TYPE_CHECKING:
    from raymoe.driver.handle import DistributedModel

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoint"
STATES_DIR = "states"  # output_dir/states/step-00000006/: the training states save_state_every writes
LATEST = "latest"


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

    ``save_state_every``: after every that many steps, the whole training state goes to
    ``output_dir/states/step-<n>`` (``async_save``: written while training goes on; the next save and the end of
    :meth:`Trainer.fit` wait for it); then all but the newest ``keep_last`` states are removed (None keeps all).
    ``resume_from``: ``"latest"`` continues from the newest complete state under ``output_dir/states`` (none yet:
    start at step 0, as the first launch of an auto-restarting job does), a path from that state.
    An ``output_dir`` that holds an earlier run (a non-empty ``metrics.jsonl``, ``checkpoint/`` or a state) is
    refused without ``resume_from``, unless ``overwrite=True``, which removes its states and starts the metrics
    afresh (the next save replaces ``checkpoint/``).
    ``max_failures``: how many times :meth:`Trainer.fit` restarts the model's ranks when one dies or hangs (new
    actors, the newest state reloaded, or the initial weights before the first state), so the finished run equals
    an uninterrupted one; 0 raises the first failure.
    Ctrl-C (SIGINT) or SIGTERM during :meth:`Trainer.fit` stops after the step in progress, saves the training state
    there (``save_state_on_interrupt``) and raises :class:`TrainingInterrupted`; a second one stops at once.
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
    save_state_every: int | None = None
    keep_last: int | None = 2
    async_save: bool = False
    resume_from: str | os.PathLike[str] | None = None
    overwrite: bool = False
    max_failures: int = 0
    save_state_on_interrupt: bool = True

    def __post_init__(self) -> None:
        for name in ("steps", "global_batch_size", "gradient_accumulation_steps"):
            _check_int(name, getattr(self, name), minimum=1)
        _check_int("seed", self.seed, minimum=0)
        _check_int("max_failures", self.max_failures, minimum=0)
        for name in ("eval_every", "save_every", "save_state_every", "keep_last"):
            if getattr(self, name) is not None:
                _check_int(name, getattr(self, name), minimum=1)
        for name in ("async_save", "overwrite", "save_state_on_interrupt"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TrainerConfig: {name}={getattr(self, name)!r} must be True or False")
        resume = self.resume_from
        if resume is not None and (not isinstance(resume, str | os.PathLike) or not str(resume)):
            raise ValueError(
                f"TrainerConfig: resume_from={resume!r} must be None, {LATEST!r} or the path of a training state"
            )
        if resume is not None and self.overwrite:
            raise ValueError(
                f"TrainerConfig: resume_from={str(resume)!r} and overwrite=True contradict each other (resuming "
                "continues the earlier run, overwrite discards it): choose one"
            )
        # The schedule checks lr, 0 <= warmup_steps <= steps and min_lr_ratio, naming each field;
        # the balance options check theirs (all before any rank is asked).
        self.schedule()
        self.balance_options()

    def balance_options(self) -> BalanceOptions:
        return BalanceOptions(self.balance, self.router_aux_loss_coef, self.bias_update_rate, self.capacity_factor)

    def schedule(self) -> WarmupCosine:
        warmup = self.warmup_steps if self.warmup_steps is not None else self.steps // 10
        return WarmupCosine(self.lr, self.steps, warmup, self.min_lr_ratio)

    def check_output_dir(self) -> Path | None:
        """What ``output_dir`` holds, against ``resume_from`` and ``overwrite``, on the driver and without writing:
        the state a run resumes from (None: it starts at step 0). A ``ValueError`` when ``output_dir`` holds an
        earlier run that neither is given for, or when the ``resume_from`` path is not a complete state.
        :class:`Trainer` calls it before any rank is asked; a script can call it before it starts a cluster."""
        output_dir = Path(self.output_dir).expanduser().absolute()
        if self.resume_from == LATEST:
            return latest_state(output_dir / STATES_DIR)
        if self.resume_from is not None:
            path = Path(self.resume_from).expanduser().absolute()
            try:
                read_manifest(path)
            except TrainingStateError as error:
                raise TrainingStateError(f"TrainerConfig: resume_from={str(self.resume_from)!r}: {error}") from None
            return path
        held = earlier_run(output_dir)
        if held and not self.overwrite:
            raise ValueError(
                f"output_dir {output_dir} holds an earlier run ({', '.join(held)}); a new run would empty its "
                f"{METRICS_FILE} and replace its checkpoint. Continue it with resume_from={LATEST!r} "
                "(finetune.py --resume), or start over with overwrite=True (--overwrite), or pick another output_dir"
            )
        return None


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"TrainerConfig: {name}={value!r} must be an int >= {minimum}")


def earlier_run(output_dir: str | os.PathLike[str]) -> list[str]:
    """What of an earlier run ``output_dir`` holds (empty: nothing a new run would overwrite)."""
    root = Path(output_dir)
    held = []
    metrics = root / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        held.append(f"a non-empty {METRICS_FILE}")
    if (root / CHECKPOINT_DIR).is_dir():
        held.append(f"a {CHECKPOINT_DIR}/ directory")
    states = completed_states(root / STATES_DIR)
    if states:
        held.append(f"{len(states)} training state(s) in {STATES_DIR}/, the latest of step {states[-1][0]}")
    return held


class TrainingFailed(RuntimeError):
    """``fit()`` gave up: ranks failed once more than ``max_failures`` allows; ``state`` is the newest state (None:
    none was saved), which a ``resume_from="latest"`` run continues from."""

    def __init__(self, message: str, state: Path | None) -> None:
        super().__init__(message)
        self.state = state


class TrainingInterrupted(KeyboardInterrupt):
    """``fit()`` stopped at a step boundary after SIGINT / SIGTERM; ``step`` and ``state`` (None: none saved) say
    where it stopped and what a ``resume_from`` run continues from."""

    def __init__(self, message: str, step: int, state: Path | None) -> None:
        super().__init__(message)
        self.step = step
        self.state = state


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
    resumed_from: Path | None = None  # the state this Trainer started from
    state: Path | None = None  # the last training state this fit wrote
    restarts: int = 0  # how often fit() replaced failed ranks and went on (TrainerConfig.max_failures)
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
        self.states_dir = self.output_dir / STATES_DIR
        # Where to start, checked against what output_dir holds and what the state saved, before any rank call.
        self.resumed_from = config.check_output_dir()
        start = self._resume_position(self.resumed_from) if self.resumed_from is not None else 0
        if self.resumed_from is None and config.resume_from == LATEST:
            held = earlier_run(self.output_dir)
            logger.log(
                logging.WARNING if held else logging.INFO,
                "resume_from=%r: no training state in %s yet, starting at step 0%s",
                LATEST,
                self.states_dir,
                f" (replacing what the earlier run left: {', '.join(held)})" if held else "",
            )
        self.step = 0
        self._pending_state: Path | None = None  # an asynchronous save_state still writing
        self._last_state: Path | None = None
        self.restarts = 0
        self._stop_signal: str | None = None  # set by the first SIGINT / SIGTERM during fit()
        self._restart_record: dict[str, Any] | None = None  # written once the first step after a restart finished
        self._configure(start)
        if self.resumed_from is not None:
            manifest = model.load_state(self.resumed_from)
            self.step = manifest.step
            logger.info("resumed from %s at step %d of %d", self.resumed_from, self.step, config.steps)
        elif config.overwrite and self.states_dir.exists():
            shutil.rmtree(self.states_dir)
        self._batches = _batch_indices(
            self.train_data.num_sequences, config.global_batch_size, config.seed, start=self.step
        )
        keep = self.step if self.resumed_from is not None else None
        self.log = MetricsLog(self.output_dir / METRICS_FILE, keep_through_step=keep)

    def _configure(self, start: int) -> None:
        config = self.config
        self.model.configure_training(
            # Resuming: the lr of the state's last step, which load_state restores (so it reports no change).
            lr=self.schedule.lr_at(max(start - 1, 0)),
            weight_decay=config.weight_decay,
            betas=config.betas,
            eps=config.eps,
            max_grad_norm=config.max_grad_norm,
            balance=config.balance,
            router_aux_loss_coef=config.router_aux_loss_coef,
            bias_update_rate=config.bias_update_rate,
            capacity_factor=config.capacity_factor,
        )

    # --- checks, all before the first step ---------------------------------------------------------

    def _check_data(self, data: PackedData, name: str, min_rows: int) -> None:
        config = self.model.model_config
        if data.seq_len > config.max_position_embeddings:
            raise ValueError(
                f"{name}: seq_len={data.seq_len} exceeds the model's max_position_embeddings="
                f"{config.max_position_embeddings}; pack into rows of at most that many tokens"
            )
        check_input_ids(data.input_ids, config.vocab_size, name=name)
        if data.labels is not None:
            bad = (data.labels != IGNORE_INDEX) & ((data.labels < 0) | (data.labels >= config.vocab_size))
            if bool(bad.any()):
                raise ValueError(f"{name}: labels must be token ids in [0, {config.vocab_size}) or {IGNORE_INDEX}")
        if data.num_label_tokens == 0:
            raise ValueError(f"{name}: no token takes loss (every label is -100, padding or a document start)")
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

    def _resume_position(self, path: Path) -> int:
        """The step of the state at ``path``, its Trainer position checked against this config and data."""
        manifest = read_manifest(path)
        saved = manifest.extra.get("trainer")
        if not isinstance(saved, dict):
            raise ValueError(
                f"training state {path} holds no Trainer position (extra['trainer']): it was not written by a "
                "Trainer; load it with model.load_state(...) instead"
            )
        current = {
            "global_batch_size": self.config.global_batch_size,
            "seed": self.config.seed,
            "train_rows": self.train_data.num_sequences,
        }
        for name, value in current.items():
            if saved.get(name) != value:
                raise ValueError(
                    f"cannot resume from {path}: {name}={value} here, but the saved run had {name}={saved.get(name)}; "
                    "the data order and position continue only with the same global_batch_size, seed and training "
                    "rows"
                )
        step = manifest.step
        if saved.get("samples_seen") != step * self.config.global_batch_size:
            raise ValueError(
                f"training state {path}: samples_seen={saved.get('samples_seen')} does not match step {step} x "
                f"global_batch_size {self.config.global_batch_size}"
            )
        if step > self.config.steps:
            raise ValueError(
                f"cannot resume from {path}: it is at step {step}, past steps={self.config.steps}; raise steps to "
                "go on from it"
            )
        return step

    def _position(self) -> dict[str, Any]:
        """The Trainer's place in its run, saved in each state's manifest (``extra["trainer"]``)."""
        return {
            "step": self.step,
            "samples_seen": self.step * self.config.global_batch_size,  # the global sample offset
            "global_batch_size": self.config.global_batch_size,
            "seed": self.config.seed,
            "train_rows": self.train_data.num_sequences,
            "steps": self.config.steps,
        }

    # --- running ---------------------------------------------------------------------------------

    def fit(self, num_steps: int | None = None) -> TrainSummary:
        """Run ``num_steps`` more optimizer steps (default: to the end of the schedule, ``config.steps``)."""
        count = self.config.steps - self.step if num_steps is None else num_steps
        _check_int("num_steps", count, minimum=0)
        eval_before = self._evaluate_record(0) if self.step == 0 and self.eval_data is not None else None
        begin = self.step
        self._last_state = None
        with self._stop_requests():
            train_time, checkpoint = self._run_steps(count)
        # also a run resumed from a state of its last step, which may have stopped before its final checkpoint
        finished_unsaved = self.resumed_from is not None and not (self.output_dir / CHECKPOINT_DIR).exists()
        if self.config.save_at_end and (count > 0 or finished_unsaved) and not self._save_due():
            checkpoint = self.save()
        self._finish_state_save()
        plot = plot_metrics(self.log.records, self.output_dir / PLOT_FILE) if self.log.records else None
        run = [r for r in self.log.records if "loss" in r and r["step"] > begin]
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
            resumed_from=self.resumed_from,
            state=self._last_state,
            restarts=self.restarts,
            history=list(self.log.records),
        )

    def _run_steps(self, count: int) -> tuple[float, Path | None]:
        """``count`` steps under the progress bar (which counts from the step the run is at, to ``steps``);
        returns their wall time and the last periodic checkpoint."""
        train_time, checkpoint = 0.0, None
        total = max(self.config.steps, self.step + count)
        progress = {"desc": "train", "unit": "step", "disable": not self.config.progress, "mininterval": 0.5}
        target = self.step + count
        with tqdm(initial=self.step, total=total, **progress) as bar:
            while self.step < target:
                try:
                    record = self._train_one_step()
                    train_time += record["step_time_s"]
                    if self._eval_due():
                        record["eval_loss"] = self.evaluate()
                    self._log_restart()
                    self.log.append(record)
                    bar.set_postfix(_postfix(record), refresh=False)
                    bar.update()
                    if self._save_due():
                        checkpoint = self.save()
                    if self._state_due():
                        self.save_state()
                    if self._stop_signal is not None:
                        self._stop_at_boundary()
                except Exception as error:
                    if self.model.is_alive or self.restarts >= self.config.max_failures:
                        raise self._give_up(error) from error
                    self._recover(error)
                    bar.reset(total=total)
                    bar.update(self.step)
        return train_time, checkpoint

    # --- interrupts -------------------------------------------------------------------------------

    @contextmanager
    def _stop_requests(self) -> Iterator[None]:
        """While ``fit`` runs: the first SIGINT / SIGTERM asks for a stop at the next step boundary, the second
        stops at once (KeyboardInterrupt where the driver is: the handle's ``with`` block then frees the ranks).
        Only in the main thread, where Python delivers signals."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        signals = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.getsignal(sig) for sig in signals}

        def request_stop(signum: int, frame: object) -> None:
            name = signal.Signals(signum).name
            if self._stop_signal is not None:
                raise KeyboardInterrupt(f"{name} again: stopped at once, in step {self.step + 1}")
            self._stop_signal = name
            saving = " and saving the training state" if self.config.save_state_on_interrupt else ""
            logger.warning("%s: stopping after step %d%s (%s again stops at once)", name, self.step + 1, saving, name)

        for sig in signals:
            signal.signal(sig, request_stop)
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            self._stop_signal = None

    def _stop_at_boundary(self) -> None:
        """Save the state of the step just finished (unless it is saved already), then raise TrainingInterrupted."""
        name = self._stop_signal
        state = None
        if self.config.save_state_on_interrupt:
            already = self._last_state is not None and self._last_state.name == state_dir_name(self.step)
            state = self._last_state if already else self.save_state()
            self._finish_state_save()
        where = f"; training state in {state} (resume_from='latest' continues)" if state is not None else ""
        raise TrainingInterrupted(f"{name}: training stopped after step {self.step}{where}", self.step, state)

    # --- failures ---------------------------------------------------------------------------------

    def _recover(self, error: Exception) -> None:
        """New ranks for the ones that failed, the newest state (or the initial weights) loaded into them, and the
        data, schedule and metrics put back at that state's step."""
        failed_at, failed_step = time.monotonic(), self.step
        self.restarts += 1
        cause = _first_line(error)
        logger.warning(
            "step %d failed (%s); restarting the ranks (restart %d of at most %d)",
            failed_step + 1, cause, self.restarts, self.config.max_failures,
        )  # fmt: skip
        self._pending_state = None  # an asynchronous save the failure interrupted is not a state
        self.model.restart()
        state = latest_state(self.states_dir)
        start = self._resume_position(state) if state is not None else 0
        self._configure(start)
        self.step = self.model.load_state(state).step if state is not None else 0
        self._batches = _batch_indices(
            self.train_data.num_sequences, self.config.global_batch_size, self.config.seed, start=self.step
        )
        self.log = MetricsLog(self.log.path, keep_through_step=self.step)
        self._restart_record = {
            "step": self.step,
            "restart": self.restarts,
            "failed_at_step": failed_step + 1,
            "resumed_from": str(state) if state is not None else None,
            "cause": cause,
            "_failed_at": failed_at,
        }

    def _log_restart(self) -> None:
        """The restart record, once the first step after it finished: ``time_lost_s`` runs from the failure to then."""
        record, self._restart_record = self._restart_record, None
        if record is not None:
            record["time_lost_s"] = time.monotonic() - record.pop("_failed_at")
            self.log.append(record)

    def _give_up(self, error: Exception) -> Exception:
        if self.config.max_failures == 0 or self.model.is_alive:
            return error
        state = latest_state(self.states_dir)
        return TrainingFailed(
            f"training failed again after {self.restarts} restart(s) (max_failures={self.config.max_failures}): "
            f"{_first_line(error)}. The newest training state is "
            + (f"{state}: resume from it with resume_from='latest'" if state is not None else "none (no state saved)"),
            state,
        )

    def _train_one_step(self) -> dict[str, Any]:
        batch = self.train_data.rows(next(self._batches))
        lr = self.schedule.lr_at(self.step)
        start = time.perf_counter()
        metrics = self.model.train_step(
            batch.input_ids,
            labels=batch.labels,
            attention_mask=batch.attention_mask,
            lr=lr,
            micro_batches=self.config.gradient_accumulation_steps,
            document_ids=batch.document_ids,
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

    def _state_due(self) -> bool:
        every = self.config.save_state_every
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
                labels=chunk.labels,
                attention_mask=chunk.attention_mask,
                micro_batches=self.config.gradient_accumulation_steps,
                document_ids=chunk.document_ids,
            )
            loss_sum += result["loss_sum"]
            num_tokens += result["num_tokens"]
        return loss_sum / num_tokens

    def _eval_chunks(self, data: PackedData) -> Iterator[PackedData]:
        """Global batches of the eval rows; a short last one is filled with masked rows (they add no tokens);
        a batch without label tokens (all answers elsewhere) is skipped."""
        size = self.config.global_batch_size
        least = self.model.topology.config.dp_size * self.config.gradient_accumulation_steps
        for start in range(0, data.num_sequences, size):
            chunk = data.rows(slice(start, start + size))
            if chunk.num_label_tokens == 0:
                continue
            yield chunk.with_blank_rows(least - chunk.num_sequences)

    def save(self, path: str | Path | None = None) -> Path:
        """Write the model (hub layout, by rank 0 on its node) and the tokenizer; default ``output_dir/checkpoint``."""
        target = Path(path).expanduser().absolute() if path is not None else self.output_dir / CHECKPOINT_DIR
        self.model.save_pretrained(target)
        if self.tokenizer is not None:
            self.tokenizer.save(target)
        return target

    def save_state(self) -> Path:
        """Write the whole training state and this Trainer's position to ``output_dir/states/step-<n>`` (what
        ``resume_from`` reads); then remove all but the newest ``keep_last`` states. With ``async_save`` it
        returns while the state is still being written: the next save and the end of :meth:`fit` wait for it
        (and prune after it), as does the handle's ``shutdown``."""
        self._finish_state_save()
        target = self.states_dir / state_dir_name(self.step)
        path = self.model.save_state(target, async_save=self.config.async_save, extra={"trainer": self._position()})
        self._last_state = path
        if self.config.async_save:
            self._pending_state = path
        else:
            self._prune_states(path)
        return path

    def _finish_state_save(self) -> None:
        """Wait for an asynchronous save (raising its failure), then prune."""
        path, self._pending_state = self._pending_state, None
        if path is not None:
            self.model.wait_for_save()
            self._prune_states(path)

    def _prune_states(self, written: Path) -> None:
        """Remove the complete states older than the newest ``keep_last`` (never ``written``; staging directories
        and unfinished saves are not states, so they are never touched here)."""
        keep = self.config.keep_last
        if keep is None:
            return
        states = completed_states(self.states_dir)
        for _, path in states[: max(len(states) - keep, 0)]:
            if path != written:
                shutil.rmtree(path)

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


def _batch_indices(num_rows: int, batch_size: int, seed: int, start: int = 0) -> Iterator[Tensor]:
    """Row indices of successive global batches from batch ``start`` on: a fresh seeded shuffle each epoch (epoch
    ``e`` is ``randperm`` under seed ``seed + e``), the short tail dropped. Batch ``b`` is the ``b % per_epoch``-th
    slice of epoch ``b // per_epoch``'s shuffle, so a resumed run draws only the shuffles from its epoch on."""
    per_epoch = num_rows // batch_size
    epoch, offset = divmod(start, per_epoch)
    while True:
        order = torch.randperm(num_rows, generator=torch.Generator().manual_seed(seed + epoch))
        for batch in range(offset, per_epoch):
            yield order[batch * batch_size : (batch + 1) * batch_size]
        epoch, offset = epoch + 1, 0


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


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
