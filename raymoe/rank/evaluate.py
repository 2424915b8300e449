"""Evaluation on a rank: the summed token loss of this rank's rows, forward only (no gradients, no optimizer).

The driver adds the sums of the distinct batch blocks (one rank per tp group) and divides by the
label-token count of the whole global batch, the same mean :mod:`raymoe.rank.train` optimizes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.loss import causal_lm_loss
from raymoe.parallel.fsdp import reshard
from raymoe.parallel.vocab_parallel import vocab_parallel_loss, whole
from raymoe.rank.context import LoadedModel, RankContext
from raymoe.rank.pipeline import forward_through_stages
from raymoe.rank.train import MicroBatch


@torch.no_grad()
def eval_loss(ctx: RankContext, micro_batches: list[MicroBatch]) -> float:
    """Sum of the token losses over this rank's micro-batches (``input_ids``, ``labels`` ``[b, S]``, and
    ``document_ids`` for packed rows).

    Every rank runs every micro-batch (the forward's collectives need all of them); rows whose
    labels are all ignored add 0.
    """
    loaded = ctx.require_model()
    if loaded.spec.stages is not None:
        return _pipeline_eval_loss(ctx, loaded, micro_batches)
    model = loaded.model
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float32)
    for micro in micro_batches:
        with vocab_parallel_loss(model):
            loss_sum += micro.loss_sum(model, ctx.device).float().cpu()
    # FSDP units keep their gathered weights after a no-grad forward; a later train step must not use them.
    reshard(model)
    return float(loss_sum)


def _pipeline_eval_loss(ctx: RankContext, loaded: LoadedModel, micro_batches: list[MicroBatch]) -> float:
    """The same sum under pipeline parallelism: the stages run in turn; the last stage's ranks take the loss."""
    loss_sum = torch.zeros((), dtype=torch.float32)
    last = loaded.parts[-1]
    for part in loaded.parts:
        part.eval()
    for micro in micro_batches:
        documents = micro.document_ids.to(ctx.device) if micro.document_ids is not None else None

        def run(part: CausalLM, inputs: Tensor, documents: Tensor | None = documents) -> Tensor:
            out: Tensor = part(inputs, document_ids_BS=documents)
            return out

        with vocab_parallel_loss(last):
            logits = forward_through_stages(ctx, loaded, micro.input_ids, run)
            if logits is not None:
                loss = causal_lm_loss(logits, micro.labels.to(ctx.device), reduction="sum")
                loss_sum += whole(loss).float().cpu()
    for part in loaded.parts:
        reshard(part)
    return float(loss_sum)
