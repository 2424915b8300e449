"""Inference batches on the driver: prompts of any lengths checked and left-padded, rows split over any layout.

Prompts come as a ``[B, S]`` tensor (with an optional left-padding ``attention_mask``) or as a list
of token-id lists of different lengths, which are left-padded here::

    [[5, 6, 7], [8, 9]]  ->  input_ids [[5, 6, 7], [p, 8, 9]]   attention_mask [[1, 1, 1], [0, 1, 1]]

Rows go to data-parallel batches in blocks (:func:`raymoe.driver.fanout.split_rows`), like a training
batch, but any number of rows works: with fewer rows than batches, an idle batch decodes a copy of row 0
(its ranks must join the collectives of every step) and its answer is dropped::

    B = 1, dp_size = 2        batch 0: row 0        batch 1: row 0 again (idle, dropped)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from raymoe.driver.batch import check_binary_mask, check_input_ids, check_like


@dataclass(frozen=True)
class PromptBatch:
    """Prompts as the ranks take them.

    ``input_ids [B, S]`` left-padded; ``attention_mask [B, S]`` (1: real token) or None when no row is
    padded; ``lengths`` the real tokens of each row; ``as_list``: the caller gave lists and gets lists back.
    """

    input_ids: Tensor
    attention_mask: Tensor | None
    lengths: tuple[int, ...]
    as_list: bool

    @property
    def num_rows(self) -> int:
        return int(self.input_ids.shape[0])


def prompt_batch(prompts: object, attention_mask: object | None, vocab_size: int, pad_id: int) -> PromptBatch:
    """Check ``prompts`` (tensor or list of lists) and build the left-padded batch; a ``ValueError`` names a problem."""
    if isinstance(prompts, Tensor):
        ids = check_input_ids(prompts, vocab_size, "prompts")
        if attention_mask is None:
            return PromptBatch(ids, None, (ids.shape[1],) * ids.shape[0], as_list=False)
        mask = check_left_padding(attention_mask, ids)
        return PromptBatch(ids, mask, tuple(int(n) for n in mask.sum(dim=1)), as_list=False)
    if attention_mask is not None:
        raise ValueError("attention_mask goes with a prompts tensor; a list of token-id lists needs none")
    rows = _token_lists(prompts, vocab_size)
    width = max(len(row) for row in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for i, row in enumerate(rows):
        ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.int64)
        mask[i, width - len(row) :] = 1
    padded = any(len(row) < width for row in rows)
    return PromptBatch(ids, mask if padded else None, tuple(len(row) for row in rows), as_list=True)


def check_left_padding(attention_mask: object, ids: Tensor) -> Tensor:
    """:func:`check_attention_mask`, and padding only before the real tokens (generation continues every row)."""
    mask = check_attention_mask(attention_mask, ids)
    if bool((mask[:, 1:] < mask[:, :-1]).any()):
        raise ValueError("attention_mask has padding after real tokens; pad prompts on the left for generation")
    return mask


def check_attention_mask(attention_mask: object, ids: Tensor) -> Tensor:
    """A forward pass's mask as int64 ``[B, S]``: 0 and 1 only, padding on either side, one real token per row."""
    mask = check_like(attention_mask, ids, "attention_mask")
    check_binary_mask(mask)
    empty = (mask.sum(dim=1) == 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"rows {empty} are empty (attention_mask all 0): every row needs a token")
    return mask


def check_token_ids(ids: Sequence[int] | None, vocab_size: int, name: str) -> tuple[int, ...] | None:
    """``ids`` (e.g. ``eos_token_ids``) as a tuple of ints in the vocabulary; None stays None."""
    if ids is None:
        return None
    if isinstance(ids, int) and not isinstance(ids, bool):
        ids = [ids]
    if not isinstance(ids, Sequence) or any(
        isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size for t in ids
    ):
        raise ValueError(f"{name}={ids!r} must be token ids in [0, {vocab_size})")
    return tuple(ids)


def check_stop_sequences(sequences: Sequence[Sequence[int]], vocab_size: int) -> tuple[tuple[int, ...], ...]:
    """Non-empty token-id sequences; a row finishes when its generated tokens end with one of them."""
    if not isinstance(sequences, Sequence) or isinstance(sequences, str | bytes):
        raise ValueError(f"stop_sequences must be a list of token-id lists, got {type(sequences).__name__}")
    checked = []
    for i, sequence in enumerate(sequences):
        ids = check_token_ids(sequence, vocab_size, f"stop_sequences[{i}]")
        if not ids:
            raise ValueError(f"stop_sequences[{i}] is empty: a stop sequence needs a token")
        checked.append(ids)
    return tuple(checked)


def _token_lists(prompts: object, vocab_size: int) -> list[list[int]]:
    if not isinstance(prompts, Sequence) or isinstance(prompts, str | bytes) or not prompts:
        raise ValueError("prompts must be a tensor [batch, seq] or a non-empty list of token-id lists")
    rows = []
    for i, row in enumerate(prompts):
        if not isinstance(row, Sequence) or isinstance(row, str | bytes):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(row).__name__}")
        if not row:
            raise ValueError(f"prompt {i} is empty: every prompt needs a token")
        bad = [t for t in row if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has {bad[:5]}: token ids must be ints in [0, {vocab_size})")
        rows.append(list(row))
    return rows


def routes_as_output(routes: Tensor, batch: PromptBatch, lengths: Tensor) -> Tensor | list[Tensor]:
    """Routes ``[B, W, L_moe, K]`` in the form :func:`as_output` gives the tokens: as they are for a tensor, else each
    row's ``[n_b, L_moe, K]`` for the tokens of its list."""
    if not batch.as_list:
        return routes
    width = batch.input_ids.shape[1]
    out = []
    for b, real in enumerate(batch.lengths):
        end = routes.shape[1] if int(lengths[b]) < 0 else width + int(lengths[b])
        out.append(routes[b, width - real : end].clone())
    return out


def as_output(tokens: Tensor, batch: PromptBatch, lengths: Tensor) -> Tensor | list[list[int]]:
    """The caller's form: a tensor ``[B, S + n]`` for a tensor, else each row's prompt and continuation, no padding
    (a row ends with its stop token; ``lengths[b]`` its generated tokens, -1 for a row that ran to the limit)."""
    if not batch.as_list:
        return tokens
    width = batch.input_ids.shape[1]
    out = []
    for b, real in enumerate(batch.lengths):
        end = tokens.shape[1] if int(lengths[b]) < 0 else width + int(lengths[b])
        out.append(tokens[b, width - real : end].tolist())
    return out
