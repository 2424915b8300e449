"""The loader bridge: which blocks of a global tensor a rank holds, and the local shard built from them."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard

from raymoe.parallel.sharding import Block, layout_for, read_local_shard, strided_shard


def chunk_reference(full, placements, mesh_shape, coordinate):
    """The local tensor by definition: torch.chunk per mesh dim, strided = chunk of each of sf pieces."""
    local = full
    for placement, size, coord in zip(placements, mesh_shape, coordinate, strict=True):
        if placement == Replicate():
            continue
        dim, pieces = placement.dim, getattr(placement, "split_factor", 1)

        def part(t, size=size, coord=coord, dim=dim):
            chunks = list(torch.chunk(t, size, dim=dim))
            return chunks[coord] if coord < len(chunks) else t.narrow(dim, 0, 0)

        local = torch.cat([part(piece) for piece in torch.chunk(local, pieces, dim=dim)], dim=dim)
    return local


def read_from(full):
    def read(block: Block):
        return full[block]

    return read


CASES = [
    ((12, 8), [Shard(0)], (2,)),
    ((12, 8), [Shard(1)], (4,)),
    ((12, 8), [Replicate()], (2,)),
    ((12, 8), [strided_shard(0, 2)], (2,)),
    ((4, 12, 8), [strided_shard(1, 2)], (3,)),
    ((4, 8, 12), [strided_shard(-1, 3)], (2,)),
    ((10, 6), [Shard(0)], (4,)),  # uneven: torch.chunk sizes 3, 3, 3, 1
    ((5, 6), [Shard(0)], (4,)),  # uneven with an empty last chunk: 2, 2, 1, 0
    ((16, 8), [Shard(0), Shard(0)], (2, 2)),
    ((16, 8), [strided_shard(0, 2), Shard(0)], (2, 2)),  # FSDP over TP, right-to-left
    ((16, 8), [Shard(1), strided_shard(0, 2)], (2, 2)),  # two dims: a grid of blocks
    ((8, 12), [Shard(0), Replicate()], (2, 3)),
]


@pytest.mark.parametrize(("shape", "placements", "mesh_shape"), CASES)
def test_layout_matches_chunk_definition_on_every_coordinate(shape, placements, mesh_shape):
    full = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        layout = layout_for(shape, placements, mesh_shape, coordinate)
        want = chunk_reference(full, placements, mesh_shape, coordinate)
        got = _read(layout, full)
        assert torch.equal(got, want), (placements, coordinate, layout)
        assert layout.local_shape == tuple(want.shape)


def _read(layout, full):
    from raymoe.parallel.sharding import _concat_grid

    grid = tuple(len(r) for r in layout.ranges)
    return _concat_grid([full[block] for block in layout.blocks()], grid)


def test_strided_blocks_are_one_range_per_packed_piece():
    """gate_up [E, 2I, H] on 2 ranks: rank 1 reads rows I/2..I of gate and of up, nothing else."""
    layout = layout_for((4, 12, 8), [strided_shard(1, 2)], (2,), (1,))
    assert layout.blocks() == [(slice(0, 4), slice(3, 6), slice(0, 8)), (slice(0, 4), slice(9, 12), slice(0, 8))]


def test_partial_is_not_a_slice():
    with pytest.raises(ValueError, match="sum of per-rank parts"):
        layout_for((4,), [Partial()], (2,), (0,))


def test_mismatched_mesh_and_placements():
    with pytest.raises(ValueError, match="one entry per mesh dimension"):
        layout_for((4,), [Shard(0)], (2, 2), (0, 0))


def test_read_checks_block_shapes_and_plain_tensors_are_read_whole():
    full = torch.arange(6.0).reshape(2, 3)
    assert torch.equal(read_local_shard(full, read_from(full)), full)
    with pytest.raises(ValueError, match=r"returned shape \(1, 3\), expected \(2, 3\)"):
        read_local_shard(full, lambda block: full[:1])


# --- every style: reading through the bridge gives exactly shard_param's local tensor -----------


def samples(style_name):
    """(module, parameter name) pairs a style applies to: 2-D embedding weights, else Linear and expert weights."""
    if style_name.startswith("embedding"):
        return [(nn.Embedding(16, 8), "weight")]
    linear = nn.Linear(8, 12)
    experts = nn.Module()
    experts.gate_up_proj = nn.Parameter(torch.randn(4, 12, 8))
    linear.qk_rope_head_dim = experts.qk_rope_head_dim = 2  # for mla_kv_a_proj
    return [(linear, "weight"), (linear, "bias"), (experts, "gate_up_proj")]


def check_every_style_through_the_bridge(rank):
    from torch.distributed.tensor import DTensor

    from raymoe.parallel.sharding import shard_layout, with_local_shard
    from raymoe.parallel.styles import STYLES

    torch.manual_seed(0)
    checked = 0
    for style_name in STYLES:
        style = STYLES.get(style_name)
        for module, name in samples(style_name):
            full = getattr(module, name).detach().clone()
            style.validate_param(module, name, full, rank.world_size)
            sharded = style.shard_param(module, name, nn.Parameter(full.clone()), rank.mesh)
            local = sharded.to_local() if isinstance(sharded, DTensor) else sharded
            got = read_local_shard(sharded, read_from(full))
            assert torch.equal(got, local.detach()), (style_name, name)
            with torch.device("meta"):
                placeholder = style.shard_param(module, name, nn.Parameter(torch.empty_like(full)), rank.mesh)
            assert shard_layout(placeholder) == shard_layout(sharded), (style_name, name)
            loaded = with_local_shard(placeholder, got)
            if isinstance(loaded, DTensor):
                assert torch.equal(loaded.full_tensor(), full), (style_name, name)
            checked += 1
    return checked


def test_every_style_reads_exactly_its_shard(tp2):
    from raymoe.parallel.styles import STYLES

    assert tp2.run(check_every_style_through_the_bridge) == [sum(len(samples(name)) for name in STYLES)] * 2
