"""The DCP planners for strided shards, on two gloo ranks: a packed weight saved under ``_StridedShard`` reads back
as the global tensor under any other placement, where DCP's default planners get it wrong."""

from __future__ import annotations

import tempfile

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor, Replicate, Shard

from raymoe.parallel.sharding import read_local_shard, strided_shard
from raymoe.parallel.state_planner import BoxLoadPlanner, BoxSavePlanner, boxes_of

SHAPE = (3, 8, 4)  # [experts, 2 * intermediate (gate; up), hidden]


def _global() -> torch.Tensor:
    return torch.arange(torch.Size(SHAPE).numel(), dtype=torch.float32).reshape(SHAPE)


def _sharded(full: torch.Tensor, mesh, placements) -> DTensor:
    """``full`` as a DTensor of ``placements`` (the local shard built by the checkpoint bridge)."""
    placeholder = DTensor.from_local(
        torch.empty(0), mesh, placements, run_check=False, shape=full.shape, stride=full.stride()
    )
    local = read_local_shard(placeholder, lambda block: full[block])
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=full.shape, stride=full.stride())


def _save_then_load(rank, directory: str, save_placements, load_placements, *, planners: bool) -> torch.Tensor:
    full = _global()
    saved = {"w": _sharded(full, rank.mesh, save_placements)}
    dcp.save(saved, checkpoint_id=f"{directory}/state", planner=BoxSavePlanner() if planners else None)
    target = {"w": _sharded(torch.full(SHAPE, -1.0), rank.mesh, load_placements)}
    dcp.load(target, checkpoint_id=f"{directory}/state", planner=BoxLoadPlanner() if planners else None)
    return target["w"].full_tensor()


def check_round_trips(rank, directory: str) -> list[bool]:
    packed = (strided_shard(1, 2),)
    full = _global()
    return [
        torch.equal(_save_then_load(rank, f"{directory}/{i}", save, load, planners=True), full)
        for i, (save, load) in enumerate([
            (packed, (Shard(0),)),
            (packed, (Replicate(),)),
            ((Shard(0),), packed),
            (packed, packed),
        ])
    ]  # fmt: skip


def check_default_planners_refuse(rank, directory: str) -> str:
    try:
        _save_then_load(rank, directory, (strided_shard(1, 2),), (Replicate(),), planners=False)
    except BaseException as error:  # DCP's CheckpointException is a BaseException
        return str(error)
    return "saved"


def check_boxes(rank) -> list:
    packed = _sharded(_global(), rank.mesh, (strided_shard(1, 2),))
    plain = _sharded(_global(), rank.mesh, (Shard(1),))
    return [
        [(b.global_offsets, b.local_offsets, b.sizes) for b in boxes_of(packed)],
        boxes_of(plain),
        boxes_of(torch.zeros(2)),
    ]


def test_a_packed_weight_reads_back_whole_under_any_placement(tp2):
    with tempfile.TemporaryDirectory() as directory:
        assert tp2.run(check_round_trips, directory) == [[True] * 4] * 2


def test_without_the_planners_dcp_cannot_save_a_packed_weight(tp2):
    """Why the planners exist: DCP's default describes a strided shard as one block at its first offset, so the two
    ranks' blocks overlap and the save is refused."""
    with tempfile.TemporaryDirectory() as directory:
        answers = tp2.run(check_default_planners_refuse, directory)
    assert all("validate" in answer.lower() for answer in answers), answers


def test_a_strided_shard_is_one_box_per_packed_piece(tp2):
    # rank r of 2 holds gate rows [2r, 2r+2) and up rows [4+2r, 4+2r+2) of dim 1
    expected = [
        [[((0, 0, 0), (0, 0, 0), (3, 2, 4)), ((0, 4, 0), (0, 2, 0), (3, 2, 4))], None, None],
        [[((0, 2, 0), (0, 0, 0), (3, 2, 4)), ((0, 6, 0), (0, 2, 0), (3, 2, 4))], None, None],
    ]
    assert tp2.run(check_boxes) == expected
