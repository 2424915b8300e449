"""All-to-all attention over the cp ranks (Ulysses): trade the split of the sequence for a split of the heads.

Shape legend: ``B`` rows, ``H`` query heads (of this rank, after any tensor parallelism), ``G`` key/value heads,
``P`` the cp ranks, ``F`` a row's tokens, ``S = F / P`` the tokens a rank holds (two chunks, :mod:`.chunks`),
``D`` channels. Before attention every rank holds all heads of its tokens; one all-to-all gives each rank all tokens
of ``H / P`` heads, the layer attends over whole rows there exactly as without the split (causality, sliding
windows, sinks of those heads, packed documents: :class:`~raymoe.models.common.packing.PackedDocuments`), and a second
all-to-all brings each rank's tokens back with every head::

    q [B, H, S, D]  --all-to-all (head group p -> rank p)-->  [B, H/P, F, D]  whole rows, tokens in row order
                                                              attend_rows / packed documents
    out [B, H, S, D] <--all-to-all (tokens back to owners)--  [B, H/P, F, D]

Keys and values go the same way with ``G / P`` heads; where ``G`` does not split ``P`` ways each kv head is repeated
(the fewest times that makes it split and keeps every query head's kv head on its rank). Needs ``H % P == 0``
(checked on the driver). Both all-to-alls carry their gradient (``all_to_all_single_autograd``); no host sync.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd

from raymoe.models.common.packing import PackedDocuments
from raymoe.models.common.row_attention import AttentionRule, attend_rows
from raymoe.parallel.context_parallel.chunks import HeadTail


def kv_repeats(query_heads: int, kv_heads: int, cp: int) -> int:
    """How many times each kv head is repeated so ``kv_heads * repeats`` splits ``cp`` ways in step with the query
    heads: the smallest divisor of the group size ``query_heads / kv_heads`` that does it."""
    groups = query_heads // kv_heads
    for repeats in range(1, groups + 1):
        if groups % repeats == 0 and (kv_heads * repeats) % cp == 0:
            return repeats
    raise ValueError(f"{query_heads} query heads / {kv_heads} kv heads do not split over cp_size={cp}")


def check_heads(query_heads: int, cp: int, where: str) -> None:
    """A ``ValueError`` unless ``query_heads`` (a rank's, after tensor parallelism) split ``cp`` ways."""
    if query_heads % cp:
        raise ValueError(
            f"cp_mode='all_to_all' gives each cp rank a share of the attention heads, but {where} has {query_heads} "
            f"query heads per tp rank, which do not split over cp_size={cp}; use cp_mode='ring' (any head count) or "
            f"a cp_size dividing {query_heads}"
        )


@dataclass(frozen=True)
class AllToAllLayout:
    """What every layer's all-to-all attention of one forward shares: the split, the cp group, and the whole rows'
    packed documents (None: one document a row)."""

    chunks: HeadTail
    group: dist.ProcessGroup
    documents: PackedDocuments | None = None

    def attend(self, q_BHSD: Tensor, k_BGSD: Tensor, v_BGSV: Tensor, rule: AttentionRule) -> Tensor:
        """``[B, H, S, Dv]``: this rank's tokens attend over whole rows (see the module docstring)."""
        cp = self.chunks.cp
        heads, kv_heads = q_BHSD.shape[1], k_BGSD.shape[1]
        check_heads(heads, cp, "this layer")
        repeats = kv_repeats(heads, kv_heads, cp)
        if repeats > 1:
            k_BGSD, v_BGSV = k_BGSD.repeat_interleave(repeats, 1), v_BGSV.repeat_interleave(repeats, 1)
        q_rows, k_rows, v_rows = (self._to_rows(x) for x in (q_BHSD, k_BGSD, v_BGSV))
        local = heads // cp
        own = rule.heads(self.chunks.rank * local, local)
        if self.documents is not None:
            out_rows = self.documents.attend(q_rows, k_rows, v_rows, own)
        else:
            out_rows = attend_rows(q_rows, k_rows, v_rows, own)
        return self._to_tokens(out_rows)

    def _to_rows(self, x_BHSD: Tensor) -> Tensor:
        """``[B, H, S, D]`` (every head of this rank's tokens) -> ``[B, H/P, F, D]`` (its heads, whole rows)."""
        cp, chunks = self.chunks.cp, self.chunks
        rows, heads, _, width = x_BHSD.shape
        send = x_BHSD.reshape(rows, cp, heads // cp, chunks.local, width).transpose(0, 1).contiguous()
        received = _exchange(send, self.group)  # [P (source rank), B, H/P, S, D]
        # source p's tokens are its chunks (p, 2P - 1 - p): put every chunk in row order
        halves = received.view(cp, rows, heads // cp, 2, chunks.chunk, width)
        by_chunk = {chunk: halves[p, :, :, half] for p in range(cp) for half, chunk in enumerate(chunks.chunks_of(p))}
        return torch.cat([by_chunk[n] for n in range(2 * cp)], dim=2)

    def _to_tokens(self, x_BhFD: Tensor) -> Tensor:
        """:meth:`_to_rows`' inverse: ``[B, H/P, F, D]`` -> ``[B, H, S, D]``."""
        cp, chunks = self.chunks.cp, self.chunks
        rows, local, _, width = x_BhFD.shape
        pieces = x_BhFD.split(chunks.chunk, dim=2)  # chunk n of the row
        shares = [torch.cat([pieces[n] for n in chunks.chunks_of(p)], dim=2) for p in range(cp)]
        send = torch.stack(shares)  # [P (owner of the tokens), B, H/P, S, D]
        received = _exchange(send, self.group)  # [P (head group), B, H/P, S, D]
        return received.permute(1, 0, 2, 3, 4).reshape(rows, cp * local, chunks.local, width)


def _exchange(send: Tensor, group: dist.ProcessGroup) -> Tensor:
    """Block ``p`` of ``send`` (dim 0) to cp rank ``p``; block ``p`` of the result from it. Gradient flows back."""
    cp = send.shape[0]
    flat = send.reshape(cp, -1)
    sizes = [math.prod(send.shape[1:])] * cp
    received = all_to_all_single_autograd(flat.reshape(-1), sizes, sizes, group)
    return received.view(send.shape)
