"""A rank's share of every row over its cp group, as the decoder runs it (context parallelism, ``cp_size > 1``).

A :class:`ContextSplit` is what the rank code sets on each model part's ``DecoderModel.sequence_split`` for the
duration of a forward (:class:`raymoe.parallel.sequence_shares.SequenceShares`). The decoder then cuts the token ids
(and replayed routes) of the whole rows it is given to this rank's chunks (:mod:`.chunks`), takes every token's RoPE
position from the whole row (a packed document's restart at its start), and each layer attends through the split's
layout: the ring (:mod:`.ring`) or the all-to-all (:mod:`.all_to_all`), by ``cp_mode``. What the rank code feeds the
loss is cut the same way (:meth:`ContextSplit.cut`), and what it answers is put back in row order
(:meth:`ContextSplit.gather`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh

from raymoe.models.common.packing import pack_documents
from raymoe.models.common.row_attention import AttentionRule
from raymoe.parallel.context_parallel import ContextParallelMode
from raymoe.parallel.context_parallel.all_to_all import AllToAllLayout
from raymoe.parallel.context_parallel.chunks import HeadTail
from raymoe.parallel.context_parallel.ring import RingLayout


@dataclass(frozen=True)
class SplitRows:
    """The token layout of one split forward: RoPE positions of this rank's tokens and the attention across ranks."""

    positions_BS: Tensor
    attention: RingLayout | AllToAllLayout

    def attend(self, q_BHSD: Tensor, k_BHSD: Tensor, v_BHSD: Tensor, rule: AttentionRule) -> Tensor:
        return self.attention.attend(q_BHSD, k_BHSD, v_BHSD, rule)


@dataclass(frozen=True)
class ContextSplit:
    """This rank's share of every row over the cp group ``mesh``, attended across by ``mode``."""

    mesh: DeviceMesh
    mode: ContextParallelMode

    @property
    def cp(self) -> int:
        return self.mesh.size()

    @property
    def rank(self) -> int:
        return self.mesh.get_local_rank()

    def fits(self, full: int) -> bool:
        """Whether rows of ``full`` tokens cut into ``2 * cp`` equal chunks."""
        return full % (2 * self.cp) == 0

    def chunks(self, full: int) -> HeadTail:
        """The split of rows of ``full`` tokens (a ``ValueError`` unless they cut into ``2 * cp`` chunks)."""
        return HeadTail(self.cp, self.rank, full)

    def local_length(self, full: int) -> int:
        return self.chunks(full).local

    def full_length(self, local: int) -> int:
        return local * self.cp

    def cut(self, x: Tensor, dim: int = 1) -> Tensor:
        """``x`` laid out along whole rows on ``dim`` -> this rank's tokens (head chunk, then tail chunk)."""
        return self.chunks(x.shape[dim]).cut(x, dim)

    def layout(self, document_ids_BS: Tensor | None, rows: int, full: int, device: torch.device) -> SplitRows:
        """The token layout of ``rows`` rows of ``full`` tokens (``document_ids [B, full]``: packed rows)."""
        chunks = self.chunks(full)
        group = self.mesh.get_group()
        if document_ids_BS is None:
            positions = chunks.token_index(device)
            if self.mode == "ring":
                return SplitRows(positions, RingLayout(chunks, group))
            return SplitRows(positions, AllToAllLayout(chunks, group))
        if self.mode == "ring":
            runs_BF, positions_BF = document_runs(document_ids_BS)
            return SplitRows(chunks.cut(positions_BF), RingLayout(chunks, group, runs_BF))
        documents = pack_documents(document_ids_BS)
        return SplitRows(chunks.cut(documents.positions_BS), AllToAllLayout(chunks, group, documents))

    def gather(self, x: Tensor, dim: int = 1) -> Tensor:
        """Every cp rank's share of ``x`` (this rank's along ``dim``) -> the whole rows, in row order, on every rank.
        No gradient."""
        x = x.detach().contiguous()
        shares = [torch.empty_like(x) for _ in range(self.cp)]
        dist.all_gather(shares, x, group=self.mesh.get_group())
        return self.chunks(x.shape[dim] * self.cp).restore(shares, dim)

    def gather_to_first(self, x: Tensor, dim: int = 1) -> Tensor | None:
        """:meth:`gather` onto cp rank 0 only (the one that answers for the batch); None on the others."""
        x = x.detach().contiguous()
        shares = [torch.empty_like(x) for _ in range(self.cp)] if self.rank == 0 else None
        dist.gather(x, shares, group=self.mesh.get_group(), group_dst=0)
        if shares is None:
            return None
        return self.chunks(x.shape[dim] * self.cp).restore(shares, dim)

    def sum(self, x: Tensor) -> Tensor:
        """``x`` summed over the cp group (in place), e.g. the token losses of every share of the rows."""
        dist.all_reduce(x, group=self.mesh.get_group())
        return x


def document_runs(document_ids_BS: Tensor) -> tuple[Tensor, Tensor]:
    """``(runs [B, S], positions [B, S])`` of packed rows, on their device, no host sync: ``runs`` numbers the runs of
    equal ids along each row (a new document where the id changes), ``positions`` count from each run's first token
    (:mod:`raymoe.models.common.packing`)."""
    starts_BS = torch.ones_like(document_ids_BS, dtype=torch.bool)
    starts_BS[:, 1:] = document_ids_BS[:, 1:] != document_ids_BS[:, :-1]
    index_S = torch.arange(document_ids_BS.shape[1], device=document_ids_BS.device)
    first_BS = torch.where(starts_BS, index_S, torch.zeros_like(index_S)).cummax(dim=1).values
    return starts_BS.cumsum(dim=1), index_S - first_BS
