"""The handle's training: AdamW and load balancing on the ranks, optimizer steps and evaluation (SPEC TRAIN-2, LB-2).

What the ranks train with lives here, on the driver, as the settings they were given (``optimizer``,
``balance``) and the step count, so a training state can record them and a restart can say they are gone.

    configure(OptimizerConfig, BalanceOptions)   checked, resolved against the model, sent to every rank
    global_batch(ids, labels, mask, docs)        the checked global batch (labels, padding, packing)
    train_step(batch, micro, lr)                 split by data-parallel batch into micro-batches -> train_step
    evaluate(batch, micro)                       the same split -> eval_loss, summed over batches
    train_step_streamed / evaluate_streamed      a StreamedBatch: each batch's ranks read its rows from Ray's
                                                 object store (rank/block_rows.py), never from this process

The loss is the mean over all label tokens of the global batch (counted here): each batch's rank returns
its summed token loss and the sums add up, whatever the layout.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import torch
from torch import Tensor

from raymoe.driver.batch import (
    GlobalBatch,
    check_micro_batches,
    check_sequence_length,
    make_global_batch,
    split_micro_batches,
)
from raymoe.driver.fanout import FanOut, split_batch_rows
from raymoe.driver.policy import PolicyStep, policy_metrics
from raymoe.driver.routing import DeadExperts, aux_loss_value, expert_load_metrics
from raymoe.driver.streamed_data import StreamedBatch
from raymoe.models.common.config import ModelConfig
from raymoe.rank.block_rows import eval_loss_on_blocks, train_step_on_blocks
from raymoe.rank.contract import EvalResult, MicroBatch, StepResult
from raymoe.rank.evaluate import eval_loss
from raymoe.rank.train import configure_optimizer, train_step
from raymoe.spec.balance import BalanceConfig, BalanceOptions
from raymoe.spec.optimizer import OptimizerConfig, check_lr
from raymoe.spec.precision import Precision, PrecisionPolicy


def check_trainable(policy: PrecisionPolicy) -> None:
    """fp16 has no loss scaling here: refused. Pure bf16 trains, with a warning that small updates are lost."""
    if not policy.trainable:
        raise ValueError(
            f"configure_training: precision {policy.precision.value!r} cannot train: float16 needs dynamic loss "
            "scaling, which raymoe does not have; load with dtype='bfloat16' (precision 'bf16-mixed') or 'float32'"
        )
    if policy.precision is Precision.BF16_PURE:
        warnings.warn(
            "configure_training: precision 'bf16-pure' holds weights and AdamW states in bf16: updates below bf16's "
            "resolution (lr 1e-5 on a weight of ~1) are lost; 'bf16-mixed' (the default) keeps float32 masters",
            stacklevel=3,
        )


class TrainingSession:
    """The training settings the ranks hold, the optimizer steps taken with them, and the routing telemetry."""

    def __init__(self, config: ModelConfig, fanout: FanOut, precision: PrecisionPolicy) -> None:
        self.config, self.fanout, self.precision = config, fanout, precision
        self.optimizer: OptimizerConfig | None = None  # None: no optimizer on the ranks
        self.balance = BalanceConfig()
        self.step = 0
        self._dead_experts = DeadExperts()

    def configure(self, optimizer: OptimizerConfig, balance: BalanceOptions) -> None:
        """A fresh AdamW and load-balancing settings on every rank; the step count starts at 0. Refused for a
        policy that cannot train (fp16: no loss scaling); a warning for pure bf16."""
        check_trainable(self.precision)
        settings = self._pipeline_balance(balance.resolve(self.config))
        self.fanout.every_rank(configure_optimizer, optimizer, settings)
        self.restore(optimizer, settings, step=0)

    def restore(self, optimizer: OptimizerConfig, balance: BalanceConfig, step: int) -> None:
        """Record the settings the ranks now hold (after ``configure``, or a loaded training state)."""
        self.optimizer, self.balance, self.step = optimizer, balance, step
        self._dead_experts.reset()

    def forget(self) -> None:
        """The ranks were replaced: no optimizer on them any more."""
        self.optimizer, self.balance, self.step = None, BalanceConfig(), 0
        self._dead_experts.reset()

    def require_optimizer(self, method: str) -> OptimizerConfig:
        if self.optimizer is None:
            raise RuntimeError(f"{method} needs an optimizer: call configure_training(...) first")
        return self.optimizer

    def _pipeline_balance(self, settings: BalanceConfig) -> BalanceConfig:
        """Under pipeline parallelism routers run on several stages in pieces: the aux loss and bias balancing
        are refused, and no routing is recorded (a step reports no expert-load metrics)."""
        pp = self.fanout.topology.config.pp_size
        if pp == 1:
            return settings
        if settings.aux_loss_coef > 0 or settings.bias_update_rate is not None:
            raise ValueError(
                f"configure_training: aux_loss_coef={settings.aux_loss_coef}, bias_update_rate="
                f"{settings.bias_update_rate} with pp_size={pp}: load balancing (the aux loss, bias updates) is not "
                "implemented under pipeline parallelism yet; use balance='none' (or a layout with pp_size=1)"
            )
        return dataclasses.replace(settings, record_routing=False)

    # --- steps ------------------------------------------------------------------------------------

    def global_batch(
        self, input_ids: Tensor, labels: Tensor | None, attention_mask: Tensor | None, document_ids: Tensor | None
    ) -> GlobalBatch:
        """The checked global batch of a step or an evaluation (labels, padding and packing folded in)."""
        batch = make_global_batch(input_ids, labels, attention_mask, self.config.vocab_size, document_ids)
        check_sequence_length(batch.input_ids.shape[1], self.config.max_position_embeddings)
        self.fanout.topology.config.check_sequence_length(batch.input_ids.shape[1])
        if batch.num_label_tokens == 0:
            raise ValueError("the batch has no label tokens (all labels are -100 or masked)")
        return batch

    def train_step(
        self,
        batch: GlobalBatch,
        micro_batches: int,
        lr: float | None,
        policy: PolicyStep | None = None,
        routes: Tensor | None = None,
    ) -> dict[str, Any]:
        """One optimizer step on the global batch (see ``DistributedModel.train_step`` for what it returns); a
        ``policy`` loss (RL) instead of cross-entropy; replayed ``routes [B, S, L_moe, K]``."""
        self.require_optimizer("train_step")
        if lr is not None:
            check_lr(lr)
        if policy is not None and policy.policy.is_callable and self.fanout.topology.config.splits_sequences:
            raise ValueError(
                "train_step: loss=callable gets whole rows of log-probs, but cp_size="
                f"{self.fanout.topology.config.cp_size} splits every row over ranks; use a built-in loss "
                "('importance_sampling', 'ppo') or a layout with cp_size=1"
            )
        if policy is not None and policy.policy.is_callable and self.balance.aux_loss_coef > 0:
            raise ValueError(
                "train_step: loss=callable divides the step's gradients by its normalizer after the backward, which "
                f"would divide the aux loss (aux_loss_coef={self.balance.aux_loss_coef}) too; configure_training with "
                "balance='bias' or 'none', or use a built-in loss"
            )
        micro_of_batch = self.micro_batches(batch, micro_batches, policy.fields if policy else None, routes)
        sizes = [micro.input_ids.shape[0] for micros in micro_of_batch for micro in micros]
        self._check_pipeline_pieces(batch.input_ids.shape[0], micro_batches, sizes)
        divisor = policy.normalizer if policy is not None else batch.num_label_tokens
        loss = policy.policy if policy is not None else None
        args = [(micro, divisor, lr, loss) for micro in micro_of_batch]
        firsts: list[StepResult] = self.fanout.per_batch(train_step, args)
        return self._step_metrics(firsts, batch.num_label_tokens, lr, policy)

    def train_step_streamed(self, batch: StreamedBatch, lr: float | None) -> dict[str, Any]:
        """:meth:`train_step` on a global batch whose rows stay in Ray's object store (cross-entropy)."""
        self.require_optimizer("train_step")
        if lr is not None:
            check_lr(lr)
        self._check_streamed(batch)
        args = [(rows, batch.num_label_tokens, lr) for rows in batch.rows]
        firsts: list[StepResult] = self.fanout.per_batch(train_step_on_blocks, args, batch.blocks)
        return self._step_metrics(firsts, batch.num_label_tokens, lr, None)

    def _step_metrics(
        self, firsts: list[StepResult], num_label_tokens: int, lr: float | None, policy: PolicyStep | None
    ) -> dict[str, Any]:
        optimizer = self.require_optimizer("train_step")
        self.step += 1
        if lr is not None:
            self.optimizer = optimizer = optimizer.with_lr(lr)
        if policy is not None:
            metrics = policy_metrics(policy, firsts)
        else:
            lm_loss = sum(r.loss_sum for r in firsts) / num_label_tokens
            metrics = {"loss": lm_loss, "lm_loss": lm_loss, "num_tokens": num_label_tokens}
        metrics["grad_norm"] = firsts[0].grad_norm  # the global norm: the same on every rank
        metrics["lr"] = optimizer.lr
        objective = metrics["loss"]
        metrics.update(self._routing_metrics(firsts))
        metrics["loss"] = objective + self.balance.aux_loss_coef * metrics.get("aux_loss", 0.0)
        compiling = max(r.compile_s for r in firsts)
        if compiling > 0:  # a new shape's first step: its blocks compiled (raymoe.parallel.compiled_blocks)
            metrics["compile_s"] = compiling
        return metrics

    def evaluate(self, batch: GlobalBatch, micro_batches: int) -> dict[str, Any]:
        micro_of_batch = self.micro_batches(batch, micro_batches)
        results: list[EvalResult] = self.fanout.per_batch(eval_loss, [(micro,) for micro in micro_of_batch])
        return self._eval_metrics(results, batch.num_label_tokens)

    def evaluate_streamed(self, batch: StreamedBatch) -> dict[str, Any]:
        """:meth:`evaluate` on a global batch whose rows stay in Ray's object store."""
        self._check_streamed(batch)
        results: list[EvalResult] = self.fanout.per_batch(eval_loss_on_blocks, [(r,) for r in batch.rows], batch.blocks)
        return self._eval_metrics(results, batch.num_label_tokens)

    @staticmethod
    def _eval_metrics(results: list[EvalResult], num_label_tokens: int) -> dict[str, Any]:
        """The batches' summed losses over the global batch's label tokens; ``compile_s`` (the longest of theirs) where
        the forward compiled the decoder blocks."""
        loss_sum = sum(r.loss_sum for r in results)
        metrics: dict[str, Any] = {"loss": loss_sum / num_label_tokens, "loss_sum": loss_sum}
        metrics["num_tokens"] = num_label_tokens
        compiling = max(r.compile_s for r in results)
        if compiling > 0:  # a new shape's first evaluation: its blocks compiled
            metrics["compile_s"] = compiling
        return metrics

    def _check_streamed(self, batch: StreamedBatch) -> None:
        """What :meth:`global_batch` and :func:`split_micro_batches` check, from the batch's row counts."""
        check_sequence_length(batch.seq_len, self.config.max_position_embeddings)
        self.fanout.topology.config.check_sequence_length(batch.seq_len)
        if batch.num_label_tokens == 0:
            raise ValueError("the batch has no label tokens (all labels are -100 or masked)")
        sizes = []
        for rows in batch.rows:
            check_micro_batches(rows.micro_batches, rows.num_rows)
            sizes += [len(part) for part in torch.tensor_split(torch.arange(rows.num_rows), rows.micro_batches)]
        self._check_pipeline_pieces(batch.num_rows, batch.rows[0].micro_batches, sizes)

    def micro_batches(
        self,
        batch: GlobalBatch,
        micro_batches: int,
        fields: dict[str, Tensor] | None = None,
        routes: Tensor | None = None,
    ) -> list[list[MicroBatch]]:
        """Each data-parallel batch's rows of ``batch`` (and of per-token ``fields``, replayed ``routes``) as
        ``micro_batches`` micro-batches."""
        split = split_batch_rows(batch.input_ids.shape[0], self.fanout.topology.config.dp_size)
        parts = (split.take_all(t) for t in (batch.input_ids, batch.labels, batch.token_mask))
        documents, route_parts = split.take(batch.document_ids), split.take(routes)
        field_parts = [
            {name: value[rows] for name, value in fields.items()} if fields is not None else None for rows in split.rows
        ]
        return [
            split_micro_batches(ids, labs, mask, micro_batches, docs, batch_fields, batch_routes)
            for ids, labs, mask, docs, batch_fields, batch_routes in zip(
                *parts, documents, field_parts, route_parts, strict=True
            )
        ]

    def _check_pipeline_pieces(self, rows: int, micro_batches: int, micro_sizes: list[int]) -> None:
        """Under pipeline parallelism each rank's micro-batch is cut into ``pp_microbatches`` equal pieces."""
        config = self.fanout.topology.config
        pieces = config.pp_microbatches
        if config.pp_size == 1 or pieces is None:
            return
        sizes = sorted(set(micro_sizes))
        if any(size % pieces for size in sizes):
            raise ValueError(
                f"pp_microbatches={pieces} must divide the rows of every micro-batch a rank runs: the global batch "
                f"of {rows} rows over dp_size={config.dp_size} with micro_batches={micro_batches} gives micro-batches "
                f"of {', '.join(map(str, sizes))} rows; use a global batch of a multiple of "
                f"{pieces * config.dp_size * micro_batches} rows or change pp_microbatches"
            )

    def _routing_metrics(self, firsts: list[StepResult]) -> dict[str, Any]:
        """Routing telemetry of a step (MoE models): loads, imbalance, dead experts, drops, the aux loss."""
        loads = [r.expert_load for r in firsts if r.expert_load is not None]
        stats = [r.aux_stats for r in firsts if r.aux_stats is not None]
        dropped = [r.dropped_pairs for r in firsts if r.dropped_pairs is not None]
        if not loads or len(loads) != len(firsts) or self.config.moe is None:
            return {}
        metrics = expert_load_metrics(loads, self.fanout.topology)
        metrics["dead_experts"] = self._dead_experts.update(torch.stack(loads).sum(dim=0))
        metrics["dropped_pairs"] = torch.stack(dropped).sum(dim=0).tolist()
        num_experts = self.config.moe.num_experts
        metrics["aux_loss"] = aux_loss_value(stats, num_experts, per_layer=self.balance.aux_loss_per_layer)
        metrics["aux_loss_coef"] = self.balance.aux_loss_coef
        return metrics
