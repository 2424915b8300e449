"""A rank's rows read from Ray's object store: the blocks of a ``StreamedData`` arrive with the call (``actors/``
resolves their references on this rank's node, never through the driver), and the rows the driver picked become
this rank's micro-batches; then the usual step or evaluation::

    blocks     ({input_ids, labels, token_mask, document_ids?: [R_b, S]}, ...)   numpy, read-only
    BlockRows  blocks [B], rows [B]: row i = blocks[blocks[i]][rows[i]]; -1: an all-padding row
    ->         MicroBatch x micro_batches: input_ids, labels [b, S] int64, token_mask bool, document_ids int64
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from raymoe.models.common.loss import IGNORE_INDEX
from raymoe.rank.context import RankContext
from raymoe.rank.contract import BlockRows, EvalResult, MicroBatch, StepResult
from raymoe.rank.evaluate import eval_loss
from raymoe.rank.train import train_step

Block = dict[str, Any]


def micro_batches_of(request: BlockRows, blocks: tuple[Block, ...]) -> list[MicroBatch]:
    """This rank's rows (see the module docstring) as ``request.micro_batches`` consecutive micro-batches."""
    ids = _gathered(request, blocks, "input_ids", 0)
    labels = _gathered(request, blocks, "labels", IGNORE_INDEX)
    mask = _gathered(request, blocks, "token_mask", False)
    documents = _gathered(request, blocks, "document_ids", -1) if "document_ids" in blocks[0] else None
    pieces = [
        torch.tensor_split(torch.from_numpy(a), request.micro_batches) if a is not None else None
        for a in (ids, labels, mask, documents)
    ]
    return [
        MicroBatch(
            pieces[0][m].long(),  # type: ignore[index]
            pieces[1][m].long(),  # type: ignore[index]
            pieces[2][m].bool(),  # type: ignore[index]
            pieces[3][m].long() if pieces[3] is not None else None,
        )
        for m in range(request.micro_batches)
    ]


def train_step_on_blocks(
    ctx: RankContext, request: BlockRows, global_tokens: float, lr: float | None, *blocks: Block
) -> StepResult:
    """:func:`raymoe.rank.train.train_step` on this rank's rows of the blocks."""
    return train_step(ctx, micro_batches_of(request, blocks), global_tokens, lr)


def eval_loss_on_blocks(ctx: RankContext, request: BlockRows, *blocks: Block) -> EvalResult:
    """:func:`raymoe.rank.evaluate.eval_loss` on this rank's rows of the blocks."""
    return eval_loss(ctx, micro_batches_of(request, blocks))


def _gathered(request: BlockRows, blocks: tuple[Block, ...], name: str, blank: Any) -> np.ndarray:
    """``[B, S]``: each picked row of column ``name``; ``blank`` fills the all-padding rows."""
    which, rows = np.asarray(request.blocks), np.asarray(request.rows)
    if not blocks:  # only padding rows
        raise ValueError("BlockRows needs at least one block")
    sample = blocks[0][name]
    out = np.full((len(rows), sample.shape[1]), blank, dtype=sample.dtype)
    for position, block in enumerate(blocks):
        mine = which == position
        out[mine] = block[name][rows[mine]]
    return out
