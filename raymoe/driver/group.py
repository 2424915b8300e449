"""What the driver needs from a group of rank processes, and the one way it reads their answers.

The handle and the Trainer are written against :class:`RankGroup`; ``actors/`` implements it on
Ray (``actors.group.RayRankGroup``). A group is a *world*: N processes in one process group.
It outlives the models loaded on it: ``use_layout`` regroups the same ranks for the next model.

    execute(fn, *args)              fn(ctx, *args) on every rank; results in rank order
    execute_per_rank(fn, args_of)   rank r runs fn(ctx, *args_of[r]) (e.g. its rows of the batch)
    use_layout(topology)            every rank builds (or reuses) that layout's meshes
    check_shared(needs)             every node hosting ranks sees these local paths as the driver does
                                    (raymoe.spec.shared_paths), else one ValueError
    replacement()                   a new group like this one (same size and placement rules, same layout),
                                    for ranks a failure ended
    shutdown()                      end the ranks; idempotent

Any rank's failure raises one driver-side error naming the rank(s) where it began and ends the group.
Implementations: ``actors.group.RayRankGroup`` (one Ray actor per rank) and
:class:`raymoe.rank.local.LocalRankGroup` (one rank in the calling process, no Ray).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, TypeVar

from raymoe.spec.shared_paths import SharedPath
from raymoe.spec.topology import Topology

T = TypeVar("T")


class RankGroup(Protocol):
    """A world of rank processes the driver fans rank functions out to."""

    @property
    def world_size(self) -> int: ...

    @property
    def is_alive(self) -> bool: ...

    def use_layout(self, topology: Topology) -> None: ...

    def check_shared(self, needs: Sequence[SharedPath]) -> None: ...

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]: ...

    def execute_per_rank(
        self,
        fn: Callable[..., Any],
        args_of_rank: Sequence[tuple[Any, ...]],
        kwargs: dict[str, Any] | None = None,
        objects_of_rank: Sequence[Sequence[Any]] | None = None,
    ) -> list[Any]:
        """``fn(ctx, *args_of_rank[r], *objects, **kwargs)`` on each rank ``r``: ``objects_of_rank[r]`` are references
        into Ray's object store, read on the rank's node (their values follow the arguments)."""
        ...

    def replacement(self) -> RankGroup: ...

    def shutdown(self) -> None: ...


def one_per_batch(results: Sequence[T | None], topology: Topology) -> list[T]:
    """The answer of each distinct batch, in batch order: every rank of a tp group holds the same rows
    (TOPO-1) and only its first rank, of the last pipeline stage, answers (the others return None, see
    ``RankContext.answers_for_batch``)."""
    answers = []
    for batch, rank in enumerate(topology.answer_ranks()):
        answer = results[rank]
        if answer is None:
            raise RuntimeError(f"rank {rank}, which answers for batch {batch}, returned no answer for it")
        answers.append(answer)
    return answers
