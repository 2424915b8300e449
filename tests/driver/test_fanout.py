"""Rows of a global batch over the data-parallel batches, and one answer per batch from a real in-process rank."""

import pytest
import torch

from raymoe import DistributedConfig, build_topology
from raymoe.driver.fanout import FanOut, split_batch_rows, split_rows
from raymoe.rank.local import LocalRankGroup


def test_rows_go_to_batches_in_blocks_and_idle_batches_borrow_row_zero():
    split = split_rows(5, 2)
    assert [rows.tolist() for rows in split.rows] == [[0, 1, 2], [3, 4]] and split.idle == (False, False)
    ids = torch.arange(10).view(5, 2)
    assert [part.tolist() for part in split.take_all(ids)] == [[[0, 1], [2, 3], [4, 5]], [[6, 7], [8, 9]]]
    assert split.take(None) == [None, None]
    assert split.gather(split.take_all(ids)).tolist() == ids.tolist()

    few = split_rows(1, 3)  # one row, three batches: two decode a copy of row 0 and are dropped
    assert [rows.tolist() for rows in few.rows] == [[0], [0], [0]] and few.idle == (False, True, True)
    assert few.gather([torch.tensor([[7]]), torch.tensor([[8]]), torch.tensor([[9]])]).tolist() == [[7]]


def test_a_training_batch_needs_a_row_per_batch():
    assert [rows.tolist() for rows in split_batch_rows(4, 4).rows] == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match=r"has 3 rows but the layout has dp_size=4 data-parallel ranks"):
        split_batch_rows(3, 4)


def rank_and_rows(ctx, rows):
    return ctx.rank, rows.tolist()


def test_fan_out_sends_each_batch_its_arguments_and_reads_its_answer():
    with LocalRankGroup() as group:
        topology = build_topology(DistributedConfig())
        group.use_layout(topology)
        fanout = FanOut(lambda: group, topology)
        assert fanout.per_batch(rank_and_rows, [(torch.tensor([1, 2]),)]) == [(0, [1, 2])]
        with pytest.raises(ValueError, match="2 argument tuples for 1 batches"):
            fanout.per_batch(rank_and_rows, [(torch.tensor([1]),), (torch.tensor([2]),)])
