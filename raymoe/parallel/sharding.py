"""Which part of a global tensor a rank holds: the bridge from DTensor placeholders to checkpoint reads.

A style's ``shard_param`` turns a parameter into a DTensor (on the meta device before loading)
whose placements say which slice of the global tensor this rank needs. The sharded loader asks
:func:`shard_layout` for that slice as per-dimension index ranges, reads each block with
``safetensors`` ``get_slice`` and lets :func:`read_local_shard` concatenate them, so no rank
reads bytes it does not keep.

Placements are applied left to right over the mesh dimensions (the DTensor convention); on
each one the rank keeps a part of what the earlier ones left it:

    Replicate()               the whole of it
    Shard(d)                  chunk ``coord`` of ``n`` along d (``torch.chunk`` sizes)
    _StridedShard(d, sf)      chunk ``coord`` of ``n`` inside each of ``sf`` equal pieces along d
    Partial()                 refused: a sum of per-rank parts is not a slice of a checkpoint

A packed weight (``gate_up_proj`` = [gate; up] along d) under ``_StridedShard(d, sf=2)`` on a
tp mesh of 2, so ``chunk(2)`` of every local shard is still (gate part, up part)::

    global dim d   | g0 g1 | g2 g3 | u0 u1 | u2 u3 |
    rank 0         | g0 g1 |               u0 u1 |         two ranges of d, concatenated
    rank 1                 | g2 g3 |               u2 u3 |
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor, Partial, Placement, Shard

# Private torch API, used only here and re-exported through `strided_shard`/`is_strided_shard`:
# DTensor has no public placement for an interleaved split, and _StridedShard is the one its own
# redistribute, full_tensor and FSDP2 understand, so a packed weight stays a regular DTensor.
from torch.distributed.tensor.placement_types import _StridedShard

Block = tuple[slice, ...]
"""One box of the global tensor: a ``slice`` per dimension, as ``get_slice(name)[block]`` takes it."""


def strided_shard(dim: int, split_factor: int) -> Placement:
    """The interleaved split of packed weights: ``split_factor`` equal pieces along ``dim``, each one sharded."""
    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement: Placement) -> bool:
    return isinstance(placement, _StridedShard)


def shard_dim(placement: Placement, ndim: int) -> int | None:
    """The tensor dimension ``placement`` splits (non-negative), or None for Replicate/Partial."""
    if isinstance(placement, Shard | _StridedShard):
        return placement.dim % ndim
    return None


def num_pieces(placement: Placement) -> int:
    """How many equal pieces a strided placement cuts its dimension into before sharding each (1 for Shard)."""
    return int(placement.split_factor) if isinstance(placement, _StridedShard) else 1


@dataclass(frozen=True)
class ShardLayout:
    """The part of a global tensor of ``global_shape`` one rank holds.

    ``ranges[d]`` lists the index ranges of dimension ``d`` the rank holds, in the order its
    local tensor concatenates them; the local tensor is every combination of them (a grid).
    """

    global_shape: tuple[int, ...]
    ranges: tuple[tuple[range, ...], ...]

    @property
    def local_shape(self) -> tuple[int, ...]:
        return tuple(sum(len(r) for r in dim_ranges) for dim_ranges in self.ranges)

    def blocks(self) -> list[Block]:
        """Every box to read, row-major over the grid (the last dimension varies fastest)."""
        per_dim = [[slice(r.start, r.stop) for r in dim_ranges] for dim_ranges in self.ranges]
        return [tuple(block) for block in itertools.product(*per_dim)]


def shard_layout(tensor: Tensor) -> ShardLayout:
    """Which part of the global tensor this rank holds for ``tensor``: a DTensor (placeholder or not) or a plain one.

    A plain tensor is held whole. A DTensor is split by its placements at this rank's mesh coordinate.
    """
    if not isinstance(tensor, DTensor):
        shape = tuple(tensor.shape)
        return ShardLayout(shape, tuple((range(n),) for n in shape))
    mesh = tensor.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"this rank is not part of the DTensor's mesh {mesh}; it holds no shard")
    return layout_for(tuple(tensor.shape), tensor.placements, tuple(mesh.shape), tuple(coordinate))


def layout_for(
    global_shape: Sequence[int],
    placements: Sequence[Placement],
    mesh_shape: Sequence[int],
    coordinate: Sequence[int],
) -> ShardLayout:
    """The part of a ``global_shape`` tensor at ``coordinate`` of a ``mesh_shape`` mesh under ``placements``."""
    if not len(placements) == len(mesh_shape) == len(coordinate):
        raise ValueError(
            f"placements {tuple(placements)}, mesh shape {tuple(mesh_shape)} and coordinate {tuple(coordinate)} "
            "must have one entry per mesh dimension"
        )
    shape = tuple(int(n) for n in global_shape)
    ranges: list[list[range]] = [[range(n)] for n in shape]
    for placement, size, coord in zip(placements, mesh_shape, coordinate, strict=True):
        if isinstance(placement, Partial):
            raise ValueError(f"a {placement} tensor is a sum of per-rank parts, not a slice of the global tensor")
        dim = shard_dim(placement, len(shape))
        if dim is None:
            continue
        ranges[dim] = _keep_chunk(ranges[dim], num_pieces(placement), size, coord)
    return ShardLayout(shape, tuple(tuple(r) for r in ranges))


def read_local_shard(tensor: Tensor, read: Callable[[Block], Tensor]) -> Tensor:
    """This rank's local tensor for ``tensor``, built from ``read(block)`` of each block of the global tensor.

    ``read`` returns the global tensor's values in ``block`` (e.g. ``safe_open(...).get_slice(name)[block]``);
    the blocks are concatenated in the order :class:`ShardLayout` gives.
    """
    layout = shard_layout(tensor)
    grid_shape = tuple(len(dim_ranges) for dim_ranges in layout.ranges)
    parts = [read(block) for block in layout.blocks()]
    for block, part in zip(layout.blocks(), parts, strict=True):
        expected = tuple(s.stop - s.start for s in block)
        if tuple(part.shape) != expected:
            raise ValueError(f"read({block}) returned shape {tuple(part.shape)}, expected {expected}")
    return _concat_grid(parts, grid_shape)


def local_tensor(tensor: Tensor) -> Tensor:
    """This rank's local tensor of ``tensor`` (a DTensor's local part; a plain tensor is its own)."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def with_local_shard(placeholder: Tensor, local: Tensor) -> Tensor:
    """``local`` (what :func:`read_local_shard` built) as a tensor laid out like ``placeholder``."""
    if not isinstance(placeholder, DTensor):
        return local
    return DTensor.from_local(
        local,
        placeholder.device_mesh,
        placeholder.placements,
        run_check=False,
        shape=placeholder.shape,
        stride=placeholder.stride(),
    )


def _keep_chunk(ranges: list[range], pieces: int, parts: int, index: int) -> list[range]:
    """Cut the indices ``ranges`` hold (in order) into ``pieces``; keep chunk ``index`` of ``parts`` of each piece."""
    length = sum(len(r) for r in ranges)
    kept: list[range] = []
    for piece_start, piece_stop in (chunk_bounds(length, pieces, p) for p in range(pieces)):
        start, stop = chunk_bounds(piece_stop - piece_start, parts, index)
        kept += _positions(ranges, piece_start + start, piece_start + stop)
    return kept or [range(0)]  # an empty chunk still reads as one empty block, so it keeps its dtype


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """Bounds of chunk ``index`` of ``torch.chunk(length items, parts)``; the last chunks may be empty."""
    size = math.ceil(length / parts)
    start = min(index * size, length)
    return start, min(start + size, length)


def _positions(ranges: list[range], start: int, stop: int) -> list[range]:
    """The global index ranges behind positions [start, stop) of the sequence ``ranges`` concatenates."""
    out, offset = [], 0
    for r in ranges:
        lo, hi = max(start - offset, 0), min(stop - offset, len(r))
        if lo < hi:
            out.append(range(r.start + lo, r.start + hi))
        offset += len(r)
    return _merge_adjacent(out)


def _merge_adjacent(ranges: list[range]) -> list[range]:
    merged: list[range] = []
    for r in ranges:
        if merged and merged[-1].stop == r.start:
            merged[-1] = range(merged[-1].start, r.stop)
        else:
            merged.append(r)
    return merged


def _concat_grid(parts: list[Tensor], grid_shape: tuple[int, ...]) -> Tensor:
    """Concatenate a row-major grid of blocks along every dimension, innermost (last) first."""
    for dim in reversed(range(len(grid_shape))):
        per_cell = grid_shape[dim]
        parts = [torch.cat(parts[i : i + per_cell], dim=dim) for i in range(0, len(parts), per_cell)]
    (whole,) = parts
    return whole
