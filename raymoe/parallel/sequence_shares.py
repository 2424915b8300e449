"""How a rank's forwards split sequences: over its cp group (context parallelism, :mod:`.context_parallel`) and the
residual stream over its tp group (sequence parallelism, :mod:`.sequence_parallel`). Decided once at load from the
layout; a forward takes what fits it.

    training, evaluation   both, always (the driver refuses lengths that do not split)
    logits, log-probs      each where the rows split (no padding mask, a length that cuts into the shares);
                           otherwise every rank runs the whole rows, with the same result
    generation             neither (a KV cache and one new token a step: every rank runs whole rows)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from raymoe.models.common.decoder import CausalLM
from raymoe.parallel.context_parallel.split import ContextSplit
from raymoe.parallel.sequence_parallel import TpResidualSplit


@dataclass(frozen=True)
class SequenceShares:
    """``context``: this rank's share of every row over the cp group (None: whole rows); ``residual``: the residual
    stream split over the tp group (None: whole)."""

    context: ContextSplit | None = None
    residual: TpResidualSplit | None = None

    def for_inference(self, width: int, padded: bool) -> SequenceShares:
        """The shares a forward of rows of ``width`` tokens (``padded``: with a padding mask, or any forward that
        cannot be split) runs on."""
        if padded:
            return SequenceShares()
        context = self.context if self.context is not None and self.context.fits(width) else None
        held = context.local_length(width) if context is not None else width
        residual = self.residual if self.residual is not None and self.residual.fits(held) else None
        return SequenceShares(context, residual)

    @contextmanager
    def applied(self, parts: Sequence[CausalLM]) -> Iterator[None]:
        """Within the block, forwards of ``parts`` run on these shares."""
        for part in parts:
            part.model.sequence_split, part.model.residual_split = self.context, self.residual
        try:
            yield
        finally:
            for part in parts:
                part.model.sequence_split, part.model.residual_split = None, None
