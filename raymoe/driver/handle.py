"""The driver-side model handle ``raymoe.from_pretrained`` returns (SPEC RAY-3, INF-1, TRAIN-2/3).

Each method validates on the driver, splits the global batch by data-parallel coordinate,
fans one rank function (``raymoe.rank.*``) out through a :class:`~raymoe.driver.group.RankGroup`
and folds the per-rank answers into one result. Nothing here touches a tensor of the model.

A handle either owns its group (``from_pretrained`` started it for this model: ``shutdown`` ends
the ranks) or borrows a world the user started (``from_pretrained(..., world=...)``: ``shutdown``
unloads the model and leaves the ranks running for the next one).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path
from types import TracebackType
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from raymoe.checkpoint.staging import (
    CheckpointSaveError,
    recover_interrupted_save,
    staging_directory,
    swappable_target,
)
from raymoe.checkpoint.training_state import StateManifest, TrainingStateError, check_training_state
from raymoe.checkpoint.writer import DEFAULT_MAX_SHARD_SIZE
from raymoe.driver.batch import (
    GlobalBatch,
    check_document_ids,
    check_input_ids,
    check_right_padded,
    check_sequence_length,
    make_global_batch,
    split_by_rank,
    split_micro_batches,
)
from raymoe.driver.group import RankGroup, one_per_batch
from raymoe.driver.prompts import (
    PromptBatch,
    RowSplit,
    as_output,
    check_attention_mask,
    check_stop_sequences,
    check_token_ids,
    prompt_batch,
    split_rows,
)
from raymoe.driver.routing import DeadExperts, aux_loss_value, expert_load_metrics
from raymoe.models.common.config import ModelConfig
from raymoe.models.common.generation import SamplingConfig, stop_rules, trim_finished
from raymoe.models.registry import parse_model_config
from raymoe.rank.evaluate import eval_loss
from raymoe.rank.infer import DecodeRequest, end_stream, forward_logits, generate_tokens, start_stream, stream_step
from raymoe.rank.load import LoadReport, load_shards, unload_model
from raymoe.rank.save import save_gathered
from raymoe.rank.state import (
    StateAnswer,
    StateRequest,
    load_training_state,
    save_training_state,
    wait_for_state_save,
)
from raymoe.rank.train import MicroBatch, StepResult, configure_optimizer, train_step
from raymoe.spec.balance import DEFAULT_BIAS_UPDATE_RATE, BalanceConfig, BalanceOptions
from raymoe.spec.launch import LaunchSpec
from raymoe.spec.optimizer import OptimizerConfig, check_lr
from raymoe.spec.plans import ResolvedPlans
from raymoe.spec.topology import Topology

logger = logging.getLogger(__name__)


class DistributedModel:
    """A model sharded over rank processes. Use as a context manager, or call :meth:`shutdown`."""

    def __init__(
        self,
        spec: LaunchSpec,
        group: RankGroup,
        load_reports: list[LoadReport],
        *,
        owns_group: bool,
        restart: Callable[[], RankGroup] | None = None,
    ) -> None:
        self._spec = spec
        self._group = group
        self._restart = restart
        self.load_reports = load_reports
        self.model_config: ModelConfig = parse_model_config(spec.model_config)
        self._optimizer: OptimizerConfig | None = None
        self._balance = BalanceConfig()
        self._dead_experts = DeadExperts()
        self._step = 0
        self._saving: Path | None = None  # the target of an asynchronous save_state still writing
        # Frees what this handle holds when it is collected or the interpreter exits.
        release: Callable[[], None] = group.shutdown if owns_group else _unloader(group)
        self._finalizer = weakref.finalize(self, release)

    @classmethod
    def launch(
        cls, spec: LaunchSpec, group: RankGroup, *, owns_group: bool, restart: Callable[[], RankGroup] | None = None
    ) -> DistributedModel:
        """Load ``spec`` on ``group`` (its layout first); an owned group is shut down if loading fails.

        A borrowed world hosts one model at a time: loading onto one whose model is still open is a
        ``ValueError`` (the old handle would otherwise drive the new model). ``restart`` starts a new group like
        ``group`` (for :meth:`restart`; an owned group only).
        """
        if not owns_group:
            _check_vacant(group)
        reports = _load(spec, group, owns_group)
        model = cls(spec, group, reports, owns_group=owns_group, restart=restart)
        if not owns_group:
            _TENANTS[group] = weakref.ref(model)
        return model

    # --- what was loaded ------------------------------------------------------------------------

    @property
    def topology(self) -> Topology:
        return self._spec.topology

    @property
    def source(self) -> str:
        """The checkpoint directory or hub id this model was loaded from."""
        return self._spec.source

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
    def plans(self) -> ResolvedPlans:
        """The resolved plans every rank applied: merged plans, concrete rules and the style instances."""
        return self._spec.plans

    @property
    def supports_tp_plan(self) -> bool:
        return bool(self._spec.plans.tp_plan)

    def describe(self) -> str:
        """The rank picture of this layout (SPEC TOPO-3)."""
        num_experts = self.model_config.moe.num_experts if self.model_config.moe is not None else None
        return self.topology.describe(num_experts=num_experts)

    # --- inference and training -------------------------------------------------------------------

    def __call__(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        return_logits: str = "all",
        document_ids: Tensor | None = None,
    ) -> Tensor:
        """Logits of the global batch ``input_ids [B, S]`` (any ``B``), gathered on the driver.

        ``return_logits="all"``: ``[B, S, V]``, every position (transformers' ``model(ids).logits``);
        ``"last"``: ``[B, V]`` at each row's last real token, the ``[B, S, V]`` tensor never built.
        ``attention_mask [B, S]`` (1: real token) may pad rows on either side. ``document_ids [B, S]``:
        packed rows, each run of equal ids a document that sees only itself, its positions from 0.
        """
        if return_logits not in ("all", "last"):
            raise ValueError(f"return_logits={return_logits!r}: choose 'all' or 'last'")
        ids = check_input_ids(input_ids, self.model_config.vocab_size)
        mask = check_attention_mask(attention_mask, ids) if attention_mask is not None else None
        documents = check_document_ids(document_ids, ids) if document_ids is not None else None
        if documents is not None and mask is not None:
            check_right_padded(mask)  # packed rows read no padding mask: padding may only trail a row
        check_sequence_length(ids.shape[1], self.model_config.max_position_embeddings)
        split = split_rows(ids.shape[0], self.topology.config.dp_size)
        parts = (split.for_ranks(part, self.topology) for part in (ids, mask, documents))
        args = [(i, m, return_logits == "last", d) for i, m, d in zip(*parts, strict=True)]
        results = self._ranks().execute_per_rank(forward_logits, args)
        return split.gather(one_per_batch(results, self.topology))

    def generate(
        self,
        prompts: Tensor | Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        attention_mask: Tensor | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        seed: int = 0,
        eos_token_ids: Sequence[int] | None = None,
        stop_sequences: Sequence[Sequence[int]] = (),
        pad_token_id: int | None = None,
    ) -> Tensor | list[list[int]]:
        """Continue each prompt by up to ``max_new_tokens`` tokens (greedy by default), with a KV cache on every rank.

        ``prompts``: a ``[B, S]`` tensor (left-padded with ``attention_mask``) -> ``[B, S + n]``, rows that
        finished early padded with ``pad_token_id`` (default: the config's, else the first eos id); or a list
        of token-id lists of any lengths -> a list of prompt + continuation lists, no padding. Any ``B`` on
        any layout. A row finishes at an ``eos_token_ids`` token (default: the config's) or at the end of a
        ``stop_sequences`` entry (both kept in the output). ``do_sample`` draws with ``temperature``,
        ``top_k``, ``top_p``; the same ``seed`` gives the same tokens under every layout.
        """
        batch, split, request = self._decode_request(
            prompts, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, seed, eos_token_ids,
            stop_sequences, pad_token_id,
        )  # fmt: skip
        results = self._ranks().execute_per_rank(generate_tokens, self._decode_args(batch, split, request))
        answers = one_per_batch(results, self.topology)
        width = max(tokens.shape[1] for tokens, _ in answers)
        pad = request.stop.pad_id
        tokens = split.gather([F.pad(t, (0, width - t.shape[1]), value=pad) for t, _ in answers])
        lengths = split.gather([lengths for _, lengths in answers])
        return as_output(trim_finished(tokens, batch.input_ids.shape[1], lengths), batch, lengths)

    def generate_stream(
        self,
        prompts: Tensor | Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        attention_mask: Tensor | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int | None = None,
        top_p: float = 1.0,
        seed: int = 0,
        eos_token_ids: Sequence[int] | None = None,
        stop_sequences: Sequence[Sequence[int]] = (),
        pad_token_id: int | None = None,
    ) -> Iterator[list[int | None]]:
        """:meth:`generate` one step at a time: yields, per step, each row's new token (None once it finished).

        The same tokens as :meth:`generate` with the same arguments. Checked before the first step;
        stopping the iteration early frees the ranks' KV caches.
        """
        batch, split, request = self._decode_request(
            prompts, attention_mask, max_new_tokens, do_sample, temperature, top_k, top_p, seed, eos_token_ids,
            stop_sequences, pad_token_id,
        )  # fmt: skip
        return self._stream(batch, split, request)

    def _stream(self, batch: PromptBatch, split: RowSplit, request: DecodeRequest) -> Iterator[list[int | None]]:
        ranks = self._ranks()
        ranks.execute_per_rank(start_stream, self._decode_args(batch, split, request))
        finished = torch.zeros(batch.num_rows, dtype=torch.bool)
        try:
            for _ in range(request.max_new_tokens):
                answers = one_per_batch(ranks.execute(stream_step), self.topology)
                tokens = split.gather([t for t, _ in answers])
                yield [None if done else int(t) for t, done in zip(tokens, finished.tolist(), strict=True)]
                finished = split.gather([f for _, f in answers])
                if request.stop.can_stop and bool(finished.all()):
                    break
        finally:
            if self._group.is_alive:
                ranks.execute(end_stream)

    def _decode_request(
        self,
        prompts: object,
        attention_mask: object | None,
        max_new_tokens: object,
        do_sample: bool,
        temperature: float,
        top_k: int | None,
        top_p: float,
        seed: int,
        eos_token_ids: Sequence[int] | None,
        stop_sequences: Sequence[Sequence[int]],
        pad_token_id: int | None,
    ) -> tuple[PromptBatch, RowSplit, DecodeRequest]:
        """Every argument of a generation checked on the driver, before any rank is asked."""
        if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be an int >= 0, got {max_new_tokens!r}")
        config = self.model_config
        sampling = SamplingConfig(do_sample, temperature, top_k, top_p, seed)
        stop = stop_rules(config, check_token_ids(eos_token_ids, config.vocab_size, "eos_token_ids"),
                          check_stop_sequences(stop_sequences, config.vocab_size), pad_token_id)  # fmt: skip
        batch = prompt_batch(prompts, attention_mask, config.vocab_size, stop.pad_id)
        check_sequence_length(batch.input_ids.shape[1] + max_new_tokens, config.max_position_embeddings)
        split = split_rows(batch.num_rows, self.topology.config.dp_size)
        return batch, split, DecodeRequest(max_new_tokens, sampling, stop)

    def _decode_args(self, batch: PromptBatch, split: RowSplit, request: DecodeRequest) -> list[tuple[Any, ...]]:
        ids = split.for_ranks(batch.input_ids, self.topology)
        masks = split.for_ranks(batch.attention_mask, self.topology)
        rows = split.row_ids(self.topology)
        return [(i, m, r, request) for i, m, r in zip(ids, masks, rows, strict=True)]

    def configure_training(
        self,
        lr: float = OptimizerConfig.lr,
        weight_decay: float = OptimizerConfig.weight_decay,
        betas: tuple[float, float] = OptimizerConfig.betas,
        eps: float = OptimizerConfig.eps,
        max_grad_norm: float | None = OptimizerConfig.max_grad_norm,
        *,
        balance: str = "auto",
        router_aux_loss_coef: float | None = None,
        bias_update_rate: float = DEFAULT_BIAS_UPDATE_RATE,
        capacity_factor: float | None = None,
        telemetry: bool = True,
    ) -> None:
        """AdamW on every rank (defaults: :class:`~raymoe.spec.optimizer.OptimizerConfig`; ``max_grad_norm=None``
        means no clipping) and load balancing (:mod:`raymoe.spec.balance`).

        ``balance="auto"`` follows the checkpoint (the aux loss iff its config.json has
        ``output_router_logits``); ``router_aux_loss_coef`` overrides the checkpoint's coefficient (and, under
        ``"auto"``, turns the aux loss on); ``"bias"`` moves the routers' selection bias by
        ``bias_update_rate`` after each step; ``capacity_factor`` drops pairs beyond each expert's share of a
        sequence; ``telemetry=False`` stops recording routing choices (no load metrics) unless a method
        needs them. Every value is checked here, before any rank is asked.
        """
        config = OptimizerConfig(lr=lr, weight_decay=weight_decay, betas=betas, eps=eps, max_grad_norm=max_grad_norm)
        options = BalanceOptions(balance, router_aux_loss_coef, bias_update_rate, capacity_factor, telemetry)
        settings = self._pipeline_balance(options.resolve(self.model_config))
        self._ranks().execute(configure_optimizer, config, settings)
        self._optimizer, self._balance = config, settings
        self._dead_experts.reset()
        self._step = 0

    def _pipeline_balance(self, settings: BalanceConfig) -> BalanceConfig:
        """Under pipeline parallelism routers run on several stages in pieces: the aux loss and bias balancing
        are refused, and no routing is recorded (a step reports no expert-load metrics)."""
        pp = self.topology.config.pp_size
        if pp == 1:
            return settings
        if settings.aux_loss_coef > 0 or settings.bias_update_rate is not None:
            raise ValueError(
                f"configure_training: aux_loss_coef={settings.aux_loss_coef}, bias_update_rate="
                f"{settings.bias_update_rate} with pp_size={pp}: load balancing (the aux loss, bias updates) is not "
                "implemented under pipeline parallelism yet; use balance='none' (or a layout with pp_size=1)"
            )
        return dataclasses.replace(settings, record_routing=False)

    @property
    def step(self) -> int:
        """Optimizer steps taken since ``configure_training`` (or restored by ``load_state``)."""
        return self._step

    @property
    def balance(self) -> BalanceConfig:
        """The load-balancing settings the ranks train with (from the last ``configure_training``)."""
        return self._balance

    def train_step(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        lr: float | None = None,
        micro_batches: int = 1,
        *,
        document_ids: Tensor | None = None,
    ) -> dict[str, Any]:
        """One optimizer step on the global batch; the loss is the mean over all its label tokens.

        ``labels`` default to ``input_ids``; label ``-100`` and ``attention_mask == 0`` take no loss.
        ``document_ids [B, S]`` packs documents into rows: each run of equal ids is a document that attends
        only to itself, with positions from 0, and its first token is no target of the previous document.
        ``lr`` overrides the learning rate from this step on (schedules set it every step).
        ``micro_batches > 1`` splits each rank's rows into that many forward/backward passes
        (gradient accumulation) before the one optimizer step.

        Returns ``loss`` (``lm_loss + aux_loss_coef * aux_loss``), ``lm_loss``, ``grad_norm``, ``num_tokens``,
        ``lr`` and, for MoE models, per MoE layer ``expert_load``, ``expert_imbalance``, ``rank_load``,
        ``rank_imbalance``, ``dead_experts``, ``dropped_pairs``, and the step's ``aux_loss`` (reported even
        when its coefficient ``aux_loss_coef`` is 0).
        """
        if self._optimizer is None:
            raise RuntimeError("call configure_training(...) before train_step")
        if lr is not None:
            check_lr(lr)
        batch, micro_of_rank = self._labelled_batch(input_ids, labels, attention_mask, micro_batches, document_ids)
        self._check_pipeline_pieces(batch.input_ids.shape[0], micro_batches, micro_of_rank)
        args = [(micro, batch.num_label_tokens, lr) for micro in micro_of_rank]
        results: list[StepResult] = self._ranks().execute_per_rank(train_step, args)
        self._step += 1
        if lr is not None:
            self._optimizer = self._optimizer.with_lr(lr)
        firsts = one_per_batch(results, self.topology)
        lm_loss = sum(r.loss_sum for r in firsts) / batch.num_label_tokens
        metrics: dict[str, Any] = {
            "loss": lm_loss,  # + aux_loss_coef * aux_loss below, for MoE models
            "lm_loss": lm_loss,
            "grad_norm": results[0].grad_norm,
            "num_tokens": batch.num_label_tokens,
            "lr": self._optimizer.lr,
        }
        metrics.update(self._routing_metrics(firsts))
        metrics["loss"] = lm_loss + self._balance.aux_loss_coef * metrics.get("aux_loss", 0.0)
        return metrics

    def _check_pipeline_pieces(self, rows: int, micro_batches: int, micro_of_rank: list[list[MicroBatch]]) -> None:
        """Under pipeline parallelism each rank's micro-batch is cut into ``pp_microbatches`` equal pieces."""
        config = self.topology.config
        pieces = config.pp_microbatches
        if config.pp_size == 1 or pieces is None:
            return
        sizes = sorted({micro.input_ids.shape[0] for micros in micro_of_rank for micro in micros})
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
        if not loads or len(loads) != len(firsts):
            return {}
        metrics = expert_load_metrics(loads, self.topology)
        metrics["dead_experts"] = self._dead_experts.update(torch.stack(loads).sum(dim=0))
        metrics["dropped_pairs"] = torch.stack(dropped).sum(dim=0).tolist()
        assert self.model_config.moe is not None  # routing metrics come from MoE models only
        aux = aux_loss_value(stats, self.model_config.moe.num_experts, per_layer=self._balance.aux_loss_per_layer)
        metrics["aux_loss"] = aux
        metrics["aux_loss_coef"] = self._balance.aux_loss_coef
        return metrics

    def evaluate(
        self,
        input_ids: Tensor,
        labels: Tensor | None = None,
        attention_mask: Tensor | None = None,
        micro_batches: int = 1,
        *,
        document_ids: Tensor | None = None,
    ) -> dict[str, Any]:
        """Mean loss over all label tokens of the global batch, forward only: no gradients, no optimizer step.

        Batch handling (``document_ids`` included) as in :meth:`train_step`. Returns ``loss``, ``loss_sum`` and
        ``num_tokens``, so the losses of several batches combine exactly: ``sum(loss_sum) / sum(num_tokens)``.
        """
        batch, micro_of_rank = self._labelled_batch(input_ids, labels, attention_mask, micro_batches, document_ids)
        results: list[float] = self._ranks().execute_per_rank(eval_loss, [(micro,) for micro in micro_of_rank])
        loss_sum = sum(one_per_batch(results, self.topology))
        return {"loss": loss_sum / batch.num_label_tokens, "loss_sum": loss_sum, "num_tokens": batch.num_label_tokens}

    def _labelled_batch(
        self,
        input_ids: Tensor,
        labels: Tensor | None,
        attention_mask: Tensor | None,
        micro_batches: int,
        document_ids: Tensor | None = None,
    ) -> tuple[GlobalBatch, list[list[MicroBatch]]]:
        """The checked global batch, and each rank's rows as micro-batches."""
        batch = make_global_batch(input_ids, labels, attention_mask, self.model_config.vocab_size, document_ids)
        check_sequence_length(batch.input_ids.shape[1], self.model_config.max_position_embeddings)
        if batch.num_label_tokens == 0:
            raise ValueError("the batch has no label tokens (all labels are -100 or masked)")
        parts = (split_by_rank(tensor, self.topology) for tensor in (batch.input_ids, batch.labels, batch.token_mask))
        documents = (
            split_by_rank(batch.document_ids, self.topology)
            if batch.document_ids is not None
            else [None] * self.topology.world_size
        )
        micro = [
            split_micro_batches(ids, labs, mask, micro_batches, docs)
            for ids, labs, mask, docs in zip(*parts, documents, strict=True)
        ]
        return batch, micro

    def save_pretrained(self, path: str | os.PathLike[str], max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> list[Path]:
        """Gather the weights into a hub-layout checkpoint at ``path`` (written by rank 0, on its node).

        All or nothing: the new checkpoint is staged beside ``path`` and swapped in whole, keeping the files
        there it does not write (a tokenizer). Whatever makes it fail (a full disk, an I/O error, a check of
        the written files), it raises one :class:`~raymoe.checkpoint.staging.CheckpointSaveError`, an
        ``OSError`` (``errno`` the disk's code) naming the path, the file and the cause; ``path`` keeps the
        previous checkpoint and the model stays loaded, weights and optimizer state: fix the cause and save
        again, or keep training.
        """
        directory = Path(path).expanduser().absolute()
        result = self._ranks().execute(save_gathered, str(directory), max_shard_size)[0]
        if result.error is not None:
            raise CheckpointSaveError(
                f"save_pretrained({str(directory)!r}) saved nothing: {result.error}. The model is still loaded "
                "(weights and optimizer state): fix the cause and call save_pretrained again",
                result.errno,
            )
        return [Path(file) for file in result.files]

    # --- training state ---------------------------------------------------------------------------

    def save_state(
        self, path: str | os.PathLike[str], *, async_save: bool = False, extra: Mapping[str, Any] | None = None
    ) -> Path:
        """Write the whole training state to the directory ``path``: model shards, AdamW moments and step counts,
        the router selection biases (bias balancing), every rank's RNG, :attr:`step`, the optimizer and balance
        settings, and ``extra`` (any JSON-serialisable dict, e.g. a data position; :meth:`load_state` returns it).

        Every rank writes its own shards in parallel (torch DCP, no gather), into a directory beside ``path``
        that rank 0 swaps in whole once every rank has finished: ``path`` holds the previous state until then,
        and a save that fails or is killed never leaves a half state there. A failure raises
        :class:`~raymoe.checkpoint.staging.CheckpointSaveError` naming the rank, the file and the cause; the
        model stays loaded, weights and optimizer state.

        ``async_save=True`` returns once every rank has copied its shards to CPU memory; the writing goes on
        while training continues. The next ``save_state``, ``load_state``, :meth:`wait_for_save` or
        ``shutdown`` waits for it and raises its failure.
        """
        if self._optimizer is None:
            raise RuntimeError("save_state needs an optimizer: call configure_training(...) first")
        extra = _checked_extra(extra)
        self.wait_for_save()
        target = swappable_target(Path(path).expanduser().absolute())
        recover_interrupted_save(target)
        manifest = StateManifest(
            model_config=dict(self._spec.model_config),
            step=self._step,
            optimizer=asdict(self._optimizer),
            balance=asdict(self._balance),
            world_size=self.topology.world_size,
            saved_layout=self.topology.config.model_dump(mode="json"),
            extra=extra,
        )
        request = StateRequest(str(staging_directory(target)), str(target), manifest.to_json(), async_save)
        answers: list[StateAnswer] = self._ranks().execute(save_training_state, request)
        if async_save:
            self._saving = target
        else:
            _report_save(answers, target)
        return target

    def wait_for_save(self) -> Path | None:
        """Wait for an asynchronous :meth:`save_state` to be written and swapped in; its directory, or None when
        none was in flight. Raises its failure (``CheckpointSaveError``); the previous state is then intact."""
        target, self._saving = self._saving, None
        if target is None:
            return None
        answers = [a for a in self._ranks().execute(wait_for_state_save) if a is not None]
        _report_save(answers, target)
        return target

    def load_state(self, path: str | os.PathLike[str]) -> StateManifest:
        """Restore a :meth:`save_state` directory into this handle, whatever layout and world size saved it.

        Checked on the driver first (manifest, model type, every tensor name and shape, every data file present
        and long enough): a :class:`~raymoe.checkpoint.training_state.TrainingStateError` naming the directory and
        the problem, before any rank reads. Then every rank reads its own shards (DCP reshards); only when all
        succeeded do they become the weights, a new AdamW with the saved settings and moments, the balance
        settings and the RNG (rank ``r`` gets saved rank ``r``'s, where the saved world had one). A failed read
        changes nothing. Returns the manifest (``step``, ``extra``). Needs no ``configure_training`` before.
        """
        self.wait_for_save()
        directory = Path(path).expanduser().absolute()
        manifest = check_training_state(directory, self._spec.build_meta_model(), self.model_config.model_type)
        try:
            optimizer = OptimizerConfig(**manifest.optimizer)
            balance = BalanceConfig(**manifest.balance)
        except (TypeError, ValueError) as error:
            raise TrainingStateError(
                f"training state {directory}: bad optimizer or balance settings: {error}"
            ) from error
        answers: list[StateAnswer] = self._ranks().execute(load_training_state, str(directory), optimizer, balance)
        failures = _failures(answers)
        if failures:
            raise TrainingStateError(
                f"load_state({str(directory)!r}) loaded nothing: {failures}; the model is unchanged"
            )
        _log_changed_settings(self._optimizer, optimizer, self._balance, balance)
        self._optimizer, self._balance, self._step = optimizer, balance, manifest.step
        self._dead_experts.reset()
        return manifest

    def run_on_ranks(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(ctx, *args, **kwargs)`` on every rank, results in rank order: for inspecting or extending
        what the ranks hold (``ctx.require_model().model`` is this rank's shard of the model; under pipelines
        ``.parts``, its stages). ``fn`` travels by pickle; a rank's exception ends the group like any rank failure."""
        return self._ranks().execute(fn, *args, **kwargs)

    # --- life cycle -------------------------------------------------------------------------------

    def shutdown(self) -> None:
        """Release the ranks: stop them (a group this handle started) or unload the model from a borrowed
        world (``from_pretrained(..., world=...)``). Safe to call more than once. Waits for an asynchronous
        ``save_state`` first, and raises its failure after releasing the ranks."""
        try:
            if self._saving is not None and self.is_alive:
                self.wait_for_save()
        finally:
            self._saving = None
            self._finalizer()

    def restart(self) -> None:
        """Replace ranks that failed (a rank died or hung, which ended the group) with new rank actors, placed
        afresh (on other nodes if a node is gone; waiting up to ``placement_timeout_s`` for room), and load the
        model from its source again. Training settings are gone with the old ranks: call ``configure_training``
        or ``load_state`` next. Only for a model ``from_pretrained`` started ranks for (not on a borrowed world)."""
        if self._restart is None:
            raise RuntimeError(
                "restart() needs ranks this model started; it runs on a world you started "
                "(from_pretrained(..., world=...)): start a new world and load the model onto it"
            )
        if self._group.is_alive:
            raise RuntimeError("restart() replaces ranks that failed; this model's ranks are running")
        group = self._restart()
        self.load_reports = _load(self._spec, group, owns_group=True)
        self._finalizer.detach()
        self._group, self._finalizer = group, weakref.finalize(self, group.shutdown)
        self._optimizer, self._balance, self._step, self._saving = None, BalanceConfig(), 0, None
        self._dead_experts.reset()

    def _ranks(self) -> RankGroup:
        """The group, for a call; a handle that was shut down fails here, on the driver, before any rank is asked."""
        if not self._finalizer.alive:
            raise RuntimeError("this model was shut down; load it again (raymoe.from_pretrained) to use it")
        return self._group

    @property
    def is_alive(self) -> bool:
        """True until :meth:`shutdown` (or a rank failure that ended the group)."""
        return self._finalizer.alive and self._group.is_alive

    def __enter__(self) -> DistributedModel:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self.is_alive else "shut down"
        return (
            f"DistributedModel({self.model_config.model_type} from {self._spec.source!r}, "
            f"{self.topology.config!r}, {state})\n{self.describe()}"
        )


def _load(spec: LaunchSpec, group: RankGroup, owns_group: bool) -> list[LoadReport]:
    """Put ``group`` in ``spec``'s layout and load the shards; an owned group is shut down if that fails."""
    try:
        group.use_layout(spec.topology)
        reports: list[LoadReport] = group.execute(load_shards, spec)
    except BaseException:
        if owns_group:
            group.shutdown()
        raise
    return reports


# The open handle of each borrowed world (a world hosts one model at a time).
_TENANTS: weakref.WeakKeyDictionary[Any, weakref.ref[DistributedModel]] = weakref.WeakKeyDictionary()


def _checked_extra(extra: Mapping[str, Any] | None) -> dict[str, Any]:
    """``extra`` as a plain dict, or a ``ValueError`` before any rank writes when JSON cannot hold it."""
    if extra is None:
        return {}
    if not isinstance(extra, Mapping):
        raise ValueError(f"save_state: extra must be a dict, got {type(extra).__name__}")
    try:
        json.dumps(dict(extra))
    except (TypeError, ValueError) as error:
        raise ValueError(f"save_state: extra must be JSON-serialisable: {error}") from error
    return dict(extra)


def _failures(answers: Sequence[StateAnswer]) -> str:
    """The distinct failures the ranks answered, one clause each (every rank reports DCP's failure)."""
    return "; ".join(dict.fromkeys(a.error for a in answers if a.error is not None))


def _report_save(answers: Sequence[StateAnswer], target: Path) -> None:
    """Log what a finished save wrote, or raise its failure as one ``CheckpointSaveError``."""
    failures = _failures(answers)
    if not failures:
        written = sum(a.bytes_written for a in answers)
        logger.info(
            "training state %s: %.1f MB from %d ranks, the slowest in %.2f s",
            target, written / 1e6, len(answers), max((a.seconds for a in answers), default=0.0),
        )  # fmt: skip
    if failures:
        errno = next((a.errno for a in answers if a.errno is not None), None)
        raise CheckpointSaveError(
            f"save_state({str(target)!r}) saved nothing: {failures}. {target} keeps what it held before; the model "
            "is still loaded (weights and optimizer state): fix the cause and call save_state again",
            errno,
        )


def _log_changed_settings(
    optimizer: OptimizerConfig | None, saved: OptimizerConfig, balance: BalanceConfig, saved_balance: BalanceConfig
) -> None:
    """Say which configured settings the loaded state replaced (load_state restores the saved run's)."""
    if optimizer is None:
        return
    before, after = asdict(optimizer) | asdict(balance), asdict(saved) | asdict(saved_balance)
    changed = [f"{key}={before[key]!r} -> {after[key]!r}" for key in after if before.get(key) != after[key]]
    if changed:
        logger.warning("load_state restored the saved run's training settings: %s", ", ".join(changed))


def _check_vacant(group: RankGroup) -> None:
    tenant = _TENANTS.get(group)
    current = tenant() if tenant is not None else None
    if current is not None and current.is_alive:
        raise ValueError(
            f"this world already hosts {current.model_config.model_type} from {current.source!r}; call its "
            "shutdown() (or leave its `with` block) before loading another model onto the same ranks"
        )


def _unloader(group: RankGroup) -> Callable[[], None]:
    """Unload the model from a borrowed world (if it is still running); the world itself stays."""

    def unload() -> None:
        _TENANTS.pop(group, None)
        if not group.is_alive:
            return
        try:
            group.execute(unload_model)
        except Exception as exc:  # the group reported and ended itself; nothing is left to free
            logger.warning("unloading the model from its world failed: %s", exc)

    return unload
