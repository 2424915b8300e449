"""The global gradient norm over both meshes (SPEC TRAIN-2) with one all-reduce over the world, whatever mix of
meshes and placements the gradients have (raymoe.parallel.grad_norm)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

LAYOUTS = {
    "tp2-fsdp2-ep2": {"tp_size": 2, "fsdp_size": 2, "ep_size": 2},
    "dp_replicate2-fsdp2-ep2": {"dp_replicate_size": 2, "fsdp_size": 2, "ep_size": 2},
    "pp2-fsdp2": {"pp_size": 2, "fsdp_size": 2},
}


def gradients_on_every_mesh(ctx) -> tuple[list[nn.Parameter], list[torch.Tensor]]:
    """Parameters whose gradients are DTensors on the dense and expert meshes' sub-meshes (sharded, strided,
    replicated) and plain tensors, all cut from full gradients every rank draws alike; and the full gradients of
    this rank's pipeline stage (another stage's are other tensors: the seed depends on the stage)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    from raymoe.spec.topology import Axis

    generator = torch.Generator().manual_seed(10 + ctx.topology.ranks[ctx.rank].pp)
    dense, expert = ctx.dense_mesh, ctx.expert_mesh
    ep = ctx.topology.axis_size(Axis.EP)
    cases = [
        (dense["fsdp"], [Shard(0)], (8, 3)),
        (dense["fsdp", "tp"], [Shard(0), Replicate()], (4, 6)),
        (dense["fsdp", "tp"], [_StridedShard(0, split_factor=2), Shard(0)], (8, 5)),
        (dense["dp_replicate", "fsdp"], [Replicate(), Shard(0)], (4, 2)),
        (expert["efsdp", "ep"], [_StridedShard(0, split_factor=ep) if ep > 1 else Shard(0), Shard(0)], (8, 2)),
        (None, None, (3,)),  # a plain tensor every rank holds whole
    ]
    params, full = [], []
    for mesh, placements, shape in cases:
        grad = torch.randn(shape, generator=generator)
        full.append(grad)
        if mesh is None:
            param, param.grad = nn.Parameter(torch.zeros(shape)), grad.clone()
        else:
            param = nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, placements))
            param.grad = distribute_tensor(grad, mesh, placements, src_data_rank=None)
        params.append(param)
    return params, full


def check_one_all_reduce_gives_the_norm_of_the_full_gradients(rank, layout):
    import torch.distributed as dist

    from raymoe.parallel.grad_norm import grad_norm
    from raymoe.spec.topology import Axis

    ctx = rank.context(**layout)
    params, full = gradients_on_every_mesh(ctx)
    stages = ctx.topology.axis_size(Axis.PP)
    with rank.dispatched_ops() as ops:
        norm = grad_norm(params, ctx.topology.world_size // stages)
    assert rank.collectives(ops) == ["c10d::allreduce_"], rank.collectives(ops)
    # every stage's full gradients, drawn here as each stage drew its own
    squares = torch.zeros((), dtype=torch.float64)
    for stage in range(stages):
        generator = torch.Generator().manual_seed(10 + stage)
        for tensor in full:
            squares += torch.randn(tensor.shape, generator=generator).double().pow(2).sum()
    assert norm.item() == pytest.approx(squares.sqrt().item(), rel=1e-6)
    assert dist.get_world_size() == 4


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_one_all_reduce_gives_the_norm_of_the_full_gradients(world4, layout):
    world4.run(check_one_all_reduce_gives_the_norm_of_the_full_gradients, LAYOUTS[layout])
