"""Who holds a handle's ranks, and what releasing them means: an owned group, or a borrowed world.

    owned     from_pretrained started the ranks for this model: releasing stops them; after a rank
              failure ended them, ``replace`` puts new ranks in (``RankGroup.replacement``)
    borrowed  from_pretrained(..., world=...) loaded onto ranks the user started: releasing unloads the
              model and leaves the ranks for the next one; a world hosts one open model at a time

Release happens once: on ``release()`` (the handle's ``shutdown``), or when the handle is collected or
the interpreter exits (a ``weakref.finalize``).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

from raymoe.driver.group import RankGroup
from raymoe.rank.load import unload_model

logger = logging.getLogger(__name__)

# The open lease of each borrowed world (a world hosts one model at a time), and what it hosts.
_TENANTS: weakref.WeakKeyDictionary[Any, tuple[weakref.ref[Any], str]] = weakref.WeakKeyDictionary()


class RankLease:
    """A handle's hold on its group; ``group()`` is the group for a call, an error once released."""

    def __init__(self, owner: object, group: RankGroup, *, owns_group: bool, tenant: str) -> None:
        self.owns_group = owns_group
        self._group = group
        self._finalizer = weakref.finalize(owner, _releaser(group, owns_group))
        if not owns_group:
            _TENANTS[group] = (weakref.ref(self), tenant)

    @staticmethod
    def check_vacant(group: RankGroup) -> None:
        """A ``ValueError`` when a borrowed world still hosts an open model (the old handle would drive the new one)."""
        entry = _TENANTS.get(group)
        if entry is None:
            return
        lease, tenant = entry[0](), entry[1]
        if lease is not None and lease.is_alive:
            raise ValueError(
                f"this world already hosts {tenant}; call its shutdown() (or leave its `with` block) before loading "
                "another model onto the same ranks"
            )

    def group(self) -> RankGroup:
        """The group, for a call; a released lease fails here, on the driver, before any rank is asked."""
        if not self._finalizer.alive:
            raise RuntimeError("this model was shut down; load it again (raymoe.from_pretrained) to use it")
        return self._group

    @property
    def is_alive(self) -> bool:
        """Not released, and the group is running (a rank failure ends it)."""
        return self._finalizer.alive and self._group.is_alive

    @property
    def released(self) -> bool:
        return not self._finalizer.alive

    @property
    def releases_at_exit(self) -> bool:
        """The ranks are released when the interpreter exits too (the finalizer runs at exit)."""
        return bool(self._finalizer.atexit)

    def release(self) -> None:
        """Stop an owned group, or unload the model from a borrowed world; safe to call more than once."""
        self._finalizer()

    def replace(self, owner: object) -> RankGroup:
        """New ranks for an owned group that a failure ended (placed afresh; the model is not loaded yet)."""
        if not self.owns_group:
            raise RuntimeError(
                "restart() needs ranks this model started; it runs on a world you started "
                "(from_pretrained(..., world=...)): start a new world and load the model onto it"
            )
        if self._group.is_alive:
            raise RuntimeError("restart() replaces ranks that failed; this model's ranks are running")
        group = self._group.replacement()
        self._finalizer.detach()
        self._group, self._finalizer = group, weakref.finalize(owner, group.shutdown)
        return group


def _releaser(group: RankGroup, owns_group: bool) -> Callable[[], None]:
    return group.shutdown if owns_group else _unloader(group)


def _unloader(group: RankGroup) -> Callable[[], None]:
    """Unload the model from a borrowed world (if it is still running); the world itself stays."""

    def unload() -> None:
        _TENANTS.pop(group, None)
        if not group.is_alive:
            return
        try:
            group.execute(unload_model)
        except Exception as exc:  # the group reported and ended itself; nothing is left to free
            logger.warning("unloading the model from its world failed: %s", exc)

    return unload
