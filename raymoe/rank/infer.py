"""Forward passes on a rank for the driver: logits or greedy tokens of this rank's batch rows (SPEC INF-1).

Every rank of a tp group computes the same rows with its shards; the first one answers.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from raymoe.models.common.generation import generate
from raymoe.parallel.fsdp import reshard
from raymoe.rank.context import RankContext
from raymoe.spec.topology import Axis


@torch.no_grad()
def forward_logits(ctx: RankContext, input_ids_BS: Tensor) -> Tensor | None:
    """``logits [B_local, S, V]`` on CPU from the first rank of each tp group; None elsewhere (same rows)."""
    model = ctx.require_model().model
    model.eval()
    logits = model(input_ids_BS.to(ctx.device))
    reshard(model)
    if isinstance(logits, DTensor):
        logits = logits.full_tensor()
    return logits.cpu() if ctx.answers_for_batch else None


def generate_tokens(
    ctx: RankContext,
    input_ids_BS: Tensor,
    max_new_tokens: int,
    eos_token_ids: tuple[int, ...] | None,
    pad_token_id: int,
) -> Tensor | None:
    """Greedy tokens ``[B_local, S + n]`` (n <= max_new_tokens) from the first rank of each tp group.

    The ranks of a tp group see the same replicated logits, so they pick the same tokens and stop together.
    """
    model = ctx.require_model().model
    model.eval()
    # Ranks with different batches share collectives (FSDP gathers, expert all-to-alls) at every step.
    in_step = ctx.topology.config.dp_size > 1 or ctx.topology.axis_size(Axis.EP) > 1
    tokens = generate(
        model,
        input_ids_BS.to(ctx.device),
        max_new_tokens,
        eos_token_ids=eos_token_ids,
        pad_token_id=pad_token_id,
        stop_early=not in_step,
    )
    reshard(model)
    return tokens.cpu() if ctx.answers_for_batch else None
