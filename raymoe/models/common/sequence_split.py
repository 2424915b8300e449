"""How attention sees tokens that are not plain whole rows, a forward over a share of each row's tokens, and a
residual stream split along the sequence.

A *token layout* stands in for plain causal rows in a forward: it gives each token's RoPE position and attends for
every layer, taking the layer's projected, rotated ``q, k, v`` ``[B, H, S, D]`` of the tokens this forward holds and
its :class:`~raymoe.models.common.row_attention.AttentionRule`. Two layouts exist:

    packed rows      raymoe.models.common.packing.PackedDocuments: each document attends only to itself
    a split row      a SequenceSplit's layout: this rank holds a share of every row's tokens; attention reaches
                     the other shares on the other ranks (context parallelism, raymoe.parallel.context_parallel)

A :class:`SequenceSplit` is what the decoder needs to run on a share of each row (set on
``DecoderModel.sequence_split`` for the duration of a forward by the rank code; the model itself knows nothing of
ranks): which tokens of a full row are this forward's (:meth:`~SequenceSplit.cut`, applied to token ids and replayed
routes, which arrive as full rows) and the layout of the rows.

A :class:`ResidualSplit` (sequence parallelism inside tensor parallelism, Megatron's) keeps the residual stream and
the norms on a share of the sequence: the decoder takes the share after the embedding and after each attention and
feed-forward, and hands the whole sequence to each of them (and to the head) after their norm::

    embedding -> share -> [ norm -> whole -> attention -> share -> + ] -> [ norm -> whole -> mlp -> share -> + ] ...
                                                                        -> norm -> whole -> head
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from raymoe.models.common.row_attention import AttentionRule


class TokenLayout(Protocol):
    """The tokens of a forward as attention sees them."""

    @property
    def positions_BS(self) -> Tensor:
        """RoPE positions of the tokens this forward holds: ``[B, S]`` (or ``[S]``, the same for every row)."""
        ...

    def attend(self, q_BHqSD: Tensor, k_BHkvSD: Tensor, v_BHkvSD: Tensor, rule: AttentionRule) -> Tensor:
        """``[B, Hq, S, Dv]``: each token's attention over the keys the layout lets it see (causal, within its row
        and document), under ``rule``."""
        ...


class SequenceSplit(Protocol):
    """A forward over this rank's share of every row (``full`` tokens long) instead of whole rows."""

    def local_length(self, full: int) -> int:
        """Tokens of a row of ``full`` tokens this forward holds."""
        ...

    def full_length(self, local: int) -> int:
        """The full row length whose share is ``local`` tokens."""
        ...

    def cut(self, x: Tensor, dim: int = 1) -> Tensor:
        """``x`` laid out along full rows on ``dim`` -> this forward's tokens, in the order the layout holds them."""
        ...

    def layout(self, document_ids_BS: Tensor | None, rows: int, full: int, device: torch.device) -> TokenLayout:
        """The layout of ``rows`` rows of ``full`` tokens (``document_ids [B, full]``: packed rows; None: one
        sequence a row)."""
        ...


class ResidualSplit(Protocol):
    """The residual stream of a forward split along the sequence (dim 1 of ``[B, S, H]``) over ranks that compute
    the rest together (the tp group)."""

    def share(self, x_BSH: Tensor) -> Tensor:
        """The whole sequence (the same on every rank) -> this rank's share of it."""
        ...

    def whole(self, x_BsH: Tensor) -> Tensor:
        """This rank's share -> the whole sequence, for a module that needs every token."""
        ...
