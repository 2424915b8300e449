"""The Ray implementation of the driver's rank group: create, fan out, gather, fail as one, shut down
(SPEC RAY-1…RAY-3; the protocol is :class:`raymoe.driver.group.RankGroup`).

    create(world_size)  preflight -> placement group -> one actor per rank -> rendezvous -> process group
    use_layout(topo)                every rank builds (or reuses) that layout's meshes
    execute(fn, *args)              the same call on every rank, results in rank order
    execute_per_rank(fn, args_of)   rank r gets args_of[r] (e.g. its slice of the batch)
    shutdown()                      kill actors, remove the placement group; idempotent

Any rank's exception, or a rank actor dying, ends the call at once with one
:class:`RankError` naming the rank, its coordinates, the function and the remote traceback;
the group is then shut down, since the surviving ranks may be stuck in a collective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from actors.cluster import track_world
from actors.placement import Placement, PlacementRequest, check_fits, cluster_nodes, node_block, place
from actors.rank import RankActor, RankFailure
from raymoe.rank.context import Backend, Rendezvous, use_layout
from raymoe.spec.topology import Topology

logger = logging.getLogger(__name__)


class RankError(RuntimeError):
    """A rank failed; ``rank``, ``function`` and ``remote_traceback`` say where and how."""

    def __init__(self, message: str, rank: int, function: str, remote_traceback: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.function = function
        self.remote_traceback = remote_traceback


@dataclass(frozen=True)
class GroupOptions:
    """How ranks are placed and how long the runtime waits before calling something stuck."""

    use_gpu: bool = False
    cpus_per_rank: float = 1.0
    backend: Backend | None = None
    placement_timeout_s: float = 120.0
    collective_timeout_s: float = 1800.0


class RayRankGroup:
    """One Ray actor per rank of a world; see the module docstring for the life cycle."""

    def __init__(self, world_size: int, placement: Placement, actors: list[Any]) -> None:
        self._world_size = world_size
        self.topology: Topology | None = None  # the layout in use, for naming ranks in errors
        self._placement: Placement | None = placement
        self._actors = actors

    @classmethod
    def create(cls, world_size: int, options: GroupOptions, *, block: int = 1) -> RayRankGroup:
        """Place and start ``world_size`` ranks, ``block`` consecutive ones per node, and join them into
        one process group."""
        request = PlacementRequest(world_size, options.use_gpu, options.cpus_per_rank, block)
        check_fits(request, cluster_nodes())
        placement = place(request, options.placement_timeout_s)
        actor_class = ray.remote(RankActor)
        actors = [
            actor_class.options(
                num_cpus=options.cpus_per_rank,
                num_gpus=1 if options.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(placement.group, bundle),
            ).remote()
            for bundle in placement.bundle_of_rank
        ]
        group = cls(world_size, placement, actors)
        track_world(group)
        try:
            group._join(options)
        except BaseException:
            group.shutdown()
            raise
        return group

    @classmethod
    def for_topology(cls, topology: Topology, options: GroupOptions) -> RayRankGroup:
        """A world sized and placed for ``topology`` (its tp / ep groups on one node), already in that layout."""
        group = cls.create(topology.world_size, options, block=node_block(topology))
        group.use_layout(topology)
        return group

    @property
    def world_size(self) -> int:
        return self._world_size

    def use_layout(self, topology: Topology) -> None:
        """Regroup the ranks as ``topology``: its tp / ep groups must not cross nodes."""
        if topology.world_size != self._world_size:
            raise ValueError(
                f"the layout needs {topology.world_size} ranks, this world has {self._world_size}; start a world of "
                f"{topology.world_size} ranks (or choose sizes whose product is {self._world_size})"
            )
        placement = self._live_placement()
        placement.check_blocks(node_block(topology))
        self.execute(use_layout, topology)
        self.topology = topology

    def _join(self, options: GroupOptions) -> None:
        address, port = self._gather("rendezvous_address", [self._actors[0].rendezvous_address.remote()], [0])[0]
        placement = self._live_placement()
        meeting = [
            Rendezvous(
                rank=rank,
                local_rank=placement.local_rank(rank),
                world_size=self._world_size,
                master_addr=address,
                master_port=port,
                backend=options.backend,
                collective_timeout_s=options.collective_timeout_s,
            )
            for rank in range(self._world_size)
        ]
        self._gather("setup", [actor.setup.remote(r) for actor, r in zip(self._actors, meeting, strict=True)])

    # --- fan-out ---------------------------------------------------------------------------------

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``fn(ctx, *args, **kwargs)`` on every rank; results in rank order."""
        return self.execute_per_rank(fn, [args] * self._world_size, kwargs)

    def execute_per_rank(
        self, fn: Callable[..., Any], args_of_rank: Sequence[tuple[Any, ...]], kwargs: dict[str, Any] | None = None
    ) -> list[Any]:
        """``fn(ctx, *args_of_rank[r], **kwargs)`` on each rank r; results in rank order."""
        actors = self._live_actors()
        if len(args_of_rank) != len(actors):
            raise ValueError(f"execute_per_rank needs {len(actors)} argument tuples, got {len(args_of_rank)}")
        refs = [
            actor.run.remote(fn, tuple(args), kwargs or {}) for actor, args in zip(actors, args_of_rank, strict=True)
        ]
        return self._gather(getattr(fn, "__qualname__", repr(fn)), refs)

    def _live_actors(self) -> list[Any]:
        self._live_placement()
        return self._actors

    def _live_placement(self) -> Placement:
        if self._placement is None:
            raise RuntimeError("this rank group was shut down; load the model again to get a new one")
        return self._placement

    def _gather(self, function: str, refs: list[Any], ranks: Sequence[int] | None = None) -> list[Any]:
        """Results in order; the first failure (exception or dead actor) shuts the group down and raises."""
        ranks = list(ranks) if ranks is not None else list(range(len(refs)))
        rank_of_ref = {ref: rank for ref, rank in zip(refs, ranks, strict=True)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            rank = rank_of_ref[ready[0]]
            try:
                value = ray.get(ready[0])
            except ray.exceptions.RayError as exc:
                self._fail(rank, function, type(exc).__name__, _first_line(exc), str(exc))
            if isinstance(value, RankFailure):
                self._fail(rank, function, value.error_type, value.message, value.traceback)
            results[rank] = value
        return [results[rank] for rank in ranks]

    def _fail(self, rank: int, function: str, error_type: str, message: str, remote_traceback: str) -> NoReturn:
        label = self.topology.ranks[rank].label() if self.topology is not None else f"rank {rank}"
        logger.error("%s failed in %s: %s: %s", label, function, error_type, message)
        self.shutdown()
        raise RankError(
            f"{label} failed in {function}: {error_type}: {message}\n"
            f"--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}",
            rank=rank,
            function=function,
            remote_traceback=remote_traceback,
        )

    # --- life cycle -----------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._placement is not None

    def __enter__(self) -> RayRankGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "running" if self.is_alive else "shut down"
        return f"RayRankGroup(world_size={self._world_size}, {state})"

    def shutdown(self) -> None:
        """Kill every rank actor and free the placement group. Safe to call any number of times."""
        placement, self._placement = self._placement, None
        if placement is None:
            return
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # an already-dead actor or a Ray that is shutting down
                logger.debug("ignoring error while killing a rank actor: %s", exc)
        self._actors = []
        try:
            placement.remove()
        except Exception as exc:  # Ray already shut down (e.g. at interpreter exit)
            logger.debug("ignoring error while removing the placement group: %s", exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
