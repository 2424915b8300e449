"""How a rank runs what it holds: the whole model, or its pipeline stages; decided once, when the model loads.

The rank functions (train, evaluate, infer, save) are written once against :class:`StageRunner`; which
runner a rank has follows ``spec.stages`` (:func:`raymoe.rank.load.load_shards` picks it)::

    WholeModel       (pp_size = 1)   one part; a forward is one call of the model
    PipelineStages   (pp_size > 1)   the parts of this rank's stages (raymoe.rank.pipeline); a forward walks
                                     the stages rank to rank, training runs a pipeline schedule

A *part call* ``run(part, inputs) -> output`` is what one forward does with one part: token ids (the first
stage) or hidden states ``[B, S, H]`` in, hidden states or logits out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.generation import Decoder
from raymoe.models.common.transfer import to_device
from raymoe.parallel.vocab_parallel import vocab_parallel_loss
from raymoe.rank.balance import Routing, aux_loss, collect_routing
from raymoe.rank.contract import MicroBatch
from raymoe.rank.objective import micro_objective
from raymoe.spec.policy import PolicyLoss

if TYPE_CHECKING:
    from raymoe.rank.context import RankContext, Training
    from raymoe.spec.launch import LaunchSpec

PartCall = Callable[[CausalLM, Tensor], Tensor]


@dataclass
class Backward:
    """What the forward/backward passes of a step's micro-batches leave: their summed token loss (float32 on the
    rank's device, 0 on ranks that take no loss), a policy loss's summed statistics (:mod:`raymoe.rank.objective`;
    None for cross-entropy and on ranks that take no loss) and, where routing is recorded, each micro-batch's
    :class:`Routing`."""

    loss_sum: Tensor
    routings: list[Routing] = field(default_factory=list)
    stats: Tensor | None = None

    def add(self, loss_sum: Tensor, stats: Tensor | None) -> None:
        self.loss_sum += loss_sum.detach().float()
        if stats is not None:
            self.stats = stats if self.stats is None else self.stats + stats


class StageRunner(Protocol):
    """What the rank functions need from the model parts a rank holds."""

    @property
    def parts(self) -> tuple[CausalLM, ...]: ...

    @property
    def stage_ids(self) -> tuple[int, ...]: ...

    def whole_model(self) -> CausalLM:
        """The whole model; an error where the rank holds only some stages."""
        ...

    def forward(self, ctx: RankContext, input_ids_BS: Tensor, run: PartCall) -> Tensor | None:
        """``run`` through every part in model order: the last part's output, None on ranks that hold no last stage."""
        ...

    def decoder(self, ctx: RankContext) -> Decoder | CausalLM:
        """What a :class:`~raymoe.models.common.generation.Generation` steps."""
        ...

    def backward(
        self,
        ctx: RankContext,
        training: Training,
        micro_batches: Sequence[MicroBatch],
        divisor: float,
        policy: PolicyLoss | None = None,
    ) -> Backward:
        """Forward and backward of every micro-batch (each loss divided by ``divisor``, the global normalizer;
        ``policy``: a policy loss instead of cross-entropy); gradients accumulate in the parts."""
        ...

    def norm_group(self, ctx: RankContext) -> dist.ProcessGroup | None:
        """The group over which the ranks hold the other parameters of the model (None: this rank has them all)."""
        ...

    def gathered(self, ctx: RankContext, spec: LaunchSpec) -> tuple[CausalLM, Iterator[tuple[str, Tensor]]]:
        """The model a checkpoint names its tensors after, and every parameter in full (on rank 0 at least), one at a
        time, in the same order on every rank (each gather is a collective)."""
        ...


class WholeModel:
    """The whole model on this rank (no pipeline parallelism)."""

    def __init__(self, model: CausalLM) -> None:
        self.model = model

    @property
    def parts(self) -> tuple[CausalLM, ...]:
        return (self.model,)

    @property
    def stage_ids(self) -> tuple[int, ...]:
        return (0,)

    def whole_model(self) -> CausalLM:
        return self.model

    def forward(self, ctx: RankContext, input_ids_BS: Tensor, run: PartCall) -> Tensor:
        return run(self.model, to_device(input_ids_BS, ctx.device))

    def decoder(self, ctx: RankContext) -> CausalLM:
        return self.model

    def backward(
        self,
        ctx: RankContext,
        training: Training,
        micro_batches: Sequence[MicroBatch],
        divisor: float,
        policy: PolicyLoss | None = None,
    ) -> Backward:
        """Each micro-batch's loss divided by ``divisor`` (the global batch's token count, or a policy loss's
        normalizer; plus its share of the aux loss), so the accumulated gradients are those of the global loss.

        FSDP2 reduce-scatters each micro-batch's gradients as its backward ends, so they accumulate sharded (a
        rank never holds more than one unit's full gradients); with ``fsdp_defer_gradient_sync`` the full
        gradients accumulate unsharded and are reduced once, after the last micro-batch. Under context parallelism
        each rank runs its share of every row (``loaded.shares``); its loss covers its share's tokens."""
        model, balance = self.model, training.balance
        model.train()
        done = Backward(torch.zeros((), dtype=torch.float32, device=ctx.device))
        trains_aux = balance.aux_loss_coef > 0
        defer_sync = ctx.topology.config.fsdp_defer_gradient_sync
        shares = ctx.require_model().shares
        split = shares.context
        for index, micro in enumerate(micro_batches):
            if defer_sync and isinstance(model, FSDPModule):
                model.set_requires_gradient_sync(index == len(micro_batches) - 1)
            with vocab_parallel_loss(model), shares.applied(self.parts):
                micro_loss, stats = micro_objective(model, micro, ctx.device, policy, split)
                # FSDP2 sums the gradients over data-parallel ranks (raymoe.parallel.fsdp): one process's gradient.
                objective = micro_loss / divisor
                token_mask = split.cut(micro.token_mask) if split is not None else micro.token_mask
                real_T = to_device(token_mask.reshape(-1), ctx.device)
                routing = collect_routing(model, real_T, with_grad=trains_aux)
                if routing is not None and trains_aux:
                    share = aux_loss(routing, ctx, per_layer=balance.aux_loss_per_layer) / len(micro_batches)
                    objective = objective + balance.aux_loss_coef * share
                objective.backward()
            done.add(micro_loss, stats)
            if routing is not None:
                done.routings.append(routing)
        return done

    def norm_group(self, ctx: RankContext) -> None:
        return None

    def gathered(self, ctx: RankContext, spec: LaunchSpec) -> tuple[CausalLM, Iterator[tuple[str, Tensor]]]:
        return self.model, full_parameters(self.model)


def full_parameters(model: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Every parameter of ``model`` in full, gathered one at a time (a collective per DTensor)."""
    for name, param in model.named_parameters():
        yield name, (param.full_tensor() if isinstance(param, DTensor) else param.detach())
