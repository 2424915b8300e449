"""Packed rows: several documents back to back in one row, each attending only to itself.

``document_ids [B, S]`` says which document each token belongs to: a run of equal ids along a row is one
document (any labelling works; equal ids in two separate runs are two documents). A token's position counts
from the first token of its run, so RoPE sees every document as if it were alone::

    document_ids  7 7 7 2 2 9        positions  0 1 2 0 1 0

Attention is block-diagonal causal. Rather than one ``[B, S, S]`` mask (which costs the full ``S^2``
scores and rules out SDPA's mask-free kernels), attention *unpacks* the documents: they are gathered into
batches of right-padded rows, one batch per length class (lengths in ``(2^(k-1), 2^k]``, so padding at
most doubles a document and the work is at most 4x the ideal ``sum(L_d^2)``), each batch runs the ordinary
attention of separate rows from position 0 (``is_causal`` SDPA; sliding windows and sinks as they are,
since positions restart), and the outputs are scattered back. Padding slots hold copies of a real token: a
real query never sees them (they come after it) and their outputs are dropped. A row that is one document
is one row of the longest class; when every row is one document, attention runs on the rows as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from raymoe.models.common.row_attention import AttentionRule, attend_rows


@dataclass(frozen=True)
class DocumentBatch:
    """Documents of one length class: ``index [N, L]`` the flat token (``b * S + s``) of each slot, right-padded
    with the document's first token, and ``valid [N, L]`` the real slots."""

    index_NL: Tensor
    valid_NL: Tensor


@dataclass(frozen=True)
class PackedDocuments:
    """What attention needs for packed rows: per-token ``positions [B, S]``, the documents in length classes, and
    ``order [B * S]``, the flat token of every valid slot in class order (where the outputs go back)."""

    positions_BS: Tensor
    batches: tuple[DocumentBatch, ...]
    order: Tensor
    one_per_row: bool = False  # every row is a single document: plain causal attention is exact

    def attend(self, q_BHqSD: Tensor, k_BHkvSD: Tensor, v_BHkvSD: Tensor, rule: AttentionRule) -> Tensor:
        """Each document's queries attend to its own keys, under ``rule`` (a token layout,
        :mod:`raymoe.models.common.sequence_split`)."""
        return packed_attention(q_BHqSD, k_BHkvSD, v_BHkvSD, self, lambda q, k, v: attend_rows(q, k, v, rule))


def pack_documents(document_ids_BS: Tensor) -> PackedDocuments:
    """The layout of packed rows (see the module docstring). Computed on the CPU (the shapes depend on the
    document lengths); the index tensors are then moved to ``document_ids``' device."""
    device = document_ids_BS.device
    ids = document_ids_BS.detach().cpu()
    batch, seq = ids.shape
    starts_BS = torch.ones_like(ids, dtype=torch.bool)
    starts_BS[:, 1:] = ids[:, 1:] != ids[:, :-1]
    first = torch.nonzero(starts_BS.flatten()).flatten()  # each document's first flat token
    lengths = torch.diff(first, append=torch.tensor([batch * seq]))
    positions = torch.arange(batch * seq) - torch.repeat_interleave(first, lengths)
    length_class = torch.ceil(torch.log2(lengths.double())).long()
    batches, order = [], []
    for cls in torch.unique(length_class).tolist():
        docs = torch.nonzero(length_class == cls).flatten()
        width = int(lengths[docs].max())
        offsets = torch.arange(width)
        valid = offsets[None, :] < lengths[docs, None]
        index = torch.where(valid, first[docs, None] + offsets[None, :], first[docs, None])
        batches.append(DocumentBatch(index.to(device), valid.to(device)))
        order.append(index[valid])
    return PackedDocuments(
        positions.view(batch, seq).to(device), tuple(batches), torch.cat(order).to(device), len(first) == batch
    )


def packed_attention(
    q_BHqSD: Tensor,
    k_BHkvSD: Tensor,
    v_BHkvSD: Tensor,
    documents: PackedDocuments,
    attend: Callable[[Tensor, Tensor, Tensor], Tensor],
) -> Tensor:
    """``attend(q, k, v)`` (attention of separate rows from position 0) on each length class of documents,
    the outputs put back in place: ``[B, Hq, S, D]``."""
    if documents.one_per_row:
        return attend(q_BHqSD, k_BHkvSD, v_BHkvSD)
    batch, heads, seq, _ = q_BHqSD.shape

    def flat(x: Tensor) -> Tensor:  # [B, H, S, D] -> [B * S, H, D] (values may have another D: MLA)
        return x.transpose(1, 2).reshape(batch * seq, x.shape[1], x.shape[-1])

    q, k, v = flat(q_BHqSD), flat(k_BHkvSD), flat(v_BHkvSD)
    outputs = []
    for group in documents.batches:

        def rows(x: Tensor, index: Tensor = group.index_NL) -> Tensor:  # [N, L, H, D] -> [N, H, L, D]
            return x[index].transpose(1, 2)

        out_NHLD = attend(rows(q), rows(k), rows(v))
        outputs.append(out_NHLD.transpose(1, 2)[group.valid_NL])  # [valid slots, Hq, D]
    slots = torch.cat(outputs)
    out = slots.new_zeros(batch * seq, heads, slots.shape[-1]).index_copy(0, documents.order, slots)
    return out.view(batch, seq, heads, -1).transpose(1, 2)
