"""Which tokens of every row a cp rank holds: the load-balanced head-tail split (torchtitan's for causal attention).

A row of ``F`` tokens is cut into ``2 * cp`` chunks of ``c = F / (2 * cp)``; cp rank ``r`` holds chunks ``r`` and
``2 * cp - 1 - r``, in that order, so every rank has one early chunk (few keys before it) and one late chunk (many),
and the causal work is even::

    cp = 2, F = 8 (c = 2)      tokens   t0 t1 | t2 t3 | t4 t5 | t6 t7
                               chunk      0       1       2       3
                               rank 0   t0 t1                   t6 t7      chunks 0, 3
                               rank 1           t2 t3   t4 t5              chunks 1, 2

Everything laid out along the tokens (ids, labels, positions, document ids, replayed routes, per-token loss inputs)
is cut the same way; results are put back in row order by :meth:`HeadTail.restore` (the all-gathered shares of every
rank, in cp rank order).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def check_splittable(full: int, cp: int) -> None:
    """A ``ValueError`` unless a row of ``full`` tokens cuts into ``2 * cp`` equal chunks."""
    if full % (2 * cp):
        raise ValueError(
            f"a sequence of {full} tokens does not split over cp_size={cp}: context parallelism cuts every row into "
            f"2 * cp_size = {2 * cp} equal chunks, so the sequence length must be a multiple of {2 * cp} (pad the "
            "rows on the right, e.g. pack to such a length)"
        )


@dataclass(frozen=True)
class HeadTail:
    """The split of rows of ``full`` tokens over ``cp`` ranks, seen from cp rank ``rank``."""

    cp: int
    rank: int
    full: int

    def __post_init__(self) -> None:
        check_splittable(self.full, self.cp)

    @property
    def chunk(self) -> int:
        """Tokens in one chunk: ``full / (2 * cp)``."""
        return self.full // (2 * self.cp)

    @property
    def local(self) -> int:
        """Tokens of a row this rank holds: two chunks."""
        return 2 * self.chunk

    def chunks_of(self, rank: int) -> tuple[int, int]:
        """The two chunk indices ``rank`` holds, in the order it holds them."""
        return rank, 2 * self.cp - 1 - rank

    @property
    def own_chunks(self) -> tuple[int, int]:
        return self.chunks_of(self.rank)

    def cut(self, x: Tensor, dim: int = 1) -> Tensor:
        """``x`` with ``full`` entries along ``dim`` -> this rank's ``2 * chunk`` (head chunk, then tail chunk)."""
        if x.shape[dim] != self.full:
            raise ValueError(f"cut: dim {dim} of {tuple(x.shape)} is not the row length {self.full}")
        head, tail = self.own_chunks
        c = self.chunk
        return torch.cat([x.narrow(dim, head * c, c), x.narrow(dim, tail * c, c)], dim)

    def token_index(self, device: torch.device | None = None) -> Tensor:
        """``[2 * chunk]`` int64: the position in the row of each token this rank holds."""
        return self.cut(torch.arange(self.full, device=device), dim=0)

    def restore(self, shares: list[Tensor], dim: int = 1) -> Tensor:
        """Every rank's share (in cp rank order, each ``2 * chunk`` along ``dim``) -> the whole rows, in order."""
        pieces: list[Tensor | None] = [None] * (2 * self.cp)
        for rank, share in enumerate(shares):
            head, tail = share.split(self.chunk, dim=dim)
            first, second = self.chunks_of(rank)
            pieces[first], pieces[second] = head, tail
        return torch.cat([piece for piece in pieces if piece is not None], dim=dim)
