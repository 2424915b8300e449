"""Pipeline parallelism on a rank: training schedules, and forward passes that walk the stages in order.

A rank holds the parts of its stages (:class:`PipelineStages`, the :class:`~raymoe.rank.runner.StageRunner` of a
pipeline; the stage plan is :mod:`raymoe.spec.pipeline`). Activations
travel between the ranks of one pp group (same replica, fsdp and tp coordinates, one rank per stage).

Training runs ``torch.distributed.pipelining``'s schedules (GPipe, 1F1B, interleaved 1F1B) over each
micro-batch the driver sends, cut into ``pp_microbatches`` pieces. The loss keeps the global token
mean (:mod:`raymoe.rank.train`): the last stage takes each piece's *summed* token loss divided by the
global batch's token count, and the schedule sums gradients over pieces (``scale_grads=False``)::

    pp rank 0   F0 F1       B0    B1          1F1B, 2 stages, 2 pieces: each stage reduces its FSDP
    pp rank 1      F0 B0 F1    B1             gradients after its last backward

Inference (logits, evaluation, generation) needs no schedule: each stage runs the whole batch in turn
and sends its hidden states ``[B, S, H]`` (float32 on the wire) to the next stage's rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.kv_cache import KVCache
from raymoe.models.common.transfer import to_device
from raymoe.parallel.vocab_parallel import vocab_parallel_loss
from raymoe.rank.contract import MicroBatch
from raymoe.rank.objective import field_names, micro_target, target_objective
from raymoe.rank.runner import Backward, PartCall
from raymoe.spec.pipeline import StagePlan
from raymoe.spec.policy import PolicyLoss
from raymoe.spec.topology import Axis

if TYPE_CHECKING:
    from raymoe.rank.context import RankContext, Training
    from raymoe.spec.launch import LaunchSpec


class PipelineLoss:
    """The last stage's loss of one piece: summed token loss (or a policy loss) against the piece's target
    (:func:`raymoe.rank.objective.micro_target`) / the global normalizer; a policy loss's statistics add up in
    ``stats``."""

    def __init__(self) -> None:
        self.divisor = 1.0
        self.policy: PolicyLoss | None = None
        self.fields: tuple[str, ...] = ()
        self.stats: Tensor | None = None

    def __call__(self, logits: Tensor, target: Tensor) -> Tensor:
        loss_sum, stats = target_objective(logits, target, self.policy, self.fields)
        if stats is not None:
            self.stats = stats if self.stats is None else self.stats + stats
        return loss_sum / self.divisor


@dataclass
class PipelineRuntime:
    """The schedule of the micro-batch shape it was built for; a new shape builds new stages (their buffers)."""

    shape: tuple[int, int, bool, bool]
    schedule: Any
    loss: PipelineLoss = field(default_factory=PipelineLoss)


class PipelineStages:
    """The parts of the stages this rank runs (``stage_ids``, in order; several with an interleaved schedule) of
    ``plan``, and the schedule built for the last micro-batch shape."""

    def __init__(self, parts: tuple[CausalLM, ...], stage_ids: tuple[int, ...], plan: StagePlan) -> None:
        self._parts, self._stage_ids, self.plan = parts, stage_ids, plan
        self._runtime: PipelineRuntime | None = None

    @property
    def parts(self) -> tuple[CausalLM, ...]:
        return self._parts

    @property
    def stage_ids(self) -> tuple[int, ...]:
        return self._stage_ids

    def whole_model(self) -> CausalLM:
        raise RuntimeError(
            f"this rank holds pipeline stages {self.stage_ids} (pp_size={self.plan.pp_size}), not the whole model: "
            "use LoadedModel.parts"
        )

    def forward(self, ctx: RankContext, input_ids_BS: Tensor, run: PartCall) -> Tensor | None:
        """``run(part, inputs)`` on each stage in turn (token ids into the first, hidden states after), the hidden
        states sent from rank to rank of the pp group; the last stage's output on its ranks, None elsewhere."""
        plan, group = self.plan, pipeline_group(ctx)
        parts = dict(zip(self.stage_ids, self.parts, strict=True))
        rows, width = input_ids_BS.shape
        split = self.parts[0].model.sequence_split  # context parallelism: stages pass this rank's share of the rows
        width = split.local_length(width) if split is not None else width
        hidden_size = self.parts[0].config.hidden_size
        x: Tensor | None = None
        for stage in range(plan.num_stages):
            if stage not in parts:
                continue
            part = parts[stage]
            if plan.is_first(stage):
                inputs = to_device(input_ids_BS, ctx.device)
            else:
                inputs = torch.empty(rows, width, hidden_size, dtype=torch.float32, device=ctx.device)
                dist.recv(inputs, group=group, group_src=plan.rank_of(stage - 1))
                inputs = inputs.to(_dtype_of(part))
            x = run(part, inputs)
            if not plan.is_last(stage):
                hidden = x.full_tensor() if isinstance(x, DTensor) else x
                dist.send(hidden.float().contiguous(), group=group, group_dst=plan.rank_of(stage + 1))
        return x if plan.rank_of(plan.num_stages - 1) == ctx.coords.pp else None

    def decoder(self, ctx: RankContext) -> StagedDecoder:
        return StagedDecoder(ctx, self)

    def backward(
        self,
        ctx: RankContext,
        training: Training,
        micro_batches: Sequence[MicroBatch],
        divisor: float,
        policy: PolicyLoss | None = None,
    ) -> Backward:
        """Each micro-batch through the schedule, cut into ``pp_microbatches`` pieces. Routing is not recorded (the
        driver refuses the aux loss and bias balancing with pp_size > 1)."""
        done = Backward(torch.zeros((), dtype=torch.float32, device=ctx.device))
        for micro in micro_batches:
            loss_sum, stats = self._micro_batch(ctx, micro, divisor, policy)
            done.add(loss_sum, stats)
        return done

    def _micro_batch(
        self, ctx: RankContext, micro: MicroBatch, divisor: float, policy: PolicyLoss | None
    ) -> tuple[Tensor, Tensor | None]:
        """Forward and backward of one micro-batch through the schedule: ``(loss_sum, stats)`` on ranks of the last
        stage, ``(0, None)`` elsewhere (on the device). Under context parallelism the stages run this rank's share of
        the rows and the last one's target is cut to it."""
        documents, routes = micro.document_ids, micro.routes
        shares = ctx.require_model().shares
        split = shares.context
        shape = (micro.input_ids.shape[0], micro.input_ids.shape[1], documents is not None, routes is not None)
        runtime = self._schedule(ctx, shape)
        runtime.loss.divisor, runtime.loss.policy = divisor, policy
        runtime.loss.fields, runtime.loss.stats = field_names(micro), None
        losses: list[Tensor] = []
        kwargs = {"document_ids_BS": to_device(documents, ctx.device)} if documents is not None else {}
        if routes is not None:
            kwargs["routes_BSLK"] = to_device(routes, ctx.device)
        args = (to_device(micro.input_ids, ctx.device),) if 0 in self.stage_ids else ()
        target = to_device(micro_target(micro, policy, split), ctx.device)
        for part in self.parts:
            part.train()
        with vocab_parallel_loss(self.parts[-1]), shares.applied(self.parts):
            runtime.schedule.step(*args, target=target, losses=losses, return_outputs=False, **kwargs)
        if not losses:  # not the last stage
            return torch.zeros((), device=ctx.device), None
        return torch.stack([loss.detach().float() for loss in losses]).sum() * divisor, runtime.loss.stats

    def _schedule(self, ctx: RankContext, shape: tuple[int, int, bool, bool]) -> PipelineRuntime:
        if self._runtime is not None and self._runtime.shape == shape:
            return self._runtime
        # Imported here, not at the top: torch.distributed.pipelining imports torch._dynamo (0.3 s, about 30 MiB),
        # which the driver (it imports this module through raymoe.api) never needs otherwise.
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        plan, group = self.plan, pipeline_group(ctx)
        stages: list[Any] = [
            PipelineStage(part, stage, plan.num_stages, ctx.device, group=group)
            for part, stage in zip(self.parts, self.stage_ids, strict=True)
        ]
        loss = PipelineLoss()
        kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
        options: dict[str, Any] = {"n_microbatches": plan.microbatches, "loss_fn": loss, "scale_grads": False}
        schedule: Any
        if plan.schedule == "interleaved_1f1b":
            schedule = ScheduleInterleaved1F1B(stages, **options)
        else:
            schedule = kinds[plan.schedule](stages[0], **options)
        self._runtime = PipelineRuntime(shape, schedule, loss)
        return self._runtime

    def norm_group(self, ctx: RankContext) -> dist.ProcessGroup:
        return pipeline_group(ctx)

    def gathered(self, ctx: RankContext, spec: LaunchSpec) -> tuple[CausalLM, Iterator[tuple[str, Tensor]]]:
        """The whole model (meta, for the names) and its parameters on rank 0: gathered inside the stage that holds
        each (its ranks only), then sent to rank 0 over the pp group when another stage holds it."""
        model = spec.build_meta_model().to(_dtype_of(self.parts[0]))
        return model, self._gathered(ctx, spec, model)

    def _gathered(self, ctx: RankContext, spec: LaunchSpec, whole: CausalLM) -> Iterator[tuple[str, Tensor]]:
        mine = {name: param for part in self.parts for name, param in part.named_parameters()}
        group = pipeline_group(ctx)
        zero_group = ctx.topology.group_of(0, Axis.PP)  # rank 0 and the ranks at its place in the other stages
        plan = self.plan
        owners = {
            name: plan.rank_of(stage)
            for stage in range(plan.num_stages)
            for name, _ in spec.build_meta_part(stage).named_parameters()
        }
        for name, meta in whole.named_parameters():
            owner = owners[name]
            full: Tensor | None = None
            if name in mine:
                param = mine[name]
                full = param.full_tensor() if isinstance(param, DTensor) else param.detach()
            if ctx.rank not in zero_group or owner == 0:
                if ctx.rank == 0:
                    assert full is not None
                    yield name, full
                continue
            if ctx.rank == 0:
                received = torch.empty(meta.shape, dtype=meta.dtype, device=ctx.device)
                dist.recv(received, group=group, group_src=owner)
                yield name, received
            elif ctx.coords.pp == owner:
                assert full is not None
                dist.send(full.contiguous(), group=group, group_dst=0)


def pipeline_group(ctx: RankContext) -> dist.ProcessGroup:
    return ctx.mesh(Axis.PP).get_group()


def _dtype_of(part: CausalLM) -> torch.dtype:
    return next(part.parameters()).dtype


class StagedDecoder:
    """The pipeline as :class:`~raymoe.models.common.generation.Generation` sees a model: ``(ids, caches, mask,
    last)`` -> ``logits [B, V]`` on every rank of the pp group (the last stage's, broadcast), one KV cache per
    part, so every stage's rank picks the same next tokens."""

    def __init__(self, ctx: RankContext, stages: PipelineStages) -> None:
        self.ctx, self.stages = ctx, stages
        self.config = stages.parts[0].config

    def new_cache(self, max_length: int) -> list[KVCache]:
        return [part.new_cache(max_length) for part in self.stages.parts]

    def __call__(self, input_BS: Tensor, cache: list[KVCache], mask_BS: Tensor | None, last_B: Tensor) -> Tensor:
        cache_of = {id(part): part_cache for part, part_cache in zip(self.stages.parts, cache, strict=True)}

        def run(part: CausalLM, inputs: Tensor) -> Tensor:
            out: Tensor = part(inputs, cache_of[id(part)], mask_BS, last_B)
            return out

        logits = self.stages.forward(self.ctx, input_BS, run)
        plan = self.stages.plan
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        if logits is None:
            logits = torch.empty(input_BS.shape[0], self.config.vocab_size, dtype=torch.float32, device=self.ctx.device)
        else:
            logits = logits.float().contiguous()
        dist.broadcast(logits, group=pipeline_group(self.ctx), group_src=plan.rank_of(plan.num_stages - 1))
        return logits
