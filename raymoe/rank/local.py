"""A world of one rank in the calling process: the driver's ``RankGroup`` without Ray, processes or pickling.

For what needs no second process: the handle's and the Trainer's own logic (batch splitting, micro-batches,
resume, failure policy, run directory, metrics) in ``make test-fast``, and a rank function stepped through in a
debugger. The rank is real: a ``torch.distributed`` world of 1 (gloo on CPU, NCCL on a GPU), the same
:class:`~raymoe.rank.context.RankContext` and rank functions a Ray rank actor runs::

    with LocalRankGroup() as world:
        model = raymoe.from_pretrained(checkpoint, world=world)   # borrowed: shutdown unloads, the world stays

As in a Ray group, a rank function's exception ends the group (:class:`LocalRankError`); ``replacement()``
starts a new world in this process. One world at a time per process (``torch.distributed`` has one default
group); the environment variables it sets (``RANK``, ``MASTER_ADDR``, ...) are restored at ``shutdown``.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch.distributed as dist

from raymoe.rank.context import RankContext, host_world_store, join_world, leave_world, use_layout
from raymoe.rank.contract import DEFAULT_COLLECTIVE_TIMEOUT_S, Backend, Rendezvous
from raymoe.rank.failure import rank_failure
from raymoe.spec.shared_paths import SharedPath
from raymoe.spec.topology import Topology

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class LocalRankError(RuntimeError):
    """The in-process rank failed; ``rank`` (0), ``function`` and ``remote_traceback`` as a Ray ``RankError`` has,
    ``primary`` the rank where it began."""

    def __init__(self, message: str, function: str, traceback: str) -> None:
        super().__init__(message)
        self.rank, self.function, self.remote_traceback = 0, function, traceback
        self.primary: tuple[int, ...] = (0,)


class LocalRankGroup:
    """Rank 0 of a world of one, in this process; see the module docstring."""

    def __init__(
        self, *, backend: Backend | None = None, collective_timeout_s: float = DEFAULT_COLLECTIVE_TIMEOUT_S
    ) -> None:
        if dist.is_initialized():
            raise RuntimeError(
                "LocalRankGroup: this process already has a torch.distributed world; shut the other one down first"
            )
        self._backend, self._timeout_s = backend, collective_timeout_s
        self._saved_env = {name: os.environ.get(name) for name in _ENV}
        self.topology: Topology | None = None
        store = host_world_store("127.0.0.1", 1)
        self._ctx: RankContext | None = join_world(
            Rendezvous(0, 0, 1, "127.0.0.1", store.port, backend, collective_timeout_s), store
        )

    @property
    def world_size(self) -> int:
        return 1

    @property
    def is_alive(self) -> bool:
        return self._ctx is not None

    def use_layout(self, topology: Topology) -> None:
        if topology.world_size != 1:
            raise ValueError(f"the layout needs {topology.world_size} ranks; a LocalRankGroup has one")
        self.execute(use_layout, topology)
        self.topology = topology

    def check_shared(self, needs: Sequence[SharedPath]) -> None:
        """Nothing to ask: the one rank runs in the driver's process, so it sees what the driver sees."""

    def execute(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Any]:
        """``[fn(ctx, *args, **kwargs)]``; an exception ends the world and raises :class:`LocalRankError`."""
        if self._ctx is None:
            raise RuntimeError("this rank group was shut down; load the model again to get a new one")
        try:
            return [fn(self._ctx, *args, **kwargs)]
        except Exception as error:
            failure = rank_failure(error)
            name = getattr(fn, "__qualname__", repr(fn))
            self.shutdown()
            raise LocalRankError(
                f"rank 0 failed in {name}: {failure.error_type}: {failure.message}", name, failure.traceback
            ) from error

    def execute_per_rank(
        self,
        fn: Callable[..., Any],
        args_of_rank: Sequence[tuple[Any, ...]],
        kwargs: dict[str, Any] | None = None,
        objects_of_rank: Sequence[Sequence[Any]] | None = None,
    ) -> list[Any]:
        if objects_of_rank is not None:
            raise ValueError(
                "rows in Ray's object store (load_dataset(engine='ray'), from_ray_dataset) need ranks on Ray; this "
                "world of one runs in the calling process: load the data with engine='driver'"
            )
        if len(args_of_rank) != 1:
            raise ValueError(f"execute_per_rank needs 1 argument tuple, got {len(args_of_rank)}")
        return self.execute(fn, *args_of_rank[0], **(kwargs or {}))

    def replacement(self) -> LocalRankGroup:
        """A new world of one in this process (this one must be shut down), in this world's layout."""
        self.shutdown()
        group = LocalRankGroup(backend=self._backend, collective_timeout_s=self._timeout_s)
        if self.topology is not None:
            group.use_layout(self.topology)
        return group

    def shutdown(self) -> None:
        """Leave the world (its process groups end); safe to call more than once."""
        if self._ctx is None:
            return
        self._ctx = None
        leave_world()
        for name, value in self._saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value

    def __enter__(self) -> LocalRankGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        return f"LocalRankGroup({'running' if self.is_alive else 'shut down'})"
