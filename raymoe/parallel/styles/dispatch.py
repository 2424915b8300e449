"""Token dispatch over the ep group (SPEC EP-3, EP-5): each (token, expert) pair travels to its expert's owner and back.

Shape legend: ``T`` tokens this rank dispatches, ``K`` experts per token, ``S = T * K`` (token, expert)
pairs, ``H`` hidden size, ``E`` experts in all, ``P`` ranks of the ep group, ``L = E / P`` local
experts (rank ``p`` owns experts ``[p * L, (p + 1) * L)``, TOPO-2), ``R`` rows this rank receives,
``G = R + L`` the rows its experts compute (one zero row each added).
Every rank is a sender (of its own pairs) and an owner (of its local experts) at once::

    sender                                                owner
    hidden [T, H], ids [T, K] (global; < 0: a pair the router's capacity limit dropped)
      | flatten to S pairs, stable sort by global expert, dropped pairs last (never sent)
    rows [V, H] (V kept pairs): by owner rank, then by its local expert
      | counts [P, L] --- all-to-all ---------------------> counts [P, L]: rows from each rank, per local expert
      |       .tolist() of both: the one host sync, for the split sizes
      | rows ------------ all-to-all (autograd) ---------> rows [R, H]: by source rank, then local expert
      |                                                     | + one zero row per local expert (EP-5)
      |                                                     | regroup by local expert
      |                                                   x [G, H], counts [L] (each >= 1)
      |                                                     | experts.compute on the local weights
      |                                                   y [G, H]
      |                                                     | undo the regrouping, drop the zero rows
    out [V, H] (sorted) <--- all-to-all (autograd) ------ y [R, H]: by source rank, then local expert
      | + zero rows for the dropped pairs, unsort, * routing weights, sum over K (on the sender, EP-3)
    [T, H]

:func:`dispatch` returns the grouped rows and a frozen :class:`DispatchMeta`; :func:`combine` takes
the experts' output and that metadata. Every rank joins every collective, including a rank with no
pairs to send or none to receive (its splits are zeros), so nothing waits on a rank that has no work.
The zero rows make every local expert run, and so get a gradient, on every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh

from raymoe.models.moe.rows import inverse_permutation, move_rows


@dataclass(frozen=True)
class DispatchMeta:
    """What :func:`combine` needs to send the experts' rows back and undo the sorting.

    ``send_splits[p]`` rows went to ep rank ``p`` and ``recv_splits[p]`` came from it (host ints);
    ``pair_order_S`` is the sender's sort of its pairs (kept pairs first, dropped ones after them),
    ``row_order`` the owner's regrouping of ``cat(received rows, zero rows)``.
    """

    num_tokens: int
    top_k: int
    pair_order_S: Tensor
    send_splits: tuple[int, ...]
    recv_splits: tuple[int, ...]
    row_order: Tensor

    @property
    def num_received(self) -> int:
        return sum(self.recv_splits)

    @property
    def num_sent(self) -> int:
        """Pairs sent: every pair but those the capacity limit dropped."""
        return sum(self.send_splits)


def dispatch(
    hidden_TH: Tensor, ids_TK: Tensor, num_experts: int, ep_mesh: DeviceMesh
) -> tuple[Tensor, Tensor, DispatchMeta]:
    """Send each pair's hidden row to its expert's owner; return the rows this rank computes, grouped.

    ``hidden: [T, H]`` and ``ids: [T, K]`` global expert ids (negative: dropped, not sent), both this
    rank's own. Returns
    ``x: [G, H]`` grouped by local expert (each group ends with one zero row), ``counts: [L]``
    (int64, on hidden's device) and the metadata for :func:`combine`.
    """
    num_tokens, top_k = ids_TK.shape
    ranks = ep_mesh.size()
    pair_order_S, counts_PL = sort_pairs(ids_TK, num_experts, ranks)
    recv_counts_PL = exchange_counts(counts_PL, ep_mesh)
    # The one host sync of the layer: the all-to-all split sizes must be host ints.
    sent, received = torch.stack([counts_PL, recv_counts_PL]).tolist()
    send_splits, recv_splits = tuple(sum(row) for row in sent), tuple(sum(row) for row in received)
    rows_SH = move_rows(hidden_TH, pair_order_S[: sum(send_splits)] // top_k)
    received_RH = all_to_all_single_autograd(rows_SH, list(recv_splits), list(send_splits), ep_mesh.get_group())
    row_order, counts_L = group_by_local_expert(recv_counts_PL, sum(recv_splits))
    x_GH = move_rows(torch.cat([received_RH, received_RH.new_zeros(counts_L.numel(), received_RH.shape[1])]), row_order)
    meta = DispatchMeta(num_tokens, top_k, pair_order_S, send_splits, recv_splits, row_order)
    return x_GH, counts_L, meta


def combine(y_GH: Tensor, weights_TK: Tensor, meta: DispatchMeta, ep_mesh: DeviceMesh) -> Tensor:
    """The experts' rows (``[G, H]``, grouped as :func:`dispatch` returned them) back on their senders.

    Each sender weights its pairs by ``weights: [T, K]`` and sums over ``K``: ``-> [T, H]``.
    """
    y_received_RH = move_rows(y_GH, inverse_permutation(meta.row_order)[: meta.num_received])
    y_sorted_SH = all_to_all_single_autograd(
        y_received_RH, list(meta.send_splits), list(meta.recv_splits), ep_mesh.get_group()
    )
    hidden_size = y_sorted_SH.shape[-1]
    num_dropped = meta.num_tokens * meta.top_k - meta.num_sent
    if num_dropped:  # dropped pairs sorted last: their rows are zero
        y_sorted_SH = torch.cat([y_sorted_SH, y_sorted_SH.new_zeros(num_dropped, hidden_size)])
    y_SH = move_rows(y_sorted_SH, inverse_permutation(meta.pair_order_S))
    y_TKH = y_SH.view(meta.num_tokens, meta.top_k, hidden_size)
    return (y_TKH * weights_TK.unsqueeze(-1)).sum(dim=1)


def sort_pairs(ids_TK: Tensor, num_experts: int, ranks: int) -> tuple[Tensor, Tensor]:
    """``(order_S, counts_PL)``: the stable sort of the flattened pairs by expert, and pairs per expert as ``[P, L]``.

    Sorted by global expert, the pairs for rank ``p`` are contiguous and ordered by its local expert;
    dropped pairs (negative ids) come last and are not counted.
    """
    ids_S = ids_TK.reshape(-1)
    key_S = torch.where(ids_S >= 0, ids_S, num_experts)  # dropped pairs after every expert's
    order_S = torch.argsort(key_S, stable=True)
    # A scatter-add rather than bincount: no host sync on GPUs. The last bin collects the dropped pairs.
    counts_E = torch.zeros(num_experts + 1, dtype=torch.int64, device=ids_S.device)
    counts_E.scatter_add_(0, key_S, torch.ones_like(key_S))
    return order_S, counts_E[:num_experts].view(ranks, num_experts // ranks)


def exchange_counts(counts_PL: Tensor, ep_mesh: DeviceMesh) -> Tensor:
    """``[P, L]`` -> ``[P, L]``: row ``p`` of ``counts`` goes to ep rank ``p``; row ``p`` of the result came from it."""
    received_PL = torch.empty_like(counts_PL)
    dist.all_to_all_single(received_PL, counts_PL.contiguous(), group=ep_mesh.get_group())
    return received_PL


def group_by_local_expert(recv_counts_PL: Tensor, num_received: int) -> tuple[Tensor, Tensor]:
    """``(row_order, counts_L)`` that regroup ``cat(received rows, one zero row per local expert)`` by local expert.

    Received rows come by source rank, then by local expert (``recv_counts[p, e]`` rows for each
    ``(p, e)``). ``cat(...)[row_order]`` puts each expert's rows together, source ranks in order, its
    zero row last; ``counts_L`` are the group sizes, zero rows included. No host sync.
    """
    ranks, local = recv_counts_PL.shape
    device = recv_counts_PL.device
    segment_R = torch.repeat_interleave(
        torch.arange(ranks * local, device=device), recv_counts_PL.reshape(-1), output_size=num_received
    )
    expert_of_row = torch.cat([segment_R % local, torch.arange(local, device=device)])
    row_order = torch.argsort(expert_of_row, stable=True)
    return row_order, recv_counts_PL.sum(dim=0) + 1
