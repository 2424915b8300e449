"""StreamedData without Ray (blocks as plain dicts, fetch the identity): the block order sees every row once per
epoch and resumes exactly; a global batch's picks name, per data-parallel batch, the rows the driver would send;
the rows a rank builds from them are the driver's micro-batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raymoe.driver.batch import make_global_batch, split_micro_batches
from raymoe.driver.batch_order import block_batch_indices
from raymoe.driver.fanout import split_batch_rows
from raymoe.driver.packing import PackedData
from raymoe.driver.streamed_data import BlockStats, StreamedData
from raymoe.models.common.loss import IGNORE_INDEX
from raymoe.rank.block_rows import micro_batches_of

SEQ = 6


def _blocks(sizes: list[int], seed: int = 0) -> tuple[list[dict], PackedData]:
    """Blocks of document-packed rows with labels, and the same rows as one PackedData."""
    generator = torch.Generator().manual_seed(seed)
    total = sum(sizes)
    ids = torch.randint(0, 50, (total, SEQ), generator=generator)
    mask = torch.ones_like(ids)
    mask[::3, -2:] = 0
    labels = ids.masked_fill(torch.rand(ids.shape, generator=generator) < 0.3, IGNORE_INDEX)
    documents = torch.tensor([0, 0, 0, 1, 1, 1]).repeat(total, 1)
    data = PackedData(ids, mask, labels, documents)
    targets = data.targets()
    blocks, at = [], 0
    for size in sizes:
        part = slice(at, at + size)
        blocks.append(
            {
                "input_ids": ids[part].numpy().astype(np.int32),
                "labels": targets[part].numpy().astype(np.int32),
                "token_mask": (mask[part] != 0).numpy(),
                "document_ids": documents[part].numpy().astype(np.int32),
            }
        )
        at += size
    return blocks, data


def _streamed(blocks: list[dict]) -> StreamedData:
    counts = [{"examples": 2 * len(b["input_ids"]), "truncated": 0, "dropped": 0} for b in blocks]
    stats = [BlockStats.of_block(b, [c], [2]) for b, c in zip(blocks, counts, strict=True)]
    return StreamedData.of_blocks(blocks, stats, SEQ, lambda refs: list(refs), has_labels=True)


def test_each_epoch_reads_every_row_once_block_by_block_and_a_resumed_order_continues_it():
    block_of_row = np.repeat(np.arange(5), [4, 3, 5, 1, 3]).astype(np.int32)
    order = block_batch_indices(block_of_row, 4, seed=7)
    epoch = torch.cat([next(order) for _ in range(16 // 4)])
    assert sorted(epoch.tolist()) == list(range(16))
    # rows of one block stay together: the epoch visits each block once
    visited = [int(b) for b in block_of_row[epoch.numpy()]]
    assert len([b for i, b in enumerate(visited) if i == 0 or visited[i - 1] != b]) == 5
    second = torch.cat([next(order) for _ in range(4)])
    assert sorted(second.tolist()) == list(range(16)) and not torch.equal(second, epoch)
    resumed = block_batch_indices(block_of_row, 4, seed=7, start=5)
    assert torch.equal(next(resumed), second[4:8])


def test_a_global_batch_picks_the_rows_the_driver_would_send_to_each_data_parallel_batch():
    blocks, data = _blocks([4, 3, 5])
    streamed = _streamed(blocks)
    assert streamed.num_label_tokens == data.num_label_tokens
    assert torch.equal(streamed.collect().targets(), data.targets())
    indices = torch.tensor([7, 0, 11, 3, 4, 9, 1])
    batch = streamed.batch(indices, dp_size=2)
    expected = make_global_batch(data.input_ids[indices], data.labels[indices], data.attention_mask[indices], 64,
                                 data.document_ids[indices])  # fmt: skip
    assert batch.num_label_tokens == expected.num_label_tokens
    split = split_batch_rows(len(indices), 2)
    for rows, refs, mine in zip(batch.rows, batch.blocks, split.rows, strict=True):
        rows = type(rows)(rows.blocks, rows.rows, micro_batches=2)
        got = micro_batches_of(rows, refs)
        want = split_micro_batches(expected.input_ids[mine], expected.labels[mine], expected.token_mask[mine], 2,
                                   expected.document_ids[mine])  # fmt: skip
        for g, w in zip(got, want, strict=True):
            for name in ("input_ids", "labels", "token_mask", "document_ids"):
                assert torch.equal(getattr(g, name), getattr(w, name)), name
                assert getattr(g, name).dtype == getattr(w, name).dtype, name
        assert len(refs) == len({int(streamed.block_of_row[i]) for i in indices[mine]})  # only the blocks it reads


def test_blank_rows_add_no_token_and_a_view_keeps_its_rows():
    blocks, data = _blocks([4, 3])
    streamed = _streamed(blocks)
    train, held = streamed.split(0.3)
    assert held is not None and train.num_sequences + held.num_sequences == 7
    assert torch.equal(held.collect().input_ids, data.input_ids[-2:])
    batch = held.batch(np.arange(2), dp_size=4, blank=2)
    assert batch.num_label_tokens == data.rows(slice(5, 7)).num_label_tokens
    idle = micro_batches_of(batch.rows[3], batch.blocks[3])[0]
    assert not idle.token_mask.any() and bool((idle.labels == IGNORE_INDEX).all())
    with pytest.raises(ValueError, match=r"eval_fraction=1 must be in \[0, 1\)"):
        streamed.split(1)
