"""Ranks of a world of any size simulated in this process, one at a time, on torch's "fake" backend: what
``raymoe.plan`` runs its rank function on, with no cluster and no weights.

    FakeWorlds().run(world_size=8, ranks=[0, 4], fn, *args)
        for each rank r:  init_process_group("fake", rank=r, world_size=8)  (groups whose collectives do nothing)
                          fn(RankContext(r, 8, cpu, "fake"), *args)           (meshes and DTensors build as on a real
                                                                               rank; tensors on meta stay shapes)
                          destroy_process_group()

One default process group per process: a process that has a world of its own (a ``LocalRankGroup``, a script's
``init_process_group``) cannot simulate another; ``raymoe plan`` on the command line always can.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from raymoe.rank.context import RankContext

T = TypeVar("T")


class FakeWorlds:
    """Runs rank functions on simulated ranks (module doc); stateless."""

    def run(self, world_size: int, ranks: Sequence[int], fn: Callable[..., T], *args: Any) -> list[T]:
        """``[fn(ctx_r, *args) for r in ranks]``, each on rank ``r`` of a fake world of ``world_size``."""
        results = []
        for rank in ranks:
            with fake_world(rank, world_size) as ctx:
                results.append(fn(ctx, *args))
        return results


@contextmanager
def fake_world(rank: int, world_size: int) -> Iterator[RankContext]:
    """This process as ``rank`` of a fake world of ``world_size`` (module doc); the world is left on exit."""
    if dist.is_initialized():
        raise RuntimeError(
            "planning needs a process without a torch.distributed world (it simulates worlds of the layout's size); "
            "this one has one (a LocalRankGroup, or init_process_group): plan before it, or run `raymoe plan`"
        )
    dist.init_process_group("fake", rank=rank, world_size=world_size)
    try:
        yield RankContext(rank, world_size, torch.device("cpu"), "fake")
    finally:
        dist.destroy_process_group()
