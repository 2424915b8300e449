"""Evaluation on a rank: the summed token loss of this rank's rows, forward only (no gradients, no optimizer).

The driver adds the sums of the distinct batch blocks (one rank per tp group) and divides by the
label-token count of the whole global batch, the same mean :mod:`raymoe.rank.train` optimizes.
"""

from __future__ import annotations

import torch
from torch import Tensor

from raymoe.models.common.decoder import CausalLM
from raymoe.models.common.loss import token_loss
from raymoe.models.common.transfer import to_device
from raymoe.parallel.compiled_blocks import compile_seconds
from raymoe.parallel.fsdp import reshard
from raymoe.parallel.vocab_parallel import vocab_parallel_loss, whole
from raymoe.rank.context import RankContext
from raymoe.rank.contract import EvalResult, MicroBatch
from raymoe.rank.objective import micro_target


@torch.no_grad()
def eval_loss(ctx: RankContext, micro_batches: list[MicroBatch]) -> EvalResult:
    """Sum of the token losses over this rank's micro-batches (``input_ids``, ``labels`` ``[B, S]``, and
    ``document_ids`` for packed rows), 0 on ranks that hold no last pipeline stage; and the seconds spent compiling
    decoder blocks for it (a new shape's first evaluation, ``compile=``).

    Every rank runs every micro-batch (the forward's collectives need all of them); rows whose
    labels are all ignored add 0. Under context parallelism each rank sums its share of the tokens and the shares
    are added over the cp group.
    """
    loaded = ctx.require_model()
    compiling_since = compile_seconds()
    shares = loaded.shares
    split = shares.context
    for part in loaded.parts:
        part.eval()
    loss_sum = torch.zeros((), dtype=torch.float32, device=ctx.device)
    for micro in micro_batches:
        documents = to_device(micro.document_ids, ctx.device) if micro.document_ids is not None else None

        def run(part: CausalLM, inputs: Tensor, documents: Tensor | None = documents) -> Tensor:
            out: Tensor = part(inputs, document_ids_BS=documents)
            return out

        with vocab_parallel_loss(loaded.parts[-1]), shares.applied(loaded.parts):
            logits = loaded.runner.forward(ctx, micro.input_ids, run)
            if logits is not None:
                targets = to_device(micro_target(micro, None, split), ctx.device)
                loss_sum += whole(token_loss(logits, targets, reduction="sum")).float()
    # FSDP units keep their gathered weights after a no-grad forward; a later train step must not use them.
    for part in loaded.parts:
        reshard(part)
    if split is not None:
        split.sum(loss_sum)
    return EvalResult(float(loss_sum.cpu()), compile_seconds() - compiling_since)  # the one wait for the device
