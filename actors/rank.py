"""The rank actor: one process per rank, a thin Ray shell around :mod:`raymoe.rank.context`.

The driver never calls arbitrary methods on it: it sends a function and its arguments to
``run``; the function receives this rank's :class:`~raymoe.rank.context.RankContext` first. A
failure comes back as a :class:`~raymoe.rank.contract.RankFailure` value carrying the remote
traceback, whether the rank's own code failed or a collective lost its peer
(:mod:`raymoe.rank.failure`), and where the rank stood in its collectives, so the driver can
name the rank that failed first and stop the others without waiting on their collectives.

``progress`` runs in a concurrency group of its own (a second thread), so it answers while ``run`` waits
in a collective: the driver's hang diagnosis (:mod:`actors.hang`). A frozen process answers nothing.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import ray
import torch.distributed as dist

from raymoe.rank.context import RankContext, host_world_store, join_world, leave_world
from raymoe.rank.contract import RankFailure, RankProgress, Rendezvous, WorldBackend
from raymoe.rank.failure import rank_failure
from raymoe.rank.progress import CallRecord, progress_report

MONITOR = "monitor"  # the concurrency group of progress(): answered while run() blocks
CONCURRENCY_GROUPS = {MONITOR: 1}

T = TypeVar("T")


class RankActor:
    """Hosts one rank. ``setup`` once, then ``run`` any number of rank functions."""

    def __init__(self) -> None:
        self._ctx: RankContext | None = None
        self._call = CallRecord()
        self._rank = -1
        self._backend: WorldBackend | None = None  # the world's, once joined: which flight recorders progress reads
        self._store: dist.TCPStore | None = None  # rank 0's, from host_rendezvous until setup joins with it

    def host_rendezvous(self, world_size: int) -> tuple[str, int] | RankFailure:
        """Rank 0's: host the world's store (bound as it starts: :func:`~raymoe.rank.context.host_world_store`),
        joined with in ``setup``; this node's address and the store's port, for every rank's ``Rendezvous``."""
        return self._guarded(lambda: self._host_store(world_size))

    def _host_store(self, world_size: int) -> tuple[str, int]:
        address = ray.util.get_node_ip_address()
        self._store = host_world_store(address, world_size)
        return address, self._store.port

    def setup(self, rendezvous: Rendezvous) -> RankFailure | None:
        return self._guarded(lambda: self._setup(rendezvous))

    def _setup(self, rendezvous: Rendezvous) -> None:
        self._rank = rendezvous.rank
        self._call.function, self._call.since = "join_world", time.monotonic()
        self._backend = rendezvous.backend  # the driver resolves it (actors.placement.rank_backend)
        store, self._store = self._store, None
        try:
            self._ctx = join_world(rendezvous, store)
            self._backend = self._ctx.backend
        finally:
            self._call.function = None

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *objects: Any) -> Any:
        """``fn(ctx, *args, *objects, **kwargs)``; ``objects`` came as object references, which Ray read on this
        node before the call."""
        if self._ctx is None:
            return RankFailure("RuntimeError", "rank used before setup", "")
        ctx = self._ctx
        self._call.function, self._call.since = getattr(fn, "__qualname__", repr(fn)), time.monotonic()
        try:
            return self._guarded(lambda: fn(ctx, *args, *objects, **kwargs))
        finally:
            self._call.function = None

    @ray.method(concurrency_group=MONITOR)
    def progress(self) -> RankProgress:
        """What this rank runs now and where it stands in each process group (answered while ``run`` blocks)."""
        return progress_report(self._rank, self._call, self._backend, self._group_descs())

    @ray.method(concurrency_group=MONITOR)
    def process_id(self) -> tuple[str, int, str]:
        """This rank's node id, process id (to make sure a frozen process is gone) and node address (for messages)."""
        return ray.get_runtime_context().get_node_id(), os.getpid(), ray.util.get_node_ip_address()

    def teardown(self) -> None:
        leave_world()

    def _group_descs(self) -> dict[str, str]:
        return self._ctx.group_descs() if self._ctx is not None else {}

    def _guarded(self, call: Callable[[], T]) -> T | RankFailure:
        try:
            return call()
        except Exception as exc:
            return rank_failure(exc, progress_report(self._rank, self._call, self._backend, self._group_descs()))
