"""What a :class:`~raymoe.driver.trainer.Trainer` run does: steps, batch, schedule, AdamW, balance, saving, resuming,
experiment trackers.

Every field is checked when the config is built (a ``ValueError`` naming it), before any rank is asked;
the AdamW defaults are :class:`~raymoe.spec.optimizer.OptimizerConfig`'s, the balance options
:mod:`raymoe.spec.balance`'s.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from raymoe.checkpoint.storage import Location, StorageUrl
from raymoe.driver.local_paths import local_path, storage_path
from raymoe.driver.run_directory import LATEST, RunDirectory
from raymoe.driver.schedule import WarmupCosine
from raymoe.driver.trackers.names import resolve_report_to
from raymoe.spec.balance import DEFAULT_BIAS_UPDATE_RATE, BalanceOptions
from raymoe.spec.optimizer import OptimizerConfig


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

    A save (``save_every``, the end) writes ``output_dir/checkpoint`` (``save_checkpoint``: the hub checkpoint; of a
    LoRA model, the merged weights ``W + s B A``) and/or ``output_dir/adapter`` (``save_adapter``: a LoRA model's
    adapters as a PEFT directory, what ``from_pretrained(base, lora=...)`` loads), each with the tokenizer.

    ``save_state_every``: after every that many steps, the whole training state goes to
    ``output_dir/states/step-<n>`` (``async_save``: written while training goes on; the next save and the end of
    :meth:`Trainer.fit` wait for it); then all but the newest ``keep_last`` states are removed (None keeps all).
    ``resume_from``: ``"latest"`` continues from the newest complete state under ``output_dir/states`` (none yet:
    start at step 0, as the first launch of an auto-restarting job does), a path from that state.
    An ``output_dir`` that holds an earlier run (a non-empty ``metrics.jsonl``, ``checkpoint/``, ``adapter/`` or a
    state) is refused without ``resume_from``, unless ``overwrite=True``, which removes its states and whichever of
    ``checkpoint/`` and ``adapter/`` this run does not save, and starts the metrics afresh (the next save replaces
    the others).
    ``max_failures``: how many times :meth:`Trainer.fit` restarts the model's ranks when one dies or hangs (new
    actors, the newest state reloaded, or the initial weights before the first state), so the finished run equals
    an uninterrupted one; 0 raises the first failure.
    Ctrl-C (SIGINT) or SIGTERM during :meth:`Trainer.fit` stops after the step in progress, saves the training state
    there (``save_state_on_interrupt``) and raises :class:`TrainingInterrupted`; a second one stops at once.

    ``report_to``: the experiment trackers each step, the config and the plot go to (:mod:`raymoe.driver.trackers`):
    ``"none"``, ``"all"`` (each whose library is installed), or one or a list of ``"tensorboard"``, ``"mlflow"``,
    ``"wandb"``, ``"trackio"``; normalised here to the tuple of names (a named tracker whose library is missing is an
    error naming its extra, ``pip install 'raymoe[mlflow]'``). ``logging_dir``: TensorBoard's directory (None:
    ``output_dir/runs``); ``run_name``: the run's name in the trackers (None: ``output_dir``'s name).
    """

    output_dir: str | Path | StorageUrl  # a local path, a file:// URL or a storage URL (s3://bucket/run)
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
    save_checkpoint: bool = True
    save_adapter: bool = False
    seed: int = 0
    progress: bool = True
    save_state_every: int | None = None
    keep_last: int | None = 2
    async_save: bool = False
    resume_from: str | os.PathLike[str] | StorageUrl | None = None
    overwrite: bool = False
    max_failures: int = 0
    save_state_on_interrupt: bool = True
    report_to: str | Sequence[str] = "none"
    logging_dir: str | os.PathLike[str] | None = None
    run_name: str | None = None
    _output: Location = field(init=False, repr=False, compare=False)  # output_dir resolved once (_check_paths)

    def __post_init__(self) -> None:
        object.__setattr__(self, "report_to", resolve_report_to(self.report_to))
        if self.run_name is not None and (not isinstance(self.run_name, str) or not self.run_name):
            raise ValueError(f"TrainerConfig: run_name={self.run_name!r} must be None or a non-empty str")
        if self.logging_dir is not None and (
            not isinstance(self.logging_dir, str | os.PathLike) or not str(self.logging_dir)
        ):
            raise ValueError(f"TrainerConfig: logging_dir={self.logging_dir!r} must be None or a directory path")
        for name in ("steps", "global_batch_size", "gradient_accumulation_steps"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("seed", self.seed, minimum=0)
        check_int("max_failures", self.max_failures, minimum=0)
        for name in ("eval_every", "save_every", "save_state_every", "keep_last"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name), minimum=1)
        for name in ("save_checkpoint", "save_adapter", "async_save", "overwrite", "save_state_on_interrupt"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"TrainerConfig: {name}={getattr(self, name)!r} must be True or False")
        if not (self.save_checkpoint or self.save_adapter):
            raise ValueError(
                "TrainerConfig: save_checkpoint=False and save_adapter=False leave a save nothing to write; to save "
                "nothing, set save_at_end=False and save_every=None"
            )
        resume = self.resume_from
        if resume is not None and (not isinstance(resume, str | os.PathLike | StorageUrl) or not str(resume)):
            raise ValueError(
                f"TrainerConfig: resume_from={resume!r} must be None, {LATEST!r} or the path of a training state"
            )
        if resume is not None and self.overwrite:
            raise ValueError(
                f"TrainerConfig: resume_from={str(resume)!r} and overwrite=True contradict each other (resuming "
                "continues the earlier run, overwrite discards it): choose one"
            )
        self._check_paths()
        # The schedule checks lr, 0 <= warmup_steps <= steps and min_lr_ratio, naming each field;
        # the balance options check theirs (all before any rank is asked).
        self.schedule()
        self.balance_options()
        self.optimizer()

    def _check_paths(self) -> None:
        """``output_dir`` and a ``resume_from`` path are local paths (``file://`` URLs are taken as their path) or
        storage URLs (checked and probed: :func:`~raymoe.driver.local_paths.storage_path`); ``logging_dir`` is a
        local path. A bad one is a ``ValueError`` here, never a local folder named ``s3:``."""
        if not isinstance(self.output_dir, str | os.PathLike | StorageUrl) or not str(self.output_dir):
            raise ValueError(f"TrainerConfig: output_dir={self.output_dir!r} must be a directory path")
        try:  # resolved (and a URL probed) once: run_directory() takes it from here
            object.__setattr__(self, "_output", storage_path(self.output_dir, "output_dir", write=True))
            if self.resume_from is not None and self.resume_from != LATEST:
                storage_path(self.resume_from, "resume_from", write=False)
            if self.logging_dir is not None:
                local_path(self.logging_dir, "logging_dir")
        except ValueError as error:
            raise ValueError(f"TrainerConfig: {error}") from None

    def balance_options(self) -> BalanceOptions:
        return BalanceOptions(self.balance, self.router_aux_loss_coef, self.bias_update_rate, self.capacity_factor)

    def schedule(self) -> WarmupCosine:
        warmup = self.warmup_steps if self.warmup_steps is not None else self.steps // 10
        return WarmupCosine(self.lr, self.steps, warmup, self.min_lr_ratio)

    def optimizer(self) -> OptimizerConfig:
        """The AdamW settings of the run (its ``lr`` the schedule's peak; each step sets the schedule's lr)."""
        return OptimizerConfig(
            lr=self.lr, weight_decay=self.weight_decay, betas=self.betas, eps=self.eps, max_grad_norm=self.max_grad_norm
        )

    @property
    def trackers(self) -> tuple[str, ...]:
        """The trackers ``report_to`` resolved to (empty: none)."""
        return tuple(self.report_to)

    def run_directory(self) -> RunDirectory:
        return RunDirectory(self.output_dir, checked=self._output)

    def check_output_dir(self) -> Location | None:
        """What ``output_dir`` holds, against ``resume_from`` and ``overwrite``, on the driver and without writing:
        the state a run resumes from (None: it starts at step 0). A ``ValueError`` when ``output_dir`` holds an
        earlier run that neither is given for, or when the ``resume_from`` path is not a complete state
        (:meth:`RunDirectory.start_point`). :class:`Trainer` calls it before any rank is asked; a script can call it
        before it starts a cluster."""
        return self.run_directory().start_point(self.resume_from, self.overwrite)


def check_int(name: str, value: object, minimum: int) -> None:
    """A ``ValueError`` naming ``name`` unless ``value`` is an int >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"TrainerConfig: {name}={value!r} must be an int >= {minimum}")
