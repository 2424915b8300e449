"""The driver-side model handle ``raymoe.from_pretrained`` returns (SPEC RAY-3, INF-1, TRAIN-2/3).

Each method validates on the driver, splits the global batch by data-parallel coordinate,
fans one rank function out through the :class:`~actors.group.RankGroup` and folds the
per-rank answers into one result. Nothing here touches a tensor of the model.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
from torch import Tensor

from actors.group import GroupOptions, RankGroup
from raymoe.balance import expert_load_metrics
from raymoe.batch import (
    GlobalBatch,
    check_input_ids,
    check_sequence_length,
    make_global_batch,
    split_by_rank,
    split_micro_batches,
)
from raymoe.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE
from raymoe.evaluation import eval_loss
from raymoe.generation import pad_token_for, trim_finished
from raymoe.inference import forward_logits, generate_on_rank
from raymoe.launch import LaunchSpec
from raymoe.loading import LoadReport, load_on_rank
from raymoe.models.config import ModelConfig, parse_model_config
from raymoe.saving import save_on_rank
from raymoe.topology import Topology
from raymoe.training import StepResult, TrainingConfig, configure_training, train_step


class DistributedModel:
    """A model sharded over Ray rank actors. Use as a context manager, or call :meth:`shutdown`."""

    def __init__(self, spec: LaunchSpec, group: RankGroup, load_reports: list[LoadReport]) -> None:
        self._spec = spec
        self._group = group
        self.load_reports = load_reports
        self.model_config: ModelConfig = parse_model_config(spec.model_config)
        self._training: TrainingConfig | None = None
        # Frees the actors when the handle is collected or the interpreter exits.
        self._finalizer = weakref.finalize(self, group.shutdown)

    @classmethod
    def launch(cls, spec: LaunchSpec, options: GroupOptions) -> DistributedModel:
        group = RankGroup.create(spec.topology, options)
        try:
            reports = group.execute(load_on_rank, spec)
        except BaseException:
            group.shutdown()
            raise
        return cls(spec, group, reports)

    # --- what was loaded ------------------------------------------------------------------------

    @property
    def topology(self) -> Topology:
        return self._spec.topology

    @property
    def tp_plan(self) -> dict[str, str]:
        """The merged TP plan (model defaults + overrides), wildcard keys (PLAN-1)."""
        return dict(self._spec.plans.tp_plan)

    @property
    def ep_plan(self) -> dict[str, str]:
        return dict(self._spec.plans.ep_plan)

    @property
    def fsdp_plan(self) -> dict[str, str]:
        return dict(self._spec.plans.fsdp_plan)

    @property
    def supports_tp_plan(self) -> bool:
        return bool(self._spec.plans.tp_plan)

    def describe(self) -> str:
        """The rank picture of this layout (SPEC TOPO-3)."""
        num_experts = self.model_config.moe.num_experts if self.model_config.moe is not None else None
        return self.topology.describe(num_experts=num_experts)

    # --- inference and training -------------------------------------------------------------------

    def __call__(self, input_ids: Tensor) -> Tensor:
        """``logits [B, S, V]`` of the global batch ``input_ids [B, S]``, gathered on the driver."""
        ids = check_input_ids(input_ids, self.model_config.vocab_size)
        check_sequence_length(ids.shape[1], self.model_config.max_position_embeddings)
        per_rank = split_by_rank(ids, self.topology)
        results = self._group.execute_per_rank(forward_logits, [(rows,) for rows in per_rank])
        return torch.cat([results[ranks[0]] for ranks in self.topology.batch_ranks()])

    def generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        *,
        eos_token_ids: Sequence[int] | None = None,
        pad_token_id: int | None = None,
    ) -> Tensor:
        """Greedy continuation ``[B, S + n]`` of the global batch, with a KV cache on every rank.

        Rows that finish early (an eos id) are padded with ``pad_token_id`` (default: the config's,
        else the first eos id) up to the longest row.
        """
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        ids = check_input_ids(input_ids, self.model_config.vocab_size)
        check_sequence_length(ids.shape[1] + max_new_tokens, self.model_config.max_position_embeddings)
        eos = tuple(self.model_config.eos_token_ids if eos_token_ids is None else eos_token_ids)
        pad = pad_token_for(self.model_config, eos, pad_token_id)
        args = [(rows, max_new_tokens, eos, pad) for rows in split_by_rank(ids, self.topology)]
        results = self._group.execute_per_rank(generate_on_rank, args)
        rows = [results[ranks[0]] for ranks in self.topology.batch_ranks()]
        width = max(r.shape[1] for r in rows)
        tokens = torch.cat([torch.nn.functional.pad(r, (0, width - r.shape[1]), value=pad) for r in rows])
        return trim_finished(tokens, ids.shape[1], eos)

    def configure_training(
        self,
        lr: float = 1e-3,
        weight_decay: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        max_grad_norm: float | None = None,
    ) -> None:
        """AdamW on every rank (torch's defaults); ``max_grad_norm=None`` means no clipping."""
        config = TrainingConfig(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, max_grad_norm=max_grad_norm)
        self._group.execute(configure_training, config)
        self._training = config

    def train_step(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        lr: float | None = None,
        micro_batches: int = 1,
    ) -> dict[str, Any]:
        """One optimizer step on the global batch; the loss is the mean over all its label tokens.

        ``labels`` default to ``input_ids``; label ``-100`` and ``attention_mask == 0`` take no loss.
        ``lr`` overrides the learning rate from this step on (schedules set it every step).
        ``micro_batches > 1`` splits each rank's rows into that many forward/backward passes
        (gradient accumulation) before the one optimizer step.
        """
        if self._training is None:
            raise RuntimeError("call configure_training(...) before train_step")
        if lr is not None:
            TrainingConfig(lr=lr)  # same rule as configure_training
        batch, micro_of_rank = self._labelled_batch(input_ids, labels, attention_mask, micro_batches)
        args = [(micro, batch.num_label_tokens, lr) for micro in micro_of_rank]
        results: list[StepResult] = self._group.execute_per_rank(train_step, args)
        if lr is not None:
            self._training = TrainingConfig(**{**self._training.__dict__, "lr": lr})
        # Every rank of a tp group holds the same rows: count each batch block once.
        firsts = [results[ranks[0]] for ranks in self.topology.batch_ranks()]
        metrics: dict[str, Any] = {
            "loss": sum(r.loss_sum for r in firsts) / batch.num_label_tokens,
            "grad_norm": results[0].grad_norm,
            "num_tokens": batch.num_label_tokens,
            "lr": self._training.lr,
        }
        loads = [r.expert_load for r in firsts]
        if all(load is not None for load in loads) and loads:
            metrics.update(expert_load_metrics([load for load in loads if load is not None], self.topology))
        return metrics

    def evaluate(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        micro_batches: int = 1,
    ) -> dict[str, Any]:
        """Mean loss over all label tokens of the global batch, forward only: no gradients, no optimizer step.

        Batch handling as in :meth:`train_step`. Returns ``loss``, ``loss_sum`` and ``num_tokens``,
        so the losses of several batches combine exactly: ``sum(loss_sum) / sum(num_tokens)``.
        """
        batch, micro_of_rank = self._labelled_batch(input_ids, labels, attention_mask, micro_batches)
        results: list[float] = self._group.execute_per_rank(eval_loss, [(micro,) for micro in micro_of_rank])
        # Every rank of a tp group holds the same rows: count each batch block once.
        loss_sum = sum(results[ranks[0]] for ranks in self.topology.batch_ranks())
        return {"loss": loss_sum / batch.num_label_tokens, "loss_sum": loss_sum, "num_tokens": batch.num_label_tokens}

    def _labelled_batch(
        self, input_ids: Tensor, labels: Tensor | None, attention_mask: Tensor | None, micro_batches: int
    ) -> tuple[GlobalBatch, list[list[tuple[Tensor, Tensor]]]]:
        """The checked global batch, and each rank's rows as ``(input_ids, labels)`` micro-batches."""
        batch = make_global_batch(input_ids, labels, attention_mask, self.model_config.vocab_size)
        check_sequence_length(batch.input_ids.shape[1], self.model_config.max_position_embeddings)
        if batch.num_label_tokens == 0:
            raise ValueError("the batch has no label tokens (all labels are -100 or masked)")
        ids_of_rank = split_by_rank(batch.input_ids, self.topology)
        labels_of_rank = split_by_rank(batch.labels, self.topology)
        micro = [
            split_micro_batches(ids, labs, micro_batches) for ids, labs in zip(ids_of_rank, labels_of_rank, strict=True)
        ]
        return batch, micro

    def save_pretrained(self, path: str | os.PathLike[str], max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> list[Path]:
        """Gather the weights into a hub-layout checkpoint at ``path`` (written by rank 0, on its node)."""
        directory = Path(path).expanduser().absolute()
        files = self._group.execute(save_on_rank, str(directory), max_shard_size)[0]
        return [Path(file) for file in files]

    # --- life cycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every rank actor and free the placement group; safe to call more than once."""
        self._finalizer()

    def __enter__(self) -> DistributedModel:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self._group.is_alive else "shut down"
        return (
            f"DistributedModel({self.model_config.model_type} from {self._spec.source!r}, "
            f"{self.topology.config!r}, {state})\n{self.describe()}"
        )
