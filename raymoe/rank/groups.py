"""Process groups by their member ranks, made once per world and shared by every layout's meshes.

A world outlives the models loaded on it, and each load may regroup it (:meth:`RankContext.use_layout`). Left to
``DeviceMesh``, every new layout would make a process group per mesh dimension, and keep it for the life of the world:
a gloo group holds two threads that wake every few milliseconds, an NCCL group a communicator. Yet the rank sets of
those groups repeat from layout to layout (on 4 ranks: the 4 singletons, a few pairs, the whole world), so
:class:`GroupPool` makes one group per distinct rank set and every mesh dimension over that set reuses it::

    layout A  dense (dp_replicate=1, pp=1, fsdp=2, cp=1, tp=2)   fsdp {0,2} {1,3}   tp {0,1} {2,3}
    layout B  dense (dp_replicate=1, pp=1, fsdp=2, cp=2, tp=1)   fsdp {0,2} {1,3}   cp {0,1} {2,3}
                                                                 ^ the same groups as A's fsdp and tp

The rank set of the whole world is the default group (``join_world`` made it, with the same timeout), never a second
group over the same ranks: on gloo each group is a transport loop waking 100 times a second, on NCCL a communicator.

A group is described by its ranks (``ranks_0_2``; the default group by torch's ``default_pg``); a rank's progress
report names it by the current layout's axes (:func:`axis_descs`). Groups are never destroyed while the world lives:
torch caches meshes by value (ranks, shape, names; not their groups) in DTensor's sharding propagation, so a mesh of
an earlier layout may be handed back for an equal one of a later layout, and its groups must still work.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch import Tensor

from raymoe.rank.contract import MESH_PREFIX, WORLD_GROUP_DESC, WorldBackend, rank_set_desc
from raymoe.spec.topology import Axis, Topology


@dataclass
class GroupPool:
    """This rank's process groups by member ranks; ``groups_of`` is collective (every rank calls it, same order)."""

    rank: int
    backend: WorldBackend
    # a fresh options object of the backend carrying the groups' timeout: torch keeps a reference in each group
    new_options: Callable[[], Any]
    _groups: dict[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict, repr=False)

    def __len__(self) -> int:
        return len(self._groups)

    def groups_of(self, ranks_grid: Tensor) -> list[dist.ProcessGroup]:
        """This rank's group along each dimension of ``ranks_grid`` (global ranks, one per mesh position), making
        the rank sets not seen before: all ranks walk every dimension's groups in the same order."""
        return [self._group_along(ranks_grid, dim) for dim in range(ranks_grid.ndim)]

    def _group_along(self, ranks_grid: Tensor, dim: int) -> dist.ProcessGroup:
        rows = ranks_grid.movedim(dim, -1).reshape(-1, ranks_grid.size(dim))
        mine = None
        for row in rows.tolist():
            members = tuple(sorted(row))
            group = self._group_of(members)
            if self.rank in members:
                mine = group
        if mine is None:
            raise ValueError(f"rank {self.rank} is not in the mesh {ranks_grid.tolist()}")
        return mine

    def _group_of(self, members: tuple[int, ...]) -> dist.ProcessGroup:
        """The group over ``members``: the default group where they are the whole world, else the pooled one."""
        world = dist.group.WORLD
        if world is not None and len(members) == world.size():
            return world
        if members not in self._groups:
            self._groups[members] = self._new_group(members)
        return self._groups[members]

    def _new_group(self, members: tuple[int, ...]) -> dist.ProcessGroup:
        options = self.new_options()
        group = dist.new_group(
            list(members),
            timeout=options._timeout,
            backend=self.backend,
            pg_options=options,
            group_desc=rank_set_desc(members),
        )
        return group  # type: ignore[no-any-return]


def axis_descs(topology: Topology, rank: int) -> dict[str, str]:
    """For ``rank``'s progress reports: each of its groups' rank-set description -> the axes of ``topology`` over
    those ranks (``ranks_0_1`` -> ``mesh_tp``, or ``mesh_tp/ep`` where both axes group the same ranks), so the
    driver's hang diagnosis names the sub-mesh and finds its members by axis."""
    axes: dict[str, list[str]] = {}
    for axis in Axis:
        members = topology.group_of(rank, axis)
        desc = WORLD_GROUP_DESC if len(members) == topology.world_size else rank_set_desc(members)
        axes.setdefault(desc, []).append(axis.value)
    return {desc: MESH_PREFIX + "/".join(names) for desc, names in axes.items()}
