"""Evaluation on a rank: the summed token loss of this rank's rows, forward only (no gradients, no optimizer).

The driver adds the sums of the distinct batch blocks (one rank per tp group) and divides by the
label-token count of the whole global batch, the same mean :mod:`raymoe.rank.train` optimizes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from raymoe.models.common.loss import causal_lm_loss
from raymoe.parallel.fsdp import reshard
from raymoe.parallel.vocab_parallel import vocab_parallel_loss, whole
from raymoe.rank.context import RankContext


@torch.no_grad()
def eval_loss(ctx: RankContext, micro_batches: list[tuple[Tensor, Tensor]]) -> float:
    """Sum of the token losses over this rank's ``(input_ids [b, S], labels [b, S])`` micro-batches.

    Every rank runs every micro-batch (the forward's collectives need all of them); rows whose
    labels are all ignored add 0.
    """
    model = ctx.require_model().model
    model.eval()
    loss_sum = torch.zeros((), dtype=torch.float32)
    for input_ids_BS, labels_BS in micro_batches:
        with vocab_parallel_loss(model):
            logits = model(input_ids_BS.to(ctx.device))
            loss_sum += whole(causal_lm_loss(logits, labels_BS.to(ctx.device), reduction="sum")).float().cpu()
    # FSDP units keep their gathered weights after a no-grad forward; a later train step must not use them.
    reshard(model)
    return float(loss_sum)
