"""The rank actor: one process per rank, a thin Ray shell around :mod:`raymoe.rank.context`.

The driver never calls arbitrary methods on it: it sends a function and its arguments to
``run``; the function receives this rank's :class:`~raymoe.rank.context.RankContext` first. A
failure comes back as a :class:`RankFailure` value carrying the remote traceback, so the
driver can name the rank and stop the others without waiting on their collectives.
"""

from __future__ import annotations

import socket
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import ray

from raymoe.rank.context import RankContext, Rendezvous, join_world, leave_world

T = TypeVar("T")


@dataclass(frozen=True)
class RankFailure:
    """An exception raised by a rank function, as text (exceptions may not unpickle on the driver)."""

    error_type: str
    message: str
    traceback: str


class RankActor:
    """Hosts one rank. ``setup`` once, then ``run`` any number of rank functions."""

    def __init__(self) -> None:
        self._ctx: RankContext | None = None

    def rendezvous_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process-group store."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = int(sock.getsockname()[1])
        return ray.util.get_node_ip_address(), port

    def setup(self, rendezvous: Rendezvous) -> RankFailure | None:
        return self._guarded(lambda: self._setup(rendezvous))

    def _setup(self, rendezvous: Rendezvous) -> None:
        self._ctx = join_world(rendezvous)

    def run(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if self._ctx is None:
            return RankFailure("RuntimeError", "rank used before setup", "")
        ctx = self._ctx
        return self._guarded(lambda: fn(ctx, *args, **kwargs))

    def teardown(self) -> None:
        leave_world()

    @staticmethod
    def _guarded(call: Callable[[], T]) -> T | RankFailure:
        try:
            return call()
        except Exception as exc:
            return RankFailure(type(exc).__name__, str(exc), traceback.format_exc())
