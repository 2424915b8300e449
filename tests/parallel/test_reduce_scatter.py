"""FSDP2's gradient reduce-scatter on gloo as one all-to-all and a local sum (raymoe.parallel.reduce_scatter): the
sum of every rank's chunk, over the whole world and over a sub-mesh's group, and FSDP2's gradients through it equal to
the gradients of one process that saw every rank's batch."""

from __future__ import annotations

import pytest
import torch
from torch import nn

# (layout, the mesh dimension the reduce-scatter runs over): all four ranks, and groups of two inside the world
GROUPS = {"fsdp4": ({"fsdp_size": 4}, "fsdp"), "tp2-fsdp2": ({"tp_size": 2, "fsdp_size": 2}, "fsdp")}


def per_rank_input(rank: int, numel: int) -> torch.Tensor:
    """Rank ``rank``'s buffer: small integers, so every order of adding them gives the same float32 sum."""
    return torch.randint(-50, 50, (numel,), generator=torch.Generator().manual_seed(rank)).float()


def check_each_rank_gets_the_sum_of_its_chunk(rank, layout, dim):
    import torch.distributed as dist

    from raymoe.parallel.reduce_scatter import AllToAllReduceScatter

    mesh = rank.context(**layout).dense_mesh[dim]
    group, members = mesh.get_group(), mesh.mesh.flatten().tolist()
    n, chunk = len(members), 5
    output = torch.full((chunk,), float("nan"))
    with rank.dispatched_ops() as ops:
        assert (
            AllToAllReduceScatter()(output, per_rank_input(dist.get_rank(), n * chunk), group, dist.ReduceOp.SUM)
            is None
        )
    assert rank.collectives(ops) == ["c10d::alltoall_base_"], rank.collectives(ops)
    position = members.index(dist.get_rank())
    expected = sum(per_rank_input(member, n * chunk).view(n, chunk)[position] for member in members)
    assert torch.equal(output, expected), (output, expected)


@pytest.mark.parametrize("layout", list(GROUPS))
def test_each_rank_gets_the_sum_of_its_chunk(world4, layout):
    world4.run(check_each_rank_gets_the_sum_of_its_chunk, *GROUPS[layout])


def check_other_reductions_are_refused(rank):
    import torch.distributed as dist

    from raymoe.parallel.reduce_scatter import AllToAllReduceScatter

    group = rank.context(fsdp_size=4).dense_mesh["fsdp"].get_group()
    with pytest.raises(ValueError, match="sums gradients only"):
        AllToAllReduceScatter()(torch.empty(2), torch.zeros(8), group, dist.ReduceOp.AVG)


def test_other_reductions_are_refused(world4):
    world4.run(check_other_reductions_are_refused)


def twin_models() -> tuple[nn.Module, nn.Module]:
    """Two copies of one small model; 6 output rows do not divide over 4 ranks (FSDP2 pads that unit's buffer)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))
    twin = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 6))
    twin.load_state_dict(model.state_dict())
    return model, twin


def check_fsdp2_gradients_through_the_all_to_all(rank, layout, dim):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from raymoe.parallel.reduce_scatter import AllToAllReduceScatter

    mesh = rank.context(**layout).dense_mesh[dim]
    members = mesh.mesh.flatten().tolist()
    sharded, whole = twin_models()
    for module in (sharded[0], sharded[2], sharded):
        fully_shard(module, mesh=mesh)
        module.set_gradient_divide_factor(1.0)  # summed over ranks, as raymoe's units are
        module.set_force_sum_reduction_for_comms(True)
        module.set_custom_reduce_scatter(AllToAllReduceScatter())

    def batch(member: int) -> torch.Tensor:
        return torch.randn(3, 8, generator=torch.Generator().manual_seed(100 + member))

    with rank.dispatched_ops() as ops:
        sharded(batch(dist.get_rank())).square().sum().backward()
    collectives = rank.collectives(ops)
    assert "c10d::alltoall_base_" in collectives and "c10d::_reduce_scatter_base_" not in collectives, collectives
    for member in members:  # one process over every member's batch
        whole(batch(member)).square().sum().backward()
    for (name, param), expected in zip(sharded.named_parameters(), whole.parameters(), strict=True):
        got = param.grad.full_tensor()
        torch.testing.assert_close(got, expected.grad, rtol=1e-6, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("layout", list(GROUPS))
def test_fsdp2_gradients_through_the_all_to_all(world4, layout):
    world4.run(check_fsdp2_gradients_through_the_all_to_all, *GROUPS[layout])
