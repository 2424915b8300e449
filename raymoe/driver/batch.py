"""The global batch on the driver: checked, labelled, and a batch's rows cut into micro-batches (SPEC TOPO-1).

``input_ids [B, S]`` is the global batch; its rows go to the data-parallel batches in blocks
(:mod:`raymoe.driver.fanout`), and each batch's rows into micro-batches for gradient accumulation.

Packed rows carry ``document_ids [B, S]``: a run of equal ids along a row is one document, which
attends only to itself and whose positions restart at 0 (:func:`raymoe.models.common.decoder.document_layout`).
Its first token is then no target of the token before it (that one belongs to another document and
cannot see it): its label is ignored, as transformers' ``DataCollatorWithFlattening`` does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from raymoe.models.common.loss import IGNORE_INDEX, count_label_tokens
from raymoe.rank.contract import MicroBatch


@dataclass(frozen=True)
class GlobalBatch:
    """A checked global batch. ``labels`` has ``IGNORE_INDEX`` wherever no loss is taken; ``token_mask``
    (bool) is False on padding (``attention_mask == 0``), which the router's aux loss does not count;
    ``document_ids`` (packed rows) or None."""

    input_ids: Tensor
    labels: Tensor
    num_label_tokens: int
    token_mask: Tensor
    document_ids: Tensor | None = None


def check_input_ids(input_ids: object, vocab_size: int, name: str = "input_ids") -> Tensor:
    """``input_ids`` as a ``[B, S]`` int64 CPU tensor, or a ``ValueError`` naming what is wrong."""
    if not isinstance(input_ids, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor of token ids [batch, seq], got {type(input_ids).__name__}")
    if input_ids.dim() != 2 or input_ids.shape[0] == 0 or input_ids.shape[1] == 0:
        raise ValueError(f"{name} must be a non-empty 2-D tensor [batch, seq], got shape {tuple(input_ids.shape)}")
    if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool or input_ids.is_complex():
        raise ValueError(f"{name} must hold integer token ids, got dtype {input_ids.dtype}")
    low, high = int(input_ids.min()), int(input_ids.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{name} must be token ids in [0, {vocab_size}), got values in [{low}, {high}]")
    return input_ids.detach().to("cpu", torch.int64)


def check_sequence_length(length: int, max_positions: int) -> None:
    if length > max_positions:
        raise ValueError(
            f"sequence length {length} exceeds the model's max_position_embeddings={max_positions}; "
            "use shorter sequences (or fewer new tokens)"
        )


def make_global_batch(
    input_ids: object,
    labels: object | None,
    attention_mask: object | None,
    vocab_size: int,
    document_ids: object | None = None,
) -> GlobalBatch:
    """Labels default to the inputs; positions where ``attention_mask`` is 0 take no loss, nor (with
    ``document_ids``) the first token of each document after a row's first (see the module docstring).

    Padding must be on the right: training and evaluation run the models without a padding mask
    (generation takes one), so a token never sees the padding after it, but would see padding placed
    before it.
    """
    ids = check_input_ids(input_ids, vocab_size)
    if labels is None:
        targets = ids.clone()
    else:
        targets = check_like(labels, ids, "labels")
        bad = (targets != IGNORE_INDEX) & ((targets < 0) | (targets >= vocab_size))
        if bool(bad.any()):
            raise ValueError(f"labels must be token ids in [0, {vocab_size}) or {IGNORE_INDEX}")
    token_mask = torch.ones_like(ids, dtype=torch.bool)
    if attention_mask is not None:
        mask = check_like(attention_mask, ids, "attention_mask")
        check_right_padded(mask)
        targets = targets.masked_fill(mask == 0, IGNORE_INDEX)
        token_mask = mask != 0
    documents = None
    if document_ids is not None:
        documents = check_document_ids(document_ids, ids)
        targets = targets.masked_fill(document_starts(documents), IGNORE_INDEX)
    return GlobalBatch(ids, targets, count_label_tokens(targets), token_mask, documents)


def check_document_ids(document_ids: object, ids: Tensor) -> Tensor:
    """``document_ids`` as an int64 CPU tensor shaped like ``ids`` (any integers: runs of equal ids are documents)."""
    if isinstance(document_ids, Tensor) and (
        document_ids.dtype.is_floating_point or document_ids.dtype == torch.bool or document_ids.is_complex()
    ):
        raise ValueError(f"document_ids must hold integer document ids, got dtype {document_ids.dtype}")
    return check_like(document_ids, ids, "document_ids")


def document_starts(document_ids: Tensor) -> Tensor:
    """``[B, S]`` bool: True at the first token of each document that is not the first of its row."""
    starts = torch.zeros_like(document_ids, dtype=torch.bool)
    starts[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    return starts


def check_like(value: object, ids: Tensor, name: str) -> Tensor:
    """``value`` (labels, a mask) as an int64 CPU tensor shaped like ``ids``, or a ``ValueError`` naming it."""
    if not isinstance(value, Tensor) or tuple(value.shape) != tuple(ids.shape):
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"{name} must be a tensor shaped like input_ids {tuple(ids.shape)}, got {shape}")
    return value.detach().to("cpu", torch.int64)


def check_binary_mask(mask: Tensor) -> None:
    if bool(((mask != 0) & (mask != 1)).any()):
        raise ValueError("attention_mask must hold only 0 and 1")


def check_right_padded(mask: Tensor) -> None:
    """A ``ValueError`` unless ``mask`` holds 0/1 and every row's zeros are at its end."""
    check_binary_mask(mask)
    # Right padding: along each row the mask never goes from 0 back to 1.
    if bool((mask[:, 1:] > mask[:, :-1]).any()):
        raise ValueError(
            "attention_mask has padding before real tokens (left padding); training and evaluation pass no padding "
            "mask to attention, so pad on the right"
        )


def check_micro_batches(micro_batches: object, rows: int | None = None) -> None:
    """``micro_batches`` is an int >= 1 and (given a rank's ``rows``) at most that many."""
    if isinstance(micro_batches, bool) or not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches must be an int >= 1, got {micro_batches!r}")
    if rows is not None and rows < micro_batches:
        raise ValueError(
            f"micro_batches={micro_batches} needs at least that many rows per data-parallel rank, "
            f"and a rank holds {rows}; use a larger global batch or fewer micro-batches"
        )


def split_micro_batches(
    input_ids: Tensor,
    labels: Tensor,
    token_mask: Tensor,
    micro_batches: int,
    document_ids: Tensor | None = None,
    fields: dict[str, Tensor] | None = None,
    routes: Tensor | None = None,
) -> list[MicroBatch]:
    """A rank's rows as ``micro_batches`` consecutive row blocks, for gradient accumulation (a policy loss's
    per-token ``fields`` and replayed ``routes`` cut with them)."""
    check_micro_batches(micro_batches, input_ids.shape[0])
    ids, labs, mask = (torch.tensor_split(tensor, micro_batches) for tensor in (input_ids, labels, token_mask))
    docs: Sequence[Tensor | None] = (
        torch.tensor_split(document_ids, micro_batches) if document_ids is not None else [None] * micro_batches
    )
    micros = [MicroBatch(*micro) for micro in zip(ids, labs, mask, docs, strict=True)]
    if fields is not None:
        blocks = {name: torch.tensor_split(value, micro_batches) for name, value in fields.items()}
        micros = [replace(m, fields={n: b[i] for n, b in blocks.items()}) for i, m in enumerate(micros)]
    if routes is not None:
        route_blocks = torch.tensor_split(routes, micro_batches)
        micros = [replace(m, routes=route_blocks[i]) for i, m in enumerate(micros)]
    return micros
