"""Connecting the driver to Ray: the cluster it runs in, or a local instance sized to the world.

ray already initialised in this process        use it as is (but see below)
RAY_ADDRESS set (e.g. inside `ray job submit`)  connect there
a cluster started on this machine (ray start)   connect to it ("auto"; RAY_ADDRESS=local skips this)
none                                            start a local instance with enough CPUs for the ranks

A local instance raymoe started itself grows: when a later world needs more CPUs than it was
started with and no world of this driver is running, it is restarted with room for the new one
(a notebook trying a 2-rank layout, then a 4-rank one). While a world runs on it, that is an error
that says so. An instance the user started (``ray.init`` / ``ray start``) is never restarted.
"""

from __future__ import annotations

import logging
import os
import weakref
from typing import Protocol

import ray
import torch

logger = logging.getLogger(__name__)


class _World(Protocol):
    @property
    def is_alive(self) -> bool: ...


# The local instance this module started (its CPUs), and the worlds started on this driver.
_local_cpus: int | None = None
_worlds: weakref.WeakSet[_World] = weakref.WeakSet()


def track_world(world: _World) -> None:
    """Remember a world started on this driver (it holds the local instance while it runs)."""
    _worlds.add(world)


def connect(num_ranks: int, cpus_per_rank: float) -> None:
    """Make sure this driver is connected to a Ray cluster; rank actors' output stays off the driver."""
    global _local_cpus
    if ray.is_initialized():
        needed = _cpus_for(num_ranks, cpus_per_rank)
        if _local_cpus is None or needed <= _local_cpus:
            return
        running = [world for world in _worlds if world.is_alive]
        if running:
            raise ValueError(
                f"a world of {num_ranks} ranks x {cpus_per_rank:g} CPUs needs {needed} CPUs, but the local Ray "
                f"instance raymoe started has {_local_cpus} and {len(running)} world(s) of this driver still run on "
                "it; shut them down first (raymoe then restarts it with room), or start Ray with enough CPUs "
                "yourself (ray.init(num_cpus=...) or `ray start --head --num-cpus ...`)"
            )
        logger.info("restarting the local Ray instance: %d CPUs -> %d for %d ranks", _local_cpus, needed, num_ranks)
        ray.shutdown()
        _local_cpus = None
    address = os.environ.get("RAY_ADDRESS")
    if address and address != "local":
        ray.init(address=address, log_to_driver=False)
        return
    if address != "local":  # Ray's own spelling for "start a new local instance, join none"
        try:
            ray.init(address="auto", log_to_driver=False)
            return
        except ConnectionError:
            pass
    num_cpus = max(os.cpu_count() or 1, _cpus_for(num_ranks, cpus_per_rank))
    logger.info("starting a local Ray instance with %d CPUs for %d ranks", num_cpus, num_ranks)
    ray.init(num_cpus=num_cpus, num_gpus=torch.cuda.device_count(), log_to_driver=False)
    _local_cpus = num_cpus


def _cpus_for(num_ranks: int, cpus_per_rank: float) -> int:
    return int(num_ranks * cpus_per_rank + 0.999)


def cluster_gpus() -> int:
    """Total GPUs of the connected cluster."""
    return int(ray.cluster_resources().get("GPU", 0))
