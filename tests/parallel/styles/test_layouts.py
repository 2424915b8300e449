"""redistribute_local: the plain-collective path (no gradient flows) agrees with the DTensor path, and gradients."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from raymoe.parallel.sharding import strided_shard

# (src, dst) layout changes, each on a [4, 6, 8] local tensor per rank
CHANGES = [
    (Partial(), Replicate()),
    (Shard(-1), Replicate()),
    (Shard(0), Replicate()),
    (Replicate(), Shard(-1)),
    (Replicate(), Shard(1)),
    (Replicate(), Replicate()),
    (Partial(), Shard(0)),  # no plain path: falls back to DTensor
    (strided_shard(-1, 2), Replicate()),  # no plain path: falls back to DTensor
]


def reference(x, mesh, src, dst):
    out = DTensor.from_local(x, mesh, [src], run_check=False).redistribute(placements=[dst]).to_local()
    return out.detach()


def check_plain_path_matches_dtensor(rank):
    from raymoe.parallel.styles.layouts import redistribute_local

    x = torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(rank.rank))  # differs per rank
    for src, dst in CHANGES:
        want = reference(x, rank.mesh, src, dst)
        with torch.no_grad():
            got = redistribute_local(x.clone().requires_grad_(), rank.mesh, src, dst)
        assert got.shape == want.shape and torch.equal(got, want), (src, dst)
        got = redistribute_local(x, rank.mesh, src, dst)  # x needs no gradient: plain path too
        assert torch.equal(got, want), (src, dst)


def check_all_reduce_pair_gradients(rank):
    """all_reduce_forward: sum forward, identity backward; all_reduce_backward: identity forward, sum backward."""
    from raymoe.parallel.styles.layouts import all_reduce_backward, all_reduce_forward

    x = torch.full((3,), float(rank.rank + 1), requires_grad=True)
    total = rank.world_size * (rank.world_size + 1) / 2
    y = all_reduce_forward(x, rank.mesh)
    assert torch.equal(y.detach(), torch.full((3,), total))
    (y * (rank.rank + 1)).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), float(rank.rank + 1)))

    x = torch.ones(3, requires_grad=True)
    y = all_reduce_backward(x, rank.mesh)
    assert torch.equal(y.detach(), x.detach())
    (y * (rank.rank + 1)).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), total))


def check_input_is_not_modified(rank):
    from raymoe.parallel.styles.layouts import all_reduce_forward

    x = torch.ones(3)
    with torch.no_grad():
        all_reduce_forward(x, rank.mesh)
    assert torch.equal(x, torch.ones(3))


def test_plain_path_matches_dtensor(tp2):
    tp2.run(check_plain_path_matches_dtensor)


def test_all_reduce_pair_gradients(tp2):
    tp2.run(check_all_reduce_pair_gradients)


def test_plain_all_reduce_is_out_of_place(tp2):
    tp2.run(check_input_is_not_modified)
