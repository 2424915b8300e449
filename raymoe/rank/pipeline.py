"""Pipeline parallelism on a rank: training schedules, and forward passes that walk the stages in order.

A rank holds the parts of its stages (``LoadedModel.parts``, :mod:`raymoe.spec.pipeline`). Activations
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

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.kv_cache import KVCache
from raymoe.models.common.loss import causal_lm_loss
from raymoe.parallel.vocab_parallel import vocab_parallel_loss, whole
from raymoe.rank.context import LoadedModel, RankContext
from raymoe.spec.pipeline import StagePlan
from raymoe.spec.topology import Axis


class PipelineLoss:
    """The last stage's loss of one piece: summed token loss / the global batch's label tokens."""

    def __init__(self) -> None:
        self.global_tokens = 1

    def __call__(self, logits: Tensor, labels: Tensor) -> Tensor:
        loss: Tensor = whole(causal_lm_loss(logits, labels, reduction="sum")) / self.global_tokens
        return loss


@dataclass
class PipelineRuntime:
    """The schedule of the micro-batch shape it was built for; a new shape builds new stages (their buffers)."""

    shape: tuple[int, int, bool]
    schedule: Any
    loss: PipelineLoss = field(default_factory=PipelineLoss)


def pipeline_group(ctx: RankContext) -> dist.ProcessGroup:
    return ctx.mesh(Axis.PP).get_group()


def stage_plan(loaded: LoadedModel) -> StagePlan:
    assert loaded.spec.stages is not None
    return loaded.spec.stages


def _runtime(ctx: RankContext, loaded: LoadedModel, shape: tuple[int, int, bool]) -> PipelineRuntime:
    if loaded.pipeline is not None and loaded.pipeline.shape == shape:
        return loaded.pipeline
    # Imported here, not at the top: torch.distributed.pipelining imports torch._dynamo (0.3 s, about 30 MiB), which
    # the driver (it imports this module through raymoe.api) never needs otherwise.
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    plan = stage_plan(loaded)
    group = pipeline_group(ctx)
    stages: list[Any] = [
        PipelineStage(part, stage, plan.num_stages, ctx.device, group=group)
        for part, stage in zip(loaded.parts, loaded.stage_ids, strict=True)
    ]
    loss = PipelineLoss()
    kinds = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}
    schedule: Any
    if plan.schedule == "interleaved_1f1b":
        schedule = ScheduleInterleaved1F1B(stages, n_microbatches=plan.microbatches, loss_fn=loss, scale_grads=False)
    else:
        schedule = kinds[plan.schedule](stages[0], n_microbatches=plan.microbatches, loss_fn=loss, scale_grads=False)
    loaded.pipeline = PipelineRuntime(shape, schedule, loss)
    return loaded.pipeline


def train_pipeline_micro_batch(
    ctx: RankContext,
    loaded: LoadedModel,
    input_ids: Tensor,
    labels: Tensor,
    document_ids: Tensor | None,
    global_tokens: int,
) -> Tensor:
    """Forward and backward of one micro-batch through the pipeline schedule; gradients accumulate in the parts.
    Returns the summed token loss on ranks of the last stage, 0 elsewhere."""
    runtime = _runtime(ctx, loaded, (input_ids.shape[0], input_ids.shape[1], document_ids is not None))
    runtime.loss.global_tokens = global_tokens
    losses: list[Tensor] = []
    kwargs = {"document_ids_BS": document_ids.to(ctx.device)} if document_ids is not None else {}
    args = (input_ids.to(ctx.device),) if 0 in loaded.stage_ids else ()
    last = loaded.parts[-1]
    for part in loaded.parts:
        part.train()
    with vocab_parallel_loss(last):
        runtime.schedule.step(*args, target=labels.to(ctx.device), losses=losses, return_outputs=False, **kwargs)
    if not losses:  # not the last stage
        return torch.zeros(())
    return torch.stack([loss.detach().float() for loss in losses]).sum().cpu() * global_tokens


def forward_through_stages(
    ctx: RankContext,
    loaded: LoadedModel,
    input_ids_BS: Tensor,
    run: Any,
) -> Tensor | None:
    """``run(part, inputs)`` on each stage in turn (token ids into the first, hidden states after), the hidden
    states sent from rank to rank of the pp group; the last stage's output on its ranks, None elsewhere."""
    plan, group = stage_plan(loaded), pipeline_group(ctx)
    parts = dict(zip(loaded.stage_ids, loaded.parts, strict=True))
    rows, width = input_ids_BS.shape
    hidden_size = loaded.parts[0].config.hidden_size
    x: Tensor | None = None
    for stage in range(plan.num_stages):
        if stage not in parts:
            continue
        part = parts[stage]
        if plan.is_first(stage):
            inputs = input_ids_BS.to(ctx.device)
        else:
            inputs = torch.empty(rows, width, hidden_size, dtype=torch.float32, device=ctx.device)
            dist.recv(inputs, group=group, group_src=plan.rank_of(stage - 1))
            inputs = inputs.to(_dtype_of(part))
        x = run(part, inputs)
        if not plan.is_last(stage):
            hidden = x.full_tensor() if isinstance(x, DTensor) else x
            dist.send(hidden.float().contiguous(), group=group, group_dst=plan.rank_of(stage + 1))
    return x if plan.rank_of(plan.num_stages - 1) == ctx.coords.pp else None


def _dtype_of(part: CausalLM) -> torch.dtype:
    return next(part.parameters()).dtype


class StagedDecoder:
    """The pipeline as :class:`~raymoe.models.common.generation.Generation` sees a model: ``(ids, caches, mask,
    last)`` -> ``logits [B, V]`` on every rank of the pp group (the last stage's, broadcast), one KV cache per
    part, so every stage's rank picks the same next tokens."""

    def __init__(self, ctx: RankContext, loaded: LoadedModel) -> None:
        self.ctx, self.loaded = ctx, loaded
        self.config = loaded.parts[0].config

    def new_cache(self, max_length: int) -> list[KVCache]:
        return [part.new_cache(max_length) for part in self.loaded.parts]

    def __call__(self, input_BS: Tensor, cache: list[KVCache], mask_BS: Tensor | None, last_B: Tensor) -> Tensor:
        cache_of = {id(part): part_cache for part, part_cache in zip(self.loaded.parts, cache, strict=True)}

        def run(part: CausalLM, inputs: Tensor) -> Tensor:
            out: Tensor = part(inputs, cache_of[id(part)], mask_BS, last_B)
            return out

        logits = forward_through_stages(self.ctx, self.loaded, input_BS, run)
        plan = stage_plan(self.loaded)
        if isinstance(logits, DTensor):
            logits = logits.full_tensor()
        if logits is None:
            logits = torch.empty(input_BS.shape[0], self.config.vocab_size, dtype=torch.float32, device=self.ctx.device)
        else:
            logits = logits.float().contiguous()
        dist.broadcast(logits, group=pipeline_group(self.ctx), group_src=plan.rank_of(plan.num_stages - 1))
        return logits
