"""``raymoe.Trainer``: fit a sharded model on packed data from the driver, with progress, metrics and checkpoints.

    Trainer(model, train_data, TrainerConfig(output_dir=..., steps=...), eval_data=..., tokenizer=...)
      checks (before any step)   seq_len <= max_position_embeddings, ids < vocab_size, enough rows,
                                 global_batch_size vs data-parallel ranks x gradient accumulation, what
                                 output_dir holds (run_directory), where a resumed run continues (resume)
      fit()                      per step: next global batch (batch_order; its labels and document_ids too:
                                 assistant-only loss, document-masked packing) -> model.train_step(lr=schedule(step),
                                 micro_batches=gradient_accumulation_steps) -> metrics.jsonl + progress bar;
                                 eval before the first step, every eval_every steps and after the last;
                                 checkpoint/adapter every save_every steps and at the end; training state every
                                 save_state_every steps; metrics.png at the end; every record and the plot also to
                                 the report_to trackers (trackers/); a failed step goes to the failure policy
                                 (recovery), a signal stops at the next boundary (interrupts)
      evaluate() / save()        on request (also save_adapter(): a LoRA model's PEFT directory; save_state())

Resuming (``resume_from="latest"`` or a state directory): the whole training state (weights, AdamW, balance
settings, RNG) comes back through ``model.load_state`` alone, under any layout and world size (no optimizer is
built first only to be replaced); the Trainer's own position rides in the state's manifest
(:mod:`raymoe.driver.resume`): the step, so the learning-rate schedule goes on where it stopped, and the global
sample offset, so the batches continue with the same seeded shuffles. ``metrics.jsonl`` keeps its records up to
the state's step and is appended to; the progress bar starts at that step.

Token counting does not depend on the layout: the global batch is what ``train_step`` gets, the loss is the mean
over all its label tokens (``num_tokens``, counted on the driver), and gradient accumulation splits each
data-parallel rank's rows into micro-batches inside the one optimizer step. ``tokens_per_s`` is label tokens per
wall-clock second of the step, as seen from the driver. Driver-side only (no ``ray``, no ``actors``).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor
from tqdm import tqdm

from raymoe.checkpoint.storage import Location, child
from raymoe.checkpoint.training_state import state_dir_name
from raymoe.driver.interrupts import StopRequests, TrainingInterrupted
from raymoe.driver.local_paths import storage_path
from raymoe.driver.metrics import MetricsLog, plot_metrics
from raymoe.driver.recovery import Decision, FailurePolicy, RestartRecord, cause_of
from raymoe.driver.resume import position, resume_step, warn_changed_settings
from raymoe.driver.run_directory import LATEST
from raymoe.driver.step_records import TrainSummary, compile_note, progress_postfix, step_record
from raymoe.driver.tokenizer import TextTokenizer
from raymoe.driver.trackers import Trackers
from raymoe.driver.trainer_config import TrainerConfig, check_int
from raymoe.driver.training_data import EvalTotals, TrainData, rows_of

if TYPE_CHECKING:
    from raymoe.driver.handle import DistributedModel

logger = logging.getLogger(__name__)


class Trainer:
    """Fits ``model`` (a :class:`~raymoe.driver.handle.DistributedModel`) on ``train_data``; see the module doc."""

    def __init__(
        self,
        model: DistributedModel,
        train_data: TrainData,
        config: TrainerConfig,
        *,
        eval_data: TrainData | None = None,
        tokenizer: TextTokenizer | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.tokenizer = tokenizer
        self.train_data = rows_of(train_data)  # on the driver, or in Ray's object store (training_data)
        self.eval_data = rows_of(eval_data) if eval_data is not None else None
        self.train_data.check("train data", model.model_config, min_rows=config.global_batch_size)
        if self.eval_data is not None:
            self.eval_data.check("eval data", model.model_config, min_rows=1)
        self._check_batch_layout()
        if config.save_adapter and model.lora is None:
            raise ValueError(
                "TrainerConfig: save_adapter=True, but the model has no LoRA adapters (from_pretrained(..., lora=...))"
            )
        self.schedule = config.schedule()
        self.run = config.run_directory()
        self.output_dir, self.states_dir = self.run.where, self.run.states
        self.policy = FailurePolicy(config.max_failures)
        # Where to start, checked against what output_dir holds and what the state saved, before any rank call.
        start = config.check_output_dir()
        checked = model.check_state(start) if start is not None else None
        model.check_shared(self.run.shared_paths())  # the ranks write state shards there
        rows, order = self.train_data.num_sequences, self.train_data.data_order
        self.step = resume_step(checked, config, rows, order) if checked is not None else 0
        self.resumed_from = start
        if start is None and config.resume_from == LATEST:
            held = self.run.earlier_run()
            logger.log(
                logging.WARNING if held else logging.INFO,
                "resume_from=%r: no training state in %s yet, starting at step 0%s",
                LATEST,
                self.states_dir,
                f" (replacing what the earlier run left: {', '.join(held)})" if held else "",
            )
        self._pending_state: Location | None = None  # an asynchronous save_state still writing
        self._last_state: Location | None = None  # the newest state this fit() saved
        self.restarts = 0
        self._eval_compile_s = 0.0  # seconds this fit's evaluations spent compiling decoder blocks
        self._stops = StopRequests(lambda: self.step, config.save_state_on_interrupt)
        self._restart_record: RestartRecord | None = None  # written once the first step after a restart finished
        if checked is not None:
            warn_changed_settings(checked, config)
            model.load_state(checked)
            logger.info("resumed from %s at step %d of %d", start, self.step, config.steps)
        else:
            if config.overwrite:
                self.run.clear_states()
                self.run.clear_unsaved(checkpoint=config.save_checkpoint, adapter=config.save_adapter)
            model.use_training_config(config.optimizer(), config.balance_options())
        self._batches = self._batches_from(self.step)
        kept = self.step if checked is not None else None  # a resumed run keeps its records (and tracker runs)
        self.run.open_mirror(resumed=kept is not None)
        self.trackers = Trackers(config, self.run, resumed_at=kept)
        self.log = MetricsLog(self.run.metrics, keep_through_step=kept, on_append=self.trackers.log)

    def _batches_from(self, step: int) -> Iterator[Tensor]:
        return self.train_data.batches(self.config.global_batch_size, self.config.seed, step)

    # --- checks, all before the first step ---------------------------------------------------------

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
        check_int("num_steps", count, minimum=0)
        self._eval_compile_s = 0.0
        with self.trackers.opened(self.model, self.step):
            eval_before = self._evaluate_record(0) if self.step == 0 and self.eval_data is not None else None
            begin = self.step
            self._last_state = None
            with self._stops.listening():
                train_time, compile_time, saved = self._run_steps(count)
            # also a run resumed from a state of its last step, which may have stopped before its final checkpoint
            finished_unsaved = self.resumed_from is not None and not self.run.saved(
                checkpoint=self.config.save_checkpoint, adapter=self.config.save_adapter
            )
            if self.config.save_at_end and (count > 0 or finished_unsaved) and not self._save_due():
                saved = self._save_due_files()
            checkpoint, adapter = saved
            self._finish_state_save()
            plot = plot_metrics(self.log.records, self.run.plot) if self.log.records else None
            self.trackers.log_image(plot, self.step)
        self.run.publish()
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
            compile_s=compile_time,
            eval_compile_s=self._eval_compile_s,
            checkpoint=checkpoint,
            adapter=adapter,
            metrics_file=self.log.path,
            plot_file=plot,
            resumed_from=self.resumed_from,
            state=self._last_state,
            restarts=self.restarts,
            history=list(self.log.records),
        )

    def _run_steps(self, count: int) -> tuple[float, float, tuple[Location | None, Location | None]]:
        """``count`` steps under the progress bar (which counts from the step the run is at, to ``steps``);
        returns their wall time, the part of it the ranks spent compiling, and the last periodic save (checkpoint,
        adapter)."""
        train_time: float = 0.0
        compile_time: float = 0.0
        saved: tuple[Location | None, Location | None] = (None, None)
        total = max(self.config.steps, self.step + count)
        progress = {"desc": "train", "unit": "step", "disable": not self.config.progress, "mininterval": 0.5}
        target = self.step + count
        with tqdm(initial=self.step, total=total, **progress) as bar:
            while self.step < target:
                try:
                    record = self._train_one_step()
                    train_time += record["step_time_s"]
                    if "compile_s" in record:
                        compile_time += record["compile_s"]
                        self._announce(compile_note(f"step {self.step}", record["compile_s"]))
                    if self._eval_due():
                        record.update(self._evaluation())
                    self._log_restart()
                    self.log.append(record)
                    bar.set_postfix(progress_postfix(record), refresh=False)
                    bar.update()
                    if self._save_due():
                        saved = self._save_due_files()
                    if self._state_due():
                        self.save_state()
                    if self._stops.signal is not None:
                        self._stop_at_boundary()
                except Exception as error:
                    alive = self.model.is_alive
                    if self.policy.decide(alive, self.restarts) is Decision.RAISE:
                        newest = self.run.latest_state()
                        raise self.policy.give_up(error, alive, self.restarts, newest) from error
                    self._restart(error)
                    bar.reset(total=total)
                    bar.update(self.step)
        return train_time, compile_time, saved

    def _stop_at_boundary(self) -> None:
        """Save the state of the step just finished (unless it is saved already), then raise TrainingInterrupted."""
        name = self._stops.signal
        state = None
        if self.config.save_state_on_interrupt:
            already = self._last_state is not None and self._last_state.name == state_dir_name(self.step)
            state = self._last_state if already else self.save_state()
            self._finish_state_save()
        where = f"; training state in {state} (resume_from='latest' continues)" if state is not None else ""
        raise TrainingInterrupted(f"{name}: training stopped after step {self.step}{where}", self.step, state)

    def _restart(self, error: Exception) -> None:
        """The policy's RESTART (:mod:`raymoe.driver.recovery`): new ranks, the newest state (or the initial
        weights) loaded into them, the data, schedule and metrics put back at that state's step."""
        failed_at, failed_step = time.monotonic(), self.step
        self.restarts += 1
        cause = cause_of(error)
        logger.warning(
            "step %d failed (%s); restarting the ranks (restart %d of at most %d)",
            failed_step + 1, cause, self.restarts, self.config.max_failures,
        )  # fmt: skip
        self._pending_state = None  # an asynchronous save the failure interrupted is not a state
        self.model.restart()
        state = self.run.latest_state()
        if state is not None:
            checked = self.model.check_state(state)
            self.step = resume_step(checked, self.config, self.train_data.num_sequences, self.train_data.data_order)
            self.model.load_state(checked)
        else:
            self.step = 0
            self.model.use_training_config(self.config.optimizer(), self.config.balance_options())
        self._batches = self._batches_from(self.step)
        self.log = MetricsLog(self.log.path, keep_through_step=self.step, on_append=self.trackers.log)
        self.trackers.rewind(self.step)
        self._restart_record = RestartRecord(self.restarts, self.step, failed_step + 1, state, cause, failed_at)

    def _log_restart(self) -> None:
        """The restart record, once the first step after it finished."""
        record, self._restart_record = self._restart_record, None
        if record is not None:
            self.log.append(record.record())

    def _train_one_step(self) -> dict[str, Any]:
        indices = next(self._batches)
        lr = self.schedule.lr_at(self.step)
        start = time.perf_counter()
        metrics = self.train_data.train_step(self.model, indices, lr, self.config.gradient_accumulation_steps)
        self.step += 1
        self.trackers.note_step(self.step, metrics)
        return step_record(self.step, metrics, time.perf_counter() - start)

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
        record = {"step": step, **self._evaluation()}
        self.log.append(record)
        return float(record["eval_loss"])

    def _evaluation(self) -> dict[str, float]:
        """The eval data's loss as a record's fields: ``eval_loss``, and ``eval_compile_s`` where the evaluation
        compiled the decoder blocks (said in the progress output, added to the fit's ``eval_compile_s``)."""
        totals = self._evaluate_totals()
        fields = {"eval_loss": totals.loss}
        if totals.compile_s > 0:
            fields["eval_compile_s"] = totals.compile_s
            self._eval_compile_s += totals.compile_s
            when = f"the evaluation after step {self.step}" if self.step else "the evaluation before training"
            self._announce(compile_note(when, totals.compile_s))
        return fields

    def _announce(self, message: str) -> None:
        """A line above the progress bar (the bar stays whole), or an INFO log record without one."""
        if self.config.progress:
            tqdm.write(message, file=sys.stderr)
        else:
            logger.info(message)

    def evaluate(self, data: TrainData | None = None) -> float:
        """Mean loss over every label token of ``data`` (default: the eval data), forward only; in global batches,
        a short last one filled with all-padding rows, one without label tokens skipped."""
        return self._evaluate_totals(data).loss

    def _evaluate_totals(self, data: TrainData | None = None) -> EvalTotals:
        rows = rows_of(data) if data is not None else self.eval_data
        if rows is None:
            raise ValueError("evaluate() needs data: pass it, or give the Trainer eval_data")
        if data is not None:
            rows.check("eval data", self.model.model_config, min_rows=1)
        return rows.evaluate(self.model, self.config.global_batch_size, self.config.gradient_accumulation_steps)

    def save(self, path: str | Path | Location | None = None) -> Location:
        """Write the model (hub layout, by rank 0 on its node; a LoRA model merged) and the tokenizer; default
        ``output_dir/checkpoint``."""
        return self._write(self.model.save_pretrained, path if path is not None else self.run.checkpoint)

    def save_adapter(self, path: str | Path | Location | None = None) -> Location:
        """Write a LoRA model's adapters (a PEFT directory, from the driver) and the tokenizer; default
        ``output_dir/adapter``."""
        return self._write(self.model.save_adapter, path if path is not None else self.run.adapter)

    def _write(self, save: Callable[[Location], object], path: str | Path | Location) -> Location:
        target = storage_path(path, "save path", write=True)
        self.run.write(save, target, self.tokenizer)
        return target

    def _save_due_files(self) -> tuple[Location | None, Location | None]:
        """What ``save_every`` and the end write: the checkpoint and/or the adapter, as the config says."""
        checkpoint = self.save() if self.config.save_checkpoint else None
        adapter = self.save_adapter() if self.config.save_adapter else None
        return checkpoint, adapter

    def save_state(self) -> Location:
        """Write the whole training state and this Trainer's position to ``output_dir/states/step-<n>`` (what
        ``resume_from`` reads); then remove all but the newest ``keep_last`` states. With ``async_save`` it
        returns while the state is still being written: the next save and the end of :meth:`fit` wait for it
        (and prune after it), as does the handle's ``shutdown``."""
        self._finish_state_save()
        target = child(self.states_dir, state_dir_name(self.step))
        rows, order = self.train_data.num_sequences, self.train_data.data_order
        extra = {"trainer": position(self.step, self.config, rows, order)}
        path = self.model.save_state(target, async_save=self.config.async_save, extra=extra)
        self._last_state = path
        if self.config.async_save:
            self._pending_state = path
        else:
            self.run.after_state_save(self.config.keep_last, path)
        return path

    def _finish_state_save(self) -> None:
        """Wait for an asynchronous save (raising its failure), then prune."""
        path, self._pending_state = self._pending_state, None
        if path is not None:
            self.model.wait_for_save()
            self.run.after_state_save(self.config.keep_last, path)

    @property
    def history(self) -> list[dict[str, Any]]:
        """Every record written to ``metrics.jsonl`` so far."""
        return list(self.log.records)
