"""The training loss of a tensor-parallel model without gathering its logits (vocabulary-parallel cross-entropy).

The default head style, ``colwise_gather_output``, all-gathers the logits so every rank holds
all of them; generation and ``model(input_ids)`` need that. A loss does not::

    gathered (inference)   hidden [B, S, H] -> logits [B, S, V/tp] --all-gather--> [B, S, V] on every rank
    vocab_parallel_loss    hidden [B, S, H] -> logits [B, S, V/tp] Shard(-1) DTensor -> torch's loss_parallel:
                           all-reduces of [B*S] maxima, exp-sums and target logits; no [B, S, V] tensor

Each rank then holds 1/tp of the logits and of their gradient, and computes 1/tp of the softmax.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import loss_parallel

from raymoe.parallel.apply import applied_style
from raymoe.parallel.styles.tensor import ColwiseParallel


@contextmanager
def vocab_parallel_loss(model: nn.Module) -> Iterator[None]:
    """Within the block, a forward of ``model`` returns logits sharded over the vocabulary when its head
    gathers them under TP, and cross-entropy on them is computed shard-wise; otherwise nothing changes.
    The backward must run inside the block too (torch's ``loss_parallel`` rule)."""
    head = getattr(model, "lm_head", None)
    style = applied_style(head) if isinstance(head, nn.Module) else None
    if head is None or type(style) is not ColwiseParallel or style.output_layout != Replicate():
        yield
        return
    with style.output_kept_sharded(head), loss_parallel():
        yield


def whole(loss: Tensor) -> Tensor:
    """A loss as a plain tensor: a vocabulary-parallel loss is a replicated DTensor."""
    return loss.full_tensor() if isinstance(loss, DTensor) else loss
